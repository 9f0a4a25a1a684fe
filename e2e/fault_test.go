package e2e

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/metrics"
	"github.com/tokengate/tokengate/tokenizer"
)

// TestRedisOutage kills redis-server in the middle of a load and restarts
// it (S21), wired as the tokengate command wires it: the Redis store,
// instrumented, behind the failover store.
//
// Failing closed, clients get 503 JSON errors with Retry-After during the
// outage and nothing else breaks. Failing open, they are admitted against
// the local fallback limit, which holds. After recovery the limits hold
// again, every reservation was settled exactly once (S8), and a clean run
// moves the bucket levels by exactly its recorded usage: nothing is charged
// twice.
//
// On Redis Cluster the master holding the global bucket, which every chain
// uses, is the one killed (failing open on a cluster only in the load run).
func TestRedisOutage(t *testing.T) {
	for _, cluster := range []bool{false, true} {
		for _, mode := range []failover.Mode{failover.Closed, failover.Open} {
			if cluster && mode == failover.Open && !heavy {
				continue
			}
			name := map[failover.Mode]string{failover.Closed: "fail closed", failover.Open: "fail open"}[mode]
			if cluster {
				name = "cluster " + name
			}
			t.Run(name, func(t *testing.T) { outage(t, mode, cluster) })
		}
	}
}

// fallbackCap is the local limit of every bucket while failing open.
const fallbackCap = 1e6

// clusterLease is the concurrency slots' lease in the cluster outage, short
// enough to wait out slots whose settlement was lost (S11).
const clusterLease = 2 * time.Second

func outage(t *testing.T, mode failover.Mode, cluster bool) {
	checkGoroutines(t)
	const userCap, globalCap = 1e7, 1e8
	const slots = loadSlots
	users := []string{"alice", "bob", "carol", "dave"}
	mix := loadRecordings(t)

	var (
		rc      fleetClient
		led     *ledger
		victim  *redistest.Server
		servers []*redistest.Server
	)
	if cluster {
		c := redistest.StartCluster(t)
		rc = redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, PoolSize: 64})
		servers = c.Servers
	} else {
		srv := redistest.Start(t)
		rc = redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 64})
		servers = []*redistest.Server{srv}
	}
	t.Cleanup(func() { rc.Close() })
	kill := func() {
		victim = owner(t, servers, led.named("global"))
		victim.Kill()
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, metrics.Options{})
	var fallbacks atomic.Int64
	fo := failover.New(m.Instrument(redisstore.New(rc, redisstore.Options{})), failover.Options{
		Mode:     mode,
		Fallback: buckets.Limit{Capacity: fallbackCap, Rate: tinyRate},
		Backoff:  50 * time.Millisecond,
		OnFallback: func(op string) {
			fallbacks.Add(1)
			m.Fallback(op)
		},
	})
	led = newLedger(fo)
	up := newLLM()
	pol := loadPolicy(userCap, globalCap, slots)
	if cluster {
		pol.Concurrency[0].Lease = clusterLease
	}
	g := startGateway(t, gatewayConfig{store: led, policies: []extproc.Policy{pol}, upstream: startLLM(t, up)})

	// The load runs until stopped, bounded in count.
	stop := make(chan struct{})
	done := make(chan []result)
	go func() {
		done <- loadPlan{gateways: []*gateway{g}, mix: mix, users: users, workers: loadWorkers, requests: 50 * loadRequests, stop: stop}.run(t)
	}()
	stopped := false
	stopLoad := func() []result {
		if stopped {
			return nil
		}
		stopped = true
		close(stop)
		return <-done
	}
	t.Cleanup(func() { stopLoad() })

	admitted := func() int {
		n := 0
		for _, o := range g.outcomes.since(0) {
			if o.Decision == "admitted" {
				n++
			}
		}
		return n
	}
	pollUntil(t, "requests admitted before the outage", func() bool { return admitted() >= 20 })
	kill()
	killedAt := g.outcomes.len()
	switch mode {
	case failover.Closed:
		pollUntil(t, "503s during the outage", func() bool {
			for _, o := range g.outcomes.since(killedAt) {
				if o.Decision == "store_error" {
					return true
				}
			}
			return false
		})
	case failover.Open:
		pollUntil(t, "admissions against the fallback limit", func() bool { return fallbacks.Load() >= 20 })
	}
	outageResults := stopLoad()
	if fo.Healthy() {
		t.Fatal("the failover store reports a healthy primary while Redis is down")
	}
	probeOutage(t, g, up, mode, users)

	victim.Restart()
	// The first call after the back-off probes Redis again.
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	recovered := 0
	pollUntil(t, "recovery", func() bool {
		r := send(ctx, g, mix[0], users[0], "", false)
		recovered++
		return r.status == 200 && fo.Healthy()
	})

	// Every client got an answer it can act on.
	counts := map[string]int{}
	for _, r := range outageResults {
		key := fmt.Sprint(r.status, " ", r.code)
		counts[key]++
		switch {
		case r.err != nil:
			t.Errorf("%v", r)
		case r.status == 200 && r.usage != r.rec.Total:
			t.Errorf("%v: want the recorded usage %d", r, r.rec.Total)
		case r.status == 503 && mode == failover.Closed && r.code == "rate_limiter_unavailable":
		case r.status != 200:
			t.Errorf("%v: want 200%s", r, map[failover.Mode]string{failover.Closed: " or 503 rate_limiter_unavailable"}[mode])
		}
	}
	t.Logf("outage run: %d requests, by status: %v", len(outageResults), counts)
	if mode == failover.Closed && counts["503 rate_limiter_unavailable"] == 0 {
		t.Error("no client saw a 503 while failing closed")
	}
	if got := sumMetric(t, reg, "tokengate_store_errors_total"); got == 0 {
		t.Error("tokengate_store_errors_total stayed 0 through the outage (S21: visible in metrics)")
	}
	if mode == failover.Open {
		if got := sumMetric(t, reg, "tokengate_store_fallback_total"); got == 0 {
			t.Error("tokengate_store_fallback_total stayed 0 while failing open")
		}
	}

	// Every request finished and each reservation settled exactly once,
	// including those settled during the outage.
	g.outcomes.wait(t, len(outageResults)+outageProbes(mode, users)+recovered)
	led.checkSettled(t)

	// After recovery, a clean run moves each bucket by exactly its usage,
	// once the settlements missed during the outage are replayed (they
	// would move the levels during the clean run).
	pollUntil(t, "missed settlements replayed", func() bool { return fo.Pending() == 0 })
	led.reset()
	before := userLevels(t, led)
	clean := loadPlan{gateways: []*gateway{g}, mix: mix, users: users, workers: loadWorkers, requests: loadRequests}.run(t)
	for _, r := range clean {
		if r.err != nil || r.status != 200 || r.usage != r.rec.Total {
			t.Fatalf("after recovery: %v, want 200 with the recorded usage", r)
		}
	}
	g.outcomes.wait(t, len(outageResults)+outageProbes(mode, users)+recovered+len(clean))
	if n := led.checkSettled(t); n != len(clean) {
		t.Errorf("after recovery the store saw %d reservations, want %d", n, len(clean))
	}
	after := userLevels(t, led)
	var gotUsed []float64
	for k, b := range before {
		gotUsed = append(gotUsed, b-after[k])
	}
	slices.Sort(gotUsed)
	wantLevels, _ := expectLevels(clean, users, 0)
	var wantUsed []float64
	for _, l := range wantLevels {
		wantUsed = append(wantUsed, -l)
	}
	for len(wantUsed) < len(gotUsed) {
		wantUsed = append(wantUsed, 0) // buckets the clean run did not use
	}
	slices.Sort(wantUsed)
	if diff := cmp.Diff(wantUsed, gotUsed, levelsEqual); diff != "" {
		t.Errorf("tokens charged per user by the clean run after recovery (-want +got):\n%s", diff)
	}
	// And the concurrency limit holds again, with every slot free. On a
	// cluster the settlements missed in the outage are replayed only once
	// the failover store has seen the store answer again, so the check
	// allows up to the slots' lease, the bound that holds whatever happens.
	if cluster {
		checkSlotsFreeWithin(t, clusterLease, g, up, mix[0], users, slots)
	} else {
		checkSlotsFree(t, g, up, mix[0], users, slots)
	}
}

