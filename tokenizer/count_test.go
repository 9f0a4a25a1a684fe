package tokenizer

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func TestDetectAPI(t *testing.T) {
	tests := []struct {
		path, body string
		want       API
	}{
		{"/v1/chat/completions", `{}`, ChatCompletions},
		{"/openai/deployments/gpt-4o/chat/completions?api-version=2024-12-01-preview", `{}`, ChatCompletions},
		{"/v1/completions", `{}`, Completions},
		{"/v1/embeddings", `{}`, Embeddings},
		{"/v1/responses", `{}`, Responses},
		{"/v1/messages", `{}`, Messages},
		{"/v1beta/models/gemini-2.0-flash:generateContent", `{}`, Gemini},
		{"/v1/projects/p/locations/l/publishers/google/models/gemini-2.0-flash:streamGenerateContent?alt=sse", `{}`, Gemini},
		{"", `{"model":"gpt-4o","messages":[]}`, ChatCompletions},
		{"", `{"model":"claude-sonnet-4-5","messages":[],"max_tokens":5}`, Messages},
		{"", `{"model":"x","system":"s","messages":[]}`, Messages},
		{"", `{"contents":[]}`, Gemini},
		{"", `{"model":"babbage-002","prompt":"x"}`, Completions},
		{"", `{"model":"text-embedding-3-small","input":"x"}`, Embeddings},
		{"", `{"model":"m","input":[[1,2,3]]}`, Embeddings},
		{"", `{"model":"gpt-5","input":[{"role":"user","content":"x"}]}`, Responses},
		{"", `{"model":"gpt-5","input":"x","instructions":"be brief"}`, Responses},
		{"/unknown", `{"model":"gpt-4o","messages":[]}`, ChatCompletions},
	}
	for _, tt := range tests {
		got, err := DetectAPI(tt.path, []byte(tt.body))
		if err != nil || got != tt.want {
			t.Errorf("DetectAPI(%q, %s) = %q, %v; want %q", tt.path, tt.body, got, err, tt.want)
		}
	}
	for _, body := range []string{`{"model":"gpt-4o"}`, `[]`, `{`} {
		if _, err := DetectAPI("", []byte(body)); !errors.Is(err, ErrUnknownAPI) && !errors.Is(err, ErrMalformed) {
			t.Errorf("DetectAPI(%s) error %v, want ErrUnknownAPI or ErrMalformed", body, err)
		}
	}
}

func TestEncodingFor(t *testing.T) {
	c := newTestCounter(t)
	tests := []struct{ model, want string }{
		{"gpt-4o", O200kBase}, {"gpt-4o-2024-08-06", O200kBase}, {"gpt-4o-mini", O200kBase},
		{"chatgpt-4o-latest", O200kBase}, {"gpt-4.1-nano", O200kBase}, {"gpt-4.5-preview", O200kBase},
		{"o1", O200kBase}, {"o1-mini", O200kBase}, {"o3-mini-2025-01-31", O200kBase}, {"o4-mini", O200kBase},
		{"gpt-5", O200kBase}, {"gpt-5-nano", O200kBase}, {"gpt-5.5", O200kBase},
		{"gpt-4", Cl100kBase}, {"gpt-4-0613", Cl100kBase}, {"gpt-4-turbo", Cl100kBase}, {"gpt-4-32k", Cl100kBase},
		{"gpt-3.5-turbo", Cl100kBase}, {"gpt-35-turbo", Cl100kBase}, {"gpt-3.5-turbo-instruct", Cl100kBase},
		{"text-embedding-3-small", Cl100kBase}, {"text-embedding-3-large", Cl100kBase}, {"text-embedding-ada-002", Cl100kBase},
		{"babbage-002", Cl100kBase}, {"GPT-4o", O200kBase}, {"openai/gpt-4o-mini", O200kBase},
		{"ft:gpt-4o-mini-2024-07-18:org::abc123", O200kBase},
	}
	for _, tt := range tests {
		got, fb, err := c.EncodingFor(tt.model)
		if err != nil || got != tt.want || fb {
			t.Errorf("EncodingFor(%q) = %q, %v, %v; want %q", tt.model, got, fb, err, tt.want)
		}
	}
	for _, m := range []string{"o10-preview", "llama-3-70b", "", "gpt-4.1-nano-wrong2"} {
		_, _, err := c.EncodingFor(m)
		if m == "gpt-4.1-nano-wrong2" {
			continue // a typo of a known family still resolves by prefix
		}
		if !errors.Is(err, ErrUnknownModel) {
			t.Errorf("EncodingFor(%q) error %v, want ErrUnknownModel", m, err)
		}
	}
	fb, err := New(Options{FallbackEncoding: Cl100kBase})
	if err != nil {
		t.Fatal(err)
	}
	if enc, isFallback, err := fb.EncodingFor("llama-3-70b"); enc != Cl100kBase || !isFallback || err != nil {
		t.Errorf("fallback EncodingFor = %q, %v, %v; want cl100k_base, true, nil", enc, isFallback, err)
	}
}

