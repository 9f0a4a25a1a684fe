package failover

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

func (f *flaky) Charge(ctx context.Context, r *buckets.Reservation, n float64) ([]buckets.BucketState, error) {
	if err := f.err(); err != nil {
		return nil, err
	}
	return f.Memory.Charge(ctx, r, n)
}

// A charge the primary cannot take is kept and replayed once it answers
// again, once, whatever the copies of it: the hits it counts were used.
func TestChargeKeptDuringOutage(t *testing.T) {
	p, s, c := setup(Closed)
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u1", Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	p.down = true
	r := &buckets.Reservation{ID: "hit", Buckets: []buckets.Bucket{b}}
	if _, err := s.Charge(ctx, r, 30); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Charge during an outage = %v, want ErrStore", err)
	}
	if s.Pending() != 1 {
		t.Fatalf("pending = %d, want the charge kept", s.Pending())
	}
	p.down = false
	c.t = c.t.Add(2 * time.Second)
	if _, err := s.Charge(ctx, &buckets.Reservation{ID: "probe", Buckets: []buckets.Bucket{b}}, 1); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Pending() > 0 || s.replayingNow() {
		if time.Now().After(deadline) {
			t.Fatal("kept charge not replayed within 5s")
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	// The charge sent again by its caller after the replay applies nothing.
	states, err := s.Charge(ctx, r, 30)
	if err != nil {
		t.Fatal(err)
	}
	if got := states[0].Remaining; got < 69-1e-6 || got > 69+1e-6 {
		t.Errorf("remaining = %v, want 69: the probe's 1 and the kept charge's 30, once", got)
	}
}

// ChargeAsync charges at once, failing while down, as Charge does.
func (f *flaky) ChargeAsync(r *buckets.Reservation, n float64, done func([]buckets.BucketState, error)) {
	st, err := f.Charge(context.Background(), r, n)
	done(st, err)
}

// TestQueuedChargeKeptWhenThePrimaryFails: a charge queued with
// ChargeAsync that the primary fails is kept for replay, as a waited-for
// one is, and replayed once when the primary answers again; during the
// outage's back-off it is kept without a call.
func TestQueuedChargeKeptWhenThePrimaryFails(t *testing.T) {
	p, s, c := setup(Closed)
	b := buckets.Bucket{Name: "user", Key: "u1", Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	p.down = true
	errc := make(chan error, 2)
	done := func(_ []buckets.BucketState, err error) { errc <- err }
	r := &buckets.Reservation{ID: "hit", Buckets: []buckets.Bucket{b}}
	s.ChargeAsync(r, 30, done)
	if err := <-errc; !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("queued charge the primary failed = %v, want ErrStore", err)
	}
	calls := p.calls
	s.ChargeAsync(&buckets.Reservation{ID: "hit2", Buckets: []buckets.Bucket{b}}, 5, done)
	if err := <-errc; !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("queued charge during the outage = %v, want ErrStore", err)
	}
	if p.calls != calls {
		t.Errorf("%d primary calls during the back-off, want 0", p.calls-calls)
	}
	if s.Pending() != 2 {
		t.Fatalf("pending = %d, want both charges kept", s.Pending())
	}
	p.down = false
	c.t = c.t.Add(2 * time.Second)
	ctx := context.Background()
	if _, err := s.Charge(ctx, &buckets.Reservation{ID: "probe", Buckets: []buckets.Bucket{b}}, 1); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Pending() > 0 || s.replayingNow() {
		if time.Now().After(deadline) {
			t.Fatal("kept charges not replayed within 5s")
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	states, err := s.Charge(ctx, r, 30)
	if err != nil {
		t.Fatal(err)
	}
	if got := states[0].Remaining; got < 64-1e-6 || got > 64+1e-6 {
		t.Errorf("remaining = %v, want 64: the probe's 1 and the kept charges' 30 and 5, once", got)
	}
}
