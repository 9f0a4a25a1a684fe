package extproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/pricing"
)

// The exits of a request and what each charges: the table in
// docs/budgets.md ("Every exit of a request"), row by row.

// heldUpstream reads each request whole, says so on received, and answers
// nothing until the request is cancelled: a provider still working on its
// answer when the client goes.
type heldUpstream struct {
	received  chan string
	cancelled atomic.Int32
}

func newHeldUpstream() *heldUpstream { return &heldUpstream{received: make(chan string, 16)} }

func (h *heldUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	h.received <- string(b)
	<-r.Context().Done()
	h.cancelled.Add(1)
}

// wait waits until the upstream has a request.
func (h *heldUpstream) wait(t *testing.T) {
	t.Helper()
	select {
	case <-h.received:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream got no request within 5s")
	}
}

// exitPolicy is a policy with a bucket, a quota of money and a
// concurrency limit of one, so that a test reads all three after an exit.
func exitPolicy(t *testing.T) Policy {
	return Policy{
		Name:        "p",
		Buckets:     []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}},
		Quotas:      []QuotaRule{{Name: "spend", Window: mustWindow(t, "day", "UTC"), Unit: buckets.Money, Limit: 1e12}},
		Concurrency: []ConcurrencyRule{{Name: "one", Max: 1}},
	}
}

// checkExit checks what an exit left: the bucket at its capacity less the
// tokens charged, the quota at the money charged, no slot held.
func checkExit(t *testing.T, r *rig, pol Policy, tokens int, money pricing.Micros) {
	t.Helper()
	key := func(name string) string { return bucketKey(pol.Name, name, globalPart) }
	if got, want := r.level(t, pol.Buckets[0], key("g")), pol.Buckets[0].Limit.Capacity-float64(tokens); got < want-1e-6 || got > want+1e-6 {
		t.Errorf("bucket at %v, want %v (capacity less the %d tokens charged)", got, want, tokens)
	}
	if len(pol.Quotas) > 0 {
		if got := r.quotaSpent(t, pol.Quotas[0], key(pol.Quotas[0].Name)); got != float64(money) {
			t.Errorf("quota spent %v micro-units, want %d", got, money)
		}
	}
	in, ok := r.store.inner.(buckets.Inspector)
	if g, gated := r.store.inner.(*gateStore); gated {
		in, ok = g.Store.(buckets.Inspector)
	}
	if !ok {
		t.Fatalf("store %T cannot be inspected", r.store.inner)
	}
	held, err := in.InUse(context.Background(), []buckets.Slot{{Name: "one", Key: key("one"), Max: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if held[0] != 0 {
		t.Errorf("%d concurrency slots still held after the request ended", held[0])
	}
}

// exitStores runs f on the memory store and on Redis.
func exitStores(t *testing.T, f func(t *testing.T, store buckets.Store)) {
	t.Run("memory", func(t *testing.T) { f(t, nil) })
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { c.Close() })
		f(t, redisstore.New(c, redisstore.Options{}))
	})
}

// S8: a client that hangs up once its request was forwarded, before any
// answer, pays for what the provider has: the prompt of a stream (Envoy
// resets the upstream, which stops generating), the whole reservation of a
// non-streamed request (the provider finishes the answer and bills it),
// and the reservation of a stream of a model that bills hidden reasoning
// nobody reported. The settlement lands although the client is gone, and
// no slot stays held.
func TestClientHangsUpAfterForwardingPaysThePrompt(t *testing.T) {
	prices := testPrices(t)
	price, err := prices.Resolve("gpt-4o-mini")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, body string
		tokens     int
		money      pricing.Micros
	}{
		{"stream", `{"model":"gpt-4o-mini","stream":true,"max_tokens":50,"messages":[]}`, 10,
			price.Cost(pricing.Usage{InputTokens: 10})},
		{"not streamed", `{"model":"gpt-4o-mini","max_tokens":50,"messages":[]}`, 10 + 50,
			price.MaxCost(10, 50)},
		{"stream of a reasoning model", `{"model":"o3-mini","stream":true,"max_tokens":50,"messages":[]}`, 10 + 50, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exitStores(t, func(t *testing.T, store buckets.Store) {
				pol := exitPolicy(t)
				if strings.Contains(tc.body, "o3") {
					pol.Quotas = nil // not priced
				}
				h := newHeldUpstream()
				r := newRig(t, nil, rigOptions{policies: []Policy{pol}, upstream: h, prices: prices, store: store})
				leave, done := startRequest(r, tc.body)
				h.wait(t)
				leave()
				r.streamGone(t)
				<-done
				o := r.outcome(t)
				if o.SettleOutcome != "no_response" || o.Settled != tc.tokens {
					t.Errorf("outcome %+v, want no_response with %d tokens settled", o, tc.tokens)
				}
				if len(pol.Quotas) > 0 && (len(o.Quotas) != 1 || o.Quotas[0].Amount != float64(tc.money)) {
					t.Errorf("quotas charged %+v, want %d micro-units", o.Quotas, tc.money)
				}
				checkExit(t, r, pol, tc.tokens, tc.money)
				if got := r.store.settlements(t); len(got) != 1 {
					t.Errorf("settlements %v, want one", got)
				}
			})
		})
	}
}

