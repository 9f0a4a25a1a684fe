package provider

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/internal/billing"
	"github.com/tokengate/tokengate/tokenizer"
)

// TestParseUsage covers the shapes of S22 beyond the recordings: router cache
// writes, Gemini tool-use prompts, null usage, and usage in a JSON array.
func TestParseUsage(t *testing.T) {
	for _, tc := range []struct {
		name string
		api  tokenizer.API
		body string
		want Usage
		ok   bool
	}{
		{"router cache write", tokenizer.ChatCompletions,
			`{"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":40,"cache_write_tokens":50},"completion_tokens_details":null}}`,
			Usage{InputTokens: 100, OutputTokens: 5, CachedInputTokens: 40, CacheCreationInputTokens: 50}, true},
		{"usage null", tokenizer.ChatCompletions, `{"id":"x","usage":null}`, Usage{}, false},
		{"error body", tokenizer.Messages, `{"type":"error","error":{"type":"overloaded_error"}}`, Usage{}, false},
		{"embeddings", tokenizer.Embeddings, ` {"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}} `, Usage{InputTokens: 8}, true},
		{"gemini tool-use prompt", tokenizer.Gemini,
			`{"usageMetadata":{"promptTokenCount":10,"toolUsePromptTokenCount":4,"candidatesTokenCount":3,"thoughtsTokenCount":2,"cachedContentTokenCount":6}}`,
			Usage{InputTokens: 14, OutputTokens: 5, ReasoningTokens: 2, CachedInputTokens: 6}, true},
		{"gemini array, last usage wins", tokenizer.Gemini,
			`[{"usageMetadata":{"promptTokenCount":15}},{"candidates":[]},{"usageMetadata":{"promptTokenCount":13,"candidatesTokenCount":8}}]`,
			Usage{InputTokens: 13, OutputTokens: 8}, true},
		{"gemini empty array", tokenizer.Gemini, `[]`, Usage{}, false},
		{"anthropic", tokenizer.Messages,
			`{"usage":{"input_tokens":3,"cache_creation_input_tokens":418,"cache_read_input_tokens":1111,"output_tokens":33}}`,
			Usage{InputTokens: 1532, OutputTokens: 33, CachedInputTokens: 1111, CacheCreationInputTokens: 418}, true},
		{"count with zero fraction", tokenizer.Responses, `{"usage":{"input_tokens":12.0,"output_tokens":1}}`, Usage{InputTokens: 12, OutputTokens: 1}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := ParseUsage(tc.api, []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" || ok != tc.ok {
				t.Errorf("ParseUsage ok=%v want %v (-want +got):\n%s", ok, tc.ok, diff)
			}
		})
	}
}

