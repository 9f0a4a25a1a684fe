package extproc

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// moneyRig is a rig whose policy has one cost quota, large enough for any
// test request, priced by the shipped table (or prices).
func moneyRig(t *testing.T, u *upstream, o rigOptions) *rig {
	t.Helper()
	spend := QuotaRule{Name: "spend", Window: mustWindow(t, "day", "UTC"), Unit: buckets.Money, Limit: 1_000_000_000}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e9, Rate: 1e6}}}, Quotas: []QuotaRule{spend}}
	o.policies = []Policy{pol}
	if o.prices == nil {
		o.prices = pricing.Defaults()
	}
	return newRig(t, u, o)
}

// charged is what the request's settlement charged the rig's cost quota.
func charged(t *testing.T, o Outcome) float64 {
	t.Helper()
	if len(o.Quotas) != 1 || !o.Quotas[0].Money {
		t.Fatalf("outcome quotas %+v; want one cost quota", o.Quotas)
	}
	return o.Quotas[0].Amount
}

// Anthropic bills a cache write with the 1-hour retention at its own rate
// (claude-opus-5: $10 per million, against $6.25 for 5 minutes), and says
// which retention each write had in usage.cache_creation. 2,000 tokens
// written for an hour and 12 output tokens bill 20,000 + 300 micro-dollars.
// The bodies are synthetic: no recording holds a 1-hour write.
func TestAnthropicOneHourCacheWritesPricedAtTheExtendedRate(t *testing.T) {
	const usage = `"usage":{"input_tokens":0,"cache_creation_input_tokens":2000,"cache_read_input_tokens":0,` +
		`"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":2000},"output_tokens":12,"service_tier":"standard"}`
	const billed = 2000*10 + 12*25
	t.Run("json", func(t *testing.T) {
		body := `{"id":"msg_1","type":"message","role":"assistant","model":"claude-opus-5","content":[{"type":"text","text":"ok"}],` +
			`"stop_reason":"end_turn",` + usage + `}`
		u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(body)}}
		r := moneyRig(t, u, rigOptions{})
		if resp, _ := r.post(t, "/v1/messages", `{"model":"claude-opus-5","max_tokens":100,"messages":[]}`, nil); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := charged(t, r.outcome(t)); got != billed {
			t.Errorf("charged %v micro-dollars; Anthropic bills %d", got, billed)
		}
	})
	// message_start carries the cache split; message_delta the final
	// output count. A stream ended by an error event has no final count:
	// it is charged the prompt as message_start reported it, on its cache
	// split, one-hour writes included (docs/budgets.md, a stream that
	// ended without the provider's final count).
	start := `{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-opus-5","content":[],` +
		`"stop_reason":null,` + usage + `}}`
	opening := [][]byte{
		anthropicEvent("message_start", start),
		anthropicEvent("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`),
		anthropicEvent("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"ok"}}`),
	}
	for name, end := range map[string][][]byte{
		"stream": {
			anthropicEvent("content_block_stop", `{"type":"content_block_stop","index":0}`),
			anthropicEvent("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":12}}`),
			anthropicEvent("message_stop", `{"type":"message_stop"}`),
		},
		"stream ended by an error": {
			anthropicEvent("error", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`),
		},
	} {
		t.Run(name, func(t *testing.T) {
			u := &upstream{Chunks: append(slices.Clone(opening), end...)}
			r := moneyRig(t, u, rigOptions{mode: streamedMode()})
			if resp, _ := r.post(t, "/v1/messages", `{"model":"claude-opus-5","max_tokens":100,"stream":true,"messages":[]}`, nil); resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			if got := charged(t, r.outcome(t)); got != billed {
				t.Errorf("charged %v micro-dollars; Anthropic bills %d", got, billed)
			}
		})
	}
}

// anthropicEvent is one event of an Anthropic stream.
func anthropicEvent(name, data string) []byte {
	return []byte("event: " + name + "\ndata: " + data + "\n\n")
}

