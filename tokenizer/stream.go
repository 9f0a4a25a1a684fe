package tokenizer

import (
	"unicode/utf8"
	"unsafe"
)

// maxPending bounds the text a Stream holds back while a piece is still
// open. A longer open piece (one run of letters or spaces longer than this)
// is cut and counted as it stands, which can only overcount by a token or
// so per cut, the safe direction for a live count.
const maxPending = 4096

// Stream counts output tokens as a response streams (S13). It is fed text
// deltas and keeps only the last, still open pre-tokenizer piece: what was
// counted is never tokenized again. The zero value is not usable; create
// one with Counter.NewStream. A Stream is owned by one goroutine.
type Stream struct {
	c       *Counter
	v       *vocab
	done    int    // tokens of closed pieces
	pending []byte // text of the open piece(s), plus an incomplete UTF-8 tail
	// open is what Tokens adds to done for pending: counted with the
	// scratch space the last write borrowed, since a live count asks
	// after every write (borrowing it twice per delta was a tenth of the
	// work of a streamed chunk).
	open int
	// held is the scratch space borrowed by Hold, nil when none is.
	held *worker
}

// NewStream returns a Stream counting with the named encoding (as returned
// by EncodingFor or Count.Encoding). An unknown encoding counts with
// o200k_base.
func (c *Counter) NewStream(encoding string) *Stream {
	v, err := c.vocab(encoding)
	if err != nil {
		v, err = c.vocab(O200kBase)
		if err != nil {
			panic("tokenizer: embedded o200k_base vocabulary does not load: " + err.Error())
		}
	}
	// Scratch space and piece caches are borrowed from the Counter for
	// each call, so an idle stream costs only its pending text.
	return &Stream{c: c, v: v, pending: make([]byte, 0, 256)}
}

// Hold borrows the Counter's scratch space for every write until Release,
// so that a run of deltas (the events of one response chunk) borrows it
// once instead of once per delta: the free list is shared by every stream
// of the process, and taking from it and giving back was two thirds of a
// delta's count under load. Hold without Release keeps the scratch space
// from the other streams; Hold while held does nothing.
func (s *Stream) Hold() {
	if s.held == nil {
		s.held = s.c.getWorker()
	}
}

// Release gives back what Hold borrowed, and reports whether it held
// anything; without a Hold it does nothing.
func (s *Stream) Release() bool {
	if s.held == nil {
		return false
	}
	s.c.putWorker(s.held)
	s.held = nil
	return true
}

// Write counts a text delta as decoded from the provider's JSON.
func (s *Stream) Write(delta string) {
	s.pending = append(s.pending, delta...)
	s.advance()
}

// WriteBytes counts raw output bytes; a UTF-8 character split across calls
// is held back until it is complete.
func (s *Stream) WriteBytes(p []byte) {
	s.pending = append(s.pending, p...)
	s.advance()
}

// completeLen returns the length of b without a trailing incomplete UTF-8
// sequence.
func completeLen(b []byte) int {
	for k := 1; k <= utf8.UTFMax-1 && k <= len(b); k++ {
		c := b[len(b)-k]
		if c < utf8.RuneSelf {
			return len(b)
		}
		if utf8.RuneStart(c) {
			if utf8.FullRune(b[len(b)-k:]) {
				return len(b)
			}
			return len(b) - k
		}
	}
	return len(b)
}

// advance counts every piece that further text can no longer change.
func (s *Stream) advance() {
	n := completeLen(s.pending)
	if n == 0 {
		return
	}
	// The string aliases pending only during this call; the piece cache
	// clones what it keeps.
	text := unsafe.String(unsafe.SliceData(s.pending), n)
	w := s.held
	if w == nil {
		w = s.c.getWorker()
		defer s.c.putWorker(w)
	}
	i := 0
	for i < len(text) {
		e, eof := s.v.split(text, i)
		if eof && len(text)-i <= maxPending {
			break
		}
		s.done += s.v.countPiece(w, text[i:e])
		i = e
	}
	if i > 0 {
		s.pending = s.pending[:copy(s.pending, s.pending[i:])]
	}
	s.countOpen(w)
}

// countOpen counts the open piece as if the stream ended now, into open.
func (s *Stream) countOpen(w *worker) {
	s.open = 0
	if len(s.pending) == 0 {
		return
	}
	n := completeLen(s.pending)
	s.open = s.v.countText(w, unsafe.String(unsafe.SliceData(s.pending), n))
	if n < len(s.pending) {
		s.open++ // an incomplete character will be at least one token
	}
}

// Tokens returns the tokens counted so far, including the open piece as if
// the stream ended now.
func (s *Stream) Tokens() int {
	if len(s.pending) > 0 && completeLen(s.pending) == 0 {
		return s.done + 1 // only an incomplete character: advance counted nothing
	}
	return s.done + s.open
}
