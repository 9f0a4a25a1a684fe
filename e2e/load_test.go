package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/metrics"
	"github.com/tokengate/tokengate/tokenizer"
)

// loadMix is the traffic of the load tests: recorded streams that carry
// provider usage, so every settlement is known in advance (S8: provider
// usage is authoritative). The chat streams go through the OpenAI SDK, the
// Anthropic one as raw HTTP.
var loadMix = []string{
	"openai/chat-stream-gpt-4o-mini",
	"openai/chat-stream-include-usage-length",
	"openai/chat-stream-tool-call-gpt-4o-mini",
	"openai/chat-stream-tool-call-include-usage",
	"openai/chat-stream-tool-result-turn",
	"anthropic/messages-stream-text",
}

// loadRecordings returns the load mix. It counts each request once, so
// that the vocabularies (shared by the process) are loaded before anything
// is timed.
func loadRecordings(t testing.TB) []recording {
	c := newCounter(t)
	var out []recording
	for _, name := range loadMix {
		r := loadRecording(t, name)
		if r.Total <= 0 {
			t.Fatalf("recording %s carries no usage; the load mix needs it", name)
		}
		if _, err := c.Count(tokenizer.Request{Path: r.Path, Body: r.Request}); err != nil {
			t.Fatalf("recording %s: %v", name, err)
		}
		out = append(out, r)
	}
	return out
}

// loadPolicy meters each user with its own bucket and concurrency limit,
// and everyone together with a global bucket. The refill is negligible, so
// the levels after a run are exact.
func loadPolicy(userCap, globalCap float64, slots int) extproc.Policy {
	return extproc.Policy{
		Name:       "load",
		Identities: []extproc.Identity{{Name: "user", Header: headerUser}},
		Anonymous:  "reject",
		Buckets: []extproc.BucketRule{
			{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: userCap, Rate: tinyRate}},
			{Name: "global", Limit: buckets.Limit{Capacity: globalCap, Rate: tinyRate}},
		},
		Concurrency: []extproc.ConcurrencyRule{{Name: "inflight", Per: "user", Max: slots}},
		InjectUsage: true,
	}
}

// result is what one client saw.
type result struct {
	direct     bool // sent on the unmetered route
	rec        recording
	user       string
	status     int
	code       string // the JSON error's code, for refusals
	typ        string // the JSON error's type
	usage      int    // total usage the client received, -1 when none
	err        error  // anything a well-behaved gateway would not do
	start, end time.Time
}

func (r result) String() string {
	return fmt.Sprintf("%s user=%s direct=%v status=%d code=%q usage=%d err=%v", r.rec.Name, r.user, r.direct, r.status, r.code, r.usage, r.err)
}

// send makes one request through g as a client would: the OpenAI SDK for
// chat completions, plain HTTP for the other APIs. A refusal is not an
// error; it is reported in status and code.
func send(ctx context.Context, g *gateway, rec recording, user, mode string, direct bool) result {
	r := result{direct: direct, rec: rec, user: user, usage: -1, start: time.Now()}
	prefix := ""
	if direct {
		prefix = "/direct"
	}
	if !strings.HasSuffix(rec.Path, "/chat/completions") {
		hdr := map[string]string{headerReplay: rec.Name, headerUser: user}
		if mode != "" {
			hdr[headerMock] = mode
		}
		x := g.post(ctx, prefix+rec.Path, rec.Request, hdr)
		r.status, r.err = x.status, x.err
		switch {
		case r.err != nil:
		case r.status == 200:
			if !bytes.Equal(x.body, rec.Response) {
				r.err = fmt.Errorf("stream differs from the recording: got %d bytes, want %d", len(x.body), len(rec.Response))
			} else {
				r.usage = rec.Total
			}
		default:
			e, err := x.jsonError()
			r.code, r.typ, r.err = e.Error.Code, e.Error.Type, err
		}
		r.end = time.Now()
		return r
	}
	client := openai.NewClient(
		option.WithBaseURL(g.url+prefix+"/v1/"),
		option.WithAPIKey("sk-e2e"),
		option.WithMaxRetries(0),
		option.WithHTTPClient(g.client),
	)
	opts := []option.RequestOption{
		option.WithRequestBody("application/json", rec.Request),
		option.WithHeader(headerReplay, rec.Name),
		option.WithHeader(headerUser, user),
	}
	if mode != "" {
		opts = append(opts, option.WithHeader(headerMock, mode))
	}
	stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{}, opts...)
	defer stream.Close()
	finished := false
	for stream.Next() {
		c := stream.Current()
		if c.Usage.TotalTokens > 0 {
			r.usage = int(c.Usage.TotalTokens)
		}
		for _, ch := range c.Choices {
			finished = finished || ch.FinishReason != ""
		}
	}
	r.status = 200
	if err := stream.Err(); err != nil {
		var apiErr *openai.Error
		if errors.As(err, &apiErr) {
			r.status, r.code, r.typ = apiErr.StatusCode, apiErr.Code, apiErr.Type
			if r.code == "" {
				r.err = fmt.Errorf("status %d without a JSON error code: %w", r.status, err)
			}
		} else {
			r.err = err
		}
	} else if !finished {
		r.err = errors.New("stream ended without a finish_reason")
	}
	r.end = time.Now()
	return r
}

