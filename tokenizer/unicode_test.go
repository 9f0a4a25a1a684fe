package tokenizer

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// tiktokenFixture is the fixture written by internal/gen/fixture.mjs with
// OpenAI's tiktoken (npm tiktoken, its WASM build): token counts for every
// assigned code point of Unicode 16.0 in several contexts.
const tiktokenFixture = "testdata/tiktoken_unicode.txt.gz"

type fixtureLine struct {
	no        int    // line number in the fixture
	template  int    // index into the fixture's templates
	ranges    string // the code points, as written
	cps       []rune // the code points
	cl, o200k int    // tiktoken's counts
}

// readTiktokenFixture parses the fixture: its templates and its lines.
func readTiktokenFixture(t *testing.T) ([]string, []fixtureLine) {
	t.Helper()
	f, err := os.Open(filepath.FromSlash(tiktokenFixture))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var templates []string
	var lines []fixtureLine
	sc := bufio.NewScanner(zr)
	for no := 1; sc.Scan(); no++ {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# template "); ok {
			// # template N "json" description
			num, rest, _ := strings.Cut(rest, " ")
			var tmpl string
			if err := json.NewDecoder(strings.NewReader(rest)).Decode(&tmpl); err != nil {
				t.Fatalf("line %d: template: %v", no, err)
			}
			if n, err := strconv.Atoi(num); err != nil || n != len(templates) {
				t.Fatalf("line %d: template %q out of order", no, num)
			}
			if strings.Count(tmpl, "X") != 1 {
				t.Fatalf("line %d: template %q has no single X", no, tmpl)
			}
			templates = append(templates, tmpl)
			continue
		}
		if strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Split(line, "\t")
		if len(fields) != 4 {
			t.Fatalf("line %d: %d fields, want 4", no, len(fields))
		}
		l := fixtureLine{no: no, ranges: fields[1]}
		var errs [3]error
		l.template, errs[0] = strconv.Atoi(fields[0])
		l.cl, errs[1] = strconv.Atoi(fields[2])
		l.o200k, errs[2] = strconv.Atoi(fields[3])
		for _, err := range errs {
			if err != nil {
				t.Fatalf("line %d: %v", no, err)
			}
		}
		if l.template < 0 || l.template >= len(templates) {
			t.Fatalf("line %d: unknown template %d", no, l.template)
		}
		for r := range strings.SplitSeq(fields[1], ",") {
			loS, hiS, isRange := strings.Cut(r, "-")
			lo, err := strconv.ParseInt(loS, 16, 32)
			if err != nil {
				t.Fatalf("line %d: %v", no, err)
			}
			hi := lo
			if isRange {
				if hi, err = strconv.ParseInt(hiS, 16, 32); err != nil {
					t.Fatalf("line %d: %v", no, err)
				}
			}
			for cp := lo; cp <= hi; cp++ {
				l.cps = append(l.cps, rune(cp))
			}
		}
		lines = append(lines, l)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return templates, lines
}

// TestTiktokenUnicodeFixture requires the counts of OpenAI's tiktoken for
// every assigned code point of Unicode 16.0 (and those of 17.0, which
// tiktoken does not know yet) in every context of the fixture: alone, after
// a space and before "'s", between letters of either case, between digits,
// between punctuation, after an apostrophe, inside white space (S7: the
// prompt count is exact).
func TestTiktokenUnicodeFixture(t *testing.T) {
	templates, lines := readTiktokenFixture(t)
	c := newTestCounter(t)
	seen := make([]uint8, unicode.MaxRune+1) // templates each code point was counted in
	var b strings.Builder
	bad := 0
	for _, l := range lines {
		b.Reset()
		pre, post, _ := strings.Cut(templates[l.template], "X")
		for _, r := range l.cps {
			b.WriteString(pre)
			b.WriteRune(r)
			b.WriteString(post)
			seen[r]++
		}
		text := b.String()
		for _, want := range []struct {
			enc string
			n   int
		}{{Cl100kBase, l.cl}, {O200kBase, l.o200k}} {
			got, err := c.CountText(want.enc, text)
			if err != nil {
				t.Fatalf("CountText(%s): %v", want.enc, err)
			}
			if got != want.n {
				bad++
				if bad <= 20 {
					t.Errorf("fixture line %d, template %q, code points %s: %s count %d, tiktoken %d",
						l.no, templates[l.template], l.ranges, want.enc, got, want.n)
				}
			}
		}
	}
	if bad > 20 {
		t.Errorf("... %d mismatches in all", bad)
	}
	// The fixture must cover what it claims: every code point that Go's
	// unicode package (15.0) knows as assigned, plus the additions, in
	// every template.
	missing, covered := 0, 0
	for r, n := range seen {
		if n > 0 {
			covered++
		}
		if int(n) != len(templates) && n > 0 {
			t.Errorf("U+%04X is in %d templates, want %d", r, n, len(templates))
		}
	}
	for _, tab := range assignedGo {
		forEachRune(tab, func(r rune) {
			if int(seen[r]) != len(templates) && !unicode.Is(unicode.Cs, r) {
				missing++
			}
		})
	}
	if missing > 0 {
		t.Errorf("%d code points assigned in Unicode %s are not in every template of the fixture", missing, unicode.Version)
	}
	if covered < 290000 || len(templates) < 8 {
		t.Errorf("fixture has %d code points in %d templates, want every assigned code point of Unicode 16 (290k+) in 8+", covered, len(templates))
	}
	t.Logf("%d lines, %d code points, %d templates", len(lines), covered, len(templates))
}

