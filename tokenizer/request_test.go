package tokenizer

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/internal/billing"
)

// TestCaseVariantKeys: keys are read as the provider reads them, exactly.
// A key that differs only in case is another (unknown) field, and the last
// of duplicate keys wins, whole (S7, S23).
func TestCaseVariantKeys(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	hi, err := c.Count(Request{Body: []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, body       string
		cap, allowance   int
		input            int // 0: the input of hi
		stream, inclUsag bool
	}{
		{name: "a case variant does not hide the real cap",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"Max_Tokens":10,"max_tokens":90000}`, cap: 90000, allowance: 90000},
		{name: "nor when it comes last",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":90000,"MAX_TOKENS":10}`, cap: 90000, allowance: 90000},
		{name: "a case variant of n is not n",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"N":1,"n":50}`, cap: 10, allowance: 500},
		{name: "n after its case variant",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"n":50,"N":1}`, cap: 10, allowance: 500},
		{name: "the last duplicate wins",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"max_tokens":90000}`, cap: 90000, allowance: 90000},
		{name: "the last duplicate wins, also when smaller",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":90000,"max_tokens":10}`, cap: 10, allowance: 10},
		{name: "escaped keys are decoded",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max\u005ftokens":90000}`, cap: 90000, allowance: 90000},
		{name: "Messages is not messages",
			body: `{"model":"gpt-4o","Messages":[{"role":"user","content":"a long prompt that is not sent"}],"messages":[{"role":"user","content":"hi"}]}`, allowance: 1000},
		{name: "Content is not content",
			body: `{"model":"gpt-4o","messages":[{"role":"user","Content":"a long prompt that is not sent","content":"hi"}]}`, allowance: 1000},
		{name: "a repeated message object is replaced, not merged",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"messages":[{"role":"user","content":"hi"}]}`, allowance: 1000},
		{name: "Stream is not stream",
			body: `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"Stream":true,"stream_options":{"Include_Usage":true}}`, allowance: 1000},
		{name: "stream and include_usage",
			body:      `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":false,"include_usage":true}}`,
			allowance: 1000, stream: true, inclUsag: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Count(Request{Body: []byte(tt.body)})
			if err != nil {
				t.Fatal(err)
			}
			want := tt.input
			if want == 0 {
				want = hi.InputTokens
			}
			if got.OutputCap != tt.cap || got.OutputAllowance != tt.allowance || got.InputTokens != want || got.Stream != tt.stream || got.IncludeUsage != tt.inclUsag {
				t.Errorf("cap %d, allowance %d, input %d, stream %v, include_usage %v; want %d, %d, %d, %v, %v",
					got.OutputCap, got.OutputAllowance, got.InputTokens, got.Stream, got.IncludeUsage, tt.cap, tt.allowance, want, tt.stream, tt.inclUsag)
			}
		})
	}
	// Nested objects: a repeated generationConfig replaces the earlier one;
	// encoding/json would merge the two and see a cap the provider ignores.
	got, err := c.Count(Request{Path: "/v1beta/models/gemini-2.0-flash:generateContent",
		Body: []byte(`{"contents":[],"generationConfig":{"maxOutputTokens":5},"generationConfig":{"candidateCount":2}}`)})
	if err != nil {
		t.Fatal(err)
	}
	if got.OutputCap != 0 || got.Choices != 2 || got.OutputAllowance != 2000 {
		t.Errorf("repeated generationConfig: cap %d, choices %d, allowance %d; want 0, 2, 2000", got.OutputCap, got.Choices, got.OutputAllowance)
	}
}

// marker stands for prompt text or a key in a body: it must never appear
// in an error.
const marker = "SECRET-MARKER-7f3a"