// S8: a client that hangs up before its request was forwarded pays
// nothing, the provider never saw it: while its tokens are reserved, or
// while it waits for them (S12). The reservation is given back whole, once,
// and its slot with it.
func TestClientHangsUpBeforeForwardingPaysNothing(t *testing.T) {
	t.Run("while reserved", func(t *testing.T) {
		gs := newGateStore(true, false)
		h := newHeldUpstream()
		pol := exitPolicy(t)
		pol.Quotas = nil
		r := newRig(t, nil, rigOptions{policies: []Policy{pol}, upstream: h, store: gs})
		leave, done := startRequest(r, `{"model":"m","max_tokens":50,"messages":[]}`)
		gs.waitEntered(t)
		leave()
		r.streamGone(t)
		close(gs.release)
		<-done
		if o := r.outcome(t); o.SettleOutcome != "not_forwarded" || o.Settled != 0 {
			t.Errorf("outcome %+v, want not_forwarded with nothing settled", o)
		}
		r.store.settlements(t)
		checkExit(t, r, pol, 0, 0)
		if len(h.received) != 0 {
			t.Error("the upstream got a request whose client had left before it was forwarded")
		}
	})
	t.Run("while waiting for tokens", func(t *testing.T) {
		r, h := waitingRig(t)
		leave, done := startRequest(r, `{"model":"m","max_tokens":10,"messages":[]}`)
		r.awaitReserved(t)
		leave()
		r.streamGone(t)
		<-done
		o := r.outcome(t)
		if o.SettleOutcome != "not_forwarded" || o.Settled != 0 || o.Waited == 0 {
			t.Errorf("outcome %+v, want not_forwarded after a wait, nothing settled", o)
		}
		if got := r.store.settlements(t); len(got) != 1 || got[0] != 0 {
			t.Errorf("settlements %v, want the reservation settled once at 0", got)
		}
		if len(h.received) != 0 {
			t.Error("the upstream got a request whose client left while it waited")
		}
	})
}

// §2.5, §7.2 (ext_proc_graceful_grpc_close): when the client goes, Envoy
// may half-close the side stream and reset it only a second later. A
// request still waiting for its tokens then was never forwarded, and pays
// nothing: the wait ends as the stream does, and its answer, which would
// forward it, is never sent.
func TestHalfCloseWhileWaitingForTokensChargesNothing(t *testing.T) {
	r, _ := waitingRig(t)
	st := waitingStream(t, r)
	// The client leaves: Envoy half-closes and waits for the server.
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for {
		a, err := st.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Errorf("the server ended the call with %v, want OK", err)
			}
			break
		}
		if a.GetRequestBody() != nil {
			t.Errorf("the server forwarded the request after the client left: %v", a)
		}
	}
	o := r.outcome(t)
	if o.SettleOutcome != "not_forwarded" || o.Settled != 0 || o.Waited == 0 {
		t.Errorf("outcome %+v, want not_forwarded after a wait, nothing settled", o)
	}
	if got := r.store.settlements(t); len(got) != 1 || got[0] != 0 {
		t.Errorf("settlements %v, want the reservation settled once at 0", got)
	}
}

