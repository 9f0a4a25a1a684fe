package tokenizer

import (
	"sync"
	"testing"
	"unicode"

	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

// The oracle of the random and hand-picked differential tests is
// tiktoken-go with its offline loader: tokens must be identical to its
// EncodeOrdinary on text it splits as OpenAI's tiktoken does, which is any
// text without the characters that Unicode assigned after Go's unicode
// tables (oracleKnows). On those, OpenAI's tiktoken itself is the oracle,
// through the fixture of TestTiktokenUnicodeFixture. Used only by tests.
var (
	oracleOnce sync.Once
	oracles    map[string]*tiktoken.Tiktoken
	oracleErr  error
)

func oracle(t testing.TB, encoding string) *tiktoken.Tiktoken {
	t.Helper()
	oracleOnce.Do(func() {
		tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
		oracles = make(map[string]*tiktoken.Tiktoken)
		for _, e := range []string{O200kBase, Cl100kBase} {
			tk, err := tiktoken.GetEncoding(e)
			if err != nil {
				oracleErr = err
				return
			}
			oracles[e] = tk
		}
	})
	if oracleErr != nil {
		t.Fatalf("load tiktoken-go oracle: %v", oracleErr)
	}
	return oracles[encoding]
}

func newTestCounter(t testing.TB) *Counter {
	t.Helper()
	c, err := New(Options{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return c
}

// oracleKnows reports whether tiktoken-go splits text as OpenAI's tiktoken
// does: it classifies characters with Go's unicode tables, so it must
// agree with this package's (Unicode 16.0) on every character of text.
func oracleKnows(text string) bool {
	initClasses()
	for _, r := range text {
		if classOf(r) != classifyGo(r) {
			return false
		}
	}
	return true
}

// classifyGo is the pre-tokenizer class of r by Go's unicode tables, as
// tiktoken-go sees it.
func classifyGo(r rune) uint8 {
	var c uint8
	if unicode.IsLetter(r) {
		c |= clsL
	}
	if unicode.IsNumber(r) {
		c |= clsN
	}
	if unicode.IsSpace(r) {
		c |= clsS
	}
	lm, lo, m := unicode.Is(unicode.Lm, r), unicode.Is(unicode.Lo, r), unicode.IsMark(r)
	if unicode.Is(unicode.Lu, r) || unicode.Is(unicode.Lt, r) || lm || lo || m {
		c |= clsUpper
	}
	if unicode.Is(unicode.Ll, r) || lm || lo || m {
		c |= clsLower
	}
	if r == '\r' || r == '\n' {
		c |= clsNL
	}
	return c
}