// TestParseErrorsNameNoBodyText: every refusal Count can give names a field
// and a byte offset, never text of the body (S23): parse errors say what
// the fault is and where, and other errors name the field at fault.
func TestParseErrorsNameNoBodyText(t *testing.T) {
	c, err := New(Options{MaxOutputTokens: 100000})
	if err != nil {
		t.Fatal(err)
	}
	m := marker
	chat := func(rest string) string {
		return `{"model":"gpt-4o","messages":[{"role":"user","content":"` + m + `"}]` + rest + `}`
	}
	tests := []struct {
		name, path, body string
		want             error
		msg              string
	}{
		{"end of input", "", `{"model":"gpt-4o","messages":[{"role":"user","content":"` + m + `"}`, ErrMalformed, "unexpected end of input at byte 76"},
		{"end of input in a string", "", `{"model":"gpt-4o","messages":[{"role":"user","content":"` + m, ErrMalformed, "unexpected end of input at byte 74"},
		{"empty body", "", ``, ErrMalformed, "unexpected end of input at byte 0"},
		{"a value expected", "", `{"model":` + m + `}`, ErrMalformed, "expected a value at byte 9"},
		{"a key expected", "", `{` + m + `:1}`, ErrMalformed, "expected a string key at byte 1"},
		{"a colon expected", "", `{"model" ` + m + `}`, ErrMalformed, "expected ':' after an object key at byte 9"},
		{"object member", "", `{"model":"gpt-4o" "` + m + `"}`, ErrMalformed, "expected ',' or '}' after an object member at byte 18"},
		{"array element", "", `{"messages":["a" "` + m + `"]}`, ErrMalformed, "expected ',' or ']' after an array element at byte 17"},
		{"bad escape", "", `{"model":"` + m + `\x"}`, ErrMalformed, "invalid escape in a string at byte 29"},
		{"bad unicode escape", "", `{"model":"` + m + `\u12G4"}`, ErrMalformed, "invalid escape in a string at byte 32"},
		{"control character", "", "{\"model\":\"" + m + "\n\"}", ErrMalformed, "control character in a string at byte 28"},
		{"bad literal", "", `{"stream":tru` + m + `}`, ErrMalformed, "invalid literal at byte 13"},
		{"bad number", "", `{"n":-` + m + `}`, ErrMalformed, "invalid number at byte 6"},
		{"bad fraction", "", `{"n":1.` + m + `}`, ErrMalformed, "invalid number at byte 7"},
		{"data after the value", "", `{}` + m, ErrMalformed, "data after the top-level value at byte 2"},
		{"nesting", "", strings.Repeat("[", maxDepth+1) + m, ErrMalformed, "nesting deeper than 10000 levels at byte 10000"},
		{"not an object", "", `"` + m + `"`, ErrMalformed, "the body: want an object, got a string at byte 0"},
		{"model of a wrong type", "", `{"model":["` + m + `"],"messages":[]}`, ErrMalformed, "model: want a string, got an array at byte 9"},
		{"stream of a wrong type", "", `{"stream":"` + m + `","messages":[]}`, ErrMalformed, "stream: want a boolean, got a string at byte 10"},
		{"content of a wrong type", "", `{"model":"gpt-4o","messages":[{"role":"user","content":{"x":"` + m + `"}}]}`, ErrMalformed, "messages[].content: want a string, an array or null, got an object at byte 55"},
		{"a part of a wrong type", "", `{"model":"gpt-4o","messages":[{"role":"user","content":["` + m + `"]}]}`, ErrMalformed, "messages[].content[]: want an object, got a string at byte 56"},
		{"text of a wrong type", "", `{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"text","text":["` + m + `"]}]}]}`, ErrMalformed, "messages[].content[].text: want a string, got an array"},
		{"prompt of a wrong type", "/v1/completions", `{"model":"babbage-002","prompt":{"x":"` + m + `"}}`, ErrMalformed, "prompt: want a string or an array, got an object at byte 32"},
		{"gemini part", "/v1beta/models/gemini-2.0-flash:generateContent", `{"contents":[{"parts":["` + m + `"]}]}`, ErrMalformed, "contents[].parts[]: want an object, got a string at byte 23"},
		{"cap of a wrong type", "", chat(`,"max_tokens":"` + m + `"`), ErrInvalidCap, "max_tokens: want a number no larger than 100000, got a string at byte 91"},
		{"absurd cap", "", chat(`,"max_tokens":1234567`), ErrInvalidCap, "got a number above 100000"},
		{"gemini cap", "/v1beta/models/gemini-2.0-flash:generateContent", `{"contents":[],"generation_config":{"max_output_tokens":"` + m + `"}}`, ErrInvalidCap, "generation_config.max_output_tokens: want a number"},
		{"n of a wrong type", "", chat(`,"n":"` + m + `"`), ErrMalformed, "n: want a whole number from 1 to 128, got a string at byte 82"},
		{"n too large", "", chat(`,"n":129`), ErrMalformed, "n: want a whole number from 1 to 128, got a number above 128"},
		{"unknown model", "", `{"model":"` + m + `","messages":[]}`, ErrUnknownModel, "the model named by model at byte 9"},
		{"unknown Azure deployment", "/openai/deployments/" + m + "/chat/completions", `{"messages":[]}`, ErrUnknownModel, "the model named by the path"},
		{"unknown shape", "", `{"model":"gpt-4o","` + m + `":1}`, ErrUnknownAPI, "none of messages"},
		{"free endpoint", "/v1/messages/count_tokens", `{"model":"` + m + `"}`, ErrFreeEndpoint, "count_tokens"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Count(Request{Path: tt.path, Body: []byte(tt.body)})
			if !errors.Is(err, tt.want) {
				t.Fatalf("Count error = %v, want %v", err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("Count error %q does not say %q", err, tt.msg)
			}
			for _, secret := range []string{marker, "SECRET", "7f3a", "tru"} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("Count error %q shows body text %q", err, secret)
				}
			}
		})
	}
}

