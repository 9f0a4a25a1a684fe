package tokenizer

import (
	"encoding/base64"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// Input classes for benchmarks and the linearity test. Realistic classes
// come from text shipped with Go and the recorded provider traffic;
// adversarial ones are generated.

// cjkChars is a sample of common Chinese and Japanese characters.
const cjkChars = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现与的なにはをがでとしたてるいうかれもこのまあ私日本語学校先生時間"

func cjkText(n int, rng *rand.Rand, punct bool) string {
	runes := []rune(cjkChars)
	var b strings.Builder
	for b.Len() < n {
		b.WriteRune(runes[rng.IntN(len(runes))])
		if punct && rng.IntN(18) == 0 {
			b.WriteString("。")
		}
	}
	return b.String()
}

// emojis are single emoji, skin-tone modified, ZWJ sequences, flags and
// keycaps: what chat text holds.
var emojis = strings.Fields("😀 😂 🥲 😍 🤔 🙄 😭 😡 👍 👍🏽 👎🏿 👋🏻 🙏 👏🏼 💪🏾 🎉 🔥 ✨ ❤️ 💔 ✅ ❌ ⚠️ 🚀 🌍 🍕 ☕ 🐱 🐶 🦄 " +
	"👨‍👩‍👧 👩🏽‍💻 🧑‍🚀 🏳️‍🌈 ❤️‍🔥 🇳🇱 🇯🇵 🇺🇸 🇧🇷 1️⃣ #️⃣ 🫠 🫶🏻 🪿")

// emojiText is emoji, mostly in runs, between short words and spaces.
func emojiText(n int, rng *rand.Rand) string {
	words := strings.Fields("ok lol yes no wow thanks love this great so fun")
	var b strings.Builder
	for b.Len() < n {
		for range 1 + rng.IntN(4) {
			b.WriteString(emojis[rng.IntN(len(emojis))])
		}
		switch rng.IntN(3) {
		case 0:
			b.WriteString(" " + words[rng.IntN(len(words))] + " ")
		case 1:
			b.WriteString(" ")
		}
	}
	return b.String()
}

// marksText is words whose letters carry combining marks: decomposed
// Latin with one or two diacritics, and heavier stacks ("zalgo").
func marksText(n int, rng *rand.Rand) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
	var b strings.Builder
	for b.Len() < n {
		heavy := rng.IntN(4) == 0
		for range 2 + rng.IntN(8) {
			b.WriteByte(letters[rng.IntN(len(letters))])
			marks := rng.IntN(2)
			if heavy {
				marks = 1 + rng.IntN(6)
			}
			for range marks {
				b.WriteRune(rune(0x300 + rng.IntN(0x70)))
			}
		}
		b.WriteByte(" .,\n"[rng.IntN(4)])
	}
	return b.String()
}

// randomRunes is code points drawn uniformly from those Go's unicode
// tables assign (letters, marks, numbers, punctuation, symbols, spaces of
// every script and plane; no private use).
func randomRunes(n int, rng *rand.Rand) string {
	var b strings.Builder
	for b.Len() < n {
		r := rune(rng.IntN(0x32000))
		if unicode.In(r, unicode.L, unicode.M, unicode.N, unicode.P, unicode.S, unicode.Z) {
			b.WriteRune(r)
		}
	}
	return b.String()
}

// alphabets are the basic letters (and vowel signs) of a dozen scripts,
// for mixedText.
var alphabets = func() [][]rune {
	span := func(rs []rune, lo, hi rune) []rune {
		for r := lo; r <= hi; r++ {
			rs = append(rs, r)
		}
		return rs
	}
	var hangul []rune // syllables of common initials, vowels and finals
	for _, l := range []rune{0, 2, 3, 5, 6, 7, 9, 11, 12, 14, 15, 16, 17, 18} {
		for v := range rune(21) {
			for _, f := range []rune{0, 0, 4, 8, 16, 21} {
				hangul = append(hangul, 0xAC00+(l*21+v)*28+f)
			}
		}
	}
	return [][]rune{
		[]rune("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZàáâäçèéêëíîïñóôöúûüß"),
		span(span(nil, 0x0410, 0x044F), 0x0451, 0x0451), // Cyrillic
		span(span(nil, 0x0391, 0x03A9), 0x03B1, 0x03C9), // Greek
		span(nil, 0x0621, 0x064A),                       // Arabic
		span(nil, 0x05D0, 0x05EA),                       // Hebrew
		span(span(nil, 0x0915, 0x0939), 0x093E, 0x094C), // Devanagari
		span(span(nil, 0x0995, 0x09B9), 0x09BE, 0x09CC), // Bengali
		span(span(nil, 0x0B95, 0x0BB9), 0x0BBE, 0x0BCC), // Tamil
		span(span(nil, 0x0E01, 0x0E2E), 0x0E30, 0x0E39), // Thai
		span(nil, 0x10D0, 0x10FA),                       // Georgian
		span(nil, 0x0561, 0x0586),                       // Armenian
		span(nil, 0x1200, 0x1357),                       // Ethiopic
		span(span(nil, 0x3041, 0x3093), 0x30A1, 0x30F3), // kana
		[]rune(cjkChars),
		hangul,
	}
}()

