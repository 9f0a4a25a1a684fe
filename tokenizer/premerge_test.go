package tokenizer

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
)

// checkEncoding compares Encode and CountText with tiktoken-go on one
// encoding.
func checkEncoding(t *testing.T, c *Counter, enc, text string) {
	t.Helper()
	want := oracle(t, enc).EncodeOrdinary(text)
	got, err := c.Encode(enc, text)
	if err != nil {
		t.Fatalf("Encode(%s): %v", enc, err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("%s Encode(%q) mismatch (-want +got):\n%s", enc, text, diff)
	}
	if n, err := c.CountText(enc, text); err != nil || n != len(want) {
		t.Fatalf("%s CountText(%q) = %d, %v; want %d", enc, text, n, err, len(want))
	}
}

// TestPremergeCutTokens puts every character that may start as one part
// (premerge.go) next to the byte-level tokens that cut a character with its
// tail or head, in the context where they match: there, the character
// must be merged from its bytes. Starting such a character whole changes
// the tokens, so this test fails if the cut check is wrong.
func TestPremergeCutTokens(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, enc := range encodings {
		v, err := loadVocab(enc)
		if err != nil {
			t.Fatal(err)
		}
		// chars lists the premerge characters by their tail (last one or
		// two bytes) and head (first one or two bytes).
		tail1, tail2 := map[byte][]string{}, map[[2]byte][]string{}
		head1, head2 := map[byte][]string{}, map[[2]byte][]string{}
		var filler []string
		for r, ci := range v.chars {
			if ci.rank < 0 {
				continue
			}
			x := string(rune(r))
			n := len(x)
			tail1[x[n-1]] = append(tail1[x[n-1]], x)
			head1[x[0]] = append(head1[x[0]], x)
			if n == 3 {
				tail2[[2]byte{x[1], x[2]}] = append(tail2[[2]byte{x[1], x[2]}], x)
				head2[[2]byte{x[0], x[1]}] = append(head2[[2]byte{x[0], x[1]}], x)
				if r >= 0x4E00 && r < 0xA000 {
					filler = append(filler, x)
				}
			}
		}
		pick := func(xs []string) string { return xs[rng.IntN(len(xs))] }
		// around puts left+x+right between filler characters and checks
		// that the cut index finds the token there.
		around := func(left, x, right string) string {
			pre := pick(filler) + pick(filler) + left
			text := pre + x + right + pick(filler) + pick(filler)
			r, _ := utf8.DecodeRuneInString(x)
			if v.uncut(text, len(pre), len(x), v.chars[r]) {
				t.Errorf("%s: cut of %q in %q not found", enc, x, text)
			}
			return text
		}
		cases := 0
		for _, tok := range v.tokens {
			k := 0
			for k < len(tok) && isCont(tok[k]) {
				k++
			}
			var xs []string
			var text string
			switch {
			case k == 1 && k < len(tok):
				xs = tail1[tok[0]]
			case k == 2 && k < len(tok):
				xs = tail2[[2]byte{tok[0], tok[1]}]
			}
			for range min(3, len(xs)) {
				// the character ends with tok's tail; the rest follows
				text = around("", pick(xs), tok[k:])
				if utf8.ValidString(text) {
					checkEncoding(t, c, enc, text)
					cases++
				}
			}
			xs = nil
			if j := lastLead(tok); j > 0 {
				switch len(tok) - j {
				case 1:
					xs = head1[tok[j]]
				case 2:
					xs = head2[[2]byte{tok[j], tok[j+1]}]
				}
				for range min(3, len(xs)) {
					// the character starts with tok's head; the rest precedes
					text = around(tok[:j], pick(xs), "")
					if utf8.ValidString(text) {
						checkEncoding(t, c, enc, text)
						cases++
					}
				}
			}
		}
		if cases < 100 {
			t.Errorf("%s: only %d cut cases checked", enc, cases)
		}
		t.Logf("%s: %d cut cases", enc, cases)
	}
}

// lastLead returns the index of the lead byte of tok's last character when
// that character is incomplete, else -1.
func lastLead(tok string) int {
	for j := len(tok) - 1; j >= 0 && j >= len(tok)-3; j-- {
		if isCont(tok[j]) {
			continue
		}
		if leadLen(tok[j]) > len(tok)-j {
			return j
		}
		return -1
	}
	return -1
}

// TestPremergeMatchesOracle counts random runs of whole multi-character
// tokens and single characters of the vocabularies, the text where
// starting characters whole and merging them on matters most.
func TestPremergeMatchesOracle(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, enc := range encodings {
		v, err := loadVocab(enc)
		if err != nil {
			t.Fatal(err)
		}
		var pool []string
		for _, tok := range v.tokens {
			if len(tok) >= 2 && tok[0] >= 0xC2 && utf8.ValidString(tok) && !strings.ContainsAny(tok, " \n") {
				pool = append(pool, tok)
			}
		}
		rounds := 3000
		if testing.Short() {
			rounds = 300
		}
		var b strings.Builder
		for range rounds {
			b.Reset()
			for range 2 + rng.IntN(12) {
				tok := pool[rng.IntN(len(pool))]
				if rng.IntN(3) == 0 {
					_, n := utf8.DecodeRuneInString(tok)
					tok = tok[:n]
				}
				b.WriteString(tok)
			}
			checkEncoding(t, c, enc, b.String())
		}
	}
}