// TestEndpointsThatGenerateNothing: a request is metered, free or unknown
// by its method and path, whatever prefix the path carries.
func TestEndpointsThatGenerateNothing(t *testing.T) {
	metered := func(api API, name string) Endpoint { return Endpoint{Class: Metered, API: api, Name: name} }
	free := func(name string) Endpoint { return Endpoint{Class: Free, Name: name} }
	unknown := func(name string) Endpoint { return Endpoint{Name: name} }
	tests := []struct {
		method, path string
		want         Endpoint
	}{
		// Generation, under any prefix.
		{"POST", "/v1/chat/completions", metered(ChatCompletions, "chat")},
		{"POST", "/openai/v1/chat/completions", metered(ChatCompletions, "chat")},
		{"POST", "/api/v1/chat/completions/", metered(ChatCompletions, "chat")},
		{"POST", "/openai/deployments/gpt-4o/chat/completions?api-version=2024-12-01-preview", metered(ChatCompletions, "chat")},
		{"POST", "/openai/deployments/chat/completions?api-version=2024-06-01", metered(Completions, "completions")},
		{"POST", "/openai/deployments/ada/embeddings?api-version=2024-06-01", metered(Embeddings, "embeddings")},
		{"POST", "/v1/completions", metered(Completions, "completions")},
		{"POST", "/v1/embeddings", metered(Embeddings, "embeddings")},
		{"POST", "/v1/responses", metered(Responses, "responses")},
		{"POST", "/openai/v1/responses?api-version=preview", metered(Responses, "responses")},
		{"POST", "/v1/messages", metered(Messages, "messages")},
		{"POST", "/anthropic/v1/messages?beta=true", metered(Messages, "messages")},
		{"POST", "/v1beta/models/gemini-2.0-flash:generateContent", metered(Gemini, "gemini_generate")},
		{"POST", "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", metered(Gemini, "gemini_generate")},
		{"POST", "/v1/projects/p/locations/l/publishers/google/models/gemini-2.0-flash:generateContent", metered(Gemini, "gemini_generate")},
		{"POST", "/v1beta/models/text-embedding-004:embedContent", metered(Gemini, "gemini_embed")},
		{"POST", "/v1beta/models/text-embedding-004:batchEmbedContents", metered(Gemini, "gemini_embed")},
		// No spelling of a generation endpoint passes as anything else.
		{"POST", "/V1/Chat/Completions", metered(ChatCompletions, "chat")},
		{"POST", "/v1/chat/complet%69ons", metered(ChatCompletions, "chat")},
		{"POST", "/v1/models/../chat/completions", metered(ChatCompletions, "chat")},
		{"POST", "/v1/models/..%2Fchat/completions", metered(ChatCompletions, "chat")},
		{"POST", "//v1//chat/completions", metered(ChatCompletions, "chat")},
		{"POST", "/v1/chat/completions#/v1/models", metered(ChatCompletions, "chat")},
		// Free: nothing is generated.
		{"POST", "/v1/messages/count_tokens", free("count_tokens")},
		{"POST", "/api/anthropic/v1/messages/count_tokens?beta=true", free("count_tokens")},
		{"POST", "/v1/responses/input_tokens", free("count_tokens")},
		{"POST", "/v1beta/models/gemini-2.0-flash:countTokens", free("count_tokens")},
		{"POST", "/v1/moderations", free("moderations")},
		{"POST", "/openai/v1/moderations", free("moderations")},
		{"POST", "/v1/chat/completions/chatcmpl-abc123", free("stored_completions")},
		{"POST", "/v1/responses/resp_123/cancel", free("response_cancel")},
		{"POST", "/v1/files", free("files")},
		{"POST", "/v1/uploads/upload_1/parts", free("files")},
		{"POST", "/upload/v1beta/files", free("files")},
		{"POST", "/openai/files?api-version=2024-06-01", free("files")},
		{"POST", "/v1/conversations/conv_1/items", free("conversations")},
		{"GET", "/v1/models", free("read")},
		{"GET", "/v1/chat/completions/chatcmpl-abc123/messages", free("read")},
		{"GET", "/v1/responses/resp_123", free("read")},
		{"HEAD", "/v1/chat/completions", free("read")},
		{"get", "/v1/files/file-1/content", free("read")},
		{"DELETE", "/v1/chat/completions/chatcmpl-abc123", free("delete")},
		{"DELETE", "/v1/responses/resp_123", free("delete")},
		// Unknown: the policy decides.
		{"POST", "/v1/images/generations", unknown("images")},
		{"POST", "/openai/deployments/dalle/images/generations?api-version=2024-02-01", unknown("images")},
		{"POST", "/v1/images/edits", unknown("images")},
		{"POST", "/v1/audio/speech", unknown("audio")},
		{"POST", "/v1/batches", unknown("batches")},
		{"POST", "/v1/messages/batches", unknown("batches")},
		{"GET", "/v1/realtime?model=gpt-realtime", unknown("realtime")},
		{"POST", "/v1/realtime/sessions", unknown("realtime")},
		{"GET", "/ws/google.ai.generativelanguage.v1beta.GenerativeService.BidiGenerateContent", unknown("realtime")},
		{"POST", "/v1/responses/compact", unknown("other")},
		{"POST", "/v1/threads/thread_1/runs", unknown("other")},
		{"POST", "/v1/vector_stores/vs_1/files", unknown("other")},
		{"POST", "/v1beta/models/gemini-2.0-flash:predict", unknown("other")},
		{"PUT", "/v1/chat/completions", unknown("other")},
		{"POST", "/", unknown("other")},
		{"POST", "", unknown("other")},
		{"POST", "/api/chat", unknown("other")},
	}
	for _, tt := range tests {
		if got := Classify(tt.method, tt.path); got != tt.want {
			t.Errorf("Classify(%s, %q) = %+v, want %+v", tt.method, tt.path, got, tt.want)
		}
	}
	// Count agrees: a free path is not counted, a metered one is.
	c := newTestCounter(t)
	if _, err := c.Count(Request{Path: "/v1/messages/count_tokens", Body: []byte(`{"model":"claude-sonnet-4-5","messages":[]}`)}); !errors.Is(err, ErrFreeEndpoint) {
		t.Errorf("Count of count_tokens: error %v, want ErrFreeEndpoint", err)
	}
	if got, err := c.Count(Request{Path: "/openai/v1/chat/completions", Body: []byte(`{"model":"gpt-4o","messages":[]}`)}); err != nil || got.API != ChatCompletions {
		t.Errorf("Count under /openai/v1: %v, %v; want chat", got.API, err)
	}
	if _, err := c.Count(Request{Path: "/v1/images/generations", Body: []byte(`{"model":"dall-e-3","prompt":"a cat"}`)}); !errors.Is(err, ErrUnknownAPI) {
		t.Errorf("Count of images: error %v, want ErrUnknownAPI", err)
	}
	if got, err := c.Count(Request{Path: "/llm/proxy", Body: []byte(`{"model":"gpt-4o","messages":[]}`)}); err != nil || got.API != ChatCompletions {
		t.Errorf("Count under a path no rule names: %v, %v; want chat from the body", got.API, err)
	}
}

