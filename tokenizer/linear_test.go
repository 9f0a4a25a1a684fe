package tokenizer

import (
	"testing"
)

// TestLinearWork counts the work done (merge steps and rank look-ups) per
// input byte on hostile inputs, whose pieces are as long as the input, at
// growing sizes: work per byte must not grow with the size. A quadratic
// merge would show a 16x growth between the smallest and largest size.
func TestLinearWork(t *testing.T) {
	classes := []string{"letters", "spaces", "base64", "cjk-nospace", "digits", "punct", "cjk", "json", "emoji", "marks", "random", "mixed"}
	sizes := []int{4 << 10, 16 << 10, 64 << 10}
	for _, enc := range encodings {
		v, err := loadVocab(enc)
		if err != nil {
			t.Fatal(err)
		}
		initClasses()
		for _, class := range classes {
			var perByte []float64
			for _, n := range sizes {
				text := benchInput(t, class, n)
				w := newWorker()
				v.countText(w, text)
				perByte = append(perByte, float64(w.work)/float64(len(text)))
			}
			t.Logf("%s %-12s work per byte at %v bytes: %.3f", enc, class, sizes, perByte)
			first, last := perByte[0], perByte[len(perByte)-1]
			if last > 1.25*first+0.05 {
				t.Errorf("%s %s: work per byte grew from %.3f to %.3f: not linear", enc, class, first, last)
			}
			if last > 8 {
				t.Errorf("%s %s: %.1f units of work per byte, want at most 8", enc, class, last)
			}
		}
	}
}
