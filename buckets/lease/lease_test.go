package lease_test

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
	"github.com/tokengate/tokengate/buckets/lease"
)

// openMemory opens one Memory store that every gateway shares, as
// gateways share one Redis: it is each gateway's inner store and lender.
func openMemory(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
	stores := make([]buckets.Store, n)
	for i := range stores {
		stores[i] = m
	}
	return stores
}

func TestLeasedVectors(t *testing.T) { bucketstest.RunLeased(t, openMemory, bucketstest.LeasedSkip...) }

func TestLeaseFleet(t *testing.T) { bucketstest.RunLeaseFleet(t, openMemory) }

// TestInspectSlots: a lease store shows what its inner store holds, and
// slots, never leased, pass through.
func TestInspectSlots(t *testing.T) {
	bucketstest.RunInspectSlots(t, func(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
		m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
		stores := make([]buckets.Store, n)
		for i := range stores {
			stores[i] = lease.New(m, m, lease.Options{Now: clock.Now, SweepEvery: -1})
		}
		return stores
	})
}

// TestCharge: a lease store charges through its inner store.
func TestCharge(t *testing.T) {
	bucketstest.RunCharge(t, func(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
		m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
		return []buckets.Store{lease.New(m, m, lease.Options{Now: clock.Now, SweepEvery: -1})}
	})
}

// lender counts the lease calls made to a memory store, and fails them
// while fail is set (answering, as a dead Redis would, an error wrapping
// buckets.ErrStore with nothing done).
type lender struct {
	*buckets.Memory
	mu    sync.Mutex
	calls int
	ops   int
	fail  bool
	// delay is how long each call takes: a round trip, under synctest.
	delay time.Duration
}

var _ lease.Lender = (*lender)(nil)

func (l *lender) Lease(ctx context.Context, ops []buckets.LeaseOp) error {
	l.mu.Lock()
	l.calls++
	l.ops += len(ops)
	fail := l.fail
	l.mu.Unlock()
	if l.delay > 0 {
		time.Sleep(l.delay)
	}
	if fail {
		return fmt.Errorf("redis: connection refused: %w", buckets.ErrStore)
	}
	return l.Memory.Lease(ctx, ops)
}

func (l *lender) count() (calls, ops int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls, l.ops
}

func (l *lender) setFail(fail bool) {
	l.mu.Lock()
	l.fail = fail
	l.mu.Unlock()
}

func newGateway(clock *bucketstest.Clock, opts lease.Options) (*lease.Store, *lender) {
	l := &lender{Memory: buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})}
	opts.Now, opts.SweepEvery = clock.Now, -1
	return lease.New(l.Memory, l, opts), l
}

func leased(name string, capacity, rate float64, l *buckets.Lease) buckets.Bucket {
	return buckets.Bucket{Name: name, Key: name, Limit: buckets.Limit{Capacity: capacity, Rate: rate}, Lease: l}
}

// A lease sized from the rate covers about Horizon of this gateway's
// traffic: in steady state a hot bucket costs far fewer than 0.1 store
// calls per request, and the lease stays near rate × horizon.
func TestAutoSizeFollowsTheRate(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{Horizon: 100 * time.Millisecond})
	ctx := context.Background()
	b := leased("provider", 1e6, 1e4, &buckets.Lease{})
	const requests, cost = 2000, 10.0 // 10,000 tokens/s
	var warm int
	for i := range requests {
		if i == requests/2 {
			warm, _ = l.count()
		}
		d, err := g.Reserve(ctx, buckets.Request{Cost: cost, Buckets: []buckets.Bucket{b}})
		if err != nil || !d.OK {
			t.Fatalf("request %d: %+v, %v", i, d, err)
		}
		if _, err := g.Settle(ctx, d.Reservation, cost); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Millisecond)
	}
	calls, _ := l.count()
	steady := float64(calls-warm) / (requests / 2)
	// rate × horizon = 1,000 tokens = 100 requests per lease call.
	if steady > 0.02 || steady < 0.005 {
		t.Errorf("%.4f lease calls per request in steady state, want about 0.01 (one per 100 requests)", steady)
	}
	if calls > requests/10 {
		t.Errorf("%d lease calls for %d requests, warm-up included: want at most 0.1 per request", calls, requests)
	}
}

