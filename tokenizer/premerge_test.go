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

// info returns the charInfo of character x (two to four bytes).
func (v *vocab) info(x string) charInfo {
	if len(x) == 4 {
		return v.suppInfo(x)
	}
	r, _ := utf8.DecodeRuneInString(x)
	return v.bmpChar(r)
}

// TestPremergeCutTokens puts the characters that may start as one part or
// cut a piece (premerge.go), of the BMP and of the planes of emoji and
// rare CJK, next to every byte-level token that cuts a character with its
// tail or head, in the context where it matches: there, the character must
// be merged from its bytes, unless the token ranks above a character that
// may start whole. Every case is compared with the oracle token for token,
// so this test fails if the cut check is wrong either way.
func TestPremergeCutTokens(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, enc := range encodings {
		v, err := loadVocab(enc)
		if err != nil {
			t.Fatal(err)
		}
		// tails and heads list the characters by their proper tails (last
		// one to three bytes) and heads (first one to three bytes).
		tails, heads := map[string][]string{}, map[string][]string{}
		var filler []string
		add := func(r rune) {
			x := string(r)
			if ci := v.info(x); ci.rank == -1 {
				return
			}
			for k := 1; k < len(x); k++ {
				if len(tails[x[k:]]) < 16 {
					tails[x[k:]] = append(tails[x[k:]], x)
				}
				if len(heads[x[:k]]) < 16 {
					heads[x[:k]] = append(heads[x[:k]], x)
				}
			}
			if r >= 0x4E00 && r < 0xA000 && v.chars[r] >= 0 {
				filler = append(filler, x)
			}
		}
		// Every character of the BMP and plane 1 (emoji), every 7th of
		// planes 2 and 3 (rare CJK).
		for r := rune(0x80); r < 0x40000; r++ {
			if (r < 0xD800 || r >= 0xE000) && (r < 0x20000 || r%7 == 0) {
				add(r)
			}
		}
		pick := func(xs []string) string { return xs[rng.IntN(len(xs))] }
		// around puts left+x+right between filler characters and checks
		// that the cut index finds the token (of rank rank) there, unless
		// it ranks above a character that may start whole.
		ignored := 0
		around := func(left, x, right string, rank int) string {
			pre := pick(filler) + pick(filler) + left
			text := pre + x + right + pick(filler) + pick(filler)
			ci := v.info(x)
			switch {
			case ci.rank >= 0 && int32(rank) > ci.rank:
				ignored++
			case v.uncut(text, len(pre), len(x), ci):
				t.Errorf("%s: cut of %+q in %+q not found", enc, x, text)
			}
			return text
		}
		cases := 0
		check := func(text string) {
			if utf8.ValidString(text) && oracleKnows(text) {
				checkEncoding(t, c, enc, text)
				cases++
			}
		}
		for rank, tok := range v.tokens {
			k := 0
			for k < len(tok) && isCont(tok[k]) {
				k++
			}
			if k < len(tok) {
				xs := tails[tok[:k]]
				for range min(3, len(xs)) {
					// the character ends with tok's tail; the rest follows
					check(around("", pick(xs), tok[k:], rank))
				}
			}
			if j := lastLead(tok); j > 0 {
				xs := heads[tok[j:]]
				for range min(3, len(xs)) {
					// the character starts with tok's head; the rest precedes
					check(around(tok[:j], pick(xs), "", rank))
				}
			}
		}
		if cases < 500 {
			t.Errorf("%s: only %d cut cases checked", enc, cases)
		}
		t.Logf("%s: %d cut cases, %d of them ranked above the character", enc, cases, ignored)
	}
}

// TestPremergeExtensions puts every character that may start whole and has
// lower-ranked extensions (tokens that start or end with it, such as
// " \u0562", which ranks below "\u0562") in the context of each of them:
// there the cut check must find a cutting token (by the argument in
// premerge.go), so that the character starts as bytes. Each case, and the
// character between filler characters, is compared with the oracle token
// for token.
func TestPremergeExtensions(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(5, 6))
	for _, enc := range encodings {
		v, err := loadVocab(enc)
		if err != nil {
			t.Fatal(err)
		}
		var filler []string
		for r := rune(0x4E00); r < 0xA000; r++ {
			if v.chars[r] >= 0 {
				filler = append(filler, string(r))
			}
		}
		if len(filler) < 100 {
			t.Fatalf("%s: only %d filler characters", enc, len(filler))
		}
		pick := func() string { return filler[rng.IntN(len(filler))] }
		cases := 0
		check := func(text string, at int, x string, ext bool) {
			t.Helper()
			if ci := v.info(x); ext && v.uncut(text, at, len(x), ci) {
				t.Errorf("%s: extension of %+q in %+q not found", enc, x, text)
			}
			if utf8.ValidString(text) && oracleKnows(text) {
				checkEncoding(t, c, enc, text)
				cases++
			}
		}
		for rank, tok := range v.tokens {
			if x, n := firstChar(tok); n > 0 && n < len(tok) && v.rank(x) > int32(rank) && v.info(x).rank >= 0 {
				pre := pick()
				check(pre+tok+pick(), len(pre), x, true)
				check(pre+x+pick(), len(pre), x, false)
			}
			if x, n := lastChar(tok); n > 0 && n < len(tok) && v.rank(x) > int32(rank) && v.info(x).rank >= 0 {
				pre := pick() + tok[:len(tok)-n]
				check(pre+x+pick(), len(pre), x, true)
			}
		}
		if cases < 50 {
			t.Errorf("%s: only %d extension cases checked", enc, cases)
		}
		t.Logf("%s: %d extension cases", enc, cases)
	}
}

