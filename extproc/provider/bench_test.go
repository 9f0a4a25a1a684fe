package provider

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/tokengate/tokengate/tokenizer"
)

// benchEvents splits a recording into its events.
func benchEvents(b *testing.B, name string) [][]byte {
	b.Helper()
	body, err := os.ReadFile(filepath.Join(recordingsDir, name, "response.sse"))
	if err != nil {
		b.Fatal(err)
	}
	var f Framer
	f.Feed(body)
	var evs [][]byte
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		evs = append(evs, bytes.Clone(ev))
	}
	return evs
}

// openAI200 is a 200-event chat stream built from a real one: its first
// chunk, its content chunks repeated, its finish chunk and [DONE].
func openAI200(b *testing.B) [][]byte {
	evs := benchEvents(b, "openai/chat-stream-no-usage")
	first, middle, tail := evs[0], evs[1:len(evs)-2], evs[len(evs)-2:]
	out := [][]byte{first}
	for i := 0; len(out) < 198; i++ {
		out = append(out, middle[i%len(middle)])
	}
	return append(out, tail...)
}

func benchObserve(b *testing.B, api tokenizer.API, evs [][]byte, injected bool) {
	b.ReportAllocs()
	text := 0
	for b.Loop() {
		s := NewStream(api, false, injected)
		for _, ev := range evs {
			e, err := s.Observe(ev)
			if err != nil {
				b.Fatal(err)
			}
			text += len(e.Text)
		}
	}
	if text == 0 {
		b.Fatal("no text counted")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/event")
}

// BenchmarkObserveOpenAI200 is the hot path of S13 on a 200-event OpenAI
// chat stream; one op is the whole stream.
func BenchmarkObserveOpenAI200(b *testing.B) {
	benchObserve(b, tokenizer.ChatCompletions, openAI200(b), false)
}

// BenchmarkObserveOpenAIInjected adds the S15 rewrite of every chunk.
func BenchmarkObserveOpenAIInjected(b *testing.B) {
	benchObserve(b, tokenizer.ChatCompletions, benchEvents(b, "azure_openai/chat-stream-include-usage"), true)
}

// BenchmarkObserveAnthropic runs a 118-event Anthropic thinking stream.
func BenchmarkObserveAnthropic(b *testing.B) {
	benchObserve(b, tokenizer.Messages, benchEvents(b, "anthropic/messages-stream-thinking-long"), false)
}

// BenchmarkObserveResponses200 runs a 200-event Responses stream built from
// a real one: its opening events, its output_text.delta repeated, and its
// closing events. Each delta also adds to the output kept for a cut-off.
func BenchmarkObserveResponses200(b *testing.B) {
	evs := benchEvents(b, "openai/responses-stream-basic")
	head, delta, rest := evs[:4], evs[4], evs[5:]
	out := append([][]byte(nil), head...)
	for len(out) < 200-len(rest) {
		out = append(out, delta)
	}
	benchObserve(b, tokenizer.Responses, append(out, rest...), false)
}

// BenchmarkObserveEncodingJSON is the baseline Observe avoids: every event
// decoded into a map with encoding/json to pick out the delta text.
func BenchmarkObserveEncodingJSON(b *testing.B) {
	evs := openAI200(b)
	b.ReportAllocs()
	text := 0
	for b.Loop() {
		for _, ev := range evs {
			data := bytes.TrimSpace(bytes.TrimPrefix(ev, []byte("data: ")))
			if string(data) == "[DONE]" {
				continue
			}
			var chunk map[string]any
			if err := json.Unmarshal(data, &chunk); err != nil {
				b.Fatal(err)
			}
			for _, c := range chunk["choices"].([]any) {
				if s, ok := c.(map[string]any)["delta"].(map[string]any)["content"].(string); ok {
					text += len(s)
				}
			}
		}
	}
	if text == 0 {
		b.Fatal("no text counted")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/event")
}

// BenchmarkFramer frames a 144-event stream fed in 1 KiB chunks.
func BenchmarkFramer(b *testing.B) {
	body, err := os.ReadFile(filepath.Join(recordingsDir, "azure_openai/chat-stream-include-usage/response.sse"))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	var f Framer
	for b.Loop() {
		n := 0
		for rest := body; len(rest) > 0; {
			c := min(len(rest), 1024)
			f.Feed(rest[:c])
			rest = rest[c:]
			for _, ok := f.Next(); ok; _, ok = f.Next() {
				n++
			}
		}
		if n != 144 {
			b.Fatalf("framed %d events, want 144", n)
		}
		f.Flush()
	}
}
