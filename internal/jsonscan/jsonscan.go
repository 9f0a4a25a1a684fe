// Package jsonscan steps over JSON values (RFC 8259) in place: it checks a
// value's syntax and finds where it ends, without decoding it or
// allocating. Strings are read by package jsonstr. It is the value skipper
// of package extproc/provider (answers and stream events) and of the
// request rewrite in package extproc, which read their own structure
// around it.
package jsonscan

import (
	"fmt"

	"github.com/tokengate/tokengate/internal/jsonstr"
)

// MaxDepth bounds nesting so that hostile input cannot exhaust the stack.
const MaxDepth = 512

// errAt is a fault at byte off, as a *jsonstr.Error: one error type for a
// value and the strings in it.
func errAt(off int, format string, args ...any) error {
	return &jsonstr.Error{Off: off, What: fmt.Sprintf(format, args...)}
}

// IsSpace reports whether c is JSON white space.
func IsSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// Space returns the offset of the first byte at or after i that is not
// white space.
func Space(b []byte, i int) int {
	for i < len(b) && IsSpace(b[i]) {
		i++
	}
	return i
}

// Value returns the offset just past the JSON value that starts at b[i]
// (leading white space allowed). A fault is a *jsonstr.Error.
func Value(b []byte, i int) (int, error) { return ValueDepth(b, i, 0) }

// ValueDepth is Value for a value nested depth levels deep, which counts
// towards MaxDepth.
func ValueDepth(b []byte, i, depth int) (int, error) {
	i = Space(b, i)
	if i >= len(b) {
		return i, errAt(i, "unexpected end of input, want a value")
	}
	switch c := b[i]; {
	case c == '"':
		return jsonstr.Scan(b, i)
	case c == '{' || c == '[':
		if depth >= MaxDepth {
			return i, errAt(i, "nesting deeper than %d", MaxDepth)
		}
		closer := byte('}')
		if c == '[' {
			closer = ']'
		}
		i = Space(b, i+1)
		if i < len(b) && b[i] == closer {
			return i + 1, nil
		}
		for {
			var err error
			if closer == '}' {
				i = Space(b, i)
				if i >= len(b) || b[i] != '"' {
					return i, errAt(i, "want an object key")
				}
				if i, err = jsonstr.Scan(b, i); err != nil {
					return i, err
				}
				i = Space(b, i)
				if i >= len(b) || b[i] != ':' {
					return i, errAt(i, "want ':' after object key")
				}
				i++
			}
			if i, err = ValueDepth(b, i, depth+1); err != nil {
				return i, err
			}
			i = Space(b, i)
			if i >= len(b) {
				return i, errAt(i, "unexpected end of input, want ',' or '%c'", closer)
			}
			switch b[i] {
			case ',':
				i++
			case closer:
				return i + 1, nil
			default:
				return i, errAt(i, "unexpected %q, want ',' or '%c'", b[i], closer)
			}
		}
	case c == '-' || (c >= '0' && c <= '9'):
		return Number(b, i)
	case c == 't':
		return Literal(b, i, "true")
	case c == 'f':
		return Literal(b, i, "false")
	case c == 'n':
		return Literal(b, i, "null")
	default:
		return i, errAt(i, "unexpected %q, want a value", c)
	}
}

// Literal returns the offset just past lit (true, false or null) at b[i].
func Literal(b []byte, i int, lit string) (int, error) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, errAt(i, "invalid literal, want %s", lit)
	}
	return i + len(lit), nil
}

// Number returns the offset just past the JSON number at b[i].
func Number(b []byte, i int) (int, error) {
	start := i
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0': // no leading zeros
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return start, errAt(start, "invalid number")
	}
	if i < len(b) && b[i] == '.' {
		i++
		frac := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == frac {
			return start, errAt(start, "invalid number")
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		exp := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == exp {
			return start, errAt(start, "invalid number")
		}
	}
	return i, nil
}