// TestParseUsageErrors: bodies that are not what the API sends get an error
// that wraps ErrMalformed and says what is wrong and where.
func TestParseUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		api  tokenizer.API
		body string
		want string
	}{
		{"empty", tokenizer.ChatCompletions, ``, `chat body: invalid JSON at offset 0: unexpected end of input, want a value`},
		{"html", tokenizer.Messages, `<html>`, `messages body: invalid JSON at offset 0: unexpected '<', want a value`},
		{"array for chat", tokenizer.ChatCompletions, `[1]`, `chat body: invalid JSON at offset 0: want an object`},
		{"trailing", tokenizer.Responses, `{} x`, `responses body: invalid JSON at offset 3: data after the JSON value`},
		{"usage string", tokenizer.Embeddings, `{"usage":"7"}`, `embeddings body: usage: invalid JSON at offset 0: want an object`},
		{"huge count", tokenizer.ChatCompletions, `{"usage":{"prompt_tokens":123456789012345678901}}`, `chat body: usage: prompt_tokens: token count "123456789012345678901" is out of range`},
		{"nested details wrong", tokenizer.ChatCompletions, `{"usage":{"prompt_tokens_details":{"cached_tokens":true}}}`, `chat body: usage: prompt_tokens_details: cached_tokens: token count "true" is not a non-negative integer`},
		{"gemini array of numbers", tokenizer.Gemini, `[1,2]`, `gemini body: invalid JSON at offset 1: want an object`},
		{"unknown api", tokenizer.API("bard"), `{}`, `bard body: unknown API "bard"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ok, err := ParseUsage(tc.api, []byte(tc.body))
			if !errors.Is(err, ErrMalformed) || ok {
				t.Fatalf("ParseUsage = ok %v, err %v; want an error wrapping ErrMalformed", ok, err)
			}
			if want := "malformed provider response: " + tc.want; err.Error() != want {
				t.Errorf("error = %q\nwant    %q", err, want)
			}
		})
	}
}

// TestAppendUnquoted: a raw string value decodes as encoding/json decodes
// it (package jsonstr's differential tests hold it to encoding/json on
// every kind of string); a value that is not a string is an error and
// appends nothing.
func TestAppendUnquoted(t *testing.T) {
	for _, in := range []string{`""`, `"plain"`, `"\"\\\/\n"`, `"\ud83d\ude00"`, `"\ud83d"`} {
		var want string
		if err := json.Unmarshal([]byte(in), &want); err != nil {
			t.Fatalf("%s: %v", in, err)
		}
		got, err := appendUnquoted([]byte("x"), []byte(in))
		if err != nil || string(got) != "x"+want {
			t.Errorf("appendUnquoted(%s) = %q, %v; want %q", in, got, err, "x"+want)
		}
	}
	for _, in := range []string{`null`, `12`, `"`, `abc`, ``} {
		if got, err := appendUnquoted([]byte("x"), []byte(in)); err == nil || string(got) != "x" {
			t.Errorf("appendUnquoted(%s) = %q, %v; want an error and nothing appended", in, got, err)
		}
	}
}

// FuzzParseUsage reads arbitrary bodies as every API: never panics, errors
// wrap ErrMalformed, counts are never negative, and a body encoding/json
// rejects is never read as usage.
func FuzzParseUsage(f *testing.F) {
	f.Add(uint8(0), []byte(`{"usage":{"prompt_tokens":3,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":1}}}`))
	f.Add(uint8(3), []byte(`{"usage":{"input_tokens":3,"output_tokens_details":{"reasoning_tokens":1}}}`))
	f.Add(uint8(4), []byte(`{"usage":{"input_tokens":3,"cache_read_input_tokens":9}}`))
	f.Add(uint8(5), []byte(`[{"usageMetadata":{"promptTokenCount":3}}]`))
	apis := []tokenizer.API{tokenizer.ChatCompletions, tokenizer.Completions, tokenizer.Embeddings,
		tokenizer.Responses, tokenizer.Messages, tokenizer.Gemini}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		api := apis[int(which)%len(apis)]
		u, ok, err := ParseUsage(api, body)
		if err != nil {
			if !errors.Is(err, ErrMalformed) || ok || u != (Usage{}) {
				t.Fatalf("ParseUsage = %+v, %v, %v", u, ok, err)
			}
			return
		}
		if u.InputTokens < 0 || u.OutputTokens < 0 || u.CachedInputTokens < 0 || u.ReasoningTokens < 0 {
			t.Fatalf("negative usage %+v", u)
		}
		if ok && !json.Valid(body) {
			t.Fatalf("read usage %+v from invalid JSON %q", u, body)
		}
	})
}

