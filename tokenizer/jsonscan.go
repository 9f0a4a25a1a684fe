package tokenizer

import (
	"bytes"
	"fmt"
	"iter"
	"sync"
	"unsafe"

	"github.com/tokengate/tokengate/internal/jsonstr"
)

// Request bodies are read by a small JSON reader of this package's own,
// because what matters is reading a body exactly as the provider will:
//
//   - Keys match exactly: case-sensitive, after decoding escapes. Providers
//     parse bodies with Python's json, JavaScript's JSON.parse or a protobuf
//     JSON parser, all case-sensitive; encoding/json (and sonic, which
//     follows it) fold case, so `"Max_Tokens":10` beside `"max_tokens":90000`
//     would reserve 10 tokens where the provider honours 90000.
//   - The last of duplicate keys wins, whole: a repeated object or array
//     replaces the earlier one instead of being merged into it.
//   - Errors name the kind of fault and its byte offset, never the text
//     around it, so they are safe to log and to return to the client.
//
// A body is validated once, completely (RFC 8259, with encoding/json's
// leniency for invalid UTF-8 inside strings, which is kept and counted as
// U+FFFD); its strings are read by package jsonstr, as provider answers
// are. The validating pass also records where every object and array
// ends, so walking the body afterwards steps over a nested value in one
// move instead of rescanning it at every level.

// maxDepth bounds nesting, as encoding/json does.
const maxDepth = 10000

// syntaxError is a fault in a body's JSON text.
type syntaxError struct {
	off  int
	what string
}

func (e *syntaxError) Error() string { return fmt.Sprintf("%s at byte %d", e.what, e.off) }

// doc is a validated body and the index of its containers (objects and
// arrays), numbered in the order they open.
type doc struct {
	src []byte
	// end[c] is the offset just past container c's closing bracket;
	// next[c] is the number of the first container that opens after it.
	end, next []int
}

// docs recycles the container index between requests. An index grown by
// an unusual body is dropped rather than kept.
var docs = sync.Pool{New: func() any { return new(doc) }}

const maxPooledContainers = 1 << 16

// parseDoc validates src and indexes its containers. The caller gives the
// doc back with release once no jval of it is in use.
func parseDoc(src []byte) (*doc, error) {
	d := docs.Get().(*doc)
	d.src, d.end, d.next = src, d.end[:0], d.next[:0]
	i, err := d.value(skipSpace(src, 0), 1)
	if err == nil {
		if i = skipSpace(src, i); i != len(src) {
			err = &syntaxError{i, "data after the top-level value"}
		}
	}
	if err != nil {
		d.release()
		return nil, err
	}
	return d, nil
}

func (d *doc) release() {
	d.src = nil
	if cap(d.end) <= maxPooledContainers {
		docs.Put(d)
	}
}

// root returns the top-level value.
func (d *doc) root() jval {
	c := 0
	return d.child(skipSpace(d.src, 0), &c)
}

func (d *doc) eof() error { return &syntaxError{len(d.src), "unexpected end of input"} }

func (d *doc) value(i, depth int) (int, error) {
	src := d.src
	if i >= len(src) {
		return i, d.eof()
	}
	switch c := src[i]; {
	case c == '{':
		return d.object(i, depth)
	case c == '[':
		return d.array(i, depth)
	case c == '"':
		return d.str(i)
	case c == 't':
		return d.literal(i, "true")
	case c == 'f':
		return d.literal(i, "false")
	case c == 'n':
		return d.literal(i, "null")
	case c == '-' || c >= '0' && c <= '9':
		return d.number(i)
	}
	return i, &syntaxError{i, "expected a value"}
}