// loadPlan describes one run of concurrent clients.
type loadPlan struct {
	gateways []*gateway // requests go round-robin over them
	mix      []recording
	users    []string
	workers  int
	// requests bounds the run; with stop set the run also ends when stop
	// is closed.
	requests int
	stop     <-chan struct{}
	// direct interleaves as many requests on the unmetered route, to
	// measure what tokengate adds.
	direct bool
}

// run sends the plan's requests from plan.workers goroutines and returns
// every result, in no particular order.
func (p loadPlan) run(t testing.TB) []result {
	t.Helper()
	var (
		next    atomic.Int64
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
	)
	step := 1
	if p.direct {
		step = 2
	}
	for range p.workers {
		wg.Go(func() {
			for {
				if p.stop != nil {
					select {
					case <-p.stop:
						return
					default:
					}
				}
				i := int(next.Add(1) - 1)
				if i >= p.requests*step {
					return
				}
				n := i / step
				ctx, cancel := context.WithTimeout(context.Background(), waitFor)
				r := send(ctx, p.gateways[n%len(p.gateways)], p.mix[n%len(p.mix)], p.users[n%len(p.users)], "", p.direct && i%2 == 0)
				cancel()
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return results
}

// metered returns the results of requests on metered routes.
func metered(rs []result) []result {
	var out []result
	for _, r := range rs {
		if !r.direct {
			out = append(out, r)
		}
	}
	return out
}

// latency returns the p50 and p99 of the results' durations.
func latency(rs []result) (p50, p99 time.Duration) {
	if len(rs) == 0 {
		return 0, 0
	}
	ds := make([]time.Duration, len(rs))
	for i, r := range rs {
		ds[i] = r.end.Sub(r.start)
	}
	slices.Sort(ds)
	at := func(q float64) time.Duration { return ds[min(len(ds)-1, int(math.Ceil(q*float64(len(ds))))-1)] }
	return at(0.50), at(0.99)
}

// expectLevels returns, per user, the level its bucket must have after rs:
// capacity less the recorded usage of its admitted requests (S8), sorted.
func expectLevels(rs []result, users []string, capacity float64) (perUser []float64, total float64) {
	used := map[string]float64{}
	for _, u := range users {
		used[u] = 0
	}
	for _, r := range rs {
		if !r.direct && r.status == 200 {
			used[r.user] += float64(r.rec.Total)
			total += float64(r.rec.Total)
		}
	}
	for _, u := range used {
		perUser = append(perUser, capacity-u)
	}
	slices.Sort(perUser)
	return perUser, total
}

// levelsEqual compares levels to within a thousandth of a token: the tiny
// refill over a run stays far below that.
var levelsEqual = cmpopts.EquateApprox(0, 1e-3)

// checkSlotsFree holds slots requests per user open at once through g: all
// must be admitted, and one more must be refused for concurrency (S11). It
// proves that no slot of the run before is still taken.
func checkSlotsFree(t *testing.T, g *gateway, up *llm, rec recording, users []string, slots int) {
	t.Helper()
	if refused := holdSlots(t, g, up, rec, users, slots); refused > 0 {
		t.Errorf("%d of %d requests within the concurrency limit were refused: slots of the run before were never released (S11)",
			refused, len(users)*slots)
	}
}

// checkSlotsFreeWithin is checkSlotsFree for slots that may still be held by
// reservations whose settlement was lost: they must come free once their
// lease has run out (S11), and not stay taken.
func checkSlotsFreeWithin(t *testing.T, lease time.Duration, g *gateway, up *llm, rec recording, users []string, slots int) {
	t.Helper()
	deadline := time.Now().Add(lease + waitFor)
	for attempt := 1; ; attempt++ {
		refused := holdSlots(t, g, up, rec, users, slots)
		if refused == 0 {
			if attempt > 1 {
				t.Logf("slots of lost settlements came free after their lease, at attempt %d", attempt)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d requests within the concurrency limit still refused %v after the lease of %v (S11)",
				refused, len(users)*slots, waitFor, lease)
		}
	}
}

// holdSlots sends slots requests per user at once, which the upstream holds
// open, and returns how many of them were refused. When none was, it checks
// that one more per user is refused for concurrency (S11, S16). It then
// releases the held requests and waits for every outcome.
func holdSlots(t *testing.T, g *gateway, up *llm, rec recording, users []string, slots int) (refused int) {
	t.Helper()
	before := g.outcomes.len()
	held0 := up.held.Load()
	total := len(users) * slots
	var (
		wg       sync.WaitGroup
		nRefused atomic.Int64
	)
	results := make(chan result, total)
	for _, u := range users {
		for range slots {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), waitFor)
				defer cancel()
				r := send(ctx, g, rec, u, mockHold, false)
				if r.status == 429 && r.typ == "requests" {
					nRefused.Add(1)
				}
				results <- r
			})
		}
	}
	pollUntil(t, "every slot request held or refused", func() bool {
		return up.held.Load()-held0+nRefused.Load() >= int64(total)
	})
	extra := 0
	if nRefused.Load() == 0 {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		defer cancel()
		for _, u := range users {
			extra++
			r := send(ctx, g, rec, u, "", false)
			if r.status != 429 || r.code != "rate_limit_exceeded" || r.typ != "requests" {
				t.Errorf("user %s: request beyond %d slots got %v type %q, want 429 rate_limit_exceeded of type requests (S11, S16)", u, slots, r, r.typ)
			}
		}
	}
	up.releaseHeld()
	wg.Wait()
	close(results)
	for r := range results {
		if r.err != nil || (r.status != 200 && !(r.status == 429 && r.typ == "requests")) {
			t.Errorf("held request: %v, want 200 (or 429 of type requests)", r)
		}
	}
	g.outcomes.wait(t, before+total+extra)
	return int(nRefused.Load())
}

