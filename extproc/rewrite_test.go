package extproc

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/tokenizer"
)

// counted counts body as the server does before a rewrite.
func counted(t testing.TB, path, body string) tokenizer.Count {
	t.Helper()
	c, err := tokenizer.New(tokenizer.Options{DefaultOutputTokens: 4096, FallbackEncoding: tokenizer.O200kBase})
	if err != nil {
		t.Fatal(err)
	}
	n, err := c.Count(tokenizer.Request{Path: path, Body: []byte(body)})
	if err != nil {
		t.Fatalf("Count(%s): %v", body, err)
	}
	return n
}

// S15: the rewrite sets include_usage wherever the provider may read it,
// keeps the other options and every other byte of the body.
func TestRewriteBodyIncludeUsage(t *testing.T) {
	for _, tc := range []struct{ name, body, want string }{
		{"added last, where it wins", ` {"model":"m","stream":true} `, ` {"model":"m","stream":true,"stream_options":{"include_usage":true}} `},
		{"into an empty body", `{ }`, `{ "stream_options":{"include_usage":true}}`},
		{"kept options", `{"stream":true,"stream_options":{"x":1}}`, `{"stream":true,"stream_options":{"x":1,"include_usage":true}}`},
		{"false becomes true", `{"stream_options":{"include_usage":false}}`, `{"stream_options":{"include_usage":true}}`},
		{"null options", `{"stream_options":null}`, `{"stream_options":{"include_usage":true}}`},
		{"every duplicate", `{"stream_options":{"include_usage":false},"stream_options":{"include_usage" : false}}`,
			`{"stream_options":{"include_usage":true},"stream_options":{"include_usage" : true}}`},
		{"escaped key", `{"stream\u005foptions":{"include_usage":false}}`, `{"stream\u005foptions":{"include_usage":true}}`},
		{"a case variant is another field", `{"Stream_Options":{"include_usage":false}}`,
			`{"Stream_Options":{"include_usage":false},"stream_options":{"include_usage":true}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := rewriteBody(tokenizer.Count{API: tokenizer.ChatCompletions}, []byte(tc.body), true, 0)
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tc.want {
				t.Errorf("rewrite of %s\n got %s\nwant %s", tc.body, out, tc.want)
			}
		})
	}
	if _, err := rewriteBody(tokenizer.Count{}, []byte(`{"stream_options":5}`), true, 0); err == nil {
		t.Error("stream_options of the wrong type was accepted")
	}
	// Errors are logged: they name offsets, never body text (S23).
	for _, body := range []string{`{"a":"SECRET`, `{"a":1} "SECRET"`, `["SECRET"]`, `{"stream_options":{"SECRET"}}`} {
		_, err := rewriteBody(tokenizer.Count{}, []byte(body), true, 0)
		if err == nil || strings.Contains(err.Error(), "SECRET") || !strings.Contains(err.Error(), "at byte") {
			t.Errorf("rewrite of %s: error %v, want one that names an offset and no body text", body, err)
		}
	}
}

// TestClampNeverRaisesCaps: clamp_output writes a per-choice cap, the
// reserved output divided by the choices, lowering (never raising) every
// cap the client set, and never to a value the provider refuses (S7, S14).
func TestClampNeverRaisesCaps(t *testing.T) {
	const gemini = "/v1beta/models/gemini-2.0-flash:generateContent"
	for _, tc := range []struct {
		name, path, body string
		total            int // the reserved output allowance
		want             string
	}{
		{"completions: 4 prompts × n=4 share 256 as 16 each", "/v1/completions",
			`{"model":"babbage-002","prompt":["a","b","c","d"],"n":4}`, 256,
			`{"model":"babbage-002","prompt":["a","b","c","d"],"n":4,"max_tokens":16}`},
		{"chat: n=3 without a cap gets the per-choice default", "/v1/chat/completions",
			`{"model":"gpt-4o","messages":[],"n":3}`, 3 * 4096,
			`{"model":"gpt-4o","messages":[],"n":3,"max_completion_tokens":4096}`},
		{"chat: n=3 with the client's cap: unchanged", "/v1/chat/completions",
			`{"model":"gpt-4o","messages":[],"n":3,"max_tokens":100}`, 300,
			`{"model":"gpt-4o","messages":[],"n":3,"max_tokens":100}`},
		{"chat: a policy cap lowers the larger cap, keeps the smaller", "/v1/chat/completions",
			`{"model":"gpt-4o","messages":[],"max_tokens":500,"max_completion_tokens":20}`, 100,
			`{"model":"gpt-4o","messages":[],"max_tokens":100,"max_completion_tokens":20}`},
		{"chat: a case variant is not a cap", "/v1/chat/completions",
			`{"model":"gpt-4o","messages":[],"Max_Tokens":10,"max_tokens":90000}`, 1000,
			`{"model":"gpt-4o","messages":[],"Max_Tokens":10,"max_tokens":1000}`},
		{"chat: every duplicate is lowered", "/v1/chat/completions",
			`{"model":"gpt-4o","messages":[],"max_tokens":90000, "max_tokens" : 50000}`, 1000,
			`{"model":"gpt-4o","messages":[],"max_tokens":1000, "max_tokens" : 1000}`},
		{"responses: never below 16", "/v1/responses",
			`{"model":"gpt-4o","input":"x","max_output_tokens":900}`, 5,
			`{"model":"gpt-4o","input":"x","max_output_tokens":16}`},
		{"anthropic: above thinking.budget_tokens", "/v1/messages",
			`{"model":"claude-sonnet-4-5","max_tokens":8000,"thinking":{"type":"enabled","budget_tokens":4000},"messages":[]}`, 1000,
			`{"model":"claude-sonnet-4-5","max_tokens":4001,"thinking":{"type":"enabled","budget_tokens":4000},"messages":[]}`},
		{"anthropic: below the budget's floor nothing changes", "/v1/messages",
			`{"model":"claude-sonnet-4-5","max_tokens":4001,"thinking":{"type":"enabled","budget_tokens":4000},"messages":[]}`, 1000,
			`{"model":"claude-sonnet-4-5","max_tokens":4001,"thinking":{"type":"enabled","budget_tokens":4000},"messages":[]}`},
		{"anthropic: without thinking", "/v1/messages",
			`{"model":"claude-sonnet-4-5","max_tokens":8000,"messages":[]}`, 1000,
			`{"model":"claude-sonnet-4-5","max_tokens":1000,"messages":[]}`},
		{"gemini: added into the config", gemini,
			`{"contents":[],"generationConfig":{"temperature":0.5}}`, 64,
			`{"contents":[],"generationConfig":{"temperature":0.5,"maxOutputTokens":64}}`},
		{"gemini: in the body's spelling", gemini,
			`{"contents":[],"generation_config":{"temperature":0.5}}`, 64,
			`{"contents":[],"generation_config":{"temperature":0.5,"max_output_tokens":64}}`},
		{"gemini: a config of its own", gemini,
			`{"contents":[]}`, 64,
			`{"contents":[],"generationConfig":{"maxOutputTokens":64}}`},
		{"gemini: a null config", gemini,
			`{"contents":[],"generationConfig":null}`, 64,
			`{"contents":[],"generationConfig":{"maxOutputTokens":64}}`},
		{"gemini: per candidate", gemini,
			`{"contents":[],"generationConfig":{"maxOutputTokens":100,"candidateCount":4}}`, 200,
			`{"contents":[],"generationConfig":{"maxOutputTokens":50,"candidateCount":4}}`},
		{"gemini: both spellings", gemini,
			`{"contents":[],"generationConfig":{"maxOutputTokens":100},"generation_config":{"max_output_tokens":300}}`, 64,
			`{"contents":[],"generationConfig":{"maxOutputTokens":64},"generation_config":{"max_output_tokens":64}}`},
		{"embeddings: nothing to cap", "/v1/embeddings",
			`{"model":"text-embedding-3-small","input":"x"}`, 64,
			`{"model":"text-embedding-3-small","input":"x"}`},
		{"other bytes are kept", "/v1/chat/completions",
			"{ \"model\" : \"gpt-4o\",\n \"messages\":[{\"role\":\"user\",\"content\":\"<\\u00e9>\"}],\"max_tokens\" :\t9000 }", 10,
			"{ \"model\" : \"gpt-4o\",\n \"messages\":[{\"role\":\"user\",\"content\":\"<\\u00e9>\"}],\"max_tokens\" :\t10 }"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := counted(t, tc.path, tc.body)
			out, err := rewriteBody(c, []byte(tc.body), false, tc.total)
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tc.want {
				t.Errorf("clamp to %d of %s\n got %s\nwant %s", tc.total, tc.body, out, tc.want)
			}
			again := counted(t, tc.path, string(out))
			if c.OutputCap > 0 && again.OutputCap > c.OutputCap {
				t.Errorf("the clamp raised the cap from %d to %d", c.OutputCap, again.OutputCap)
			}
		})
	}
}

// The rewrite of a counted body is valid JSON that counts as the same
// request, always carries include_usage when asked, and never raises the
// output the provider may generate.
func FuzzRewriteBody(f *testing.F) {
	for _, s := range []string{`{}`, `{"stream_options":{"include_usage":false}}`, `{"max_tokens":1e9}`, `{"generationConfig":null}`, `[]`, `{"a":`,
		`{"model":"gpt-4o","messages":[],"n":3,"max_tokens":500,"Max_Tokens":9}`,
		`{"contents":[],"generation_config":{"max_output_tokens":90,"candidate_count":2},"generationConfig":{}}`} {
		f.Add([]byte(s), true, 10)
	}
	counter, err := tokenizer.New(tokenizer.Options{DefaultOutputTokens: 4096, FallbackEncoding: tokenizer.O200kBase})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body []byte, inject bool, clamp int) {
		clamp %= 1 << 20 // an allowance is at most the largest cap the counter accepts
		for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1beta/models/gemini-2.0-flash:generateContent"} {
			c, err := counter.Count(tokenizer.Request{Path: path, Body: body})
			if err != nil {
				continue // only counted bodies are rewritten
			}
			out, err := rewriteBody(c, body, inject, clamp)
			if err != nil {
				// Only an earlier, ignored stream_options of a wrong type
				// is beyond the rewrite.
				if !inject || !strings.Contains(err.Error(), "stream_options is not an object") {
					t.Fatalf("rewrite of counted body %q: %v", body, err)
				}
				continue
			}
			again, err := counter.Count(tokenizer.Request{Path: path, Body: out})
			if err != nil {
				t.Fatalf("rewrite of %q gave %q, which does not count: %v", body, out, err)
			}
			if inject && !again.IncludeUsage && (path == "/v1/chat/completions" || path == "/v1/completions") {
				t.Fatalf("rewrite of %q lost include_usage: %q", body, out)
			}
			if again.InputTokens != c.InputTokens || again.Choices != c.Choices {
				t.Fatalf("rewrite of %q changed the request: %q", body, out)
			}
			if c.OutputCap > 0 && again.OutputCap > c.OutputCap {
				t.Fatalf("rewrite of %q raised the cap: %q", body, out)
			}
			if per, ok := c.ChoiceCap(clamp); ok && clamp > 0 && again.OutputCap > per {
				t.Fatalf("rewrite of %q to %d per choice left cap %d: %q", body, per, again.OutputCap, out)
			}
			var v any
			if err := json.Unmarshal(out, &v); err != nil {
				t.Fatalf("rewrite of %q gave invalid JSON %q: %v", body, out, err)
			}
		}
	})
}

