package extproc

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/tokenizer"
)

// marker stands for prompt text and key material: it may reach debug logs,
// nothing else.
const marker = "Zq7secretMARKER"

// No prompt or key material leaves tokengate outside debug logs: a marker in
// the prompt and in the API key goes through every refusal path (400
// malformed, unknown model, invalid cap, unknown API, duplicate identity;
// 401; 413 body and never admissible; 429 tokens and requests; 503 store;
// upstream errors) and appears in no log line at INFO or above and in no
// response body or header. Counting is the real tokenizer's, whose own
// errors quote the body.
func TestMarkerNeverLeaves(t *testing.T) {
	counter, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	prompt := `[{"role":"user","content":"` + marker + ` tell me"}]`
	key := "Bearer sk-" + marker
	small := Policy{Name: "p", Identities: []Identity{{Name: "key", Header: "authorization", Hash: true}},
		Buckets:     []BucketRule{{Name: "user", Per: "key", Limit: buckets.Limit{Capacity: 200, Rate: 1e-9}}},
		Concurrency: []ConcurrencyRule{{Name: "inflight", Per: "key", Max: 1}}}
	strict := small
	strict.Name, strict.Anonymous = "strict", anonymousReject
	for _, tc := range []struct {
		name   string
		path   string
		body   string
		hdr    http.Header
		status int
		setup  func(r *rig)
		up     *upstream
	}{
		{name: "malformed", body: `{"model":"gpt-4o-mini","messages":` + prompt[:len(prompt)-2], status: 400},
		{name: "malformed value", body: `{"model":"gpt-4o-mini","messages":` + prompt + `,"x":` + marker + `}`, status: 400},
		{name: "unknown model", body: `{"model":"` + marker + `","messages":` + prompt + `}`, status: 400},
		{name: "invalid cap", body: `{"model":"gpt-4o-mini","max_tokens":"` + marker + `","messages":` + prompt + `}`, status: 400},
		{name: "invalid n", body: `{"model":"gpt-4o-mini","n":"` + marker + `","messages":` + prompt + `}`, status: 400},
		{name: "unknown api", path: "/v1/" + marker, body: `{"` + marker + `":1}`, status: 400},
		{name: "duplicate identity", body: `{"model":"gpt-4o-mini","messages":` + prompt + `}`,
			hdr: http.Header{"Authorization": {key, key + "2"}}, status: 400},
		{name: "missing identity", path: "/strict" + chatPath, body: `{"model":"gpt-4o-mini","messages":` + prompt + `}`, hdr: http.Header{}, status: 401},
		{name: "body too large", body: `{"model":"gpt-4o-mini","messages":` + prompt + `,"pad":"` + strings.Repeat("x", 9<<20) + `"}`, status: 413},
		{name: "never admissible", body: `{"model":"gpt-4o-mini","max_tokens":1000,"messages":` + prompt + `}`, status: 413},
		{name: "refused tokens", body: `{"model":"gpt-4o-mini","max_tokens":150,"messages":` + prompt + `}`, status: 429,
			up: &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}, // no usage: the reservation stands
			setup: func(r *rig) {
				r.post(t, chatPath, `{"model":"gpt-4o-mini","max_tokens":150,"messages":[]}`, map[string]string{"authorization": key})
			}},
		{name: "store down", body: `{"model":"gpt-4o-mini","messages":` + prompt + `}`, status: 503,
			setup: func(r *rig) { r.store.fail.Store(true) }},
		{name: "upstream 400", body: `{"model":"gpt-4o-mini","max_tokens":10,"messages":` + prompt + `}`, status: 400,
			up: &upstream{Status: 400, ContentType: "application/json", Chunks: [][]byte{[]byte(`{"error":{"message":"bad"}}`)}}},
		{name: "upstream 500 streamed", body: `{"model":"gpt-4o-mini","stream":true,"max_tokens":10,"messages":` + prompt + `}`, status: 500,
			up: &upstream{Status: 500, Chunks: [][]byte{[]byte("data: {\"error\":\"x\"}\n\n")}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs syncBuffer
			r := newRig(t, tc.up, rigOptions{
				policies: []Policy{small, strict}, tokenizer: counter, bufferLimit: 16 << 20, msgTimeout: 10 * time.Second,
				routes: []standin.Route{
					{Prefix: "/strict/", InitialMetadata: map[string]string{"x-tokengate-policy": "strict"}},
					{Prefix: "/"},
				},
				logger: slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
			})
			if tc.setup != nil {
				tc.setup(r)
			}
			hdr := tc.hdr
			if hdr == nil {
				hdr = http.Header{"Authorization": {key}}
			}
			path := tc.path
			if path == "" {
				path = chatPath
			}
			resp, body := r.postHeaders(t, path, tc.body, hdr)
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d (body %.200s)", resp.StatusCode, tc.status, body)
			}
			if strings.Contains(body, marker) {
				t.Errorf("response body shows the marker: %.300s", body)
			}
			for k, vs := range resp.Header {
				for _, v := range vs {
					if strings.Contains(k, marker) || strings.Contains(v, marker) {
						t.Errorf("response header %s: %s shows the marker", k, v)
					}
				}
			}
			for line := range strings.Lines(logs.String()) {
				var rec struct{ Level string }
				if err := json.Unmarshal([]byte(line), &rec); err != nil {
					t.Fatalf("log line %q: %v", line, err)
				}
				if rec.Level != "DEBUG" && strings.Contains(line, marker) {
					t.Errorf("log line at %s shows the marker: %.300s", rec.Level, line)
				}
			}
		})
	}
}
