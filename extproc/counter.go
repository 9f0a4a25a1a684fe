package extproc

import (
	"strings"
	"unicode/utf8"

	"github.com/tokengate/tokengate/tokenizer"
)

// tokenizerCounter is the tokenCounter of a *tokenizer.Counter.
type tokenizerCounter struct{ *tokenizer.Counter }

func (c tokenizerCounter) NewLive(encoding string) liveCounter {
	if encoding == "" {
		encoding = tokenizer.O200kBase
	}
	return &liveText{c: c.Counter, encoding: encoding}
}

// maxPending bounds the text held back while waiting for a word boundary
// (text without spaces, such as CJK or minified code).
const maxPending = 1024

// countBatch is how much text is gathered before it is counted.
const countBatch = 128

// liveText counts streamed output incrementally (S13): text up to the last
// word boundary is counted once and never again; only the word still being
// written (and up to countBatch bytes before it) is held back and counted
// when Tokens is asked. BPE pieces start
// at word boundaries, so the sum equals counting the whole text up to rare
// merges across a boundary. It is owned by one goroutine.
type liveText struct {
	c        *tokenizer.Counter
	encoding string
	counted  int
	pending  strings.Builder
	tail     int // count of pending, valid when !dirty
	dirty    bool
}

func (l *liveText) Write(delta string) {
	if delta == "" {
		return
	}
	l.pending.WriteString(delta)
	l.dirty = true
	if l.pending.Len() < countBatch {
		return // counted in batches: one tokenizer call per few dozen tokens
	}
	p := l.pending.String()
	cut := strings.LastIndexByte(p, ' ')
	if cut <= 0 && len(p) > maxPending {
		cut = len(p) - utf8.UTFMax
		for cut > 0 && !utf8.RuneStart(p[cut]) {
			cut--
		}
	}
	if cut <= 0 {
		return
	}
	l.counted += l.count(p[:cut])
	rest := p[cut:]
	l.pending.Reset()
	l.pending.WriteString(rest)
}

// Bound is an upper bound of Tokens without counting the held-back word:
// no token is shorter than one byte.
func (l *liveText) Bound() int { return l.counted + l.pending.Len() }

func (l *liveText) Tokens() int {
	if l.dirty {
		l.tail = l.count(l.pending.String())
		l.dirty = false
	}
	return l.counted + l.tail
}

func (l *liveText) count(s string) int {
	if s == "" {
		return 0
	}
	n, err := l.c.CountText(l.encoding, s)
	if err != nil {
		// An unknown encoding cannot happen for a Count's own encoding;
		// fall back to the usual four bytes per token.
		return (len(s) + 3) / 4
	}
	return n
}