// FuzzReadObject: the in-place reader finds the members (keys decoded as
// encoding/json decodes them, value offsets) and the closing brace that
// encoding/json's tokenizer finds, and refuses what it refuses.
func FuzzReadObject(f *testing.F) {
	for _, s := range []string{`{}`, ` {"a" : 1, "b\u0041":[{"c":"}"}] , "a":null} `, `{"a":1}x`, `{"a":1,}`, `{"\ud800":2}`, `{"é":"\x"}`, `[1]`, "{\"\xff\\u0041\":1}", "{\"\xff\":1}"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, err := readObject(body, 0)
		want, werr := oracleObject(body)
		if (err == nil) != (werr == nil) {
			t.Fatalf("readObject(%q) error %v, encoding/json %v", body, err, werr)
		}
		if err != nil {
			if !strings.Contains(err.Error(), "at byte") {
				t.Fatalf("readObject(%q) error %q names no offset", body, err)
			}
			return
		}
		if got.close != want.close || len(got.members) != len(want.members) {
			t.Fatalf("readObject(%q) = %+v, encoding/json %+v", body, got, want)
		}
		for k := range got.members {
			// encoding/json turns each invalid UTF-8 byte of a key into
			// U+FFFD, which the reader keeps; as runes they agree.
			got.members[k].key = string([]rune(got.members[k].key))
			if got.members[k] != want.members[k] {
				t.Fatalf("readObject(%q) member %d = %+v, encoding/json %+v", body, k, got.members[k], want.members[k])
			}
		}
	})
}

// oracleObject reads a body that must be one JSON object with
// encoding/json's tokenizer.
func oracleObject(body []byte) (object, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return object{}, errors.New("not an object")
	}
	var o object
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return object{}, err
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return object{}, err
		}
		end := int(dec.InputOffset())
		o.members = append(o.members, member{key: k.(string), start: end - len(v), end: end})
	}
	if _, err := dec.Token(); err != nil {
		return object{}, err
	}
	o.close = int(dec.InputOffset()) - 1
	if _, err := dec.Token(); err != io.EOF {
		return object{}, errors.New("data after the object")
	}
	return o, nil
}
