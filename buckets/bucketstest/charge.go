package bucketstest

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/tokengate/tokengate/buckets"
)

// RunCharge checks buckets.Charger, as every store must answer it: a
// charge without a reservation debits every bucket and quota, down to a
// bucket's floor, and reports the level it left; a refund fills at most to
// capacity; a charge on a done context writes nothing; a charge sets the
// windows of its quotas. The stores open returns must be Chargers and
// Inspectors. A store that is also a buckets.AsyncCharger answers the same
// through ChargeAsync ("queued"), and charges queued together, which may
// share a call, each apply once. That a copy of a store's call sent again
// after a lost reply applies nothing is each store's own test, under real
// faults (package redisstore's TestChargeRetriedAfterTimeoutAppliesOnce).
func RunCharge(t *testing.T, open Open) {
	t.Run("waited", func(t *testing.T) { runCharge(t, open, false) })
	t.Run("queued", func(t *testing.T) { runCharge(t, open, true) })
}

func runCharge(t *testing.T, open Open, queued bool) {
	clock := NewClock()
	st := open(t, clock, 1)[0]
	ch, ok := st.(buckets.Charger)
	in, ok2 := st.(Inspector)
	if !ok || !ok2 {
		t.Fatalf("%T does not implement Charger and Inspector", st)
	}
	ac, async := st.(buckets.AsyncCharger)
	if queued && !async {
		t.Skipf("%T does not charge asynchronously", st)
	}
	// send charges r, through ChargeAsync when queued, and waits.
	send := func(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
		if !queued {
			return ch.Charge(ctx, r, actual)
		}
		type result struct {
			states []buckets.BucketState
			err    error
		}
		done := make(chan result, 1)
		ac.ChargeAsync(r, actual, func(s []buckets.BucketState, err error) { done <- result{s, err} })
		res := <-done
		return res.states, res.err
	}
	ctx := context.Background()
	b := bucket("b", 10, 1e-9)
	b.Key, b.MaxDebt = t.Name()+"/b", 5
	q := quota("q", 100, window("day", "UTC"))
	q.Key = t.Name() + "/q"
	charge := func(id string, cost, actual float64) buckets.BucketState {
		t.Helper()
		r := &buckets.Reservation{ID: id, Cost: cost, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
		states, err := send(ctx, r, actual)
		if err != nil {
			t.Fatalf("Charge %s: %v", id, err)
		}
		if len(states) != 1 || !queued && len(r.Windows) != 1 {
			t.Fatalf("Charge %s: %d states and %d windows, want 1 and 1", id, len(states), len(r.Windows))
		}
		return states[0]
	}
	check := func(what string, level, spent float64) {
		t.Helper()
		bs, qs, err := in.Inspect(ctx, []buckets.Bucket{b}, []buckets.Quota{q})
		if err != nil {
			t.Fatal(err)
		}
		if math.Abs(bs[0].Remaining-level) > 1e-6 || math.Abs(qs[0].Spent-spent) > 1e-6 {
			t.Errorf("%s: bucket %v, quota %v; want %v and %v", what, bs[0].Remaining, qs[0].Spent, level, spent)
		}
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

	if s := charge("c1", 0, 4); !near(s.Remaining, 6) || s.Forgiven != 0 {
		t.Errorf("charge of 4 from 10: %+v, want remaining 6", s)
	}
	check("after a charge of 4", 6, 4)
	if s := charge("c2", 0, 8); !near(s.Remaining, -2) || s.Forgiven != 0 {
		t.Errorf("charge of 8 from 6: %+v, want remaining -2", s)
	}
	if s := charge("c3", 0, 10); !near(s.Remaining, -5) || !near(s.Remaining-s.Forgiven, -12) {
		t.Errorf("charge of 10 from -2 with max debt 5: %+v, want remaining -5, forgiven 7", s)
	}
	check("after charges past the floor", -5, 22)
	if s := charge("c4", 20, 0); !near(s.Remaining, 10) {
		t.Errorf("refund of 20 at -5: %+v, want the capacity 10", s)
	}
	check("after a refund of 20", 10, 2)

	if queued {
		// Charges queued together, which may go in one call, each apply
		// once: 2 + 3 + 4 taken from 10.
		errs := make(chan error, 3)
		for i, n := range []float64{2, 3, 4} {
			r := &buckets.Reservation{ID: "together" + string(rune('a'+i)), Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
			ac.ChargeAsync(r, n, func(_ []buckets.BucketState, err error) { errs <- err })
		}
		for range 3 {
			if err := <-errs; err != nil {
				t.Fatalf("ChargeAsync of charges queued together: %v", err)
			}
		}
		check("after charges of 2, 3 and 4 queued together", 1, 11)
		errc := make(chan error, 1)
		ac.ChargeAsync(&buckets.Reservation{Buckets: []buckets.Bucket{b}}, 1, func(_ []buckets.BucketState, err error) { errc <- err })
		if err := <-errc; !errors.Is(err, buckets.ErrInvalidRequest) {
			t.Errorf("ChargeAsync without an ID = %v, want ErrInvalidRequest", err)
		}
		check("after a queued charge without an ID", 1, 11)
		return
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	r := &buckets.Reservation{ID: "c5", Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
	if _, err := ch.Charge(done, r, 3); !errors.Is(err, context.Canceled) {
		t.Errorf("Charge on a cancelled context = %v, want context.Canceled", err)
	}
	check("after a charge on a cancelled context", 10, 2)
	if _, err := ch.Charge(ctx, &buckets.Reservation{Buckets: []buckets.Bucket{b}}, 1); !errors.Is(err, buckets.ErrInvalidRequest) {
		t.Errorf("Charge without an ID = %v, want ErrInvalidRequest", err)
	}
}
