package e2e

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/tokenizer"
)

// fleetClient is what a gateway of the fleet needs from its Redis client.
type fleetClient interface {
	redisstore.Scripter
	Close() error
}

// TestFleetSharesOneBucket runs two gateways, each with its own Redis
// client behind its own stand-in, against one bucket with room for exactly
// K requests and no refill to speak of. Both are hammered at once; admitted
// requests are held open so nothing is refunded while the others are
// decided. Exactly K must be admitted in total (S20: one atomic script per
// operation, one clock), on one Redis and on a three-master Redis Cluster.
func TestFleetSharesOneBucket(t *testing.T) {
	t.Run("redis", func(t *testing.T) {
		checkGoroutines(t)
		srv := redistest.Start(t)
		fleet(t, func() fleetClient { return redis.NewClient(&redis.Options{Addr: srv.Addr}) })
	})
	t.Run("cluster", func(t *testing.T) {
		checkGoroutines(t)
		c := redistest.StartCluster(t)
		fleet(t, func() fleetClient { return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs}) })
	})
}

func fleet(t *testing.T, newClient func() fleetClient) {
	const k = 7        // requests the shared bucket has room for
	const n = 6 * k    // requests sent at once
	const gateways = 2 // tokengate instances sharing the Redis
	rec := loadRecording(t, "openai/chat-stream-include-usage-length")
	count, err := newCounter(t).Count(tokenizer.Request{Path: rec.Path, Body: rec.Request})
	if err != nil {
		t.Fatal(err)
	}
	cost := float64(count.Reservation())
	capacity := k*cost + cost/2
	pol := extproc.Policy{
		Name:       "fleet",
		Identities: []extproc.Identity{{Name: "user", Header: headerUser}},
		// A chain over two hash slots: on a cluster the store takes from
		// each group atomically and compensates a refusal (S20).
		Buckets: []extproc.BucketRule{
			{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: 1e9, Rate: tinyRate}},
			{Name: "shared", Limit: buckets.Limit{Capacity: capacity, Rate: tinyRate}},
		},
	}
	up := newLLM()
	base := startLLM(t, up)
	var gs []*gateway
	var leds []*ledger
	for range gateways {
		rc := newClient()
		t.Cleanup(func() { rc.Close() })
		led := newLedger(redisstore.New(rc, redisstore.Options{}))
		leds = append(leds, led)
		gs = append(gs, startGateway(t, gatewayConfig{store: led, policies: []extproc.Policy{pol}, upstream: base}))
	}

	var refused atomic.Int64
	var wg sync.WaitGroup
	results := make(chan result, n)
	start := make(chan struct{})
	users := []string{"u1", "u2", "u3", "u4", "u5"}
	for i := range n {
		wg.Go(func() {
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), waitFor)
			defer cancel()
			r := send(ctx, gs[i%gateways], rec, users[i%len(users)], mockHold, false)
			if r.status == 429 {
				refused.Add(1)
			}
			results <- r
		})
	}
	close(start)
	pollUntil(t, "every request decided", func() bool { return up.held.Load()+refused.Load() >= n })
	if got := up.held.Load(); got != k {
		t.Errorf("%d requests admitted across %d gateways, want exactly %d (S20)", got, gateways, k)
	}
	up.releaseHeld()
	wg.Wait()
	close(results)
	for r := range results {
		switch {
		case r.err != nil:
			t.Errorf("%v", r)
		case r.status == 429 && (r.code != "rate_limit_exceeded" || r.typ != "tokens"):
			t.Errorf("refusal %v type %q, want rate_limit_exceeded of type tokens (S16)", r, r.typ)
		case r.status != 200 && r.status != 429:
			t.Errorf("%v, want 200 or 429", r)
		}
	}
	total := func() int {
		sum := 0
		for _, g := range gs {
			sum += g.outcomes.len()
		}
		return sum
	}
	pollUntil(t, "every request's outcome", func() bool { return total() >= n })
	settled := 0
	for _, g := range gs {
		for _, o := range g.outcomes.since(0) {
			settled += o.Settled
		}
	}
	reservations := 0
	for _, led := range leds {
		reservations += led.checkSettled(t)
	}
	if reservations != k {
		t.Errorf("the stores saw %d reservations, want %d", reservations, k)
	}
	if settled != k*rec.Total {
		t.Errorf("settled %d tokens in all, want %d × %d recorded", settled, k, rec.Total)
	}
	// Every gateway reads the same level: the one the recorded usage leaves.
	var shared []buckets.Bucket
	for _, led := range leds {
		shared = append(shared, led.named("shared")...)
	}
	if len(shared) == 0 {
		t.Fatal("no reservation used the shared bucket")
	}
	want := capacity - float64(k*rec.Total)
	for i, led := range leds {
		if diff := cmp.Diff(want, led.level(t, shared[0]), levelsEqual); diff != "" {
			t.Errorf("gateway %d: shared bucket level (-want +got):\n%s", i, diff)
		}
	}
}