func TestCount(t *testing.T) {
	c := newTestCounter(t)
	hello := func(enc string) int { n, _ := c.CountText(enc, "Hello"); return n }
	tests := []struct {
		name string
		req  Request
		want Count
	}{
		{
			name: "chat: 3 per message + role + content, 3 to prime; largest cap wins over a decoy (S7)",
			req:  Request{Body: []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"Hello"}],"max_tokens":1,"max_completion_tokens":500,"stream":true,"stream_options":{"include_usage":true}}`)},
			want: Count{API: ChatCompletions, Model: "gpt-4o", Encoding: O200kBase, Exact: true, InputTokens: 3 + 1 + hello(O200kBase) + 3,
				OutputCap: 500, OutputAllowance: 500, AllowanceSource: FromRequest, Stream: true, IncludeUsage: true,
				ModelKey: "gpt-4o", Choices: 1, ChoiceAllowance: 500, CapFields: []string{"max_tokens", "max_completion_tokens"},
				AddCapField: "max_completion_tokens", CapFloor: 1},
		},
		{
			name: "chat: name costs its tokens plus one; n multiplies the allowance",
			req:  Request{Body: []byte(`{"model":"gpt-4","messages":[{"role":"user","name":"bob","content":[{"type":"text","text":"Hello"}]}],"max_tokens":10,"n":3}`)},
			want: Count{API: ChatCompletions, Model: "gpt-4", Encoding: Cl100kBase, Exact: true, InputTokens: 3 + 1 + hello(Cl100kBase) + 1 + 1 + 3,
				OutputCap: 10, OutputAllowance: 30, AllowanceSource: FromRequest,
				ModelKey: "gpt-4", Choices: 3, ChoiceAllowance: 10, CapFields: []string{"max_tokens"}, AddCapField: "max_completion_tokens", CapFloor: 1},
		},
		{
			name: "special-token strings in user text are text",
			req:  Request{Body: []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"<|endoftext|>"}],"max_tokens":5}`)},
			want: Count{API: ChatCompletions, Model: "gpt-4o", Encoding: O200kBase, Exact: true, InputTokens: 3 + 1 + 7 + 3,
				OutputCap: 5, OutputAllowance: 5, AllowanceSource: FromRequest,
				ModelKey: "gpt-4o", Choices: 1, ChoiceAllowance: 5, CapFields: []string{"max_tokens"}, AddCapField: "max_completion_tokens", CapFloor: 1},
		},
		{
			name: "Azure: the deployment in the path names the model",
			req:  Request{Path: "/openai/deployments/gpt-35-turbo/chat/completions?api-version=2024-06-01", Body: []byte(`{"messages":[{"role":"user","content":"Hello"}],"max_tokens":7}`)},
			want: Count{API: ChatCompletions, Model: "gpt-35-turbo", Encoding: Cl100kBase, Exact: true, InputTokens: 3 + 1 + hello(Cl100kBase) + 3,
				OutputCap: 7, OutputAllowance: 7, AllowanceSource: FromRequest,
				ModelKey: "gpt-35-turbo", Deployment: "gpt-35-turbo", Choices: 1, ChoiceAllowance: 7, CapFields: []string{"max_tokens"}, AddCapField: "max_completion_tokens", CapFloor: 1},
		},
		{
			name: "legacy completions default to 16 output tokens per prompt",
			req:  Request{Body: []byte(`{"model":"babbage-002","prompt":["Hello","Hello"]}`)},
			want: Count{API: Completions, Model: "babbage-002", Encoding: Cl100kBase, Exact: true, InputTokens: 2 * hello(Cl100kBase),
				OutputAllowance: 32, AllowanceSource: FromRequest,
				ModelKey: "babbage-002", Choices: 2, ChoiceAllowance: 16, AddCapField: "max_tokens", CapFloor: 1},
		},
		{
			name: "embeddings of token arrays count the ids",
			req:  Request{Path: "/v1/embeddings", Body: []byte(`{"model":"text-embedding-3-small","input":[[1,2,3],[4,5]]}`)},
			want: Count{API: Embeddings, Model: "text-embedding-3-small", Encoding: Cl100kBase, Exact: true, InputTokens: 5,
				AllowanceSource: FromRequest, ModelKey: "text-embedding-3-small", Choices: 1, Embedding: true, CapFloor: 1},
		},
		{
			name: "Gemini: model from the path, cap from generationConfig, estimate",
			req:  Request{Path: "/v1beta/models/gemini-2.0-flash:generateContent", Body: []byte(`{"contents":[{"role":"user","parts":[{"text":"Hello"}]}],"generationConfig":{"maxOutputTokens":64}}`)},
			want: Count{API: Gemini, Model: "gemini-2.0-flash", Encoding: O200kBase, InputTokens: 2,
				OutputCap: 64, OutputAllowance: 64, AllowanceSource: FromRequest,
				ModelKey: "gemini-2.0-flash", Choices: 1, ChoiceAllowance: 64, CapFields: []string{"generationConfig.maxOutputTokens"},
				AddCapField: "generationConfig.maxOutputTokens", CapFloor: 1},
		},
		{
			name: "Anthropic: max_tokens, estimate",
			req:  Request{Body: []byte(`{"model":"claude-sonnet-4-5","max_tokens":1024,"system":"Hello","messages":[{"role":"user","content":[{"type":"text","text":"Hello"}]}]}`)},
			want: Count{API: Messages, Model: "claude-sonnet-4-5", Encoding: O200kBase, InputTokens: 7, // ceil((1+4+1) * 1.15)
				OutputCap: 1024, OutputAllowance: 1024, AllowanceSource: FromRequest,
				ModelKey: "claude-sonnet-4-5", Choices: 1, ChoiceAllowance: 1024, CapFields: []string{"max_tokens"}, AddCapField: "max_tokens", CapFloor: 1},
		},
		{
			name: "no cap: the configured default",
			req:  Request{Model: "gpt-4o-mini", Body: []byte(`{"model":"ignored","messages":[]}`)},
			want: Count{API: ChatCompletions, Model: "gpt-4o-mini", Encoding: O200kBase, Exact: true, InputTokens: 3,
				OutputAllowance: 4096, AllowanceSource: FromDefault,
				ModelKey: "gpt-4o-mini", Choices: 1, ChoiceAllowance: 4096, AddCapField: "max_completion_tokens", CapFloor: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Count(tt.req)
			if err != nil {
				t.Fatalf("Count: %v", err)
			}
			// The billing fields have a test of their own
			// (TestCountReadsTheFieldsThatChangeThePrice).
			if diff := cmp.Diff(tt.want, got, cmpopts.IgnoreFields(Count{}, "ServiceTier", "ExtendedCacheRetention")); diff != "" {
				t.Errorf("Count (-want +got):\n%s", diff)
			}
			if got.Reservation() != got.InputTokens+got.OutputAllowance {
				t.Errorf("Reservation() = %d", got.Reservation())
			}
		})
	}
}

