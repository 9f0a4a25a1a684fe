package pricing_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// TestCostOfRecordedUsage prices recorded provider responses, read by
// extproc/provider, and checks each bill against the response's raw usage
// fields priced by hand. The prices are test prices, not the shipped ones.
func TestCostOfRecordedUsage(t *testing.T) {
	table, err := pricing.NewTable("USD", []pricing.Entry{
		{Model: "claude-sonnet-4-5", SharesSnapshots: true, Input: "3.00", CachedInput: "0.30", CacheWrite: "3.75", CacheWriteExtended: "6.00", Output: "15.00"},
		{Model: "gpt-5.6-sol", Input: "5.00", CachedInput: "0.50", Output: "30.00"},
		{Model: "gemini-2.5-pro", Input: "1.25", Output: "10.00"},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		recording string
		api       tokenizer.API
		model     string // as the response names it
		want      pricing.Micros
	}{
		// input_tokens 3, cache_creation_input_tokens 418 (5-minute),
		// cache_read_input_tokens 1111, output_tokens 33:
		// 3×3.00 + 1111×0.30 + 418×3.75 + 33×15.00 = 2404.8 micros.
		{"anthropic/messages-cache-write-and-read", tokenizer.Messages, "claude-sonnet-4-5-20250929", 2405},
		// prompt_tokens 4020 with cached_tokens 4012, completion_tokens 4:
		// 8×5.00 + 4012×0.50 + 4×30.00 = 2166 micros.
		{"openai/chat-prompt-cache-hit", tokenizer.ChatCompletions, "gpt-5.6-sol", 2166},
		// promptTokenCount 15, candidatesTokenCount 8, thoughtsTokenCount 275
		// billed as output: 15×1.25 + 283×10.00 = 2848.75 micros.
		{"gemini/generate-thinking-config", tokenizer.Gemini, "models/gemini-2.5-pro", 2849},
	}
	for _, tt := range tests {
		body, err := os.ReadFile(filepath.Join("..", "testdata", "providers", tt.recording, "response.json"))
		if err != nil {
			t.Fatal(err)
		}
		u, ok, err := provider.ParseUsage(tt.api, body)
		if err != nil || !ok {
			t.Fatalf("%s: ParseUsage = %+v, %v, %v", tt.recording, u, ok, err)
		}
		got, err := table.Cost(tt.model, u)
		if err != nil || got != tt.want {
			t.Errorf("%s: Cost(%s, %+v) = %d, %v; want %d", tt.recording, tt.model, u, got, err, tt.want)
		}
	}
}
