package tokenizer

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

// streamTexts are outputs whose piece boundaries depend on what follows:
// whitespace runs before newlines, contractions, letter runs and digits
// split across deltas.
var streamTexts = []string{
	"Hello, world! It's a fine day; we'll see.\n\n  Next paragraph   ends here.  \n",
	"The answer is 1234567 and the list:\n- one\n- two\r\n\tthree",
	"日本語のテキストです。漢字とかなが混ざっています 👍🏽 and café",
	"don'T 'll 'RE x'  '   \n \n  \n",
	strings.Repeat("word ", 200),
}

// TestStreamMatchesWhole feeds each text split at random points (S13) and
// requires the running count to equal a count of the text so far, and the
// final count to equal the count of the whole.
func TestStreamMatchesWhole(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, enc := range encodings {
		for _, text := range streamTexts {
			for trial := range 20 {
				s := c.NewStream(enc)
				fed := 0
				for fed < len(text) {
					n := 1 + rng.IntN(12)
					if trial == 0 {
						n = 1
					}
					end := min(fed+n, len(text))
					// Write takes whole characters; move end to a boundary.
					for end < len(text) && !utf8.RuneStart(text[end]) {
						end++
					}
					// Odd trials hold the scratch space over runs of
					// writes, as a response chunk's events are counted.
					if trial%2 == 1 && rng.IntN(3) == 0 {
						s.Hold()
					}
					s.Write(text[fed:end])
					fed = end
					if rng.IntN(3) == 0 {
						s.Release()
					}
					want, _ := c.CountText(enc, text[:fed])
					if got := s.Tokens(); got != want {
						t.Fatalf("%s trial %d: after %q Tokens() = %d, want %d", enc, trial, text[:fed], got, want)
					}
				}
			}
		}
	}
}

// TestStreamHoldBorrowsOnce checks that Hold takes one scratch space from
// the Counter's free list for all writes until Release, which gives that
// same one back, and that writes without a Hold leave the list as it was.
func TestStreamHoldBorrowsOnce(t *testing.T) {
	c := newTestCounter(t)
	w := c.getWorker()
	c.putWorker(w)
	if len(c.workers) != 1 {
		t.Fatalf("free list holds %d scratch spaces, want 1", len(c.workers))
	}
	s := c.NewStream(O200kBase)
	s.Write("Hello, ")
	if len(c.workers) != 1 {
		t.Fatalf("after a write without Hold the free list holds %d, want 1", len(c.workers))
	}
	s.Hold()
	s.Hold()
	if len(c.workers) != 0 || s.held != w {
		t.Fatalf("Hold twice: free list holds %d, held the pooled one %v; want 0 and true", len(c.workers), s.held == w)
	}
	s.Write("world")
	s.Write("! It's")
	s.Release()
	s.Release()
	if len(c.workers) != 1 || s.held != nil {
		t.Fatalf("Release twice: free list holds %d, still held %v; want 1 and false", len(c.workers), s.held != nil)
	}
	if got, want := s.Tokens(), mustCount(t, c, O200kBase, "Hello, world! It's"); got != want {
		t.Fatalf("Tokens() = %d, want %d", got, want)
	}
}

func mustCount(t *testing.T, c *Counter, enc, text string) int {
	t.Helper()
	n, err := c.CountText(enc, text)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestStreamBytesSplitRunes feeds raw bytes one at a time, so every
// multi-byte character arrives split, and checks the final count.
func TestStreamBytesSplitRunes(t *testing.T) {
	c := newTestCounter(t)
	for _, enc := range encodings {
		for _, text := range streamTexts {
			s := c.NewStream(enc)
			for i := range len(text) {
				s.WriteBytes([]byte{text[i]})
			}
			want, _ := c.CountText(enc, text)
			if got := s.Tokens(); got != want {
				t.Errorf("%s %q: Tokens() = %d, want %d", enc, text, got, want)
			}
		}
	}
}

// TestStreamIncompleteTail counts a character that has not fully arrived
// as at least one token.
func TestStreamIncompleteTail(t *testing.T) {
	c := newTestCounter(t)
	s := c.NewStream(O200kBase)
	s.WriteBytes([]byte("hi \xe6\x97"))
	head, _ := c.CountText(O200kBase, "hi ")
	if got := s.Tokens(); got != head+1 {
		t.Errorf("Tokens() with an incomplete character = %d, want %d", got, head+1)
	}
	s.WriteBytes([]byte("\xa5"))
	want, _ := c.CountText(O200kBase, "hi 日")
	if got := s.Tokens(); got != want {
		t.Errorf("Tokens() after completion = %d, want %d", got, want)
	}
}

// TestStreamLongRunBounded feeds a single endless piece: pending text stays
// bounded and the count stays close to (never under) the exact count.
func TestStreamLongRunBounded(t *testing.T) {
	c := newTestCounter(t)
	s := c.NewStream(O200kBase)
	text := strings.Repeat("abcdefghij", 5000)
	for i := 0; i < len(text); i += 7 {
		s.Write(text[i:min(i+7, len(text))])
		if len(s.pending) > 2*maxPending {
			t.Fatalf("pending grew to %d bytes", len(s.pending))
		}
	}
	want, _ := c.CountText(O200kBase, text)
	got := s.Tokens()
	// Each cut of the open piece may add a couple of tokens.
	bound := want + 2*(len(text)/maxPending+1)
	if got < want || got > bound {
		t.Errorf("Tokens() = %d, want within [%d, %d]", got, want, bound)
	}
}

// TestStreamWriteAllocs checks that a warm stream counts deltas without
// allocating.
func TestStreamWriteAllocs(t *testing.T) {
	c := newTestCounter(t)
	s := c.NewStream(O200kBase)
	deltas := strings.Fields("The quick brown fox jumps over the lazy dog , again and again .")
	for range 3 {
		for _, d := range deltas {
			s.Write(" " + d)
		}
	}
	spaced := make([]string, len(deltas))
	for i, d := range deltas {
		spaced[i] = " " + d
	}
	allocs := testing.AllocsPerRun(100, func() {
		for _, d := range spaced {
			s.Write(d)
		}
		_ = s.Tokens()
	})
	if allocs != 0 {
		t.Errorf("Write+Tokens allocate %.1f times per run, want 0", allocs)
	}
}

// FuzzStream checks that any split of any text yields the count of the
// whole text.
func FuzzStream(f *testing.F) {
	for _, s := range streamTexts {
		f.Add(s, uint8(3))
	}
	c := newTestCounter(f)
	f.Fuzz(func(t *testing.T, text string, step uint8) {
		if len(text) > 3000 {
			text = text[:3000]
		}
		// Raw bytes may be any UTF-8; an invalid tail never completes.
		text = strings.ToValidUTF8(text, "\uFFFD")
		n := int(step%16) + 1
		for _, enc := range encodings {
			s := c.NewStream(enc)
			for i := 0; i < len(text); i += n {
				s.WriteBytes([]byte(text[i:min(i+n, len(text))]))
			}
			want, _ := c.CountText(enc, text)
			if got := s.Tokens(); got != want {
				t.Fatalf("%s step %d: Tokens() = %d, want %d", enc, n, got, want)
			}
		}
	})
}