func (d *doc) literal(i int, lit string) (int, error) {
	for k := 0; k < len(lit); k++ {
		if i+k >= len(d.src) {
			return i, d.eof()
		}
		if d.src[i+k] != lit[k] {
			return i, &syntaxError{i + k, "invalid literal"}
		}
	}
	return i + len(lit), nil
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func (d *doc) digits(i int) (int, error) {
	src := d.src
	if i >= len(src) {
		return i, d.eof()
	}
	if !isDigit(src[i]) {
		return i, &syntaxError{i, "invalid number"}
	}
	for i < len(src) && isDigit(src[i]) {
		i++
	}
	return i, nil
}

func (d *doc) number(i int) (int, error) {
	src := d.src
	if src[i] == '-' {
		i++
	}
	var err error
	if i < len(src) && src[i] == '0' {
		i++
	} else if i, err = d.digits(i); err != nil {
		return i, err
	}
	if i < len(src) && src[i] == '.' {
		if i, err = d.digits(i + 1); err != nil {
			return i, err
		}
	}
	if i < len(src) && (src[i] == 'e' || src[i] == 'E') {
		i++
		if i < len(src) && (src[i] == '+' || src[i] == '-') {
			i++
		}
		if i, err = d.digits(i); err != nil {
			return i, err
		}
	}
	return i, nil
}

func isHex(c byte) bool { return isDigit(c) || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// str checks the string at src[i] (package jsonstr) and returns its end.
func (d *doc) str(i int) (int, error) {
	end, err := jsonstr.Scan(d.src, i)
	if e, ok := err.(*jsonstr.Error); ok {
		return e.Off, &syntaxError{e.Off, e.What}
	}
	return end, err
}

// open numbers a new container; close records where it ends.
func (d *doc) open() int {
	d.end = append(d.end, 0)
	d.next = append(d.next, 0)
	return len(d.end) - 1
}

func (d *doc) close(c, end int) {
	d.end[c] = end
	d.next[c] = len(d.end)
}

func (d *doc) object(i, depth int) (int, error) {
	if depth > maxDepth {
		return i, &syntaxError{i, fmt.Sprintf("nesting deeper than %d levels", maxDepth)}
	}
	c := d.open()
	src := d.src
	i = skipSpace(src, i+1)
	if i < len(src) && src[i] == '}' {
		d.close(c, i+1)
		return i + 1, nil
	}
	for {
		if i >= len(src) {
			return i, d.eof()
		}
		if src[i] != '"' {
			return i, &syntaxError{i, "expected a string key"}
		}
		var err error
		if i, err = d.str(i); err != nil {
			return i, err
		}
		if i = skipSpace(src, i); i >= len(src) {
			return i, d.eof()
		}
		if src[i] != ':' {
			return i, &syntaxError{i, "expected ':' after an object key"}
		}
		if i, err = d.value(skipSpace(src, i+1), depth+1); err != nil {
			return i, err
		}
		if i = skipSpace(src, i); i >= len(src) {
			return i, d.eof()
		}
		switch src[i] {
		case ',':
			i = skipSpace(src, i+1)
		case '}':
			d.close(c, i+1)
			return i + 1, nil
		default:
			return i, &syntaxError{i, "expected ',' or '}' after an object member"}
		}
	}
}

func (d *doc) array(i, depth int) (int, error) {
	if depth > maxDepth {
		return i, &syntaxError{i, fmt.Sprintf("nesting deeper than %d levels", maxDepth)}
	}
	c := d.open()
	src := d.src
	i = skipSpace(src, i+1)
	if i < len(src) && src[i] == ']' {
		d.close(c, i+1)
		return i + 1, nil
	}
	for {
		var err error
		if i, err = d.value(i, depth+1); err != nil {
			return i, err
		}
		if i = skipSpace(src, i); i >= len(src) {
			return i, d.eof()
		}
		switch src[i] {
		case ',':
			i = skipSpace(src, i+1)
		case ']':
			d.close(c, i+1)
			return i + 1, nil
		default:
			return i, &syntaxError{i, "expected ',' or ']' after an array element"}
		}
	}
}

func skipSpace(src []byte, i int) int {
	for i < len(src) {
		switch src[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// jval is one JSON value of a validated body: where it is, for errors,
// and, for objects and arrays, its number in the container index. The
// zero value is an absent value.
type jval struct {
	d        *doc
	off, end int // the value's text is d.src[off:end]
	c        int // container number of an object or array
}

// text returns the value's JSON text.
func (v jval) text() []byte {
	if v.d == nil {
		return nil
	}
	return v.d.src[v.off:v.end]
}

// absent reports whether the field was not in the body at all.
func (v jval) absent() bool { return v.d == nil }

// present reports whether the value is there and not null.
func (v jval) present() bool { return v.d != nil && v.d.src[v.off] != 'n' }

// kind is the value's first byte, with every number reported as '0', and
// 0 for an absent value.
func (v jval) kind() byte {
	if v.d == nil {
		return 0
	}
	c := v.d.src[v.off]
	if c == '-' || isDigit(c) {
		return '0'
	}
	return c
}

// kindName names the JSON type of v for errors.
func (v jval) kindName() string {
	switch v.kind() {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case '0':
		return "a number"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "nothing"
}

// child returns the value that starts at offset i inside a container
// whose next nested container is number *c, and advances *c past it.
func (d *doc) child(i int, c *int) jval {
	v := jval{d: d, off: i}
	switch d.src[i] {
	case '{', '[':
		v.c, v.end = *c, d.end[*c]
		*c = d.next[*c]
	case '"':
		v.end = skipString(d.src, i)
	default:
		v.end = skipScalar(d.src, i)
	}
	return v
}

// skipScalar returns the end of the valid number or literal at i.
func skipScalar(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
		i++
	}
	return i
}

// skipString returns the end of the valid JSON string that starts at i.
func skipString(b []byte, i int) int {
	start := i
	i++
	for {
		q := i + bytes.IndexByte(b[i:], '"')
		backslashes := 0
		for k := q - 1; k > start && b[k] == '\\'; k-- {
			backslashes++
		}
		if backslashes%2 == 0 {
			return q + 1
		}
		i = q + 1
	}
}

// members iterates over the members of v, if it is an object, in order,
// with keys decoded; a later duplicate comes later, so assigning in the
// loop makes the last one win.
func (v jval) members() iter.Seq2[[]byte, jval] {
	return func(yield func([]byte, jval) bool) {
		if v.kind() != '{' {
			return
		}
		d, b, c := v.d, v.d.src, v.c+1
		for i := skipSpace(b, v.off+1); b[i] == '"'; {
			kend := skipString(b, i)
			key := b[i+1 : kend-1]
			if bytes.IndexByte(key, '\\') >= 0 {
				key = unescape(key)
			}
			m := d.child(skipSpace(b, skipSpace(b, kend)+1), &c) // past ':'
			if !yield(key, m) {
				return
			}
			if i = skipSpace(b, m.end); b[i] == ',' {
				i = skipSpace(b, i+1)
			}
		}
	}
}

// elems iterates over the elements of v, if it is an array, in order.
func (v jval) elems() iter.Seq[jval] {
	return func(yield func(jval) bool) {
		if v.kind() != '[' {
			return
		}
		d, b, c := v.d, v.d.src, v.c+1
		for i := skipSpace(b, v.off+1); b[i] != ']'; {
			e := d.child(i, &c)
			if !yield(e) {
				return
			}
			if i = skipSpace(b, e.end); b[i] == ',' {
				i = skipSpace(b, i+1)
			}
		}
	}
}

// str returns the string value v decodes to; v must be a string.
func (v jval) str() string {
	s := v.d.src[v.off+1 : v.end-1]
	if bytes.IndexByte(s, '\\') < 0 {
		return string(s)
	}
	// The decoded bytes are new and never written again: they can be the
	// string itself, as strings.Builder does.
	out := unescape(s)
	return unsafe.String(unsafe.SliceData(out), len(out))
}

// isString reports whether v is a string with exactly the value s.
func (v jval) isString(s string) bool {
	if v.kind() != '"' {
		return false
	}
	raw := v.d.src[v.off+1 : v.end-1]
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw) == s
	}
	return string(unescape(raw)) == s
}

// unescape decodes the escapes of the inside of a valid JSON string as
// encoding/json does (package jsonstr), into new bytes.
func unescape(s []byte) []byte { return jsonstr.Append(make([]byte, 0, len(s)), s) }

// member is one member of an object.
type member struct {
	key string
	v   jval
}

// objectMembers returns the members of the object v with duplicates
// removed as Python's dict and JavaScript objects do: the first position,
// the last value.
func objectMembers(v jval) []member {
	var ms []member
	var seen map[string]int
	for k, m := range v.members() {
		key := string(k)
		if seen == nil && len(ms) >= 8 {
			seen = make(map[string]int, 2*len(ms))
			for i, x := range ms {
				seen[x.key] = i
			}
		}
		i := -1
		if seen != nil {
			if j, ok := seen[key]; ok {
				i = j
			}
		} else {
			for j := range ms {
				if ms[j].key == key {
					i = j
					break
				}
			}
		}
		if i >= 0 {
			ms[i].v = m
			continue
		}
		if seen != nil {
			seen[key] = len(ms)
		}
		ms = append(ms, member{key, m})
	}
	return ms
}

// canonicalJSON appends the compact text of the valid JSON value v with
// duplicate keys removed (the first position, the last value, as Python's
// json and JavaScript's JSON.parse keep them) and strings re-encoded with
// the fewest escapes: '"', '\\' and control characters only.
func canonicalJSON(dst []byte, v jval) []byte {
	switch v.kind() {
	case '{':
		dst = append(dst, '{')
		for i, m := range objectMembers(v) {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = appendJSONString(dst, m.key)
			dst = append(dst, ':')
			dst = canonicalJSON(dst, m.v)
		}
		return append(dst, '}')
	case '[':
		dst = append(dst, '[')
		first := true
		for e := range v.elems() {
			if !first {
				dst = append(dst, ',')
			}
			first = false
			dst = canonicalJSON(dst, e)
		}
		return append(dst, ']')
	case '"':
		return appendJSONString(dst, v.str())
	}
	return append(dst, v.text()...)
}

// appendJSONString appends s as a JSON string with the fewest escapes.
// Invalid UTF-8 is copied as it is (the counter reads it as U+FFFD).
func appendJSONString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\r':
			dst = append(dst, '\\', 'r')
		case '\t':
			dst = append(dst, '\\', 't')
		case '\b':
			dst = append(dst, '\\', 'b')
		case '\f':
			dst = append(dst, '\\', 'f')
		default:
			dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		start = i + 1
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