// mixedText is text that switches script from word to word: words of
// random letters of the basic alphabets of a dozen scripts (words a cache
// of pieces has not seen), between spaces, punctuation and numbers.
func mixedText(n int, rng *rand.Rand) string {
	var b strings.Builder
	for b.Len() < n {
		rs := alphabets[rng.IntN(len(alphabets))]
		for range 2 + rng.IntN(7) {
			b.WriteRune(rs[rng.IntN(len(rs))])
		}
		switch rng.IntN(8) {
		case 0:
			b.WriteString(", ")
		case 1:
			b.WriteString(". ")
		case 2:
			b.WriteString(" " + strconv.Itoa(rng.IntN(10000)) + " ")
		default:
			b.WriteByte(' ')
		}
	}
	return b.String()
}

var tagRE = regexp.MustCompile(`<[^>]*>`)

// repeatTo repeats s to n bytes.
func repeatTo(s string, n int) string {
	if s == "" {
		return ""
	}
	return strings.Repeat(s, n/len(s)+1)[:n]
}

// benchInput returns n bytes of the named input class (whole characters),
// or "" when its source is not available.
func benchInput(tb testing.TB, class string, n int) string {
	rng := rand.New(rand.NewPCG(uint64(n), 7))
	var s string
	switch class {
	case "prose":
		b, err := os.ReadFile(filepath.Join(runtime.GOROOT(), "doc", "go_spec.html"))
		if err != nil {
			tb.Skipf("prose source: %v", err)
		}
		s = repeatTo(tagRE.ReplaceAllString(string(b), ""), n)
	case "code":
		b, err := os.ReadFile(filepath.Join(runtime.GOROOT(), "src", "net", "http", "server.go"))
		if err != nil {
			tb.Skipf("code source: %v", err)
		}
		s = repeatTo(string(b), n)
	case "json":
		type rec struct {
			ID    int               `json:"id"`
			Name  string            `json:"name"`
			Tags  []string          `json:"tags"`
			Score float64           `json:"score"`
			Attrs map[string]string `json:"attrs"`
		}
		words := strings.Fields("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu")
		var recs []rec
		for size := 0; size < n; size += 120 {
			recs = append(recs, rec{
				ID: rng.IntN(1e6), Name: words[rng.IntN(len(words))] + "_" + words[rng.IntN(len(words))],
				Tags: []string{words[rng.IntN(len(words))], words[rng.IntN(len(words))]}, Score: rng.Float64() * 100,
				Attrs: map[string]string{"k": words[rng.IntN(len(words))]},
			})
		}
		b, _ := json.MarshalIndent(recs, "", "  ")
		s = string(b)
	case "cjk":
		s = cjkText(n, rng, true)
	case "letters": // one letter repeated: one huge piece
		s = strings.Repeat("a", n)
	case "spaces":
		s = strings.Repeat(" ", n) + "x"
	case "base64":
		raw := make([]byte, n)
		for i := range raw {
			raw[i] = byte(rng.Uint32())
		}
		s = base64.StdEncoding.EncodeToString(raw)
	case "cjk-nospace": // CJK without punctuation: one huge piece
		s = cjkText(n, rng, false)
	case "digits":
		s = strings.Repeat("1234567890", n/10+1)
	case "punct":
		s = strings.Repeat("!@#$%^&*()", n/10+1)
	case "emoji":
		s = emojiText(n, rng)
	case "marks":
		s = marksText(n, rng)
	case "random":
		s = randomRunes(n, rng)
	case "mixed":
		s = mixedText(n, rng)
	default:
		tb.Fatalf("unknown input class %q", class)
	}
	if len(s) > n {
		s = s[:n]
		s = strings.ToValidUTF8(s, "")
	}
	return s
}

// chatBody returns a chat completions body with one user message.
func chatBody(model, text string) []byte {
	b, _ := json.Marshal(map[string]any{
		"model":    model,
		"messages": []map[string]string{{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}},
	})
	return b
}
