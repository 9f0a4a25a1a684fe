package extproc

import (
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/extproc/provider"
)

// stepClock advances by step at every reading, so that every later event
// of a request reads a later time than every earlier one.
type stepClock struct {
	mu   sync.Mutex
	t    time.Time
	step time.Duration
}

func (c *stepClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(c.step)
	return c.t
}

// An Outcome carries what the GenAI metrics need: the API, the model the
// upstream answered with, the provider's usage by token type, how long the
// request took and, for a stream, when its first output arrived.
func TestOutcomeCarriesResponseModelUsageAndTimes(t *testing.T) {
	stream := &upstream{Chunks: [][]byte{
		sse(chatChunk("Hello"), chatChunk(" there")),
		sse(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini-2024-07-18","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19,"prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":3}}}`, "[DONE]"),
	}}
	clock := &stepClock{t: time.Unix(1_000_000, 0), step: time.Millisecond}
	r := newRig(t, stream, rigOptions{now: clock.now})
	if resp, body := r.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}`, nil); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	o := r.outcome(t)
	if diff := cmp.Diff(provider.Usage{InputTokens: 12, OutputTokens: 7, CachedInputTokens: 4, ReasoningTokens: 3}, o.ProviderUsage); diff != "" {
		t.Errorf("ProviderUsage (-want +got):\n%s", diff)
	}
	if o.API != "chat" || o.ResponseModel != "gpt-4o-mini-2024-07-18" || !o.Streamed || o.Embedding {
		t.Errorf("API %q, ResponseModel %q, Streamed %v, Embedding %v; want chat, gpt-4o-mini-2024-07-18, a stream, no embedding", o.API, o.ResponseModel, o.Streamed, o.Embedding)
	}
	if o.FirstOutput <= 0 || o.Duration <= o.FirstOutput {
		t.Errorf("FirstOutput %v, Duration %v: want 0 < first output < duration", o.FirstOutput, o.Duration)
	}

	whole := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(`{"id":"m1","type":"message","role":"assistant","model":"claude-opus-5","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":20,"cache_creation_input_tokens":5,"cache_read_input_tokens":6,"output_tokens":9}}`)}}
	r = newRig(t, whole, rigOptions{now: clock.now})
	if resp, body := r.post(t, "/v1/messages", `{"model":"claude-opus-5","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}`, nil); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	o = r.outcome(t)
	if o.API != "messages" || o.ResponseModel != "claude-opus-5" || o.Streamed || o.FirstOutput != 0 || o.Duration <= 0 {
		t.Errorf("API %q, ResponseModel %q, Streamed %v, FirstOutput %v, Duration %v; want messages, claude-opus-5, not a stream, no first output, a duration",
			o.API, o.ResponseModel, o.Streamed, o.FirstOutput, o.Duration)
	}
	if o.ProviderUsage.CacheCreationInputTokens != 5 || o.ProviderUsage.CachedInputTokens != 6 {
		t.Errorf("ProviderUsage %+v, want 5 cache-creation and 6 cached input tokens", o.ProviderUsage)
	}
}