// assignedGo are the tables of Go's unicode package that together hold
// every assigned code point.
var assignedGo = []*unicode.RangeTable{unicode.L, unicode.M, unicode.N, unicode.P, unicode.S, unicode.Z,
	unicode.Cc, unicode.Cf, unicode.Co, unicode.Cs}

// forEachRune calls f with every code point of tab.
func forEachRune(tab *unicode.RangeTable, f func(rune)) {
	for _, r := range tab.R16 {
		for x := rune(r.Lo); x <= rune(r.Hi); x += rune(r.Stride) {
			f(x)
		}
	}
	for _, r := range tab.R32 {
		for x := rune(r.Lo); x <= rune(r.Hi); x += rune(r.Stride) {
			f(x)
		}
	}
}

// runeSet returns the code points of tab as a bitmap indexed by rune.
func runeSet(tab *unicode.RangeTable) []bool {
	set := make([]bool, unicode.MaxRune+1)
	forEachRune(tab, func(r rune) { set[r] = true })
	return set
}

// TestUnicodeTablesExtendGo checks the generated Unicode 16 tables against
// Go's own (15.0): they may differ only on code points that 15.0 did not
// assign, and the pre-tokenizer classes must follow them.
func TestUnicodeTablesExtendGo(t *testing.T) {
	initClasses()
	assigned := make([]bool, unicode.MaxRune+1)
	for _, tab := range assignedGo {
		forEachRune(tab, func(r rune) { assigned[r] = true })
	}
	type pair struct {
		name      string
		ours, std *unicode.RangeTable
	}
	pairs := []pair{
		{"L", letter16, unicode.L}, {"N", number16, unicode.N}, {"M", mark16, unicode.M},
		{"Lu", upper16, unicode.Lu}, {"Ll", lower16, unicode.Ll}, {"Lt", title16, unicode.Lt},
		{"Lm", modifier16, unicode.Lm}, {"Lo", otherLetter16, unicode.Lo}, {"White_Space", whiteSpace16, unicode.White_Space},
	}
	ours, std := make([][]bool, len(pairs)), make([][]bool, len(pairs))
	for i, p := range pairs {
		ours[i], std[i] = runeSet(p.ours), runeSet(p.std)
	}
	const L, N, M, Lu, Ll, Lt, Lm, Lo, WS = 0, 1, 2, 3, 4, 5, 6, 7, 8 // indices in pairs
	added := 0
	for r := range rune(unicode.MaxRune + 1) {
		for i, p := range pairs {
			if ours[i][r] != std[i][r] && (assigned[r] || !ours[i][r]) {
				t.Errorf("U+%04X: %s is %v in Unicode %s, %v in Go's %s", r, p.name, ours[i][r], unicodeVersion, std[i][r], unicode.Version)
			}
		}
		if ours[L][r] && !std[L][r] {
			added++
		}
		is := func(i int) bool { return ours[i][r] }
		var want uint8
		if is(L) {
			want |= clsL
		}
		if is(N) {
			want |= clsN
		}
		if is(WS) {
			want |= clsS
		}
		if is(Lu) || is(Lt) || is(Lm) || is(Lo) || is(M) {
			want |= clsUpper
		}
		if is(Ll) || is(Lm) || is(Lo) || is(M) {
			want |= clsLower
		}
		if r == '\r' || r == '\n' {
			want |= clsNL
		}
		if got := classOf(r); got != want {
			t.Errorf("class of U+%04X = %08b, want %08b", r, got, want)
		}
	}
	if added < 4000 {
		t.Errorf("%d letters added since Go's tables, want the 4000+ of Unicode 15.1 and 16.0", added)
	}
	t.Logf("%d letters added since Unicode %s (Go's tables), %s here", added, unicode.Version, unicodeVersion)
}

// TestUnicode16Letters checks a few counts by OpenAI's tiktoken
// (tiktoken@1.0.22 encode_ordinary) on letters that Unicode 15.1 and 16.0
// added, where Go's unicode tables see symbols.
func TestUnicode16Letters(t *testing.T) {
	c := newTestCounter(t)
	for _, tc := range []struct {
		text      string
		cl, o200k int
	}{
		{"\U00010D46's", 5, 5},              // Garay
		{"\U0002EBF0\U0002EBF1's", 9, 9},    // CJK Extension I
		{"A\U00011BC0\U00011BC1's", 10, 10}, // Sunuwar
		{"x\U00016D40y", 6, 6},              // Kirat Rai
	} {
		for _, want := range []struct {
			enc string
			n   int
		}{{Cl100kBase, tc.cl}, {O200kBase, tc.o200k}} {
			if got, err := c.CountText(want.enc, tc.text); err != nil || got != want.n {
				t.Errorf("%s CountText(%+q) = %d, %v; tiktoken %d", want.enc, tc.text, got, err, want.n)
			}
		}
	}
}