// TestCountImages checks that images are bounded by the documented tile
// formula when their size is unknown.
func TestCountImages(t *testing.T) {
	c := newTestCounter(t)
	body := func(model, detail string) []byte {
		return fmt.Appendf(nil, `{"model":%q,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png","detail":%q}}]}]}`, model, detail)
	}
	tests := []struct {
		model, detail string
		want          int
	}{
		{"gpt-4o", "low", 3 + 1 + 85 + 3},
		{"gpt-4o", "high", 3 + 1 + 1445 + 3},
		{"gpt-4o", "auto", 3 + 1 + 1445 + 3},
		{"gpt-4o-mini", "low", 3 + 1 + 2833 + 3},
	}
	for _, tt := range tests {
		got, err := c.Count(Request{Body: body(tt.model, tt.detail)})
		if err != nil || got.InputTokens != tt.want {
			t.Errorf("%s detail %s: InputTokens = %d, %v; want %d", tt.model, tt.detail, got.InputTokens, err, tt.want)
		}
	}
}

func TestCountErrors(t *testing.T) {
	c, err := New(Options{MaxOutputTokens: 100000})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, body string
		want       error
		msg        string
	}{
		{"malformed", `{"model":"gpt-4o","messages":[`, ErrMalformed, "malformed"},
		{"not an object", `"hello"`, ErrMalformed, ""},
		{"messages not an array", `{"model":"gpt-4o","messages":{}}`, ErrMalformed, ""},
		{"content of a wrong type", `{"model":"gpt-4o","messages":[{"role":"user","content":42}]}`, ErrMalformed, "messages[].content: want a string, an array or null, got a number at byte 55"},
		{"unknown shape", `{"model":"gpt-4o","foo":1}`, ErrUnknownAPI, ""},
		{"unknown model", `{"model":"llama-3","messages":[]}`, ErrUnknownModel, "the model named by model at byte 9"},
		{"no model at all", `{"messages":[]}`, ErrUnknownModel, "names no model"},
		{"string cap", `{"model":"gpt-4o","messages":[],"max_tokens":"10"}`, ErrInvalidCap, "max_tokens: want a number no larger than 100000, got a string at byte 45"},
		{"boolean cap", `{"model":"gpt-4o","messages":[],"max_tokens":true}`, ErrInvalidCap, "got a boolean"},
		{"absurd cap", `{"model":"gpt-4o","messages":[],"max_tokens":100001}`, ErrInvalidCap, "got a number above 100000"},
		{"huge cap", `{"model":"gpt-4o","messages":[],"max_tokens":99999999999999999999}`, ErrInvalidCap, "above"},
		{"infinite cap", `{"model":"gpt-4o","messages":[],"max_tokens":1e400}`, ErrInvalidCap, "above"},
		{"absurd gemini cap", `{"contents":[],"generationConfig":{"maxOutputTokens":1e9}}`, ErrInvalidCap, "generationConfig.maxOutputTokens"},
		{"small decoy beside an absurd cap", `{"model":"gpt-4o","messages":[],"max_tokens":1,"max_completion_tokens":100001}`, ErrInvalidCap, "max_completion_tokens"},
		{"bad n", `{"model":"gpt-4o","messages":[],"n":0}`, ErrMalformed, "n: want a whole number from 1 to 128, got a number below 1 at byte 36"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Count(Request{Body: []byte(tt.body)})
			if !errors.Is(err, tt.want) {
				t.Fatalf("Count error = %v, want %v", err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("Count error %q does not mention %q", err, tt.msg)
			}
		})
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	for _, o := range []Options{
		{FallbackEncoding: "p50k_base"},
		{DefaultOutputTokens: -1},
		{MaxOutputTokens: -1},
		{Estimator: EstimatorOptions{Quantile: 1.5}},
		{Estimator: EstimatorOptions{HalfLife: -1}},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) succeeded, want an error", o)
		}
	}
}

