// Package jsonstr reads JSON strings (RFC 8259) in place, as encoding/json
// reads them: Scan checks one and finds where it ends, Append decodes its
// inside. It is the one string reader of package tokenizer (request
// bodies), package extproc/provider (answers and stream events), package
// jsonscan and the request rewrite of package extproc; each reads its own
// structure around it.
//
// Scan steps over the plain bytes of a string eight at a time (a word
// tested for '"', '\\' and control bytes at once), and Append copies the
// runs between escapes whole. Of the two readers there were, these are the
// tokenizer's, which read the strings of the recorded provider traffic
// (BenchmarkScan, BenchmarkAppend) about as fast as the other on short
// ones and two to five times as fast on long ones; one word per step
// instead of two keeps stream events, whose strings are short, as fast as
// the provider reader's byte loop did.
//
// Invalid UTF-8 inside a string is accepted, as encoding/json accepts it,
// and kept as it is: encoding/json replaces each invalid byte with U+FFFD
// when it decodes, which a reader of the bytes can do itself (a counter
// counts them as U+FFFD) without an allocation here.
package jsonstr

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"unicode/utf16"
	"unicode/utf8"
)

// Error is a fault in a JSON string: what it is and the offset of the
// byte where it was found (the end of the input when the string is not
// closed).
type Error struct {
	Off  int
	What string
}

func (e *Error) Error() string { return fmt.Sprintf("%s at byte %d", e.What, e.Off) }

// The faults Scan reports.
const (
	EndOfInput    = "unexpected end of input"
	InvalidEscape = "invalid escape in a string"
	ControlByte   = "control character in a string"
)

// Scan returns the offset just past the JSON string whose opening quote is
// at src[i]. A string that is not closed, an escape that is not one of
// JSON's, or a control byte (below 0x20) is an *Error.
func Scan(src []byte, i int) (int, error) {
	i++
	for {
		// Plain, inline: a call per run costs more than the run on the
		// short strings of stream events.
		for ; i+8 <= len(src); i += 8 {
			if k := word(src, i); k < 8 {
				i += k
				goto special
			}
		}
		for i < len(src) && plain[src[i]] {
			i++
		}
	special:
		if i >= len(src) {
			return i, &Error{len(src), EndOfInput}
		}
		switch src[i] {
		case '"':
			return i + 1, nil
		case '\\':
			if i+1 >= len(src) {
				return i, &Error{len(src), EndOfInput}
			}
			switch src[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				for k := 2; k < 6; k++ {
					if i+k >= len(src) {
						return i, &Error{len(src), EndOfInput}
					}
					if !isHex(src[i+k]) {
						return i, &Error{i + k, InvalidEscape}
					}
				}
				i += 6
			default:
				return i, &Error{i + 1, InvalidEscape}
			}
		default:
			return i, &Error{i, ControlByte}
		}
	}
}

// Plain returns the offset of the first byte at or after i that ends a
// run of plain string bytes: '"', '\\' or a control byte; len(src) when
// there is none.
func Plain(src []byte, i int) int {
	for ; i+8 <= len(src); i += 8 {
		if k := word(src, i); k < 8 {
			return i + k
		}
	}
	for i < len(src) && plain[src[i]] {
		i++
	}
	return i
}

// word is the index of the first special byte ('"', '\\' or a control
// byte) of the eight at src[i:], or 8 when there is none. A word at a time
// reads long strings several times as fast as a byte at a time; one word,
// not two, keeps the short strings of stream events as fast.
func word(src []byte, i int) int {
	return bits.TrailingZeros64(special(binary.LittleEndian.Uint64(src[i:]))) / 8
}

// SWAR constants: one in every byte, the top bit of every byte.
const (
	ones = 0x0101010101010101
	tops = 0x8080808080808080
)

// special returns the top bit of each of the 8 bytes of w (little
// endian) that is '"', '\\' or a control byte; bits above the lowest may
// be spurious, the lowest is exact (the usual "has a byte below n" test: a
// borrow only runs upwards from a byte that matches).
func special(w uint64) uint64 {
	q := w ^ (ones * '"')
	b := w ^ (ones * '\\')
	return ((w-ones*0x20)&^w | (q-ones)&^q | (b-ones)&^b) & tops
}

// plain marks the bytes a scan passes over: not '"', '\\', or a control
// byte.
var plain = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func isHex(c byte) bool { return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// Append appends to dst the decoded inside of a JSON string (without its
// quotes) that Scan accepted, as encoding/json decodes it: a lone or
// mismatched surrogate escape becomes U+FFFD; other bytes, invalid UTF-8
// included, are copied as they are. On input Scan would refuse it does
// not panic: what is not an escape is copied.
func Append(dst, s []byte) []byte {
	for i := 0; i < len(s); {
		j := bytes.IndexByte(s[i:], '\\')
		if j < 0 {
			return append(dst, s[i:]...)
		}
		dst = append(dst, s[i:i+j]...)
		i += j
		if i+1 >= len(s) {
			return append(dst, s[i:]...)
		}
		switch c := s[i+1]; c {
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r, ok := hex4(s[i+2:])
			if !ok {
				dst = append(dst, s[i:i+2]...)
				break
			}
			i += 6
			if utf16.IsSurrogate(r) {
				r2, ok := rune(-1), false
				if i+1 < len(s) && s[i] == '\\' && s[i+1] == 'u' {
					r2, ok = hex4(s[i+2:])
				}
				if dec := utf16.DecodeRune(r, r2); ok && dec != utf8.RuneError {
					r = dec
					i += 6
				} else {
					r = utf8.RuneError
				}
			}
			dst = utf8.AppendRune(dst, r)
			continue
		case '"', '\\', '/':
			dst = append(dst, c)
		default: // not an escape
			dst = append(dst, s[i:i+2]...)
		}
		i += 2
	}
	return dst
}

// hex4 decodes the four hex digits that b starts with.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}
