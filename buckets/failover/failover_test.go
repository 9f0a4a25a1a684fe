package failover

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// flaky is a primary store that can be switched off; while on, it is a real
// memory store.
type flaky struct {
	*buckets.Memory
	down  bool
	calls int
}

var _ buckets.Store = (*flaky)(nil)

func (f *flaky) err() error {
	f.calls++
	if f.down {
		return fmt.Errorf("%w: connection refused", buckets.ErrStore)
	}
	return nil
}

func (f *flaky) Reserve(ctx context.Context, r buckets.Request) (buckets.Decision, error) {
	if err := f.err(); err != nil {
		return buckets.Decision{}, err
	}
	return f.Memory.Reserve(ctx, r)
}

func (f *flaky) Settle(ctx context.Context, r *buckets.Reservation, n float64) ([]buckets.BucketState, error) {
	if err := f.err(); err != nil {
		return nil, err
	}
	return f.Memory.Settle(ctx, r, n)
}

func (f *flaky) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if err := f.err(); err != nil {
		return false, err
	}
	return f.Memory.Extend(ctx, r, n)
}

// SettleAsync settles at once, failing while down, as Settle does.
func (f *flaky) SettleAsync(r *buckets.Reservation, n float64, done func([]buckets.BucketState, error)) {
	st, err := f.Settle(context.Background(), r, n)
	done(st, err)
}

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func setup(mode Mode) (*flaky, *Store, *clock) {
	c := &clock{t: time.Unix(1000, 0)}
	p := &flaky{Memory: buckets.NewMemory(buckets.MemoryOptions{Now: c.now})}
	s := New(p, Options{Mode: mode, Fallback: buckets.Limit{Capacity: 10, Rate: 1}, Backoff: time.Second, Now: c.now})
	return p, s, c
}

func req(id string, cost float64) buckets.Request {
	return buckets.Request{ID: id, Cost: cost, Buckets: []buckets.Bucket{{Name: "user", Key: "u1", Limit: buckets.Limit{Capacity: 100, Rate: 1}}}}
}

// S21: failing closed, an outage is an error (503 at the edge), never an
// admission; the primary is not called again during the back-off.
func TestClosedRefusesDuringOutage(t *testing.T) {
	p, s, c := setup(Closed)
	ctx := context.Background()
	p.down = true
	for i := range 3 {
		if _, err := s.Reserve(ctx, req(fmt.Sprint(i), 1)); !errors.Is(err, buckets.ErrStore) {
			t.Fatalf("Reserve during outage = %v, want ErrStore", err)
		}
	}
	if p.calls != 1 {
		t.Errorf("primary called %d times within the back-off, want 1", p.calls)
	}
	if s.Healthy() {
		t.Error("Healthy() = true during outage")
	}
	p.down = false
	c.t = c.t.Add(time.Second)
	d, err := s.Reserve(ctx, req("after", 1))
	if err != nil || !d.OK {
		t.Fatalf("after recovery: %+v, %v", d, err)
	}
	if !s.Healthy() {
		t.Error("Healthy() = false after recovery")
	}
}

// S21: failing open admits against the local fallback limit, which still
// bounds the outage, and settles those reservations locally.
func TestOpenAdmitsAgainstFallback(t *testing.T) {
	p, s, _ := setup(Open)
	ctx := context.Background()
	p.down = true
	var admitted float64
	var res []*buckets.Reservation
	for i := range 20 {
		d, err := s.Reserve(ctx, req(fmt.Sprint(i), 3))
		if err != nil {
			t.Fatal(err)
		}
		if d.OK {
			admitted += 3
			res = append(res, d.Reservation)
		}
	}
	if admitted != 9 {
		t.Errorf("admitted %v tokens against a fallback capacity of 10 at cost 3, want 9", admitted)
	}
	// Settling a fallback reservation refunds locally: 3 reserved, 1 used.
	if _, err := s.Settle(ctx, res[0], 1); err != nil {
		t.Fatalf("Settle of a fallback reservation: %v", err)
	}
	d, err := s.Reserve(ctx, req("refunded", 3))
	if err != nil || !d.OK {
		t.Errorf("after a local refund of 2 (level 1+2=3), cost 3 should fit: %+v %v", d, err)
	}
}

