package provider

import "bytes"

// Framer splits a server-sent event byte stream into complete events,
// incrementally (S13). It accepts any chunking, down to one byte; LF, CRLF and
// CR line ends; comment lines; and keeps every byte: the events it returns,
// followed by Pending, are exactly the bytes fed.
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
// The zero value is ready to use. A Framer is owned by one goroutine. It
// buffers one incomplete event; a caller that must bound memory checks
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