// A message that arrives while the request waits for its tokens does not
// end the wait: it is handled after it, in its turn (§1.3: answers in the
// order of the messages), and the request goes on.
func TestMessageWhileWaitingForTokensIsHandledAfterTheWait(t *testing.T) {
	r, _ := waitingRig(t)
	st := waitingStream(t, r)
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for len(got) < 3 {
		a, err := st.Recv()
		if err != nil {
			t.Fatalf("after %v: %v", got, err)
		}
		switch {
		case a.GetOverrideMessageTimeout() != nil:
			got = append(got, "timeout extended")
		case a.GetRequestBody() != nil:
			got = append(got, "body")
		case a.GetRequestTrailers() != nil:
			got = append(got, "trailers")
		default:
			got = append(got, fmt.Sprintf("%T", a.GetResponse()))
		}
	}
	if want := []string{"timeout extended", "body", "trailers"}; !slices.Equal(got, want) {
		t.Errorf("answers %v, want %v", got, want)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("the server ended the call with %v, want OK", err)
	}
	// Forwarded, and gone before its non-streamed answer: the
	// reservation stands.
	if o := r.outcome(t); o.SettleOutcome != "no_response" || o.Settled != 20 || o.Waited == 0 {
		t.Errorf("outcome %+v, want no_response with the reservation of 20 settled after a wait", o)
	}
}

// waitingStream opens an ext_proc stream to r's server, as Envoy would,
// and sends it a request (BUFFERED) that waits for its tokens: it returns
// once the request has its reservation.
func waitingStream(t *testing.T, r *rig) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	st, err := extprocv3.NewExternalProcessorClient(r.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []*extprocv3.ProcessingRequest{
		reqHeadersMsg(buffered, duplex, chatPath),
		reqBodyMsg(`{"model":"m","max_tokens":10,"messages":[]}`, true),
	} {
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if a, err := st.Recv(); err != nil || a.GetRequestHeaders() == nil {
		t.Fatalf("the request headers' answer: %v, %v", a, err)
	}
	r.awaitReserved(t)
	return st
}

// waitingRig is a rig whose bucket has 10 of its 100 tokens left, refilling
// 10 a second, and whose policy lets a request wait 5s for its tokens: a
// request of 20 waits about a second.
func waitingRig(t *testing.T) (*rig, *heldUpstream) {
	t.Helper()
	h := newHeldUpstream()
	pol := exitPolicy(t)
	pol.Quotas, pol.MaxWait, pol.MaxQueue = nil, 5*time.Second, 1
	pol.Buckets[0].Limit = buckets.Limit{Capacity: 100, Rate: 10}
	r := newRig(t, nil, rigOptions{policies: []Policy{pol}, upstream: h, maxMsgTimeout: 10 * time.Second})
	// Another gateway's request holds 90 of the 100 tokens.
	b := buckets.Bucket{Name: "g", Key: bucketKey("p", "g", globalPart), Limit: pol.Buckets[0].Limit}
	if d, err := r.store.inner.Reserve(context.Background(), buckets.Request{ID: "other", Cost: 90, Buckets: []buckets.Bucket{b}}); err != nil || !d.OK {
		t.Fatalf("reserving 90: %+v, %v", d, err)
	}
	return r, h
}

// awaitReserved polls until the rig's store has made a reservation.
func (r *rig) awaitReserved(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		r.store.mu.Lock()
		n := len(r.store.reserved)
		r.store.mu.Unlock()
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the request reserved nothing within 5s")
		}
		time.Sleep(time.Millisecond) // polling, with the deadline above
	}
}