// FuzzCount feeds arbitrary bodies to every API: Count must not panic, and
// every error must wrap one of the package's sentinels.
func FuzzCount(f *testing.F) {
	for _, s := range []string{
		`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"properties":{"a":{"type":"string","enum":["x"]}}}}}]}`,
		`{"model":"claude-3","system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"tool_result","content":"r"}]}],"max_tokens":5}`,
		`{"contents":[{"parts":[{"text":"x"},{"inlineData":{}}]}],"generationConfig":{"maxOutputTokens":5}}`,
		`{"model":"gpt-5","input":[{"type":"function_call","name":"f","arguments":"{}"},{"type":"function_call_output","output":"x"}]}`,
		`{"model":"text-embedding-3-small","input":[[1,2],"x"]}`,
		`{"model":"babbage-002","prompt":"x","suffix":"y","best_of":2}`,
	} {
		f.Add(s, uint8(0))
	}
	apis := []API{"", ChatCompletions, Completions, Embeddings, Responses, Messages, Gemini}
	c, err := New(Options{FallbackEncoding: O200kBase})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body string, api uint8) {
		_, err := c.Count(Request{API: apis[int(api)%len(apis)], Body: []byte(body)})
		if err == nil {
			return
		}
		for _, s := range []error{ErrMalformed, ErrUnknownAPI, ErrUnknownModel, ErrInvalidCap} {
			if errors.Is(err, s) {
				return
			}
		}
		t.Fatalf("Count error %v wraps no sentinel", err)
	})
}