// A bucket whose capacity is small next to the traffic is metered per
// request: a lease sized from the rate never exceeds MaxShare of it, so
// it could not cover several requests, and none is taken.
func TestAutoSizeBoundedByCapacity(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{})
	ctx := context.Background()
	b := leased("user", 60, 1e-9, &buckets.Lease{}) // an eighth is 7.5 tokens
	for i := range 200 {
		d, err := g.Reserve(ctx, buckets.Request{Cost: 8, Buckets: []buckets.Bucket{b}})
		if err != nil || !d.OK {
			t.Fatalf("request %d: %+v, %v", i, d, err)
		}
		if _, err := g.Settle(ctx, d.Reservation, 0.25); err != nil {
			t.Fatal(err)
		}
		clock.Advance(10 * time.Millisecond)
	}
	if calls, _ := l.count(); calls != 0 {
		t.Errorf("%d lease calls for 200 requests of 8 tokens: want none (a lease may hold at most 7.5)", calls)
	}
	probe, err := l.Memory.Reserve(ctx, buckets.Request{Buckets: []buckets.Bucket{b}})
	if err != nil {
		t.Fatal(err)
	}
	if got := probe.Buckets[0].Remaining; math.Abs(got-10) > 1e-6 {
		t.Errorf("shared level %v, want 10 (60 less 200 × 0.25 used)", got)
	}
}