// crashable is a store that can be made unreachable for good, so that a
// gateway using it behaves as one that died: nothing it holds is ever
// settled.
type crashable struct {
	buckets.Store
	down atomic.Bool
}

var _ buckets.Store = (*crashable)(nil)

var errCrashed = fmt.Errorf("%w: the gateway has crashed", buckets.ErrStore)

func (c *crashable) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if c.down.Load() {
		return buckets.Decision{}, errCrashed
	}
	return c.Store.Reserve(ctx, req)
}

func (c *crashable) Settle(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	if c.down.Load() {
		return nil, errCrashed
	}
	return c.Store.Settle(ctx, r, actual)
}

func (c *crashable) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if c.down.Load() {
		return false, errCrashed
	}
	return c.Store.Extend(ctx, r, n)
}

// TestCrashedGatewayLeasesExpire: a gateway dies while it holds a user's
// every concurrency slot. Another gateway of the fleet refuses that user for
// concurrency (429, type requests) until the slots' leases run out, and
// admits again after: slots are leases, and a dead gateway does not leak
// them forever (S11).
func TestCrashedGatewayLeasesExpire(t *testing.T) {
	checkGoroutines(t)
	const lease = 700 * time.Millisecond
	const slots = 2
	srv := redistest.Start(t)
	pol := extproc.Policy{
		Name:        "lease",
		Identities:  []extproc.Identity{{Name: "user", Header: headerUser}},
		Buckets:     []extproc.BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: 1e9, Rate: tinyRate}}},
		Concurrency: []extproc.ConcurrencyRule{{Name: "inflight", Per: "user", Max: slots, Lease: lease}},
	}
	up := newLLM()
	base := startLLM(t, up)
	newStore := func() buckets.Store {
		rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { rc.Close() })
		return redisstore.New(rc, redisstore.Options{})
	}
	dying := &crashable{Store: newStore()}
	a := startGateway(t, gatewayConfig{store: dying, policies: []extproc.Policy{pol}, upstream: base})
	b := startGateway(t, gatewayConfig{store: newStore(), policies: []extproc.Policy{pol}, upstream: base})
	rec := loadRecording(t, "openai/chat-stream-gpt-4o-mini")

	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	taken := time.Now()
	var wg sync.WaitGroup
	for range slots {
		wg.Go(func() { send(ctx, a, rec, "victim", mockHold, false) })
	}
	pollUntil(t, "the dying gateway holding every slot", func() bool { return up.held.Load() == slots })
	dying.down.Store(true)

	r := send(ctx, b, rec, "victim", "", false)
	if r.status != 429 || r.typ != "requests" {
		t.Fatalf("while the dead gateway's slots are leased: %v type %q, want 429 of type requests", r, r.typ)
	}
	var admitted time.Time
	pollUntil(t, "the leases to expire", func() bool {
		r := send(ctx, b, rec, "victim", "", false)
		switch {
		case r.status == 200 && r.err == nil:
			admitted = time.Now()
			return true
		case r.status != 429 || r.typ != "requests":
			t.Fatalf("waiting for the leases: %v type %q, want 429 of type requests or 200", r, r.typ)
		}
		return false
	})
	// The Redis clock and ours may differ by a hair; a lease that ended
	// much too early would show here.
	if early := taken.Add(lease - 50*time.Millisecond); admitted.Before(early) {
		t.Errorf("admitted %v after the slots were taken, before their lease of %v ran out", admitted.Sub(taken), lease)
	}
	up.releaseHeld()
	wg.Wait()
}