// A settlement the primary missed during an outage is replayed once it
// answers again: the refund and the slot come back without waiting for the
// lease, and replaying never charges twice.
func TestMissedSettlementReplayed(t *testing.T) {
	p, s, c := setup(Closed)
	ctx := context.Background()
	r := req("p", 50)
	r.Slots = []buckets.Slot{{Name: "slot", Key: "u1", Max: 1, Lease: time.Hour}}
	d, err := s.Reserve(ctx, r)
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	p.down = true
	if _, err := s.Settle(ctx, d.Reservation, 10); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Settle during outage = %v, want ErrStore", err)
	}
	if s.Pending() != 1 {
		t.Fatalf("pending settlements = %d, want 1", s.Pending())
	}
	p.down = false
	c.t = c.t.Add(2 * time.Second)
	// Any successful call ends the outage and starts the replay.
	if _, err := s.Reserve(ctx, req("probe", 0.5)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Pending() > 0 || s.replayingNow() {
		if time.Now().After(deadline) {
			t.Fatal("missed settlement not replayed within 5s")
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	// The slot is free again, and the bucket got its refund once:
	// 100 - 50 (reserved) - 0.5 (probe) + 40 (refund) + 2 s of refill.
	next := req("next", 1)
	next.Slots = r.Slots
	d, err = s.Reserve(ctx, next)
	if err != nil || !d.OK {
		t.Fatalf("after the replay the slot should be free: %+v %v", d, err)
	}
	if got := d.Buckets[0].Remaining; got != 90.5 {
		t.Errorf("remaining = %v, want 90.5 (refunded exactly once)", got)
	}
	if _, err := s.Settle(ctx, d.Reservation, 1); err != nil {
		t.Fatal(err)
	}
}

// slowReplay is a primary whose Replay waits for release once it has
// said on entered that it began.
type slowReplay struct {
	*flaky
	entered, release chan struct{}
}

func (p slowReplay) Replay(ctx context.Context, r *buckets.Reservation, actual float64, sent bool) ([]buckets.BucketState, error) {
	p.entered <- struct{}{}
	<-p.release
	return p.flaky.Replay(ctx, r, actual, sent)
}

// A write being replayed is still pending until the primary has it: a
// caller that waits for Pending to reach 0 then sees the replay applied.
func TestPendingCountsTheWriteBeingReplayed(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	f := &flaky{Memory: buckets.NewMemory(buckets.MemoryOptions{Now: c.now})}
	p := slowReplay{flaky: f, entered: make(chan struct{}, 1), release: make(chan struct{})}
	s := New(p, Options{Mode: Closed, Fallback: buckets.Limit{Capacity: 10, Rate: 1}, Backoff: time.Second, Now: c.now})
	ctx := context.Background()
	d, err := s.Reserve(ctx, req("r", 50))
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	f.down = true
	if _, err := s.Settle(ctx, d.Reservation, 10); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Settle during outage = %v, want ErrStore", err)
	}
	f.down = false
	c.t = c.t.Add(2 * time.Second)
	if _, err := s.Reserve(ctx, req("probe", 0.5)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the replay did not start")
	}
	if n := s.Pending(); n != 1 {
		t.Errorf("Pending() = %d while the write is being replayed, want 1", n)
	}
	close(p.release)
	deadline := time.Now().Add(5 * time.Second)
	for s.Pending() > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the replay did not end within 5s")
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	// Pending is 0 only once the primary has the refund: 100 - 50 - 0.5
	// + 40 + 2 s of refill.
	st, _, err := s.Inspect(ctx, req("x", 0).Buckets, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := st[0].Remaining; got != 91.5 {
		t.Errorf("remaining %v once Pending is 0, want 91.5: the refund applied", got)
	}
}

// callerBound is a primary store that answers a call whose context has
// ended as a network client does: an error wrapping both ErrStore and the
// context's error.
type callerBound struct{ *flaky }

func (c callerBound) Reserve(ctx context.Context, r buckets.Request) (buckets.Decision, error) {
	if err := ctx.Err(); err != nil {
		return buckets.Decision{}, fmt.Errorf("%w: %w", buckets.ErrStore, err)
	}
	return c.flaky.Reserve(ctx, r)
}

func (c callerBound) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("%w: %w", buckets.ErrStore, err)
	}
	return c.flaky.Extend(ctx, r, n)
}