// TestGeminiBatchEmbedContents: Gemini's embedding endpoints are counted
// (their input; they generate nothing).
func TestGeminiBatchEmbedContents(t *testing.T) {
	c := newTestCounter(t)
	hello, err := c.CountText(O200kBase, "Hello")
	if err != nil {
		t.Fatal(err)
	}
	scaled := func(n int) int { return int(float64(n)*geminiFactor + 0.999999) }
	tests := []struct {
		name, path, body string
		input            int
	}{
		{"batchEmbedContents", "/v1beta/models/text-embedding-004:batchEmbedContents",
			`{"requests":[{"model":"models/text-embedding-004","content":{"parts":[{"text":"Hello"}]}},{"model":"models/text-embedding-004","content":{"parts":[{"text":"Hello"},{"text":"Hello"}]}}]}`,
			scaled(3 * hello)},
		{"embedContent", "/v1beta/models/text-embedding-004:embedContent",
			`{"content":{"parts":[{"text":"Hello"}]},"taskType":"RETRIEVAL_QUERY"}`, scaled(hello)},
		{"embedContent, detected from the body", "",
			`{"model":"models/text-embedding-004","content":{"parts":[{"text":"Hello"}]}}`, scaled(hello)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Count(Request{Path: tt.path, Body: []byte(tt.body)})
			if err != nil {
				t.Fatal(err)
			}
			want := Count{API: Gemini, Model: "text-embedding-004", ModelKey: "text-embedding-004", Encoding: O200kBase,
				InputTokens: tt.input, AllowanceSource: FromRequest, Choices: 1, Embedding: true, CapFloor: 1, ServiceTier: billing.Standard}
			if tt.path == "" {
				want.Model = "models/text-embedding-004"
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("Count (-want +got):\n%s", diff)
			}
			if cap, ok := got.ChoiceCap(100); ok {
				t.Errorf("ChoiceCap of an embedding = %d, true; want nothing to clamp", cap)
			}
		})
	}
}