// realCounter is the tokenizer serve runs with, for tests of the fields it
// reads from a body.
func realCounter(t *testing.T) *tokenizer.Counter {
	t.Helper()
	tc, err := tokenizer.New(tokenizer.Options{DefaultOutputTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	return tc
}

// promptTokens is what the tokenizer counts the prompt of body at.
func promptTokens(t *testing.T, tc *tokenizer.Counter, path, body string) int {
	t.Helper()
	c, err := tc.Count(tokenizer.Request{Path: path, Body: []byte(body)})
	if err != nil {
		t.Fatal(err)
	}
	return c.InputTokens
}

// A request is reserved at the dearest service tier it can be billed at,
// and settled at the tier the answer names: OpenAI's service_tier
// "priority" (or "fast") costs twice the standard rates on gpt-5.6-terra,
// "flex" half on gpt-6.1-terra; no service_tier, or "auto", is the
// project's tier (standard unless pricing.project_service_tier says
// otherwise). Answers are synthetic bodies; the prices are the shipped ones.
func TestServiceTierReservedAtTheDearestAndSettledAsBilled(t *testing.T) {
	tc := realCounter(t)
	answer := func(tier string) []byte {
		return []byte(`{"id":"c1","object":"chat.completion","model":"gpt-5.6-terra","service_tier":"` + tier + `",` +
			`"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],` +
			`"usage":{"prompt_tokens":1000,"completion_tokens":10,"total_tokens":1010}}`)
	}
	post := func(t *testing.T, r *rig, body string) Outcome {
		t.Helper()
		resp, text := r.post(t, chatPath, body, nil)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, text)
		}
		return r.outcome(t)
	}
	const (
		terraPriority = `{"model":"gpt-5.6-terra","service_tier":"priority","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
		terraAuto     = `{"model":"gpt-5.6-terra","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
	)
	in := promptTokens(t, tc, chatPath, terraPriority)

	t.Run("priority reserves at fast rates", func(t *testing.T) {
		// No usage answered: the reservation stands. Fast: the dearest
		// input rate is the cache write, $5.00; output $24.00.
		r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}, rigOptions{tokenizer: tc})
		if got, want := charged(t, post(t, r, terraPriority)), float64(in*5+100*24); got != want {
			t.Errorf("charged %v; want %v, the reservation at fast rates", got, want)
		}
	})
	t.Run("the answer's tier wins", func(t *testing.T) {
		for _, tt := range []struct {
			name, body, tier string
			want             float64
		}{
			{"priority served at default", terraPriority, "default", 1000*2 + 10*12},
			{"priority served at priority", terraPriority, "priority", 1000*4 + 10*24},
			{"auto served at priority", terraAuto, "priority", 1000*4 + 10*24},
			{"fast served at fast", `{"model":"gpt-5.6-terra","service_tier":"fast","max_tokens":100,"messages":[]}`, "fast", 1000*4 + 10*24},
		} {
			r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{answer(tt.tier)}}, rigOptions{tokenizer: tc})
			if got := charged(t, post(t, r, tt.body)); got != tt.want {
				t.Errorf("%s: charged %v; want %v", tt.name, got, tt.want)
			}
		}
	})
	t.Run("flex", func(t *testing.T) {
		body := `{"model":"gpt-6.1-terra","service_tier":"flex","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
		r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{answer("flex")}}, rigOptions{tokenizer: tc})
		// $0.50 input, $2.50 output.
		if got, want := charged(t, post(t, r, body)), float64(1000*0.5+10*2.5); got != want {
			t.Errorf("charged %v; want %v at flex rates", got, want)
		}
	})
	t.Run("a project on fast reserves auto requests at fast rates", func(t *testing.T) {
		prices, err := pricing.Config{ProjectServiceTier: "fast"}.Table()
		if err != nil {
			t.Fatal(err)
		}
		r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}, rigOptions{tokenizer: tc, prices: prices})
		if got, want := charged(t, post(t, r, terraAuto)), float64(in*5+100*24); got != want {
			t.Errorf("charged %v; want %v, the reservation at fast rates", got, want)
		}
	})
}

// Anthropic's fast mode (speed "fast") is billed at rates of its own. The
// shipped table has none for Claude models: where a cost quota applies
// such a request is refused until the configuration prices it; priced, it
// is reserved at the fast rates and settled by the answer's usage.speed.
func TestAnthropicFastModeReservedAtItsOwnRates(t *testing.T) {
	tc := realCounter(t)
	const body = `{"model":"claude-opus-5","max_tokens":100,"speed":"fast","messages":[{"role":"user","content":"hi"}]}`
	r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}, rigOptions{tokenizer: tc})
	resp, text := r.post(t, "/v1/messages", body, nil)
	if resp.StatusCode != 400 || !strings.Contains(text, `"code":"unpriced_model"`) || !strings.Contains(text, "no price at the fast service tier") {
		t.Fatalf("unpriced fast mode: %d %s; want 400 unpriced_model naming the tier", resp.StatusCode, text)
	}
	r.outcome(t)

	prices, err := pricing.Config{Models: []pricing.Entry{
		// Test prices, twice the standard ones.
		{Model: "claude-opus-5", ServiceTier: "fast", Input: "10", CachedInput: "1", CacheWrite: "12.50", CacheWriteExtended: "20", Output: "50"},
	}}.Table()
	if err != nil {
		t.Fatal(err)
	}
	usage := func(speed string) []byte {
		return []byte(`{"id":"m","type":"message","role":"assistant","model":"claude-opus-5","content":[],"stop_reason":"end_turn",` +
			`"usage":{"input_tokens":1000,"output_tokens":10,"speed":"` + speed + `"}}`)
	}
	for _, tt := range []struct {
		speed string
		want  float64
	}{{"fast", 1000*10 + 10*50}, {"standard", 1000*5 + 10*25}} {
		r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{usage(tt.speed)}}, rigOptions{tokenizer: tc, prices: prices})
		if resp, text := r.post(t, "/v1/messages", body, nil); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, text)
		}
		if got := charged(t, r.outcome(t)); got != tt.want {
			t.Errorf("answered speed %s: charged %v; want %v", tt.speed, got, tt.want)
		}
	}
}

// Audio tokens are billed at audio rates (gpt-4o-mini-audio-preview's
// answer of 18 completion tokens holds 12 of audio). The recording is
// openai/chat-audio-output; the prices are test prices.
func TestAudioTokensPricedAtAudioRates(t *testing.T) {
	body, err := os.ReadFile(filepath.Join("..", "testdata", "providers", "openai", "chat-audio-output", "response.json"))
	if err != nil {
		t.Fatal(err)
	}
	prices, err := pricing.NewTable("USD", []pricing.Entry{{Model: "gpt-4o-mini-audio-preview", Snapshots: []string{"gpt-4o-mini-audio-preview-2024-12-17"},
		Input: "1", Output: "2", AudioInput: "10", AudioOutput: "20"}})
	if err != nil {
		t.Fatal(err)
	}
	r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{body}}, rigOptions{prices: prices})
	if resp, text := r.post(t, chatPath, `{"model":"gpt-4o-mini-audio-preview","max_tokens":100,"messages":[]}`, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, text)
	}
	// prompt_tokens 22 (audio 0), completion_tokens 18 (audio 12, text 6).
	if got, want := charged(t, r.outcome(t)), float64(22*1+6*2+12*20); got != want {
		t.Errorf("charged %v; want %v", got, want)
	}
}

// OpenAI bills the cache writes of a request with prompt_cache_retention
// "24h" at the extended rate (gpt-6.2-sol: $5 per million, against $2.50
// for 30 minutes). A chat answer does not repeat the retention: the
// request's is read. Synthetic bodies: no recording holds a 24h write.
func TestOpenAIExtendedCacheWritesPricedAtTheExtendedRate(t *testing.T) {
	tc := realCounter(t)
	answer := []byte(`{"id":"c1","object":"chat.completion","model":"gpt-6.2-sol","service_tier":"default","choices":[],` +
		`"usage":{"prompt_tokens":3000,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":0,"cache_write_tokens":2000}}}`)
	for _, tt := range []struct {
		retention string
		want      float64
	}{
		{`"in_memory"`, 1000*2 + 2000*2.5 + 10*10},
		{`"24h"`, 1000*2 + 2000*5 + 10*10},
	} {
		r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{answer}}, rigOptions{tokenizer: tc})
		body := `{"model":"gpt-6.2-sol","prompt_cache_retention":` + tt.retention + `,"max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
		if resp, text := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, text)
		}
		if got := charged(t, r.outcome(t)); got != tt.want {
			t.Errorf("retention %s: charged %v; want %v", tt.retention, got, tt.want)
		}
	}
}

// A request that names no tier, on a project set to fast, is reserved at
// the fast price where the table has one, and at the standard price where
// it has none (the provider serves a model at a tier it supports): it is
// not refused, as a request that asks for fast by name is.
func TestAutoTierWithoutAFastPriceReservesStandard(t *testing.T) {
	tc := realCounter(t)
	prices, err := pricing.Config{ProjectServiceTier: "fast"}.Table()
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"claude-opus-5","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
	in := promptTokens(t, tc, "/v1/messages", body)
	r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}, rigOptions{tokenizer: tc, prices: prices})
	// Anthropic requests never leave the tier to a project: standard.
	if resp, text := r.post(t, "/v1/messages", body, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, text)
	}
	// The dearest input rate is the 1-hour cache write, $10; output $25.
	if got, want := charged(t, r.outcome(t)), float64(in*10+100*25); got != want {
		t.Errorf("charged %v; want %v at standard rates", got, want)
	}

	onlyStandard, err := pricing.Config{ProjectServiceTier: "fast", Defaults: "none",
		Models: []pricing.Entry{{Model: "gpt-4o-mini", Input: "1", Output: "2"}}}.Table()
	if err != nil {
		t.Fatal(err)
	}
	r = moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}, rigOptions{tokenizer: tc, prices: onlyStandard})
	chat := `{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
	in = promptTokens(t, tc, chatPath, chat)
	if resp, text := r.post(t, chatPath, chat, nil); resp.StatusCode != 200 {
		t.Fatalf("auto on a fast project without a fast price: %d %s", resp.StatusCode, text)
	}
	if got, want := charged(t, r.outcome(t)), float64(in*1+100*2); got != want {
		t.Errorf("charged %v; want %v at standard rates", got, want)
	}
	resp, text := r.post(t, chatPath, `{"model":"gpt-4o-mini","service_tier":"priority","max_tokens":100,"messages":[]}`, nil)
	if resp.StatusCode != 400 || !strings.Contains(text, "unpriced_model") {
		t.Errorf("priority by name without a fast price: %d %s; want 400 unpriced_model", resp.StatusCode, text)
	}
	r.outcome(t)
}

// Azure OpenAI serves and bills the deployment the path names, whatever
// model the body names: a deployment the price table names (an alias,
// docs/budgets.md "Prices") prices the request, so a client cannot buy a
// dear deployment at a cheap model's price by naming it in the body.
// 100 prompt and 10 output tokens at $10 and $50 per million: 1,500
// micro-dollars.
func TestAzureDeploymentPricesTheRequest(t *testing.T) {
	prices, err := pricing.Defaults().Merge([]pricing.Entry{
		{Model: "gpt-4o-mini", Input: "0.10", Output: "0.40"},
		{Model: "dear-model", Aliases: []string{"prod-eu"}, Input: "10.00", Output: "50.00"},
	})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"id":"chatcmpl-1","object":"chat.completion","model":"dear-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":100,"completion_tokens":10,"total_tokens":110}}`
	for path, want := range map[string]float64{
		"/openai/deployments/prod-eu/chat/completions?api-version=2024-10-21": 100*10 + 10*50,
		// A deployment the table does not name: the body's model prices it.
		"/openai/deployments/other/chat/completions?api-version=2024-10-21": 100*0.10 + 10*0.40,
	} {
		u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(body)}}
		r := moneyRig(t, u, rigOptions{prices: prices, tokenizer: realCounter(t)})
		if resp, out := r.post(t, path, `{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`, nil); resp.StatusCode != 200 {
			t.Fatalf("%s: status %d %s", path, resp.StatusCode, out)
		}
		if got := charged(t, r.outcome(t)); got != want {
			t.Errorf("%s: charged %v micro-dollars, want %v", path, got, want)
		}
	}
}