// outageProbes is how many requests probeOutage sends.
func outageProbes(mode failover.Mode, users []string) int {
	if mode == failover.Closed {
		return 1
	}
	return fallbackFits + 1
}

// fallbackFits is how many probe requests fit the local fallback bucket of
// a fresh user at once.
const fallbackFits = 3

// probeOutage checks what a client gets while Redis is down: failing
// closed, a 503 JSON error with Retry-After (S21); failing open, admission
// against the local fallback limit, which refuses what does not fit.
func probeOutage(t *testing.T, g *gateway, up *llm, mode failover.Mode, users []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	rec := loadRecording(t, "openai/chat-stream-gpt-4o-mini")
	if mode == failover.Closed {
		x := g.replay(ctx, rec, users[0], "")
		e, err := x.jsonError()
		if x.status != 503 || err != nil || e.Error.Code != "rate_limiter_unavailable" || x.header.Get("retry-after") == "" {
			t.Errorf("during the outage: status %d, Retry-After %q, body %q (%v); want 503 rate_limiter_unavailable with Retry-After",
				x.status, x.header.Get("retry-after"), trim(x.body), err)
		}
		return
	}
	// A fresh user's fallback bucket holds fallbackFits requests of this
	// cost at once, not one more; they are held open so nothing is refunded.
	body := fmt.Appendf(nil, `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}],"max_tokens":%d}`, 1)
	c, err := newCounter(t).Count(tokenizer.Request{Path: rec.Path, Body: body})
	if err != nil {
		t.Fatal(err)
	}
	maxTokens := int(math.Floor(fallbackCap/(fallbackFits+0.5))) - c.InputTokens
	body = fmt.Appendf(nil, `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}],"max_tokens":%d}`, maxTokens)
	probe := rec
	probe.Request = body
	results := make(chan exchange, fallbackFits)
	held := up.held.Load()
	for range fallbackFits {
		go func() { results <- g.replay(ctx, probe, "fallback-user", mockHold) }()
	}
	pollUntil(t, "probes admitted against the fallback limit", func() bool { return up.held.Load() >= held+fallbackFits })
	x := g.replay(ctx, probe, "fallback-user", "")
	if e, err := x.jsonError(); x.status != 429 || err != nil || e.Error.Type != "tokens" {
		t.Errorf("probe beyond the fallback limit: status %d body %q (%v); want 429 of type tokens", x.status, trim(x.body), err)
	}
	up.releaseHeld()
	for range fallbackFits {
		if x := <-results; x.status != 200 || x.err != nil {
			t.Errorf("probe within the fallback limit: status %d err %v; want 200", x.status, x.err)
		}
	}
}