// S8: shutdown past its grace settles a request still waiting for its
// tokens at nothing, and the request is then not forwarded: nothing backs
// it any more.
func TestShutdownWhileWaitingForTokensForwardsNothing(t *testing.T) {
	r, h := waitingRig(t)
	_, done := startRequest(r, `{"model":"m","max_tokens":10,"messages":[]}`)
	r.awaitReserved(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.srv.Shutdown(ctx); err == nil {
		t.Fatal("Shutdown returned nil while a request was open")
	}
	<-done
	if o := r.outcome(t); o.SettleOutcome != "shutdown" || o.Settled != 0 {
		t.Errorf("outcome %+v, want settled at nothing at shutdown", o)
	}
	if got := r.store.settlements(t); len(got) != 1 || got[0] != 0 {
		t.Errorf("settlements %v, want the reservation settled once at 0", got)
	}
	if len(h.received) != 0 {
		t.Error("the upstream got a request whose reservation shutdown had settled")
	}
}

// S8: shutdown past its grace settles a request still waiting for its
// non-streamed answer at its reservation, as a hang-up does: the provider
// has the request and bills the answer it finishes.
func TestShutdownChargesInFlightNonStreamedTheReservation(t *testing.T) {
	exitStores(t, func(t *testing.T, store buckets.Store) {
		pol := exitPolicy(t)
		h := newHeldUpstream()
		prices := testPrices(t)
		price, err := prices.Resolve("gpt-4o-mini")
		if err != nil {
			t.Fatal(err)
		}
		r := newRig(t, nil, rigOptions{policies: []Policy{pol}, upstream: h, prices: prices, store: store})
		leave, done := startRequest(r, `{"model":"gpt-4o-mini","max_tokens":500,"messages":[]}`)
		h.wait(t)
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // no grace: settle what is open at once
		if err := r.srv.Shutdown(ctx); err == nil {
			t.Fatal("Shutdown returned nil while a request was open")
		}
		leave()
		<-done
		o := r.outcome(t)
		if o.SettleOutcome != "shutdown" || o.Reserved != 510 || o.Settled != 510 {
			t.Errorf("outcome %+v, want 510 reserved and 510 settled at shutdown", o)
		}
		checkExit(t, r, pol, 510, price.MaxCost(10, 500))
	})
}

// anthropicErrorStream is a messages stream that reports its prompt in
// message_start (output_tokens 1, a placeholder), sends n one-token
// deltas, and ends with an error event instead of message_stop.
func anthropicErrorStream(n int) []byte {
	return append(anthropicStream(n), []byte("event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n")...)
}

// S8: an Anthropic stream that ends with an error event charges what was
// delivered: the reported prompt and the larger of the reported and the
// counted output, not message_start's placeholder output_tokens.
func TestAnthropicStreamEndingWithErrorChargesWhatWasDelivered(t *testing.T) {
	u := &upstream{Chunks: [][]byte{anthropicErrorStream(50)}}
	r := newRig(t, u, rigOptions{})
	_, got := r.post(t, "/v1/messages", `{"model":"claude-x","stream":true,"max_tokens":500,"messages":[]}`, nil)
	if !strings.Contains(got, "overloaded_error") {
		t.Fatalf("the client did not get the error event:\n%s", got)
	}
	if o := r.outcome(t); o.Output != 50 || o.Settled != 12+50 {
		t.Errorf("outcome %+v, want 50 counted and 62 settled (12 reported input + 50 delivered)", o)
	}
}

// anthropicCachedStream is a messages stream whose message_start reports
// a prompt mostly read from the cache and partly written to it, as
// Anthropic's does, followed by n one-token deltas.
func anthropicCachedStream(n int) []byte {
	var b strings.Builder
	b.WriteString("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-x\",\"content\":[]," +
		"\"usage\":{\"input_tokens\":5,\"cache_read_input_tokens\":1000,\"cache_creation_input_tokens\":200,\"output_tokens\":1}}}\n\n")
	b.WriteString("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	for range n {
		b.WriteString("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" w\"}}\n\n")
	}
	return []byte(b.String())
}

// S8, S14: a FULL_DUPLEX_STREAMED cut-off settles on the prompt's split
// the provider already reported (Anthropic's message_start: cache reads,
// cache writes, uncached input) and the output counted, priced as billed,
// and its closing events report that prompt.
func TestDuplexCutOffSettlesOnTheReportedCacheSplit(t *testing.T) {
	prices, err := pricing.NewTable("USD", []pricing.Entry{{Model: "claude-x", Input: "3", CachedInput: "0.3", CacheWrite: "3.75", Output: "15"}})
	if err != nil {
		t.Fatal(err)
	}
	price, err := prices.Resolve("claude-x")
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Name: "p", MaxOutputTokens: 20,
		Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}},
		Quotas:  []QuotaRule{{Name: "spend", Window: mustWindow(t, "day", "UTC"), Unit: buckets.Money, Limit: 1e12}}}
	u := &upstream{Chunks: [][]byte{anthropicCachedStream(50)}, Hang: true}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: duplexMode(), prices: prices})
	_, got := r.post(t, "/v1/messages", `{"model":"claude-x","stream":true,"max_tokens":500,"messages":[]}`, nil)
	if !strings.Contains(got, `"stop_reason":"max_tokens"`) {
		t.Fatalf("stream not cut off:\n%s", got)
	}
	o := r.outcome(t)
	// 21 tokens counted: the 21st crossed max_output_tokens and was withheld.
	billed := pricing.Usage{InputTokens: 1205, CachedInputTokens: 1000, CacheCreationInputTokens: 200, OutputTokens: 21}
	if want := price.Cost(billed); !o.CutOff || o.Settled != 1205+21 || len(o.Quotas) != 1 || o.Quotas[0].Amount != float64(want) {
		t.Errorf("outcome %+v; want cut off, %d tokens settled, %d micro-units charged", o, 1205+21, want)
	}
}