// TestGeminiSnakeCase: Google's API takes snake_case field names as well
// as camelCase (protobuf JSON); both are read. A body that spells one
// field both ways is read conservatively: the largest cap and candidate
// count win (S7).
func TestGeminiSnakeCase(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	const path = "/v1beta/models/gemini-2.5-flash:generateContent"
	camel, err := c.Count(Request{Path: path, Body: []byte(`{"systemInstruction":{"parts":[{"text":"be brief"}]},"contents":[{"role":"user","parts":[{"text":"hi"},{"inlineData":{"mimeType":"image/png","data":"AA=="}}]}]}`)})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, body       string
		cap, choices     int
		fields           []string
		add              string
		sameInputAsCamel bool
	}{
		{"snake_case config", `{"contents":[],"generation_config":{"max_output_tokens":64,"candidate_count":2}}`,
			64, 2, []string{"generation_config.max_output_tokens"}, "generation_config.max_output_tokens", false},
		{"snake_case fields in a camelCase config", `{"contents":[],"generationConfig":{"max_output_tokens":64}}`,
			64, 1, []string{"generationConfig.max_output_tokens"}, "generationConfig.maxOutputTokens", false},
		{"both spellings: the largest wins", `{"contents":[],"generationConfig":{"maxOutputTokens":10,"candidateCount":3},"generation_config":{"max_output_tokens":500,"candidate_count":1}}`,
			500, 3, []string{"generationConfig.maxOutputTokens", "generation_config.max_output_tokens"}, "generation_config.max_output_tokens", false},
		{"snake_case contents", `{"system_instruction":{"parts":[{"text":"be brief"}]},"contents":[{"role":"user","parts":[{"text":"hi"},{"inline_data":{"mime_type":"image/png","data":"AA=="}}]}]}`,
			0, 1, nil, "generationConfig.maxOutputTokens", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Count(Request{Path: path, Body: []byte(tt.body)})
			if err != nil {
				t.Fatal(err)
			}
			allowance := tt.cap
			if allowance == 0 {
				allowance = 1000
			}
			if got.OutputCap != tt.cap || got.Choices != tt.choices || got.OutputAllowance != allowance*tt.choices ||
				!cmp.Equal(got.CapFields, tt.fields) || got.AddCapField != tt.add {
				t.Errorf("cap %d, choices %d, allowance %d, fields %q, add %q; want %d, %d, %d, %q, %q",
					got.OutputCap, got.Choices, got.OutputAllowance, got.CapFields, got.AddCapField, tt.cap, tt.choices, allowance*tt.choices, tt.fields, tt.add)
			}
			if tt.sameInputAsCamel && got.InputTokens != camel.InputTokens {
				t.Errorf("input %d, want %d as in camelCase", got.InputTokens, camel.InputTokens)
			}
		})
	}
}