// TestUnknownEncodingAndAPI checks the remaining error paths.
func TestUnknownEncodingAndAPI(t *testing.T) {
	c := newTestCounter(t)
	if _, err := c.CountText("p50k_base", "x"); err == nil || !strings.Contains(err.Error(), `unknown encoding "p50k_base"`) {
		t.Errorf("CountText(p50k_base) error = %v, want unknown encoding", err)
	}
	if _, err := c.Count(Request{API: "soap", Body: []byte(`{"model":"gpt-4o"}`)}); !errors.Is(err, ErrUnknownAPI) {
		t.Errorf("Count with API soap: error %v, want ErrUnknownAPI", err)
	}
	// A stream for an unknown encoding counts with o200k_base rather than
	// failing mid-response.
	s := c.NewStream("")
	s.Write("Hello, world")
	want, _ := c.CountText(O200kBase, "Hello, world")
	if got := s.Tokens(); got != want {
		t.Errorf("NewStream(\"\").Tokens() = %d, want %d", got, want)
	}
}

// Provider validation stays the provider's: a cap the provider refuses but
// tokengate can still meter (zero, negative, a fraction, an exponent) is
// counted at its value rounded up, never below zero, so the request is
// reserved for its prompt and little or no output and forwarded for the
// provider to answer. The largest cap still counts (S7), and what cannot
// be metered is still refused (see TestCountErrors).
func TestProviderValidationStaysTheProviders(t *testing.T) {
	c, err := New(Options{MaxOutputTokens: 100000})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name, path, body string
		allowance        int
		fields           []string
	}{
		{"zero", "", `{"model":"gpt-4o","messages":[],"max_tokens":0}`, 0, []string{"max_tokens"}},
		{"zero completion tokens", "", `{"model":"gpt-4o","messages":[],"max_completion_tokens":0}`, 0, []string{"max_completion_tokens"}},
		{"negative", "", `{"model":"gpt-4o","messages":[],"max_tokens":-12345}`, 0, []string{"max_tokens"}},
		{"minus infinity", "", `{"model":"gpt-4o","messages":[],"max_tokens":-1e400}`, 0, []string{"max_tokens"}},
		{"a fraction", "", `{"model":"gpt-4o","messages":[],"max_tokens":12.5}`, 13, []string{"max_tokens"}},
		{"an exponent", "", `{"model":"gpt-4o","messages":[],"max_tokens":1e3}`, 1000, []string{"max_tokens"}},
		{"a negative decoy beside a large cap", "", `{"model":"gpt-4o","messages":[],"max_tokens":-1,"max_completion_tokens":700}`, 700, []string{"max_tokens", "max_completion_tokens"}},
		{"legacy completions: zero, not the default 16", "/v1/completions", `{"model":"gpt-3.5-turbo-instruct","prompt":"x","max_tokens":0}`, 0, []string{"max_tokens"}},
		{"anthropic", "/v1/messages", `{"model":"claude-sonnet-4-5","messages":[],"max_tokens":0}`, 0, []string{"max_tokens"}},
		{"gemini", "/v1beta/models/gemini-2.0-flash:generateContent", `{"contents":[],"generationConfig":{"maxOutputTokens":-3}}`, 0, []string{"generationConfig.maxOutputTokens"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Count(Request{Path: tt.path, Body: []byte(tt.body)})
			if err != nil {
				t.Fatalf("Count: %v, want the request metered and forwarded", err)
			}
			if got.OutputAllowance != tt.allowance || got.AllowanceSource != FromRequest || !slices.Equal(got.CapFields, tt.fields) {
				t.Errorf("allowance %d from %s, cap fields %q; want %d from the request, %q",
					got.OutputAllowance, got.AllowanceSource, got.CapFields, tt.allowance, tt.fields)
			}
		})
	}
}
