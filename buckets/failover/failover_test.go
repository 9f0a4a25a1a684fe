package failover

import (
	"context"
	"errors"
	"fmt"
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