// TestPremergeSpaced checks pieces that start with a space and a character
// that may start from their tokens alone (premerge.go): each such character
// followed by its neighbours in the code chart, by ASCII and by characters
// of other scripts, and, in the context where they match, by the rest of
// every token that starts with one of its tails or with the whole
// character, or with a space and the character: there the piece must start
// from bytes unless the token ranks above the merges of " X" alone. Every case is compared with the oracle
// token for token.
func TestPremergeSpaced(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(7, 8))
	for _, enc := range encodings {
		v, err := loadVocab(enc)
		if err != nil {
			t.Fatal(err)
		}
		var spaced []string
		// spaced characters by their proper tails and by themselves
		starts := map[string][]string{}
		for r, k := range v.spacedIndex {
			if k == 0 {
				continue
			}
			x := string(rune(r))
			spaced = append(spaced, x)
			for k := 0; k < len(x); k++ {
				if len(starts[x[k:]]) < 16 {
					starts[x[k:]] = append(starts[x[k:]], x)
				}
			}
		}
		if len(spaced) < 200 {
			t.Fatalf("%s: only %d characters start with a space from their tokens", enc, len(spaced))
		}
		cases := 0
		check := func(text string) {
			t.Helper()
			if utf8.ValidString(text) && oracleKnows(text) {
				checkEncoding(t, c, enc, text)
				cases++
			}
		}
		pick := func() string { return spaced[rng.IntN(len(spaced))] }
		// Every fourth character next to others, every 16th next to its
		// neighbours in the chart and to ASCII: checking them all takes
		// seconds.
		for j, x := range spaced {
			if j%4 == 0 {
				check(" " + x + pick() + pick())
			}
			if j%16 != 0 {
				continue
			}
			r, _ := utf8.DecodeRuneInString(x)
			check(" " + x)
			for d := rune(-2); d <= 2; d++ {
				check(" " + x + string(r+d) + string(r-d))
			}
			check(" " + x + "a")
		}
		cut := 0
		for rank, tok := range v.tokens {
			k := 0
			for k < len(tok) && isCont(tok[k]) {
				k++
			}
			if _, n := firstChar(tok); n > 0 && n < len(tok) {
				k = n // an extension of x
			} else if k == 0 || k == len(tok) {
				continue
			}
			xs := starts[tok[:k]]
			for range min(3, len(xs)) {
				x := xs[rng.IntN(len(xs))]
				r, _ := utf8.DecodeRuneInString(x)
				if int32(rank) < v.spaced[v.spacedIndex[r]].bound {
					cut++
				}
				check(" " + x + tok[k:] + pick())
			}
		}
		// Tokens that start with a space and such a character, go on and
		// rank below the merges of the two alone.
		for rank, tok := range v.tokens {
			if len(tok) > 1 && tok[0] == ' ' {
				r, n := utf8.DecodeRuneInString(tok[1:])
				if n > 1 && 1+n < len(tok) && r < 0x10000 && v.spacedIndex[r] != 0 &&
					int32(rank) < v.spaced[v.spacedIndex[r]].bound {
					check(tok + pick())
				}
			}
		}
		if cases < 1000 || cut < 20 {
			t.Errorf("%s: only %d cases checked, %d of them cut", enc, cases, cut)
		}
		t.Logf("%s: %d spaced characters, %d cases, %d cut", enc, len(spaced), cases, cut)
	}
}

// firstChar returns the first character of tok and its length when it is
// a valid character of two to four bytes, else n == 0.
func firstChar(tok string) (string, int) {
	r, n := utf8.DecodeRuneInString(tok)
	if r == utf8.RuneError || n < 2 {
		return "", 0
	}
	return tok[:n], n
}

// lastChar is firstChar for the last character of tok.
func lastChar(tok string) (string, int) {
	r, n := utf8.DecodeLastRuneInString(tok)
	if r == utf8.RuneError || n < 2 {
		return "", 0
	}
	return tok[len(tok)-n:], n
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
