package e2e

import (
	"bytes"
	"context"
	"errors"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/tokenizer"
)

// TestCutOffUnderLoad streams concurrently from the mock LLM, which would
// write 60 tokens per answer (the last ones only as long as nobody cancels), under a policy with a hard output cap of 20
// (S14) and a hard bucket in its chain. Every client must get a clean end:
// finish_reason "length" and, on the wire, data: [DONE]; every upstream
// request must be cancelled so the model stops; every request settles once
// with what was counted (S8); and the hard bucket ends exactly at capacity
// less those settlements, never below zero.
func TestCutOffUnderLoad(t *testing.T) {
	checkGoroutines(t)
	const capOut, planned = 20, 60
	const hardCap = 1e7
	counter := newCounter(t)
	var stuck atomic.Int64 // upstream streams the gateway never cancelled
	mock := mockllm.New(mockllm.Config{
		DefaultTokens: planned,
		// The model writes the tokens up to a little past the cap at once,
		// then keeps generating slowly: only a cancelled upstream request
		// stops it.
		Pace: func(ctx context.Context, i int) error {
			if i < capOut+2 {
				return nil
			}
			t := time.NewTimer(waitFor)
			defer t.Stop()
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-t.C:
				stuck.Add(1)
				return errors.New("never cancelled")
			}
		},
		PromptTokens: func(b []byte) int {
			c, err := counter.Count(tokenizer.Request{Path: "/v1/chat/completions", Body: b})
			if err != nil {
				return 0
			}
			return c.InputTokens
		},
	})
	upSrv := httptest.NewServer(mock)
	t.Cleanup(func() {
		upSrv.Close()
		if n := stuck.Load(); n > 0 {
			t.Errorf("%d upstream streams were never cancelled (S14)", n)
		}
	})
	base, err := url.Parse(upSrv.URL)
	if err != nil {
		t.Fatal(err)
	}
	srv := redistest.Start(t)
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rc.Close() })
	led := newLedger(redisstore.New(rc, redisstore.Options{}))
	pol := extproc.Policy{
		Name:            "cut",
		Identities:      []extproc.Identity{{Name: "user", Header: headerUser}},
		Buckets:         []extproc.BucketRule{{Name: "hard", Per: "user", Hard: true, Limit: buckets.Limit{Capacity: hardCap, Rate: tinyRate}}},
		MaxOutputTokens: capOut,
		InjectUsage:     true,
	}
	g := startGateway(t, gatewayConfig{store: led, policies: []extproc.Policy{pol}, upstream: base})

	// One request on the wire: a well-formed end of stream.
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	x := g.post(ctx, "/v1/chat/completions", []byte(`{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Count."}]}`),
		map[string]string{headerUser: "wire"})
	if x.err != nil || x.status != 200 {
		t.Fatalf("status %d err %v", x.status, x.err)
	}
	if !bytes.HasSuffix(x.body, []byte("data: [DONE]\n\n")) || !bytes.Contains(x.body, []byte(`"finish_reason":"length"`)) {
		t.Errorf("cut-off stream does not end with finish_reason length and data: [DONE] (S14):\n%s", trim(x.body[max(0, len(x.body)-400):]))
	}

	// Then many at once through the SDK.
	requests := loadRequests / 2
	users := []string{"alice", "bob", "carol"}
	client := openai.NewClient(option.WithBaseURL(g.url+"/v1/"), option.WithAPIKey("sk-e2e"),
		option.WithMaxRetries(0), option.WithHTTPClient(g.client))
	var wg sync.WaitGroup
	errs := make(chan string, requests)
	work := make(chan int)
	for range loadWorkers {
		wg.Go(func() {
			for i := range work {
				errs <- cutStream(ctx, client, users[i%len(users)])
			}
		})
	}
	for i := range requests {
		work <- i
	}
	close(work)
	wg.Wait()
	close(errs)
	for e := range errs {
		if e != "" {
			t.Error(e)
		}
	}

	outs := g.outcomes.wait(t, requests+1)
	total := 0.0
	for _, o := range outs {
		got := [3]any{o.Decision, o.SettleOutcome, o.CutOff}
		if diff := cmp.Diff([3]any{"admitted", "cut_off", true}, got); diff != "" {
			t.Errorf("outcome %+v (-want +got):\n%s", o, diff)
		}
		if o.Output > capOut+1 || o.Settled != o.InputTokens+o.Output {
			t.Errorf("outcome %+v: want at most %d output tokens (plus the event in flight) settled with the prompt", o, capOut)
		}
		total += float64(o.Settled)
	}
	recs, err := mock.WaitRequests(ctx, requests+1)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if !r.Cancelled || r.TokensSent >= planned {
			t.Errorf("upstream request sent %d of %d tokens, cancelled %v: want it cancelled (S14)", r.TokensSent, r.TokensPlanned, r.Cancelled)
		}
	}
	if n := led.checkSettled(t); n != requests+1 {
		t.Errorf("the store saw %d reservations, want %d", n, requests+1)
	}
	sum := 0.0
	for _, l := range led.levels(t, "hard") {
		if l < 0 {
			t.Errorf("hard bucket at %v, below zero (S14)", l)
		}
		sum += hardCap - l
	}
	if diff := cmp.Diff(total, sum, levelsEqual); diff != "" {
		t.Errorf("tokens taken from the hard buckets vs settled (-settled +taken):\n%s", diff)
	}
}

// cutStream reads one streamed answer through the SDK and returns what is
// wrong with it, or "".
func cutStream(ctx context.Context, client openai.Client, user string) string {
	stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:    "gpt-4o-mini",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Count to sixty.")},
	}, option.WithHeader(headerUser, user))
	defer stream.Close()
	var text strings.Builder
	finish := ""
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			text.WriteString(c.Delta.Content)
			if c.FinishReason != "" {
				finish = c.FinishReason
			}
		}
	}
	if err := stream.Err(); err != nil {
		return "stream: " + err.Error()
	}
	if n := strings.Count(text.String(), "tok"); finish != "length" || n == 0 || n > 20 {
		return "stream ended with finish_reason " + finish + " after " + text.String()
	}
	return ""
}