// geminiReportedStream is a Gemini stream whose usageMetadata reports a
// prompt of 37 tokens (the fake counter counts 10) and runs behind the
// candidates sent.
func geminiReportedStream(n int) []byte {
	var b strings.Builder
	for range n {
		b.WriteString(`data: {"candidates":[{"content":{"parts":[{"text":" w"}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":37,"candidatesTokenCount":1,"totalTokenCount":38}}` + "\n\n")
	}
	return []byte(b.String())
}

// S14: a cut-off's closing chunk reports the prompt the provider counted
// when it reported one (Gemini's promptTokenCount), not tokengate's
// estimate; and the request's "request finished" line logs the output
// settled, for Anthropic and Gemini streams alike.
func TestCutOffReportsTheProvidersPromptAndLogsTheSettledOutput(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		stream           []byte
		settled          int
		closing          string
	}{
		{"gemini", "/v1beta/models/gemini-x:streamGenerateContent?alt=sse", `{"model":"gemini-x","stream":true,"max_tokens":500}`,
			geminiReportedStream(50), 37 + 21, `"promptTokenCount":37,"candidatesTokenCount":20`},
		{"anthropic", "/v1/messages", `{"model":"claude-x","stream":true,"max_tokens":500,"messages":[]}`,
			anthropicStream(50), 12 + 21, `"usage":{"output_tokens":20}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs syncBuffer
			pol := Policy{Name: "p", MaxOutputTokens: 20, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}}}
			u := &upstream{Chunks: [][]byte{tc.stream}, Hang: true}
			r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: duplexMode(), logger: slog.New(slog.NewJSONHandler(&logs, nil))})
			_, got := r.post(t, tc.path, tc.body, nil)
			if !strings.Contains(got, tc.closing) {
				t.Errorf("closing events lack %s:\n%s", tc.closing, got[max(0, len(got)-600):])
			}
			o := r.outcome(t)
			if !o.CutOff || o.Settled != tc.settled {
				t.Errorf("outcome %+v, want cut off with %d settled", o, tc.settled)
			}
			type finished struct {
				Msg     string `json:"msg"`
				Output  int    `json:"output_tokens"`
				Settled int    `json:"settled"`
			}
			var logged *finished
			for line := range strings.Lines(logs.String()) {
				var l finished
				if err := json.Unmarshal([]byte(line), &l); err != nil {
					t.Fatal(err)
				}
				if l.Msg == "request finished" {
					logged = &l
				}
			}
			if logged == nil || logged.Output != 21 || logged.Settled != tc.settled {
				t.Errorf("request finished logged %+v, want 21 output tokens of %d settled:\n%s", logged, tc.settled, logs.String())
			}
		})
	}
}

// S8: a side stream on which Envoy sends nothing for StreamIdleTimeout is
// ended, and its request settled as the exit it then is: a stream as
// aborted (the prompt and what was counted), a request still waiting for
// its non-streamed answer as unanswered (its reservation).
func TestStreamIdleTimeoutSettlesByTheExitRule(t *testing.T) {
	const idle = 300 * time.Millisecond
	t.Run("mid-stream", func(t *testing.T) {
		u := &upstream{Chunks: [][]byte{sse(words(3)...)}, Hang: true}
		pol := exitPolicy(t)
		pol.Quotas = nil
		r := newRig(t, u, rigOptions{policies: []Policy{pol}, idleTimeout: idle})
		_, done := startRequest(r, `{"model":"m","stream":true,"max_tokens":50,"messages":[]}`)
		<-done // Envoy resets the response when its side stream fails
		if o := r.outcome(t); o.SettleOutcome != "aborted" || o.Output != 3 || o.Settled != 10+3 {
			t.Errorf("outcome %+v, want aborted with the prompt and 3 counted settled", o)
		}
		checkExit(t, r, pol, 13, 0)
	})
	t.Run("waiting for a non-streamed answer", func(t *testing.T) {
		h := newHeldUpstream()
		pol := exitPolicy(t)
		pol.Quotas = nil
		r := newRig(t, nil, rigOptions{policies: []Policy{pol}, upstream: h, idleTimeout: idle})
		r.post(t, chatPath, `{"model":"m","max_tokens":50,"messages":[]}`, nil)
		if o := r.outcome(t); o.SettleOutcome != "no_response" || o.Settled != 60 {
			t.Errorf("outcome %+v, want no_response with the reservation of 60 settled", o)
		}
		checkExit(t, r, pol, 60, 0)
	})
}

// S8: answers that end are charged by the usage they report: a complete
// JSON answer its usage, one without usage its reservation; an upstream
// error status the usage it reported, else nothing.
func TestAnswersChargeTheUsageTheyReport(t *testing.T) {
	for _, tc := range []struct {
		name    string
		status  int
		body    string
		outcome string
		settled int
	}{
		{"complete with usage", 200, `{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}`, "complete", 42},
		{"complete without usage", 200, `{"choices":[]}`, "complete", 60},
		{"upstream error with usage", 500, `{"error":{"message":"boom"},"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}`, "upstream_error", 15},
		{"upstream error without usage", 500, `{"error":{"message":"boom"}}`, "upstream_error", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := &upstream{Status: tc.status, ContentType: "application/json", Chunks: [][]byte{[]byte(tc.body)}}
			pol := exitPolicy(t)
			pol.Quotas = nil
			r := newRig(t, u, rigOptions{policies: []Policy{pol}})
			r.post(t, chatPath, `{"model":"m","max_tokens":50,"messages":[]}`, nil)
			if o := r.outcome(t); o.SettleOutcome != tc.outcome || o.Settled != tc.settled {
				t.Errorf("outcome %+v, want %s with %d settled", o, tc.outcome, tc.settled)
			}
			checkExit(t, r, pol, tc.settled, 0)
		})
	}
}

