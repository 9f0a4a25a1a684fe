package extproc

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"

	"github.com/tokengate/tokengate/buckets"
)

func sdkClient(r *rig, retries int) openai.Client {
	return openai.NewClient(
		option.WithBaseURL(r.front.URL+"/v1/"),
		option.WithAPIKey("sk-test"),
		option.WithMaxRetries(retries),
		option.WithHTTPClient(r.front.Client()),
	)
}

func sdkParams(maxTokens int64) openai.ChatCompletionNewParams {
	p := openai.ChatCompletionNewParams{
		Model:    "gpt-4o-mini",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hello")},
	}
	if maxTokens > 0 {
		p.MaxTokens = openai.Int(maxTokens)
	}
	return p
}

// With the official SDK as client: a refused request is an API error with
// status 429, its code and the rate-limit headers (S16).
func TestSDKRefused429(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(
		`{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}`)}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 100, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	c := sdkClient(r, 0)
	ctx := context.Background()
	if _, err := c.Chat.Completions.New(ctx, sdkParams(80)); err != nil {
		t.Fatalf("first request: %v", err)
	}
	_, err := c.Chat.Completions.New(ctx, sdkParams(80))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("error %v is not an API error", err)
	}
	if apiErr.StatusCode != 429 || apiErr.Code != "rate_limit_exceeded" || apiErr.Type != "tokens" {
		t.Errorf("API error %d %q %q, want 429 rate_limit_exceeded tokens", apiErr.StatusCode, apiErr.Code, apiErr.Type)
	}
	for _, h := range []string{headerRetryAfter, headerLimit, headerRemaining, headerReset} {
		if apiErr.Response.Header.Get(h) == "" {
			t.Errorf("429 lacks %s", h)
		}
	}
}

// An impossible request is a 413 that the SDK does not retry (S4).
func TestSDKNeverAdmissible413NotRetried(t *testing.T) {
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 100, Rate: 1}}}}
	r := newRig(t, nil, rigOptions{policies: []Policy{pol}})
	c := sdkClient(r, 2)
	_, err := c.Chat.Completions.New(context.Background(), sdkParams(5000))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 413 {
		t.Fatalf("error %v, want a 413 API error", err)
	}
	r.outcome(t)
	select {
	case o := <-r.outcomes:
		t.Errorf("the SDK retried the 413: %+v", o)
	default:
	}
	r.entry(t, 1)
	if n := len(r.proxy.Log()); n != 1 {
		t.Errorf("stand-in saw %d requests, want 1", n)
	}
}

// A stream cut at the budget ends cleanly for the SDK with finish_reason
// "length", and the upstream saw the cancellation (S14).
func TestSDKStreamCutOff(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(10)...)}, Hang: true}
	pol := Policy{Name: "p", InjectUsage: true, MaxOutputTokens: 3,
		Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	c := sdkClient(r, 0)
	stream := c.Chat.Completions.NewStreaming(context.Background(), sdkParams(0))
	defer stream.Close()
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream error: %v", err)
	}
	if len(acc.Choices) != 1 {
		t.Fatalf("%d choices", len(acc.Choices))
	}
	if got := acc.Choices[0]; got.FinishReason != "length" || got.Message.Content != " w w w" {
		t.Errorf("finish %q content %q, want length and 3 words", got.FinishReason, got.Message.Content)
	}
	deadline := time.Now().Add(5 * time.Second)
	for u.cancelled.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the upstream never saw the cancellation")
		}
		time.Sleep(5 * time.Millisecond) // polling a deadline
	}
}
