package tokenizer

import (
	"strings"
	"testing"
	"unsafe"
)

// retained returns the bytes of memory a worker holds between calls:
// merge scratch and caches.
func (w *worker) retained() int {
	n := (cap(w.next)+cap(w.prev)+cap(w.toks)+cap(w.starts))*4 + cap(w.tree)*8
	for i := range numVocabs {
		if w.cache[i] != nil {
			n += int(unsafe.Sizeof(*w.cache[i]))
		}
		if w.joins[i] != nil {
			n += int(unsafe.Sizeof(*w.joins[i]))
		}
	}
	return n
}

// TestWorkerMemoryBounded counts 4 MB single-piece inputs, whose merges
// need ~100 MB of scratch, and the longest pieces whose scratch is kept,
// and requires every pooled worker to keep less than 1 MiB afterwards,
// caches included.
func TestWorkerMemoryBounded(t *testing.T) {
	const bound = 1 << 20
	c := newTestCounter(t)
	inputs := []struct{ name, enc, text string }{
		{"one letter", O200kBase, strings.Repeat("a", 4<<20)},
		{"CJK, no break", Cl100kBase, benchInput(t, "cjk-nospace", 4<<20)},
		{"emoji run", O200kBase, strings.Repeat("\U0001F600\U0001F972", 1<<19)},
		// The longest piece whose scratch is kept, in both merges.
		{"longest kept piece", Cl100kBase, strings.Repeat("a", maxKeptPiece)},
		{"longest kept CJK piece", O200kBase, benchInput(t, "cjk-nospace", maxKeptPiece)},
	}
	prose := benchInput(t, "prose", 64<<10)
	for _, in := range inputs {
		name := in.name
		// Ordinary text first, so that the worker's caches exist.
		for _, enc := range encodings {
			if _, err := c.CountText(enc, prose); err != nil {
				t.Fatal(err)
			}
		}
		n, err := c.CountText(in.enc, in.text)
		if err != nil || n == 0 {
			t.Fatalf("%s %s: CountText = %d, %v", name, in.enc, n, err)
		}
		// Every pooled worker: the one that counted and any other.
		var ws []*worker
		for len(c.workers) > 0 {
			ws = append(ws, <-c.workers)
		}
		if len(ws) == 0 {
			t.Fatalf("%s: no worker was pooled", name)
		}
		for _, w := range ws {
			if got := w.retained(); got > bound {
				t.Errorf("%s: a pooled worker retains %d bytes, want at most %d", name, got, bound)
			} else {
				t.Logf("%s: a pooled worker retains %d KB", name, got>>10)
			}
			c.putWorker(w)
		}
	}
}