// TestModelKeyResolved: spellings of one model that the provider bills and
// limits as one share one key.
func TestModelKeyResolved(t *testing.T) {
	tests := []struct{ model, want string }{
		{"gpt-4o", "gpt-4o"}, {"GPT-4o", "gpt-4o"}, {"openai/gpt-4o", "gpt-4o"}, {" gpt-4o ", "gpt-4o"},
		{"gpt-4o-2024-08-06", "gpt-4o"}, {"gpt-4o-mini-2024-07-18", "gpt-4o-mini"}, {"gpt-4o-mini", "gpt-4o-mini"},
		{"ft:gpt-4o-mini-2024-07-18:org::abc123", "gpt-4o-mini"}, {"gpt-4-0613", "gpt-4"}, {"gpt-3.5-turbo-0125", "gpt-3.5-turbo"},
		{"o3-mini-2025-01-31", "o3-mini"}, {"gpt-5", "gpt-5"}, {"babbage-002", "babbage-002"}, {"text-embedding-ada-002", "text-embedding-ada-002"},
		{"claude-3-5-sonnet-20241022", "claude-3-5-sonnet"}, {"anthropic/claude-sonnet-4-5-20250929", "claude-sonnet-4-5"},
		{"claude-sonnet-4-5@20250929", "claude-sonnet-4-5"}, {"claude-sonnet-4-5", "claude-sonnet-4-5"},
		{"gemini-1.5-pro-002", "gemini-1.5-pro"}, {"models/gemini-2.0-flash-001", "gemini-2.0-flash"},
		{"gemini-2.5-pro-preview-05-06", "gemini-2.5-pro-preview"}, {"gemini-2.5-flash", "gemini-2.5-flash"},
		{"", ""},
	}
	for _, tt := range tests {
		if got := modelKey(tt.model); got != tt.want {
			t.Errorf("modelKey(%q) = %q, want %q", tt.model, got, tt.want)
		}
	}
	// Client text cannot grow a key or put odd bytes into it.
	for _, m := range []string{strings.Repeat("x", 65), "gpt\n4o", "gpt 4o", "gpt-4o{x}", marker + strings.Repeat("a", 100)} {
		got := modelKey(m)
		if !strings.HasPrefix(got, "sha256:") || len(got) != len("sha256:")+24 || got != modelKey(m) {
			t.Errorf("modelKey(%q) = %q, want a stable sha256: key", m, got)
		}
	}
	// Count sets it; Azure keys by the deployment the provider bills.
	c, err := New(Options{FallbackEncoding: O200kBase})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ path, body, want string }{
		{"/v1/chat/completions", `{"model":"OpenAI/GPT-4o-2024-08-06","messages":[]}`, "gpt-4o"},
		{"/openai/deployments/Prod-GPT4o/chat/completions?api-version=2024-06-01", `{"model":"gpt-4o","messages":[]}`, "prod-gpt4o"},
		{"/v1beta/models/gemini-2.0-flash-001:generateContent", `{"model":"models/gemini-1.5-pro","contents":[]}`, "gemini-2.0-flash"},
	} {
		got, err := c.Count(Request{Path: tt.path, Body: []byte(tt.body)})
		if err != nil || got.ModelKey != tt.want {
			t.Errorf("Count(%s).ModelKey = %q, %v; want %q", tt.path, got.ModelKey, err, tt.want)
		}
	}
}

