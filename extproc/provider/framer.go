package provider

import (
	"bytes"
	"strings"

	"github.com/tokengate/tokengate/tokenizer"
)

// Framing is how a response body is cut into events.
type Framing uint8

const (
	// Unframed: the body is one JSON document, read whole by ParseUsage.
	Unframed Framing = iota
	// SSE: a server-sent event stream (text/event-stream).
	SSE
	// JSONArray: a JSON array whose elements arrive one after the other,
	// as Gemini's streamGenerateContent sends without alt=sse
	// (application/json).
	JSONArray
)

// FramingOf says how a response of api is framed, from the request path and
// the response's content-type. A Gemini streamGenerateContent answer is an
// event stream with alt=sse and a JSON array without it; every other JSON
// body is one document.
func FramingOf(api tokenizer.API, path, contentType string) Framing {
	mt, _, _ := strings.Cut(contentType, ";")
	mt = strings.ToLower(strings.TrimSpace(mt))
	path, _, _ = strings.Cut(path, "?")
	switch {
	case mt == "text/event-stream":
		return SSE
	case mt == "application/json" && api == tokenizer.Gemini && strings.HasSuffix(path, ":streamGenerateContent"):
		return JSONArray
	}
	return Unframed
}

// Framer splits a streamed response body into complete events,
// incrementally (S13). It accepts any chunking, down to one byte, and keeps
// every byte: the events it returns, followed by Pending, are exactly the
// bytes fed.
//
// It frames server-sent events unless Reset to JSONArray. An SSE stream may
// use LF, CRLF and CR line ends and comment lines.
//
// An event is everything up to and including the blank line that ends it. A
// block without a data field (comment lines such as a router's
// ": PROCESSING" keep-alives, or a lone blank line) is returned as an event of
// its own, at once, so that keep-alives reach the client when they were meant
// to; the WHATWG algorithm dispatches nothing for such a block and Stream
// forwards it untouched.
//
// A CR that ends a chunk may be the first half of a CRLF, so the event it
// would end waits for the next byte or for Flush.
//
// A JSON array is cut after each element that is an object or an array: the
// first event is the opening bracket with the first element, each later one
// the separator with its element, the last the closing bracket (with the
// white space before it). Elements of other kinds stay with the next event;
// a top-level value that is not an array is one event.
//
// The zero value frames SSE. A Framer is owned by one goroutine. It buffers
// one incomplete event; a caller that must bound memory checks
// len(Pending()).
type Framer struct {
	buf       []byte
	start     int // offset of the first byte not yet returned
	pos       int // offset of the first byte not yet scanned
	lineStart int // offset of the line being scanned
	// nextLF and nextCR are one more than the offset of the next LF and CR
	// found at or after a scanned position, len(buf)+1 when buf holds none,
	// and 0 when not yet searched since the last Feed. They keep a stream
	// with one kind of line end from being searched for the other kind
	// again at every line.
	nextLF, nextCR int

	// JSON array framing: the nesting depth at pos, whether pos is inside a
	// string or just after its backslash, and whether the top-level value
	// is an array.
	array             bool
	depth             int
	inString, escaped bool
	topArray          bool
}

// Reset empties the Framer and sets how it cuts the next stream: the
// elements of a JSON array for JSONArray, server-sent events otherwise.
func (f *Framer) Reset(fr Framing) {
	f.Flush()
	f.array = fr == JSONArray
}

// Feed appends the next chunk of the stream. It invalidates the slices
// returned by Next, Pending and Flush.
func (f *Framer) Feed(chunk []byte) {
	if f.start > 0 {
		n := copy(f.buf, f.buf[f.start:])
		f.buf = f.buf[:n]
		f.pos -= f.start
		f.lineStart -= f.start
		f.start = 0
	}
	f.buf = append(f.buf, chunk...)
	f.nextLF, f.nextCR = 0, 0
}

// lineEnd returns the offset of the first CR or LF at or after i, or -1.
func (f *Framer) lineEnd(i int) int {
	b := f.buf
	if f.nextLF <= i { // not searched, or behind i
		f.nextLF = len(b) + 1
		if k := bytes.IndexByte(b[i:], '\n'); k >= 0 {
			f.nextLF = i + k + 1
		}
	}
	if f.nextCR <= i {
		f.nextCR = len(b) + 1
		if k := bytes.IndexByte(b[i:], '\r'); k >= 0 {
			f.nextCR = i + k + 1
		}
	}
	if e := min(f.nextLF, f.nextCR) - 1; e < len(b) {
		return e
	}
	return -1
}

// Next returns the next complete event's raw bytes exactly as received,
// including the blank line that ends it. The slice is valid until the next
// Feed.
func (f *Framer) Next() (event []byte, ok bool) {
	if f.array {
		return f.nextElement()
	}
	b := f.buf
	for i := f.pos; i < len(b); i++ {
		if i = f.lineEnd(i); i < 0 {
			break
		}
		c := b[i]
		end := i + 1
		if c == '\r' {
			if end == len(b) {
				// A CR at the end of what we have: wait to see whether
				// LF follows.
				f.pos = i
				return nil, false
			}
			if b[end] == '\n' {
				end++
			}
		}
		if i == f.lineStart { // a blank line ends the event
			event = b[f.start:end]
			f.start, f.pos, f.lineStart = end, end, end
			return event, true
		}
		f.lineStart = end
		i = end - 1
	}
	f.pos = len(b)
	return nil, false
}

// nextElement is Next for a JSON array. It scans each byte once: the
// nesting depth and string state carry over from one Feed to the next.
func (f *Framer) nextElement() (event []byte, ok bool) {
	b := f.buf
	for i := f.pos; i < len(b); i++ {
		c := b[i]
		switch {
		case f.escaped:
			f.escaped = false
		case f.inString:
			switch c {
			case '\\':
				f.escaped = true
			case '"':
				f.inString = false
			default:
				// Skip the rest of a plain run at once.
				k := bytes.IndexAny(b[i:], `"\`)
				if k < 0 {
					i = len(b) - 1
				} else {
					i += k - 1
				}
			}
		case c == '"':
			f.inString = true
		case c == '{' || c == '[':
			if f.depth == 0 {
				f.topArray = c == '['
			}
			f.depth++
		case c == '}' || c == ']':
			f.depth = max(f.depth-1, 0) // a stray closer ends an event too
			if f.depth == 0 || f.depth == 1 && f.topArray {
				end := i + 1
				event = b[f.start:end]
				f.start, f.pos = end, end
				return event, true
			}
		}
	}
	f.pos = len(b)
	return nil, false
}

// Pending returns the incomplete tail: bytes fed but not yet returned by Next.
// The slice is valid until the next Feed.
func (f *Framer) Pending() []byte { return f.buf[f.start:] }

// Flush returns the incomplete tail as a final event, for the end of the
// stream (an upstream that omits the last blank line), and resets the Framer.
// It returns nil when nothing is pending. The slice is valid until the next
// Feed.
func (f *Framer) Flush() []byte {
	tail := f.buf[f.start:]
	f.buf = f.buf[:0]
	f.start, f.pos, f.lineStart = 0, 0, 0
	f.nextLF, f.nextCR = 0, 0
	f.depth, f.inString, f.escaped, f.topArray = 0, false, false, false
	if len(tail) == 0 {
		return nil
	}
	return tail
}

// isDataLine reports whether a line (without its line end) is a data field:
// "data" followed by a colon, or the bare field name.
func isDataLine(line []byte) bool {
	return len(line) >= 4 && string(line[:4]) == "data" && (len(line) == 4 || line[4] == ':')
}