// Callers that find a lease short at once wait for one call and share its
// lease; when it finds the bucket empty, they are refused by that call
// too, without calls of their own. Each call takes a millisecond of the
// bubble's clock, so that callers meet it on its way.
func TestCallsAreCoalesced(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := &lender{Memory: buckets.NewMemory(buckets.MemoryOptions{}), delay: time.Millisecond}
		g := lease.New(l.Memory, l, lease.Options{SweepEvery: -1})
		ctx := context.Background()
		b := leased("b", 1000, 1e-9, &buckets.Lease{Size: 640})
		run := func() (admitted int) {
			var mu sync.Mutex
			var wg sync.WaitGroup
			for range 64 {
				wg.Go(func() {
					d, err := g.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
					if err != nil {
						t.Error(err)
						return
					}
					if d.OK {
						mu.Lock()
						admitted++
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			return admitted
		}
		if n := run(); n != 64 {
			t.Fatalf("admitted %d of 64, want all: the bucket holds 1000", n)
		}
		if calls, _ := l.count(); calls != 1 {
			t.Errorf("%d lease calls for 64 concurrent requests and a lease of 64 requests, want 1", calls)
		}
		// 360 tokens are left: 36 more requests fit, then the bucket is
		// empty; one call leases the 360, one finds the bucket empty.
		if n := run(); n != 36 {
			t.Errorf("admitted %d of the next 64, want 36", n)
		}
		if calls, _ := l.count(); calls != 3 {
			t.Errorf("%d lease calls in all, want 3: refusals share a call", calls)
		}
	})
}

// When lease calls fail, requests take from what the gateway still holds,
// then go to the inner store (whose failure mode decides); no call is made
// during the back-off; what a failed call gave back is taken as lost and
// what it owed as still owed.
func TestLeaseCallFailure(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{Backoff: time.Second})
	ctx := context.Background()
	b := leased("b", 1000, 1e-9, &buckets.Lease{Size: 100})
	reserve := func(cost float64) buckets.Decision {
		t.Helper()
		d, err := g.Reserve(ctx, buckets.Request{Cost: cost, Buckets: []buckets.Bucket{b}})
		if err != nil || !d.OK {
			t.Fatalf("Reserve(%v) = %+v, %v", cost, d, err)
		}
		return d
	}
	first := reserve(10) // takes a lease of 100: 90 held
	l.setFail(true)
	for range 9 {
		reserve(10) // from the lease
	}
	if calls, _ := l.count(); calls != 1 {
		t.Fatalf("%d calls, want 1: the lease held enough", calls)
	}
	// Owe 20 (usage beyond the reservation), then run out: the call fails,
	// the request goes to the inner store (the same memory here).
	if _, err := g.Settle(ctx, first.Reservation, 30); err != nil {
		t.Fatal(err)
	}
	d := reserve(10)
	if calls, _ := l.count(); calls != 2 {
		t.Fatalf("%d calls, want 2", calls)
	}
	reserve(10) // during the back-off: straight to the inner store
	if calls, _ := l.count(); calls != 2 {
		t.Errorf("%d calls during the back-off, want none beyond 2", calls)
	}
	clock.Advance(time.Second)
	l.setFail(false)
	if _, err := g.Settle(ctx, d.Reservation, 10); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(ctx); err != nil {
		t.Fatal(err)
	}
	// 1000 - 100 (the lease) - 20 (owed, kept through the failed call)
	// - 2 × 10 (reserved in the inner store) = 860.
	probe, err := l.Memory.Reserve(ctx, buckets.Request{Buckets: []buckets.Bucket{b}})
	if err != nil {
		t.Fatal(err)
	}
	if got := probe.Buckets[0].Remaining; math.Abs(got-860) > 1e-6 {
		t.Errorf("shared level %v, want 860", got)
	}
}

// Extend (S14) takes from the lease of a hard bucket, refuses when the
// bucket is out, and a reservation settled or unknown backs nothing.
func TestExtendHardLease(t *testing.T) {
	clock := bucketstest.NewClock()
	g, _ := newGateway(clock, lease.Options{})
	ctx := context.Background()
	hard := leased("hard", 100, 1e-9, &buckets.Lease{Size: 30})
	hard.Hard = true
	d, err := g.Reserve(ctx, buckets.Request{Cost: 20, Buckets: []buckets.Bucket{hard}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	r := d.Reservation
	for i, want := range []bool{true, true, false} {
		ok, err := g.Extend(ctx, r, 35)
		if err != nil || ok != want {
			t.Fatalf("Extend %d = %v, %v; want %v (100 - 20 - 35 - 35 leaves 10)", i, ok, err, want)
		}
	}
	if r.Extended != 70 {
		t.Errorf("Extended = %v, want 70", r.Extended)
	}
	states, err := g.Settle(ctx, r, 95)
	if err != nil {
		t.Fatal(err)
	}
	if got := states[0].Remaining; got != 5 {
		t.Errorf("after settling 95 of 90 charged: %v left, want 5", got)
	}
	if ok, err := g.Extend(ctx, r, 1); ok || err != nil {
		t.Errorf("Extend after Settle = %v, %v; want false, nil", ok, err)
	}
}

// A lease sized from the rate never holds more than the bucket's own
// refill over the horizon, however fast this gateway admits: a bucket at
// its limit loses at most that much to one gateway's lease.
func TestAutoSizeBoundedByTheBucketRate(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{Horizon: 250 * time.Millisecond})
	ctx := context.Background()
	b := leased("provider", 1e9, 1000, &buckets.Lease{}) // 250 tokens per horizon
	const requests = 2000
	for i := range requests {
		d, err := g.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
		if err != nil || !d.OK {
			t.Fatalf("request %d: %+v, %v", i, d, err)
		}
		if _, err := g.Settle(ctx, d.Reservation, 10); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Millisecond) // 10,000 tokens/s here
	}
	calls, _ := l.count()
	if calls < requests/25 || calls > requests/20 {
		t.Errorf("%d lease calls for %d requests of 10 tokens, want about %d: leases of 250 tokens", calls, requests, requests/25)
	}
}

// A bucket with lease: auto that this gateway sees too rarely for a lease
// to cover several requests — a per-identity bucket among many, each
// identity asking about once a second — is metered in the inner store,
// request by request, as without a lease: no lease call is made (each
// would cover its own request only, and be returned at its TTL), and the
// counts are exact.
func TestAutoLeaseMetersRarelySeenBucketsDirectly(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{})
	ctx := context.Background()
	const users, requests, cost, used = 1000, 5000, 60.0, 17.0
	bucket := func(u int) buckets.Bucket {
		return leased(fmt.Sprintf("user%d", u), 1e6, 1e-9, &buckets.Lease{})
	}
	for i := range requests {
		d, err := g.Reserve(ctx, buckets.Request{Cost: cost, Buckets: []buckets.Bucket{bucket(i % users)}})
		if err != nil || !d.OK {
			t.Fatalf("request %d: %+v, %v", i, d, err)
		}
		if _, err := g.Settle(ctx, d.Reservation, used); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Millisecond) // 1,000 requests a second, one per user
	}
	if calls, _ := l.count(); calls != 0 {
		t.Errorf("%d lease calls for %d requests spread over %d buckets, want none", calls, requests, users)
	}
	for _, u := range []int{0, 1, users - 1} {
		probe, err := l.Memory.Reserve(ctx, buckets.Request{Buckets: []buckets.Bucket{bucket(u)}})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := probe.Buckets[0].Remaining, 1e6-requests/users*used; math.Abs(got-want) > 1e-6 {
			t.Errorf("user %d: shared level %v, want %v", u, got, want)
		}
	}
}