// TestClampFieldsOnCount: Count says what clamp_output needs: the choices,
// the per-choice allowance, the cap fields present and the least cap the
// provider accepts; ChoiceCap turns a total allowance into a per-choice
// cap.
func TestClampFieldsOnCount(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 4096})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path, body      string
		choices, perChoice    int
		fields                []string
		add                   string
		floor, total, wantCap int
	}{
		{"completions: 4 prompts × n=4 of the default 16", "/v1/completions", `{"model":"babbage-002","prompt":["a","b","c","d"],"n":4}`,
			16, 16, nil, "max_tokens", 1, 256, 16},
		{"completions: best_of counts when larger than n", "/v1/completions", `{"model":"babbage-002","prompt":"a","n":2,"best_of":5,"max_tokens":30}`,
			5, 30, []string{"max_tokens"}, "max_tokens", 1, 100, 20},
		{"chat: n=3 without a cap", "/v1/chat/completions", `{"model":"gpt-4o","messages":[],"n":3}`,
			3, 4096, nil, "max_completion_tokens", 1, 3 * 4096, 4096},
		{"responses: at least 16", "/v1/responses", `{"model":"gpt-4o","input":"x","max_output_tokens":900}`,
			1, 900, []string{"max_output_tokens"}, "max_output_tokens", 16, 5, 16},
		{"anthropic: above the thinking budget", "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":8000,"thinking":{"type":"enabled","budget_tokens":4000},"messages":[]}`,
			1, 8000, []string{"max_tokens"}, "max_tokens", 4001, 1000, 4001},
		{"anthropic: thinking disabled", "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":8000,"thinking":{"type":"disabled","budget_tokens":4000},"messages":[]}`,
			1, 8000, []string{"max_tokens"}, "max_tokens", 1, 1000, 1000},
		{"gemini: candidates", "/v1beta/models/gemini-2.0-flash:generateContent", `{"contents":[],"generationConfig":{"maxOutputTokens":100,"candidateCount":4}}`,
			4, 100, []string{"generationConfig.maxOutputTokens"}, "generationConfig.maxOutputTokens", 1, 200, 50},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Count(Request{Path: tt.path, Body: []byte(tt.body)})
			if err != nil {
				t.Fatal(err)
			}
			if got.Choices != tt.choices || got.ChoiceAllowance != tt.perChoice || got.OutputAllowance != tt.choices*tt.perChoice ||
				!cmp.Equal(got.CapFields, tt.fields) || got.AddCapField != tt.add || got.CapFloor != tt.floor {
				t.Errorf("choices %d, per choice %d, allowance %d, fields %q, add %q, floor %d; want %d, %d, %d, %q, %q, %d",
					got.Choices, got.ChoiceAllowance, got.OutputAllowance, got.CapFields, got.AddCapField, got.CapFloor,
					tt.choices, tt.perChoice, tt.choices*tt.perChoice, tt.fields, tt.add, tt.floor)
			}
			if cap, ok := got.ChoiceCap(tt.total); !ok || cap != tt.wantCap {
				t.Errorf("ChoiceCap(%d) = %d, %v; want %d, true", tt.total, cap, ok, tt.wantCap)
			}
		})
	}
}

