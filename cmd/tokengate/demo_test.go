package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// The demo's "capped" route is described as it behaves: max_output_tokens
// cuts a stream at 80 output tokens (S14), while an answer that is not
// streamed arrives whole, since only clamp_output would cap it.
func TestDemoCappedRouteDescribedAsItBehaves(t *testing.T) {
	var out, errOut syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"demo", "--serve", "--listen", "127.0.0.1:0", "--token-delay", "0s"}, nil, &out, &errOut)
	}()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(10 * time.Second):
			t.Error("demo --serve did not stop within 10s")
		}
	}()
	var started struct {
		Standin string `json:"envoy_standin"`
	}
	poll(t, func() error {
		for _, line := range strings.Split(errOut.String(), "\n") {
			if strings.Contains(line, "demo stack listening") {
				return json.Unmarshal([]byte(line), &started)
			}
		}
		return fmt.Errorf("not started: %s", errOut.String())
	})
	ask := func(stream bool) string {
		body := fmt.Sprintf(`{"model":"gpt-4o-mini","max_tokens":300,"stream":%t,"messages":[{"role":"user","content":"hi"}]}`, stream)
		req, err := http.NewRequest(http.MethodPost, started.Standin+"/capped/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("x-user-id", "me")
		req.Header.Set("content-type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("capped route: %s %v %s", resp.Status, err, b)
		}
		return string(b)
	}
	if s := ask(true); strings.Count(s, `"content":`) > 81 || !strings.Contains(s, `"finish_reason":"length"`) {
		t.Errorf("a stream asking for 300 tokens was not cut at 80:\n%s", lastLines(s, 3))
	}
	var whole struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(ask(false)), &whole); err != nil || whole.Usage.CompletionTokens != 300 {
		t.Errorf("a non-streamed answer asking for 300 tokens had %d (%v), want 300: not capped", whole.Usage.CompletionTokens, err)
	}
	help := strings.Join(strings.Fields(out.String()), " ")
	for _, want := range []string{"a stream is cut at 80 output tokens", "an answer that is not streamed is not"} {
		if !strings.Contains(help, want) {
			t.Errorf("the demo's help does not say of the capped route %q:\n%s", want, out.String())
		}
	}
}
