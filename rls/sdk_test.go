package rls_test

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/envoy/standin"
)

// sdkYAML gives each user 1,000 tokens, refilling 1 a minute.
const sdkYAML = `
store: {type: memory}
tokenizer: {fallback_encoding: o200k_base}
policies:
  - name: ai
    identities:
      - {name: user, header: x-user-id}
    buckets:
      - {name: user, per: user, tokens_per_minute: 1, burst: 1000, max_debt: 1000}
rls:
  domains:
    - domain: ai-gateway
      descriptors:
        - {key: user, identity: user, policy: ai}
`

// completion is the upstream's answer: 600 tokens in all, which the model
// backend (AI Gateway's ext_proc, here the handler) puts in dynamic
// metadata for the stream-done charge.
const completion = `{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":500,"completion_tokens":100,"total_tokens":600}}`

// TestRLSSDKThroughEnvoy is Envoy AI Gateway's token rate limiting with the
// official OpenAI SDK as client: Envoy's rate-limit filter (the stand-in)
// checks the user's bucket before the request and charges the answer's
// total tokens at stream done; the second request passes on what is left,
// drives the bucket into debt, and the third is a 429 that the SDK reports
// as an API error with Envoy's rate-limit headers and the service's
// retry-after.
func TestRLSSDKThroughEnvoy(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("content-type", "application/json")
			w.Write([]byte(completion))
			standin.SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", &structpb.Struct{Fields: map[string]*structpb.Value{"llm_total_token": structpb.NewNumberValue(600)}})
		})
		s := newScene(t, store, costFilter, next, sdkYAML)
		client := openai.NewClient(
			option.WithBaseURL(s.front.URL+"/v1/"), option.WithAPIKey("sk-test"), option.WithMaxRetries(0),
			option.WithHTTPClient(s.front.Client()), option.WithHeader("x-user-id", "ann"),
		)
		params := openai.ChatCompletionNewParams{
			Model:    "gpt-4o-mini",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hello")},
		}
		ctx := context.Background()
		for i := range 2 {
			c, err := client.Chat.Completions.New(ctx, params)
			if err != nil {
				t.Fatalf("request %d: %v", i+1, err)
			}
			if c.Usage.TotalTokens != 600 {
				t.Fatalf("request %d: usage %+v", i+1, c.Usage)
			}
			s.entry(t, i+1) // its 600 tokens are charged
		}
		_, err := client.Chat.Completions.New(ctx, params)
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 {
			t.Fatalf("third request: %v, want a 429 API error", err)
		}
		h := apiErr.Response.Header
		if h.Get("x-envoy-ratelimited") != "true" || h.Get("retry-after") == "" || h.Get("x-ratelimit-remaining") != "0" {
			t.Errorf("429 headers %v", h)
		}
		if l := s.rig.level(t, "user", "ann"); l > -199 || l < -201 {
			t.Errorf("level %v, want -200: 1,200 tokens charged of 1,000", l)
		}
	})
}