// A caller's cancellation or deadline is never an outage (S21): failing
// closed it must not turn unrelated requests into 503s, failing open it
// must not admit from the fallback.
func TestCallerCancellationIsNotAnOutage(t *testing.T) {
	for _, mode := range []Mode{Closed, Open} {
		c := &clock{t: time.Unix(1000, 0)}
		p := callerBound{&flaky{Memory: buckets.NewMemory(buckets.MemoryOptions{Now: c.now})}}
		var fallbacks int
		s := New(p, Options{Mode: mode, Fallback: buckets.Limit{Capacity: 10, Rate: 1}, Now: c.now,
			OnFallback: func(string) { fallbacks++ }})
		cancelled, cancel := context.WithCancel(context.Background())
		cancel()
		expired, cancel2 := context.WithDeadline(context.Background(), c.t)
		defer cancel2()
		for _, ctx := range []context.Context{cancelled, expired} {
			if _, err := s.Reserve(ctx, req("gone", 1)); !errors.Is(err, ctx.Err()) {
				t.Errorf("mode %v: Reserve with the caller gone = %v, want its context's error", mode, err)
			}
		}
		d, err := s.Reserve(context.Background(), req("r", 5))
		if err != nil || !d.OK {
			t.Fatalf("mode %v: Reserve = %+v, %v", mode, d, err)
		}
		if _, err := s.Extend(cancelled, d.Reservation, 1); !errors.Is(err, context.Canceled) {
			t.Errorf("mode %v: Extend with the caller gone = %v, want context.Canceled", mode, err)
		}
		if !s.Healthy() || fallbacks != 0 {
			t.Errorf("mode %v: after cancelled callers Healthy() = %v, fallback answers = %d; want healthy, none", mode, s.Healthy(), fallbacks)
		}
		// Unrelated requests go on to the shared store.
		if got := d.Buckets[0].Remaining; got != 95 {
			t.Errorf("mode %v: remaining = %v, want 95 (nothing taken by the cancelled calls)", mode, got)
		}
	}
}

// S19, S21: failing open, a provider bucket's priority headroom keeps its
// share of the fallback capacity. Before, an absolute headroom of 90 in a
// fallback of 100 made ordinary requests over 10 tokens never admissible
// (413), and a headroom of 100 made every request invalid (503).
func TestOpenHeadroomScalesWithFallback(t *testing.T) {
	for _, headroom := range []float64{90, 100} {
		t.Run(fmt.Sprint("headroom ", headroom), func(t *testing.T) {
			p, s, _ := setup(Open)
			s.opts.Fallback = buckets.Limit{Capacity: 100, Rate: 1e-9}
			p.down = true
			ctx := context.Background()
			prov := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 1000, Rate: 1}, Headroom: headroom}
			ask := func(cost float64, priority bool) buckets.Decision {
				t.Helper()
				d, err := s.Reserve(ctx, buckets.Request{Cost: cost, Buckets: []buckets.Bucket{prov}, Priority: priority})
				if err != nil {
					t.Fatalf("Reserve(%v) during the outage: %v", cost, err)
				}
				return d
			}
			localHeadroom := headroom / 10 // the fallback is a tenth of the bucket
			d := ask(50, false)
			if !d.OK || d.Buckets[0].Remaining != 50 {
				t.Fatalf("ordinary request of 50 = %+v; want admitted, 50 left", d)
			}
			if d := ask(50-localHeadroom+1, false); d.OK || d.Reason != buckets.ShortOfTokens {
				t.Errorf("ordinary request into the scaled headroom = %+v; want short of tokens", d)
			}
			if d := ask(50, true); !d.OK {
				t.Errorf("priority request using the headroom = %+v; want admitted", d)
			}
			if d := ask(1000-headroom+1, false); d.Reason != buckets.NeverAdmissible {
				t.Errorf("request over the shared bucket's admissible size = %+v; want never admissible", d)
			}
		})
	}
}

// A request the shared bucket could admit but larger than the fallback is
// admitted once the fallback is full, and settlement charges its usage:
// during an outage it is delayed, never refused as never admissible.
func TestOpenLargeRequestFitsTheFallbackOverTime(t *testing.T) {
	p, s, c := setup(Open)
	s.opts.Fallback = buckets.Limit{Capacity: 100, Rate: 10}
	p.down = true
	ctx := context.Background()
	prov := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 1000, Rate: 100}}
	big := buckets.Request{Cost: 400, Buckets: []buckets.Bucket{prov}}
	d, err := s.Reserve(ctx, big)
	if err != nil || !d.OK || d.Reservation.Cost != 100 {
		t.Fatalf("large request on a full fallback = %+v, %v; want admitted reserving the fallback's 100", d, err)
	}
	st, err := s.Settle(ctx, d.Reservation, 400)
	if err != nil || st[0].Remaining != -300 {
		t.Fatalf("Settle(400) = %+v, %v; want the fallback at -300", st, err)
	}
	d, err = s.Reserve(ctx, big)
	if err != nil || d.OK || d.Reason != buckets.ShortOfTokens || d.Wait != 40*time.Second {
		t.Fatalf("next large request = %+v, %v; want short of tokens for 40s", d, err)
	}
	c.t = c.t.Add(40 * time.Second)
	s.downTill.Store(c.t.Add(time.Hour).UnixNano()) // the outage goes on
	if d, err = s.Reserve(ctx, big); err != nil || !d.OK {
		t.Fatalf("large request once the fallback is full again = %+v, %v", d, err)
	}
}