// owner returns the server that holds the bucket bs[0], by the key layout
// the redisstore package documents: only its owner answers a GET of it
// (the other masters of a cluster answer MOVED).
func owner(t *testing.T, servers []*redistest.Server, bs []buckets.Bucket) *redistest.Server {
	t.Helper()
	if len(bs) == 0 {
		t.Fatal("no reservation used the bucket")
	}
	if len(servers) == 1 {
		return servers[0]
	}
	for _, s := range servers {
		if _, err := redistest.Do(s.Addr, "GET", "tg:b:{"+bs[0].Key+"}"); err == nil {
			return s
		}
	}
	t.Fatalf("no master holds bucket %s", bs[0].Key)
	return nil
}

// userLevels reads the level of every user bucket, by store key.
func userLevels(t *testing.T, led *ledger) map[string]float64 {
	out := map[string]float64{}
	for _, b := range led.named("user") {
		out[b.Key] = led.level(t, b)
	}
	return out
}

// sumMetric adds up every series of the named metric family.
func sumMetric(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// TestStoreBlip cuts the gateway off from Redis for a moment without losing
// Redis's data, as a network blip would, while a user's every concurrency
// slot is held; the held streams end during the blip, so their settlements
// cannot reach Redis. After the blip the missed settlements are replayed:
// the bucket is charged exactly what was used (S8: once, no double charge)
// and the user gets its slots back (S11).
func TestStoreBlip(t *testing.T) {
	checkGoroutines(t)
	const lease = time.Second
	const slots = 3
	const capacity = 1e6
	srv := redistest.Start(t)
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rc.Close() })
	link := &crashable{Store: redisstore.New(rc, redisstore.Options{})}
	fo := failover.New(link, failover.Options{Mode: failover.Closed, Backoff: 20 * time.Millisecond})
	led := newLedger(fo)
	pol := extproc.Policy{
		Name:        "blip",
		Identities:  []extproc.Identity{{Name: "user", Header: headerUser}},
		Buckets:     []extproc.BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: capacity, Rate: tinyRate}}},
		Concurrency: []extproc.ConcurrencyRule{{Name: "inflight", Per: "user", Max: slots, Lease: lease}},
	}
	up := newLLM()
	g := startGateway(t, gatewayConfig{store: led, policies: []extproc.Policy{pol}, upstream: startLLM(t, up)})
	rec := loadRecording(t, "openai/chat-stream-gpt-4o-mini")

	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var wg sync.WaitGroup
	for range slots {
		wg.Go(func() {
			if r := send(ctx, g, rec, "blipped", mockHold, false); r.status != 200 || r.err != nil {
				t.Errorf("held request: %v, want 200", r)
			}
		})
	}
	pollUntil(t, "every slot held", func() bool { return up.held.Load() == slots })
	link.down.Store(true)
	up.releaseHeld()
	wg.Wait()
	outs := g.outcomes.wait(t, slots)
	link.down.Store(false)
	probe := buckets.Request{Buckets: []buckets.Bucket{{Name: "probe", Key: "e2e-probe", Limit: buckets.Limit{Capacity: 1, Rate: 1}}}}
	pollUntil(t, "the store back", func() bool {
		fo.Reserve(ctx, probe) // the first call after the back-off reaches Redis
		return fo.Healthy()
	})
	healed := time.Now()

	var reserved, settled float64
	for _, o := range outs {
		reserved += float64(o.Reserved)
		settled += float64(o.Settled)
	}
	bs := led.named("user")
	if len(bs) != 1 {
		t.Fatalf("%d user buckets, want the one of the blipped user", len(bs))
	}
	// The settlements the store missed are replayed once it answers again.
	pollUntil(t, "missed settlements replayed", func() bool { return fo.Pending() == 0 })
	for _, b := range bs {
		var level float64
		pollUntil(t, "the bucket charged exactly what was used", func() bool {
			level = led.level(t, b)
			return level > capacity-settled-1e-3 && level < capacity-settled+1e-3
		})
		t.Logf("bucket after the blip: %v of %v (reserved %v, used %v)", level, capacity, reserved, settled)
	}
	checkSlotsFreeWithin(t, lease, g, up, rec, []string{"blipped"}, slots)
	t.Logf("slots free again %v after the store came back (lease %v)", time.Since(healed).Round(time.Millisecond), lease)
}