// TestBillingFieldsOfRecordings reads what decides the rates a response
// is billed at, beyond its token counts: the service tier the answer names
// (OpenAI service_tier, in JSON bodies, chat chunks and Responses objects),
// audio tokens, and the retention of cache writes. Recordings first, then
// synthetic bodies for shapes no recording holds (an Anthropic 1-hour cache
// write, fast mode, a Responses cache write with the 24h retention).
func TestBillingFieldsOfRecordings(t *testing.T) {
	type fields struct {
		Tier              billing.Tier
		Written, Extended int
		AudioIn, AudioOut int
	}
	of := func(u Usage) fields {
		return fields{u.ServiceTier, u.CacheCreationInputTokens, u.CacheCreationExtendedInputTokens, u.AudioInputTokens, u.AudioOutputTokens}
	}
	recorded := map[string]fields{
		"openai/chat-basic":                       {Tier: billing.Standard},
		"openai/chat-audio-output":                {Tier: billing.Standard, AudioOut: 12},
		"openai/responses-stream-reasoning-usage": {Tier: billing.Flex},
		"openai/responses-stream-basic":           {Tier: billing.Standard},
		"openai/chat-stream-gpt-4o-mini":          {Tier: billing.Standard},
		"anthropic/messages-cache-write-and-read": {Written: 418},
	}
	seen := 0
	for _, r := range loadRecordings(t) {
		want, ok := recorded[r.name]
		if !ok {
			continue
		}
		seen++
		var u Usage
		if r.sse {
			rp := play(r.api, true, false, r.body, nil)
			u, ok = rp.Usage, rp.HasUsage
		} else {
			var err error
			if u, ok, err = ParseUsage(r.api, r.body); err != nil {
				t.Fatalf("%s: %v", r.name, err)
			}
		}
		if !ok {
			t.Fatalf("%s: no usage", r.name)
		}
		if diff := cmp.Diff(want, of(u)); diff != "" {
			t.Errorf("%s (-want +got):\n%s", r.name, diff)
		}
	}
	if seen != len(recorded) {
		t.Errorf("found %d of the %d recordings", seen, len(recorded))
	}

	anthropic := `"usage":{"input_tokens":5,"cache_creation_input_tokens":2500,"cache_read_input_tokens":0,` +
		`"cache_creation":{"ephemeral_5m_input_tokens":500,"ephemeral_1h_input_tokens":2000},"output_tokens":1,"speed":"fast"}`
	u, _, err := ParseUsage(tokenizer.Messages, []byte(`{"type":"message",`+anthropic+`}`))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(fields{Tier: billing.Fast, Written: 2500, Extended: 2000}, of(u)); diff != "" {
		t.Errorf("anthropic JSON (-want +got):\n%s", diff)
	}
	if u.InputTokens != 2505 {
		t.Errorf("anthropic JSON input %d, want 2505 (cache writes included)", u.InputTokens)
	}
	// In a stream message_start has the split; message_delta's usage
	// overlays it without one.
	stream := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{" + anthropic + "}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\n"
	rp := play(tokenizer.Messages, false, false, []byte(stream), nil)
	if diff := cmp.Diff(fields{Tier: billing.Fast, Written: 2500, Extended: 2000}, of(rp.Usage)); diff != "" || rp.Usage.OutputTokens != 9 {
		t.Errorf("anthropic stream: output %d (-want +got):\n%s", rp.Usage.OutputTokens, diff)
	}

	// A speed not known names no tier: settlement keeps the reserved one.
	u, _, err = ParseUsage(tokenizer.Messages, []byte(`{"usage":{"input_tokens":5,"output_tokens":1,"speed":"warp"}}`))
	if err != nil || u.ServiceTier != "" {
		t.Errorf("unknown speed: tier %q, %v; want none", u.ServiceTier, err)
	}

	responses := `{"object":"response","service_tier":"priority","prompt_cache_retention":"24h",` +
		`"usage":{"input_tokens":4020,"input_tokens_details":{"cache_write_tokens":4000,"cached_tokens":0},"output_tokens":5}}`
	u, _, err = ParseUsage(tokenizer.Responses, []byte(responses))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(fields{Tier: billing.Fast, Written: 4000, Extended: 4000}, of(u)); diff != "" {
		t.Errorf("responses (-want +got):\n%s", diff)
	}
}