// S14, S21: during an outage, failing closed, Extend of a reservation the
// primary took answers an error wrapping ErrStore, which cuts the stream;
// failing open it is metered against the fallback, and the primary is
// later settled only for what it took.
func TestExtendDuringOutage(t *testing.T) {
	hard := buckets.Bucket{Name: "hard", Key: "h", Hard: true, Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	r := buckets.Request{ID: "x", Cost: 20, Buckets: []buckets.Bucket{hard}}
	ctx := context.Background()

	p, s, _ := setup(Closed)
	d, err := s.Reserve(ctx, r)
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	p.down = true
	if ok, err := s.Extend(ctx, d.Reservation, 5); ok || !errors.Is(err, buckets.ErrStore) {
		t.Errorf("closed: Extend during the outage = %v, %v; want false, ErrStore", ok, err)
	}

	p, s, c := setup(Open)
	d, err = s.Reserve(ctx, r)
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	p.down = true
	if ok, err := s.Extend(ctx, d.Reservation, 6); !ok || err != nil {
		t.Fatalf("open: Extend(6) against a fallback of 10 = %v, %v; want true", ok, err)
	}
	if ok, err := s.Extend(ctx, d.Reservation, 6); ok || err != nil {
		t.Fatalf("open: Extend(6) with 4 left in the fallback = %v, %v; want false (cut)", ok, err)
	}
	if d.Reservation.Extended != 6 {
		t.Errorf("Extended = %v, want 6", d.Reservation.Extended)
	}
	p.down = false
	c.t = c.t.Add(2 * time.Second)
	st, err := s.Settle(ctx, d.Reservation, 26)
	if err != nil {
		t.Fatal(err)
	}
	// The primary took 20 and is charged the 26 used.
	if got := st[0].Remaining; math.Abs(got-74) > 1e-6 {
		t.Errorf("primary after settling 26 = %v, want 74", got)
	}
}

// A settlement queued with SettleAsync that the primary cannot take is
// kept for replay, as Settle's is, and reported to its caller.
func TestSettleAsyncKeptDuringOutage(t *testing.T) {
	p, s, c := setup(Closed)
	ctx := context.Background()
	d, err := s.Reserve(ctx, req("a", 50))
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	p.down = true
	var got error
	s.SettleAsync(d.Reservation, 10, func(_ []buckets.BucketState, err error) { got = err })
	if !errors.Is(got, buckets.ErrStore) || s.Pending() != 1 {
		t.Fatalf("SettleAsync during the outage: done with %v, %d pending; want ErrStore, 1 pending", got, s.Pending())
	}
	p.down = false
	c.t = c.t.Add(2 * time.Second)
	if _, err := s.Reserve(ctx, req("probe", 0)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Pending() > 0 || s.replayingNow() {
		if time.Now().After(deadline) {
			t.Fatal("missed settlement not replayed within 5s")
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	d, err = s.Reserve(ctx, req("after", 0))
	if err != nil || d.Buckets[0].Remaining != 92 {
		t.Fatalf("after the replay: %+v, %v; want 100 - 50 + 40 + 2 s of refill = 92", d, err)
	}
}

// fakeFleet answers heartbeats with a fixed count of gateways.
type fakeFleet struct {
	mu    sync.Mutex
	alive int
	beats int
	left  []string
}

func (f *fakeFleet) Heartbeat(ctx context.Context, gateway string, ttl time.Duration) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.beats++
	return f.alive, nil
}

func (f *fakeFleet) Leave(ctx context.Context, gateway string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.left = append(f.left, gateway)
	return nil
}

// The share of a fleet's fallback never drops below the floor; Run
// beats until its context ends, then leaves the fleet.
func TestFleetShareFloorAndLeave(t *testing.T) {
	ff := &fakeFleet{alive: 10}
	s := New(&flaky{Memory: buckets.NewMemory(buckets.MemoryOptions{})}, Options{Mode: Open,
		Fallback: buckets.Limit{Capacity: 1000, Rate: 10}, FallbackFloor: buckets.Limit{Capacity: 200},
		Fleet: ff, GatewayID: "me", HeartbeatEvery: time.Millisecond})
	if got := s.share(); got != s.opts.Fallback {
		t.Errorf("share before any heartbeat = %+v, want the whole fallback", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ff.mu.Lock()
		beats := ff.beats
		ff.mu.Unlock()
		if beats >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fewer than 3 heartbeats within 5s")
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	if got, want := s.share(), (buckets.Limit{Capacity: 200, Rate: 1}); got != want {
		t.Errorf("share of 10 gateways = %+v, want %+v (capacity at the floor)", got, want)
	}
	cancel()
	<-done
	if len(ff.left) != 1 || ff.left[0] != "me" {
		t.Errorf("left = %q, want [me]", ff.left)
	}
}

// Inspect shows the shared store's state; during an outage there is none
// to show, failing open or closed.
func TestInspectThroughPrimary(t *testing.T) {
	for _, mode := range []Mode{Closed, Open} {
		p, s, c := setup(mode)
		ctx := context.Background()
		w, err := buckets.ParseWindow("day", "UTC")
		if err != nil {
			t.Fatal(err)
		}
		r := req("q", 5)
		r.Quotas = []buckets.Quota{{Name: "daily", Key: "q1", Window: w, Limit: 50}}
		r.Slots = []buckets.Slot{{Name: "s", Key: "s1", Max: 2, Lease: time.Minute}}
		if d, err := s.Reserve(ctx, r); err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		bs, qs, err := s.Inspect(ctx, r.Buckets, r.Quotas)
		if err != nil || bs[0].Remaining != 95 || qs[0].Spent != 5 {
			t.Fatalf("mode %v: Inspect = %+v, %+v, %v; want 95 left and 5 spent", mode, bs, qs, err)
		}
		if n, err := s.InUse(ctx, r.Slots); err != nil || len(n) != 1 || n[0] != 1 {
			t.Fatalf("mode %v: InUse = %v, %v; want one lease held", mode, n, err)
		}
		p.down = true
		if _, err := s.Reserve(ctx, req("x", 1)); err == nil && mode == Closed {
			t.Fatal("Reserve during outage succeeded failing closed")
		}
		if _, _, err := s.Inspect(ctx, r.Buckets, r.Quotas); !errors.Is(err, buckets.ErrStore) {
			t.Errorf("mode %v: Inspect during outage = %v; want ErrStore", mode, err)
		}
		if _, err := s.InUse(ctx, r.Slots); !errors.Is(err, buckets.ErrStore) {
			t.Errorf("mode %v: InUse during outage = %v; want ErrStore", mode, err)
		}
		p.down = false
		c.t = c.t.Add(time.Second)
		if _, qs, err := s.Inspect(ctx, r.Buckets, r.Quotas); err != nil || qs[0].Spent != 5 {
			t.Errorf("mode %v: Inspect after recovery = %+v, %v", mode, qs, err)
		}
	}
}

// TestFailOpenConcurrencyIsDividedAcrossTheFleet: failing open, a
// concurrency limit's maximum is the fleet's, as the buckets' fallback is
// (S20): each of 3 gateways admits a third of 6 requests in flight per key,
// not 6 each; a maximum below the gateways alive still admits one each.
func TestFailOpenConcurrencyIsDividedAcrossTheFleet(t *testing.T) {
	for _, c := range []struct{ max, gateways, each int }{{6, 3, 2}, {7, 3, 2}, {2, 3, 1}, {6, 1, 6}} {
		t.Run(fmt.Sprintf("max %d over %d gateways", c.max, c.gateways), func(t *testing.T) {
			p, s, _ := setup(Open)
			s.opts.Fleet = &fakeFleet{alive: c.gateways}
			s.opts.Fallback = buckets.Limit{Capacity: 1000, Rate: 1}
			ctx := context.Background()
			if err := s.Beat(ctx); err != nil {
				t.Fatal(err)
			}
			p.down = true
			slot := buckets.Slot{Name: "conc", Key: "u1", Max: c.max, Lease: time.Minute}
			admitted := 0
			for i := range c.max + 1 {
				r := req(fmt.Sprint("r", i), 1)
				r.Slots = []buckets.Slot{slot}
				d, err := s.Reserve(ctx, r)
				if err != nil {
					t.Fatal(err)
				}
				if d.OK {
					admitted++
				} else if d.Reason != buckets.ConcurrencyFull {
					t.Fatalf("refusal %v, want concurrency full", d.Reason)
				}
			}
			if admitted != c.each {
				t.Errorf("a gateway of %d admitted %d requests in flight of a limit of %d, want %d", c.gateways, admitted, c.max, c.each)
			}
		})
	}
}
