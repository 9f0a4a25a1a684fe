package tokenizer

import (
	"fmt"
	"testing"

	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

// BenchmarkCountText counts 1 KB, 100 KB and 1 MB of each input class with
// this package ("fast") and with a plain tiktoken-go EncodeOrdinary of the
// same text ("tiktoken-go") in the same run; compare their MB/s.
// tiktoken-go is quadratic on long pieces, so it is not run on hostile
// inputs above 10 KB.
//
//	go test ./tokenizer -run '^$' -bench CountText -benchmem
func BenchmarkCountText(b *testing.B) {
	classes := []string{"prose", "code", "json", "cjk", "emoji", "marks", "random", "mixed"}
	hostile := []string{"letters", "spaces", "base64", "cjk-nospace"}
	sizes := []struct {
		name string
		n    int
	}{{"1KB", 1 << 10}, {"100KB", 100 << 10}, {"1MB", 1 << 20}}
	c := newTestCounter(b)
	for _, class := range append(classes, hostile...) {
		isHostile := class == "letters" || class == "spaces" || class == "base64" || class == "cjk-nospace"
		for _, size := range sizes {
			text := benchInput(b, class, size.n)
			for _, enc := range encodings {
				name := fmt.Sprintf("%s/%s/%s", class, size.name, enc)
				b.Run(name+"/fast", func(b *testing.B) {
					c.CountText(enc, text) // load the vocabulary
					b.SetBytes(int64(len(text)))
					b.ReportAllocs()
					for b.Loop() {
						c.CountText(enc, text)
					}
				})
				if isHostile && size.n > 10<<10 {
					continue
				}
				b.Run(name+"/tiktoken-go", func(b *testing.B) {
					tk := oracle(b, enc)
					b.SetBytes(int64(len(text)))
					b.ReportAllocs()
					for b.Loop() {
						tk.EncodeOrdinary(text)
					}
				})
			}
		}
	}
}

// BenchmarkCount counts whole request bodies, JSON parsing included.
//
//	go test ./tokenizer -run '^$' -bench 'Count$' -benchmem
func BenchmarkCount(b *testing.B) {
	c := newTestCounter(b)
	for _, size := range []int{1 << 10, 100 << 10, 1 << 20} {
		text := benchInput(b, "prose", size)
		body := chatBody("gpt-4o", text)
		if _, err := c.Count(Request{Body: body}); err != nil { // load the vocabulary, compile the decoder
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("chat/%dKB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.Count(Request{Body: body}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkStreamWrite feeds a response in small deltas.
func BenchmarkStreamWrite(b *testing.B) {
	c := newTestCounter(b)
	text := benchInput(b, "prose", 100<<10)
	var deltas []string
	for i := 0; i < len(text); i += 16 {
		deltas = append(deltas, text[i:min(i+16, len(text))])
	}
	c.CountText(O200kBase, text) // load the vocabulary
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		s := c.NewStream(O200kBase)
		for _, d := range deltas {
			s.WriteBytes([]byte(d))
		}
		_ = s.Tokens()
	}
}

// BenchmarkLoadVocab measures parsing the embedded vocabularies.
func BenchmarkLoadVocab(b *testing.B) {
	for _, enc := range encodings {
		b.Run(enc, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				data, err := vocabAsset(enc)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := parseVocab(enc, data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkLoadVocabTiktokenGo measures tiktoken-go's offline loader and
// encoder construction for the same vocabularies, for comparison.
func BenchmarkLoadVocabTiktokenGo(b *testing.B) {
	for _, enc := range encodings {
		b.Run(enc, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				ranks, err := tiktoken_loader.NewOfflineLoader().LoadTiktokenBpe(enc + ".tiktoken")
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tiktoken.NewCoreBPE(ranks, map[string]int{"<|endoftext|>": len(ranks) + 1}, `\s+`); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