// A bucket with lease: auto is leased once this gateway's rate on it makes
// a lease cover several requests, and stays metered in the inner store
// before: a bucket first seen once a second, then a thousand times a
// second.
func TestAutoLeaseStartsOnceTheBucketIsHot(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{})
	ctx := context.Background()
	b := leased("team", 1e6, 1e4, &buckets.Lease{})
	run := func(n int, every time.Duration) {
		for i := range n {
			d, err := g.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
			if err != nil || !d.OK {
				t.Fatalf("request %d: %+v, %v", i, d, err)
			}
			if _, err := g.Settle(ctx, d.Reservation, 10); err != nil {
				t.Fatal(err)
			}
			clock.Advance(every)
		}
	}
	run(20, time.Second)
	if calls, _ := l.count(); calls != 0 {
		t.Fatalf("%d lease calls while the bucket was seen once a second, want none", calls)
	}
	run(2000, time.Millisecond)
	// 10,000 tokens a second, leases of 250 ms of it: 250 requests each.
	if calls, _ := l.count(); calls == 0 || calls > 2000/100 {
		t.Errorf("%d lease calls for 2,000 requests at 10,000 tokens a second, want a few (leases of about 250 requests)", calls)
	}
}

// TestChargeOnALeasedBucketStaysLocal: the rate-limit service's hits on a
// bucket this gateway leases are taken from its lease, as a reservation
// settled at once would be: one lease call per lease, not a store call
// per charge, and every hit reaches the shared bucket exactly once the
// lease is returned. A charge the lease cannot cover goes to the shared
// bucket, below zero down to the floor.
func TestChargeOnALeasedBucketStaysLocal(t *testing.T) {
	clock := bucketstest.NewClock()
	g, l := newGateway(clock, lease.Options{})
	ctx := context.Background()
	b := leased("shared", 100_000, 1e-9, &buckets.Lease{Size: 5_000})
	b.MaxDebt = 1_000
	const charges, hits = 200, 10.0
	for i := range charges {
		st, err := g.Charge(ctx, &buckets.Reservation{ID: "c" + strconv.Itoa(i), Buckets: []buckets.Bucket{b}}, hits)
		if err != nil {
			t.Fatalf("charge %d: %v", i, err)
		}
		if len(st) != 1 || st[0].Remaining-st[0].Forgiven < 0 {
			t.Fatalf("charge %d: %+v, want the hits covered", i, st)
		}
	}
	// 2,000 hits in leases of 5,000: one lease call.
	if calls, _ := l.count(); calls != 1 {
		t.Errorf("%d lease calls for %d charges on a leased bucket, want 1", calls, charges)
	}
	if err := g.Close(ctx); err != nil {
		t.Fatal(err)
	}
	bs, _, err := l.Memory.Inspect(ctx, []buckets.Bucket{b}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := bs[0].Remaining, 100_000-charges*hits; math.Abs(got-want) > 0.01 {
		t.Errorf("the shared bucket holds %v after the lease came back, want %v", got, want)
	}

	// A charge larger than any lease goes to the shared bucket, into debt.
	small := leased("small", 100, 1e-9, &buckets.Lease{Size: 50})
	small.MaxDebt = 100
	g3, l3 := newGateway(clock, lease.Options{})
	st, err := g3.Charge(ctx, &buckets.Reservation{ID: "big", Buckets: []buckets.Bucket{small}}, 150)
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != 1 || math.Abs(st[0].Remaining-st[0].Forgiven-(-50)) > 0.01 {
		t.Errorf("a charge of 150 on a bucket of 100: %+v, want the level 50 below zero", st)
	}
	bs, _, err = l3.Memory.Inspect(ctx, []buckets.Bucket{small}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(bs[0].Remaining-(-50)) > 0.01 {
		t.Errorf("the shared bucket holds %v, want -50", bs[0].Remaining)
	}
}