// pollUntil polls cond until it holds, failing the test after waitFor.
func pollUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", waitFor, what)
		}
		<-tick.C
	}
}

// redisGateway starts a Redis, a tokengate on it, wired with metrics as
// the tokengate command wires it, and the mock upstream.
func redisGateway(t testing.TB, pol extproc.Policy) (*gateway, *ledger, *llm, *prometheus.Registry) {
	t.Helper()
	srv := redistest.Start(t)
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 128})
	t.Cleanup(func() { rc.Close() })
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, metrics.Options{})
	led := newLedger(m.Instrument(redisstore.New(rc, redisstore.Options{})))
	up := newLLM()
	g := startGateway(t, gatewayConfig{store: led, policies: []extproc.Policy{pol}, upstream: startLLM(t, up), metrics: m})
	return g, led, up, reg
}

// TestLoad sends concurrent streams of recorded traffic through the
// stand-in to tokengate on Redis, interleaved with as many on a route
// without tokengate, and then checks the books: every reservation settled
// exactly once with the recorded usage (S8), bucket levels exactly where
// that usage puts them, every concurrency slot free again (S11), and no
// goroutine left. The default run is small; `-tags load` runs thousands.
func TestLoad(t *testing.T) {
	checkGoroutines(t)
	const userCap, globalCap = 1e7, 1e8
	users := []string{"alice", "bob", "carol", "dave"}
	g, led, up, reg := redisGateway(t, loadPolicy(userCap, globalCap, loadSlots))
	mix := loadRecordings(t)

	start := time.Now()
	rs := loadPlan{gateways: []*gateway{g}, mix: mix, users: users, workers: loadWorkers, requests: loadRequests, direct: true}.run(t)
	elapsed := time.Since(start)

	bad := 0
	for _, r := range rs {
		if r.err != nil || r.status != 200 || r.usage != r.rec.Total {
			if bad++; bad <= 5 {
				t.Errorf("%v: want 200 with the recorded usage %d", r, r.rec.Total)
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d of %d requests failed", bad, len(rs))
	}
	gated := metered(rs)
	if len(gated) != loadRequests {
		t.Fatalf("%d metered requests ran, want %d", len(gated), loadRequests)
	}

	// Every request reported exactly one outcome, settled with the
	// provider's usage.
	outs := g.outcomes.wait(t, loadRequests)
	if len(outs) != loadRequests {
		t.Errorf("%d outcomes reported for %d requests, want one each", len(outs), loadRequests)
	}
	var settled, want []int
	for _, o := range outs {
		if o.Decision != "admitted" || o.SettleOutcome != "complete" || !o.Usage {
			t.Errorf("outcome %+v, want admitted, complete, with provider usage", o)
		}
		settled = append(settled, o.Settled)
	}
	for _, r := range gated {
		want = append(want, r.rec.Total)
	}
	slices.Sort(settled)
	slices.Sort(want)
	if diff := cmp.Diff(want, settled); diff != "" {
		t.Errorf("settled amounts differ from the recorded usage (-want +got):\n%s", diff)
	}
	if n := led.checkSettled(t); n != loadRequests {
		t.Errorf("the store saw %d reservations, want %d", n, loadRequests)
	}

	// The buckets hold exactly what the recorded usage leaves.
	wantUser, total := expectLevels(rs, users, userCap)
	if diff := cmp.Diff(wantUser, led.levels(t, "user"), levelsEqual); diff != "" {
		t.Errorf("user bucket levels (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]float64{globalCap - total}, led.levels(t, "global"), levelsEqual); diff != "" {
		t.Errorf("global bucket level (-want +got):\n%s", diff)
	}

	// The metrics tell the same story (S24).
	gotMetrics := map[string]float64{}
	for _, name := range []string{"tokengate_requests_total", "tokengate_tokens_settled_total", "tokengate_stream_outcomes_total", "tokengate_store_errors_total"} {
		gotMetrics[name] = sumMetric(t, reg, name)
	}
	wantMetrics := map[string]float64{
		"tokengate_requests_total":        loadRequests,
		"tokengate_tokens_settled_total":  total,
		"tokengate_stream_outcomes_total": loadRequests,
		"tokengate_store_errors_total":    0,
	}
	if diff := cmp.Diff(wantMetrics, gotMetrics); diff != "" {
		t.Errorf("metrics after the run (-want +got):\n%s", diff)
	}

	checkSlotsFree(t, g, up, mix[0], users, loadSlots)

	_, gp99 := latency(gated)
	gp50, _ := latency(gated)
	direct := slices.DeleteFunc(slices.Clone(rs), func(r result) bool { return !r.direct })
	dp50, dp99 := latency(direct)
	t.Logf("load: %d requests (%d metered, %d direct) from %d workers in %v: %.0f requests/s",
		len(rs), len(gated), len(direct), loadWorkers, elapsed.Round(time.Millisecond), float64(len(rs))/elapsed.Seconds())
	t.Logf("latency p50 metered %v direct %v; p99 metered %v direct %v; added p99 %v (×%.2f)",
		gp50, dp50, gp99, dp99, gp99-dp99, float64(gp99)/float64(dp99))
}

// BenchmarkStream measures one streamed request of the load mix through the
// stand-in, metered by tokengate on Redis, against the same request on the
// route without tokengate. Compare the two ns/op: the difference is what
// tokengate adds per request (counting, one Redis script to reserve, live
// counting, one to settle).
func BenchmarkStream(b *testing.B) {
	checkGoroutines(b)
	users := []string{"alice", "bob", "carol", "dave"}
	g, _, _, _ := redisGateway(b, loadPolicy(1e12, 1e12, 1<<20))
	mix := loadRecordings(b)
	for _, route := range []string{"metered", "direct"} {
		b.Run(route, func(b *testing.B) {
			var next atomic.Int64
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					n := int(next.Add(1))
					ctx, cancel := context.WithTimeout(context.Background(), waitFor)
					r := send(ctx, g, mix[n%len(mix)], users[n%len(users)], "", route == "direct")
					cancel()
					if r.err != nil || r.status != 200 {
						b.Errorf("%v", r)
					}
				}
			})
		})
	}
}