func ExampleClassify() {
	for _, r := range []struct{ method, path string }{
		{"POST", "/openai/deployments/gpt-4o/chat/completions?api-version=2024-06-01"},
		{"POST", "/v1/messages/count_tokens"},
		{"POST", "/v1/images/generations"},
	} {
		e := Classify(r.method, r.path)
		fmt.Println(e.Class, e.API, e.Name)
	}
	// Output:
	// metered chat chat
	// free  count_tokens
	// unknown  images
}

// TestCountReadsTheFieldsThatChangeThePrice: the service tier a request
// asks for and its prompt-cache retention are read as its provider reads
// them, so that it is reserved at the rates it can be billed at. A value of
// the wrong type is the provider's to refuse, and reads as not known.
func TestCountReadsTheFieldsThatChangeThePrice(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path, body string
		tier       billing.Tier
		extended   bool
	}{
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[]}`, billing.Auto, false},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":"auto"}`, billing.Auto, false},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":"default"}`, billing.Standard, false},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":"priority"}`, billing.Fast, false},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":"fast"}`, billing.Fast, false},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":"flex","prompt_cache_retention":"24h"}`, billing.Flex, true},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":"turbo"}`, billing.Unknown, false},
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[],"service_tier":7,"prompt_cache_retention":1}`, billing.Unknown, true},
		{"/v1/responses", `{"model":"gpt-5","input":"hi","service_tier":"priority","prompt_cache_retention":"in_memory"}`, billing.Fast, false},
		{"/v1/messages", `{"model":"claude-opus-5","max_tokens":1,"messages":[]}`, billing.Standard, false},
		{"/v1/messages", `{"model":"claude-opus-5","max_tokens":1,"messages":[],"speed":"fast","service_tier":"auto"}`, billing.Fast, false},
		{"/v1/messages", `{"model":"claude-opus-5","max_tokens":1,"messages":[],"speed":"warp"}`, billing.Unknown, false},
		{"/v1beta/models/gemini-2.5-pro:generateContent", `{"contents":[]}`, billing.Standard, false},
	}
	for _, tt := range tests {
		got, err := c.Count(Request{Path: tt.path, Body: []byte(tt.body)})
		if err != nil {
			t.Fatalf("%s: %v", tt.body, err)
		}
		if got.ServiceTier != tt.tier || got.ExtendedCacheRetention != tt.extended {
			t.Errorf("%s: tier %q, extended retention %v; want %q, %v", tt.body, got.ServiceTier, got.ExtendedCacheRetention, tt.tier, tt.extended)
		}
	}
}

// A request of a model that bills reasoning its answer does not show says
// so (Count.HiddenReasoning): settlement must then hear the provider's
// count of the output, or charge the reservation (S8).
func TestCountHiddenReasoning(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path, body string
		want       bool
	}{
		{"/v1/chat/completions", `{"model":"gpt-4o","messages":[]}`, false},
		{"/v1/chat/completions", `{"model":"o3-mini","messages":[]}`, true},
		{"/v1/chat/completions", `{"model":"openai/gpt-5-2025-08-07","messages":[]}`, true},
		{"/v1/responses", `{"model":"o4-mini","input":"hi"}`, true},
		{"/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":2000,"messages":[]}`, false},
		{"/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":2000,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[]}`, true},
		{"/v1beta/models/gemini-2.0-flash:generateContent", `{"contents":[]}`, false},
		{"/v1beta/models/gemini-2.5-flash:streamGenerateContent", `{"contents":[]}`, true},
		{"/v1beta/models/gemini-3-pro-preview:generateContent", `{"contents":[]}`, true},
	} {
		got, err := c.Count(Request{Path: tc.path, Body: []byte(tc.body)})
		if err != nil {
			t.Fatalf("%s %s: %v", tc.path, tc.body, err)
		}
		if got.HiddenReasoning != tc.want {
			t.Errorf("%s %s: HiddenReasoning %v, want %v", tc.path, tc.body, got.HiddenReasoning, tc.want)
		}
	}
}
