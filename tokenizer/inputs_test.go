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

// mixedScripts are the scripts of mixedText.
var mixedScripts = []*unicode.RangeTable{
	unicode.Latin, unicode.Cyrillic, unicode.Greek, unicode.Arabic, unicode.Hebrew,
	unicode.Devanagari, unicode.Bengali, unicode.Tamil, unicode.Thai, unicode.Georgian,
	unicode.Armenian, unicode.Ethiopic, unicode.Hangul, unicode.Han, unicode.Hiragana, unicode.Katakana,
}

// mixedText is words of random letters (and marks) of a dozen scripts,
// one script per word, between spaces, punctuation and numbers: text in
// many languages that a cache of pieces has not seen.
func mixedText(n int, rng *rand.Rand) string {
	var letters [][]rune
	for _, tab := range mixedScripts {
		var rs []rune
		for r := rune(0); r < 0x10000; r++ {
			if unicode.Is(tab, r) && unicode.In(r, unicode.L, unicode.M) {
				rs = append(rs, r)
			}
		}
		letters = append(letters, rs)
	}
	var b strings.Builder
	for b.Len() < n {
		rs := letters[rng.IntN(len(letters))]
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
