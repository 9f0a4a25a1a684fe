package tokenizer

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

var encodings = []string{O200kBase, Cl100kBase}

// differentialSeeds exercise every branch of both pre-tokenizers: contractions,
// case classes, marks, digits, punctuation runs with trailing newlines and
// slashes, every kind of whitespace run, NEL, CJK, emoji, invalid UTF-8 and
// special-token strings in user text.
var differentialSeeds = []string{
	"", "a", "hello world", "Hello, World! It's 2024; we'll see.", "DON'T 'S 'Re 'VE 'll 'd",
	"'s", "'", "'r", "''s", "x'LL", "HTTPServer XMLHttpRequest camelCase PascalCase",
	"  leading", "trailing  ", "a\n\nb", "a \n \n b", "a\r\n\tb", "\t\tx", " \u00850", "\u00a0\u3000x",
	"12345678", "1,234.56", "٣٤٥ Ⅻ ½", "path/to/file\n//comment\n", "a!!!\n\n", " !!/\n", "?!\r\n\r\n",
	"お誕生日おめでとう", "日本語のテキストです。漢字とかなが混ざっています", "中文没有空格的长句子测试一下",
	"한국어 텍스트", "Ελληνικά κείμενο", "русский Текст", "مرحبا بالعالم", "हिन्दी पाठ", "ǅungla ǈ ǋ",
	"e\u0301 \u0301x a\u0301\u0302b !\u0301 \u0301", "ʰʱ ʰA Aʰ ˆx", "👍🏽 👨‍👩‍👧 🇳🇱",
	"<|endoftext|> and <|fim_prefix|><|endofprompt|>", "\xff\xfe invalid \xc3 utf8 \xe4\xb8",
	"func main() {\n\tfmt.Println(\"hi\")\n}\n", `{"a": [1, 2, {"b": null}], "c": "d"}`,
	"aGVsbG8gd29ybGQgdGhpcyBpcyBiYXNlNjQgZW5jb2RlZCB0ZXh0Cg==", strings.Repeat("a", 300),
	strings.Repeat(" ", 200) + "x", strings.Repeat("\n", 100), strings.Repeat("ab", 150),
	strings.Repeat("漢", 120), strings.Repeat("!@#", 60), strings.Repeat("9", 50),
	// invalid UTF-8 inside pieces that are merged by characters
	"日本\xe4\xb8語です", "😀\xf0\x9f😀 x", "a\xccb\u0301c", "Привет\xd0мир", "\xed\xa0\x80漢字",
	// characters that cut their piece, one and four bytes, in runs
	"𠀀𠀁𠀂𠀃 x𠀀y 𪚲'𠮷s", "ǅ𝒜𝓑𝔠 ℌ𝕏", "👩🏽‍💻👨‍👩‍👧‍👦🏳️‍🌈 🇯🇵🇺🇸", "a\u0300\u0301\u0302\u0303b\u0336\u0337",
	"ꦗꦮ ᏣᎳᎩ ትግርኛ ქართული Հայերեն",
}

func checkSame(t *testing.T, c *Counter, text string) {
	t.Helper()
	if !oracleKnows(text) {
		t.Fatalf("%+q has characters that tiktoken-go classifies by older Unicode tables", text)
	}
	for _, enc := range encodings {
		want := oracle(t, enc).EncodeOrdinary(text)
		got, err := c.Encode(enc, text)
		if err != nil {
			t.Fatalf("Encode(%s): %v", enc, err)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("%s Encode(%q) mismatch (-want +got):\n%s", enc, text, diff)
		}
		n, err := c.CountText(enc, text)
		if err != nil {
			t.Fatalf("CountText(%s): %v", enc, err)
		}
		if n != len(want) {
			t.Fatalf("%s CountText(%q) = %d, want %d", enc, text, n, len(want))
		}
	}
}

// TestDifferential compares tokens and counts with tiktoken-go on
// hand-picked inputs.
func TestDifferential(t *testing.T) {
	c := newTestCounter(t)
	for _, s := range differentialSeeds {
		checkSame(t, c, s)
	}
}

// FuzzDifferential checks that Encode and CountText agree with tiktoken-go's
// EncodeOrdinary token for token on any input. Inputs are kept short because
// the oracle is quadratic on long pieces.
func FuzzDifferential(f *testing.F) {
	for _, s := range differentialSeeds {
		f.Add(s)
	}
	c := newTestCounter(f)
	f.Fuzz(func(t *testing.T, s string) {
		if len(s) > 600 {
			s = s[:600]
		}
		if !oracleKnows(s) {
			t.Skip("characters newer than tiktoken-go's Unicode tables: TestTiktokenUnicodeFixture covers them")
		}
		checkSame(t, c, s)
	})
}

// TestLongPiecesMatchOracle compares counts on hostile inputs whose pieces
// are kilobytes long, where the tree-based merge does all the work.
func TestLongPiecesMatchOracle(t *testing.T) {
	c := newTestCounter(t)
	for _, class := range []string{"letters", "spaces", "base64", "cjk-nospace", "cjk", "punct", "emoji", "marks", "random", "mixed"} {
		text := benchInput(t, class, 6<<10)
		for _, enc := range encodings {
			want := len(oracle(t, enc).EncodeOrdinary(text))
			got, err := c.CountText(enc, text)
			if err != nil || got != want {
				t.Errorf("%s %s: CountText = %d, %v; tiktoken-go %d", class, enc, got, err, want)
			}
		}
	}
}