// §2.3: with trailer mode SKIP, a non-streamed answer that its HTTP/2
// upstream ended with trailers reaches tokengate without an end_of_stream
// body message, in STREAMED and BUFFERED mode alike, and the side stream
// then closes. A body that parses whole is the complete answer, charged
// the usage it reports (docs/budgets.md, "complete, usage reported"); one
// cut short, the client gone mid-answer, keeps its reservation.
func TestTrailersEndedNonStreamedAnswerChargesItsUsage(t *testing.T) {
	const usage = `"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}`
	for _, tc := range []struct {
		name    string
		mode    filterv3.ProcessingMode_BodySendMode
		chunks  []string
		outcome string
		settled int
	}{
		{"STREAMED", streamed, []string{`{"choices":[],`, usage}, "complete", 42},
		{"BUFFERED", buffered, []string{`{"choices":[],` + usage}, "complete", 42},
		{"STREAMED, cut short", streamed, []string{`{"choices":[],`, usage[:20]}, "aborted", 60},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, outcomes := requestServer(t, 1e6, &fakeCounter{input: 10, allowance: 100}, 1<<20)
			msgs := []*extprocv3.ProcessingRequest{
				reqHeadersMsg(buffered, tc.mode, chatPath),
				reqBodyMsg(`{"model":"m","max_tokens":50,"messages":[]}`, true),
				respHeadersMsg("200", "application/json", false),
			}
			for _, c := range tc.chunks {
				msgs = append(msgs, respBodyMsg(c, false)) // the trailers that follow are not sent
			}
			drive(t, s, msgs)
			if o := <-outcomes; o.SettleOutcome != tc.outcome || o.Settled != tc.settled {
				t.Errorf("outcome %+v, want %s with %d settled", o, tc.outcome, tc.settled)
			}
		})
	}
}
