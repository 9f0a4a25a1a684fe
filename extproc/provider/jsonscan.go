package provider

import (
	"fmt"

	"github.com/tokengate/tokengate/internal/jsonscan"
	"github.com/tokengate/tokengate/internal/jsonstr"
)

// This file holds a small targeted JSON reader. A streamed response carries
// hundreds of events, of which tokengate reads a handful of members; decoding
// each event into maps would allocate per event on the hot path. The reader
// walks the bytes in place instead: it skips the values it does not need
// (package jsonscan) and returns offsets of the ones it does; strings are
// read by package jsonstr, as request bodies are. Object keys are compared
// as raw bytes, so a key spelled with escapes ("us\u0061ge") does not
// match; no provider sends such keys.

// syntaxError reports malformed JSON with the byte offset where it was found.
type syntaxError struct {
	off int
	msg string
}

func (e *syntaxError) Error() string {
	return fmt.Sprintf("invalid JSON at offset %d: %s", e.off, e.msg)
}

func errAt(off int, format string, args ...any) error {
	return &syntaxError{off: off, msg: fmt.Sprintf(format, args...)}
}

// scanned passes on what package jsonscan or jsonstr returned, its fault
// as a syntaxError.
func scanned(end int, err error) (int, error) {
	if e, ok := err.(*jsonstr.Error); ok {
		return end, errAt(e.Off, "%s", e.What)
	}
	return end, err
}

func skipSpace(b []byte, i int) int { return jsonscan.Space(b, i) }

// skipValue returns the offset just past the JSON value that starts at b[i]
// (leading white space allowed).
func skipValue(b []byte, i int) (int, error) { return scanned(jsonscan.Value(b, i)) }

// skipValueDepth is skipValue for a value depth levels deep.
func skipValueDepth(b []byte, i, depth int) (int, error) {
	return scanned(jsonscan.ValueDepth(b, i, depth))
}

func skipLiteral(b []byte, i int, lit string) (int, error) {
	return scanned(jsonscan.Literal(b, i, lit))
}

// skipString returns the offset just past the string whose opening quote is
// at b[i] (package jsonstr reads it).
func skipString(b []byte, i int) (int, error) { return scanned(jsonstr.Scan(b, i)) }

// object iterates over the members of a JSON object in place.
type object struct {
	b     []byte
	i     int
	n     int // members returned so far
	err   error
	ended bool
}

// openObject starts iterating the object that begins at b[i] (leading white
// space allowed). A value that is not an object yields an error.
func openObject(b []byte, i int) (object, error) {
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != '{' {
		return object{}, errAt(i, "want an object")
	}
	return object{b: b, i: i + 1}, nil
}

// member is one object member: its raw key (without quotes) and the offsets
// of its value, and the offset where the member itself starts (its key's
// opening quote).
type member struct {
	key        []byte
	start      int
	valueStart int
	valueEnd   int
}

// next returns the next member; ok is false at the end of the object or on
// error (see err).
func (o *object) next() (m member, ok bool) {
	if o.ended || o.err != nil {
		return member{}, false
	}
	b, i := o.b, skipSpace(o.b, o.i)
	if o.n > 0 {
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		} else if i < len(b) && b[i] == '}' {
			o.ended, o.i = true, i+1
			return member{}, false
		} else {
			o.err = errAt(i, "want ',' or '}' in object")
			return member{}, false
		}
	} else if i < len(b) && b[i] == '}' {
		o.ended, o.i = true, i+1
		return member{}, false
	}
	if i >= len(b) || b[i] != '"' {
		o.err = errAt(i, "want an object key")
		return member{}, false
	}
	keyEnd, err := skipString(b, i)
	if err != nil {
		o.err = err
		return member{}, false
	}
	m.start, m.key = i, b[i+1:keyEnd-1]
	i = skipSpace(b, keyEnd)
	if i >= len(b) || b[i] != ':' {
		o.err = errAt(i, "want ':' after object key")
		return member{}, false
	}
	m.valueStart = skipSpace(b, i+1)
	if m.valueEnd, err = skipValue(b, m.valueStart); err != nil {
		o.err = err
		return member{}, false
	}
	o.i = m.valueEnd
	o.n++
	return m, true
}

// finish reports an error left by next, or data after the end of the
// object when the object was the whole input.
func (o *object) finish() error {
	if o.err != nil {
		return o.err
	}
	if j := skipSpace(o.b, o.i); j != len(o.b) {
		return errAt(j, "data after the JSON value")
	}
	return nil
}

// array iterates over the elements of a JSON array in place.
type array struct {
	b     []byte
	i     int
	n     int
	err   error
	ended bool
}

// openArray starts iterating the array at b[i].
func openArray(b []byte, i int) (array, error) {
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != '[' {
		return array{}, errAt(i, "want an array")
	}
	return array{b: b, i: i + 1}, nil
}

// next returns the offsets of the next element.
func (a *array) next() (start, end int, ok bool) {
	if a.ended || a.err != nil {
		return 0, 0, false
	}
	b, i := a.b, skipSpace(a.b, a.i)
	if i < len(b) && b[i] == ']' {
		a.ended, a.i = true, i+1
		return 0, 0, false
	}
	if a.n > 0 {
		if i >= len(b) || b[i] != ',' {
			a.err = errAt(i, "want ',' or ']' in array")
			return 0, 0, false
		}
		i = skipSpace(b, i+1)
	}
	end, err := skipValue(b, i)
	if err != nil {
		a.err = err
		return 0, 0, false
	}
	a.i = end
	a.n++
	return i, end, true
}

// isNull reports whether the raw value v is the literal null.
func isNull(v []byte) bool { return string(v) == "null" }

// parseCount reads a raw JSON number as a token count. Counts are
// non-negative integers; a float with a zero fraction (12.0) is accepted.
func parseCount(v []byte) (int, error) {
	if isNull(v) {
		return 0, nil
	}
	n, i := 0, 0
	if len(v) == 0 || v[0] < '0' || v[0] > '9' {
		return 0, fmt.Errorf("token count %.40q is not a non-negative integer", v)
	}
	for ; i < len(v) && v[i] >= '0' && v[i] <= '9'; i++ {
		if n > (1<<53)/10 {
			return 0, fmt.Errorf("token count %.40q is out of range", v)
		}
		n = n*10 + int(v[i]-'0')
	}
	if i < len(v) && v[i] == '.' {
		for i++; i < len(v) && v[i] == '0'; i++ {
		}
	}
	if i != len(v) {
		return 0, fmt.Errorf("token count %.40q is not a non-negative integer", v)
	}
	return n, nil
}

// appendUnquoted appends the decoded contents of the raw JSON string s
// (quotes included), as the reader found it, to dst (package jsonstr
// decodes it as encoding/json does). A value that is not a string is an
// error.
func appendUnquoted(dst, s []byte) ([]byte, error) {
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return dst, fmt.Errorf("want a JSON string, got %.40q", s)
	}
	return jsonstr.Append(dst, s[1:len(s)-1]), nil
}
