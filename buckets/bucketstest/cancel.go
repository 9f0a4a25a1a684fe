package bucketstest

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
)

type midCallKey struct{}

// WithMidCall returns ctx carrying fn, which a store under test calls from
// inside an operation, once it has started and before its result is back
// (the Redis tests call it from a client hook as a command is sent): the
// moment a client that disconnects mid-call would cancel the context.
func WithMidCall(ctx context.Context, fn func()) context.Context {
	return context.WithValue(ctx, midCallKey{}, fn)
}

// MidCall returns the function that WithMidCall put into ctx, or nil.
func MidCall(ctx context.Context) func() {
	fn, _ := ctx.Value(midCallKey{}).(func())
	return fn
}

// RunCancel checks the buckets.Store contract on the caller's context: a
// context that ended before a call makes the call write nothing and return
// the context's error, never buckets.ErrStore; a context cancelled during a
// call either leaves nothing written or a result that settles exactly;
// Settle always runs; and a failover store over the store never counts a
// caller's cancellation as an outage, failing closed or open.
func RunCancel(t *testing.T, open Open) {
	b := bucket("user", 100, never)
	hard := bucket("hard", 100, never)
	hard.Hard = true
	slot := buckets.Slot{Name: "conc", Key: "conc", Max: 1, Lease: time.Minute}
	request := func(t *testing.T) buckets.Request {
		r := req(10, b, hard)
		r.Slots = []buckets.Slot{slot}
		return scope(t.Name(), r)
	}
	bg := context.Background()
	// levels returns the levels of the request's buckets and whether its
	// slot is free, without changing them.
	levels := func(t *testing.T, st buckets.Store, r buckets.Request) []float64 {
		t.Helper()
		probe := r
		probe.Cost = 0
		d, err := st.Reserve(bg, probe)
		if err != nil {
			t.Fatalf("probe Reserve: %v", err)
		}
		if !d.OK {
			t.Fatalf("probe Reserve refused (%v by %s): the slot or a bucket is still held", d.Reason, d.Limiting)
		}
		if _, err := st.Settle(bg, d.Reservation, 0); err != nil {
			t.Fatalf("probe Settle: %v", err)
		}
		var ls []float64
		for _, s := range d.Buckets {
			ls = append(ls, s.Remaining)
		}
		return ls
	}
	callerErr := func(t *testing.T, op string, err, want error) {
		t.Helper()
		if !errors.Is(err, want) || errors.Is(err, buckets.ErrStore) {
			t.Errorf("%s with the caller's context ended: error %v; want one wrapping %v and not ErrStore", op, err, want)
		}
	}

	t.Run("context ended before the call writes nothing", func(t *testing.T) {
		st := open(t, NewClock(), 1)[0]
		r := request(t)
		cancelled, cancel := context.WithCancel(bg)
		cancel()
		expired, cancel2 := context.WithDeadline(bg, time.Unix(0, 0))
		defer cancel2()
		for _, c := range []struct {
			ctx  context.Context
			want error
		}{{cancelled, context.Canceled}, {expired, context.DeadlineExceeded}} {
			d, err := st.Reserve(c.ctx, r)
			callerErr(t, "Reserve", err, c.want)
			if d.OK {
				t.Errorf("Reserve with the caller's context ended admitted %+v", d)
			}
		}
		if got := levels(t, st, r); got[0] != 100 || got[1] != 100 {
			t.Fatalf("levels after cancelled Reserves = %v, want [100 100]", got)
		}
		d, err := st.Reserve(bg, r)
		if err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		ok, err := st.Extend(cancelled, d.Reservation, 5)
		callerErr(t, "Extend", err, context.Canceled)
		if ok || d.Reservation.Extended != 0 {
			t.Errorf("Extend with a cancelled context = %v, Extended %v; want false, 0", ok, d.Reservation.Extended)
		}
		pb := r.Buckets[0]
		callerErr(t, "Pause", st.Pause(cancelled, pb, Epoch.Add(time.Hour)), context.Canceled)
		if rn, isRenewer := st.(buckets.Renewer); isRenewer {
			callerErr(t, "Renew", rn.Renew(cancelled, d.Reservation), context.Canceled)
		}
		// Settle runs although the caller is gone: 10 reserved, 4 used.
		states, err := st.Settle(cancelled, d.Reservation, 4)
		if err != nil {
			t.Fatalf("Settle with a cancelled context: %v; want it to run", err)
		}
		if states[0].Remaining != 96 || states[1].Remaining != 96 {
			t.Errorf("levels after Settle = %v, %v; want 96, 96 (no Extend, no Pause written)", states[0].Remaining, states[1].Remaining)
		}
		if got := levels(t, st, r); got[0] != 96 || got[1] != 96 {
			t.Errorf("levels after Settle = %v, want [96 96] and the slot free", got)
		}
	})

	t.Run("context cancelled during the call leaves nothing unsettled", func(t *testing.T) {
		st := open(t, NewClock(), 1)[0]
		r := request(t)
		for i := range 3 {
			ctx, cancel := context.WithCancel(bg)
			ctx = WithMidCall(ctx, cancel)
			d, err := st.Reserve(ctx, r)
			cancel()
			switch {
			case err != nil:
				callerErr(t, "Reserve", err, context.Canceled)
				if got := levels(t, st, r); got[0] != 100-float64(i)*3 {
					t.Fatalf("round %d: level after a cancelled Reserve = %v, want %v", i, got, 100-float64(i)*3)
				}
				d, err = st.Reserve(bg, r)
				if err != nil || !d.OK {
					t.Fatalf("Reserve = %+v, %v", d, err)
				}
			case !d.OK:
				t.Fatalf("round %d: Reserve cancelled mid-call refused: %+v", i, d)
			}
			// Whatever the store did is settleable: 10 reserved, an Extend
			// of 5 cancelled mid-call, 3 used.
			ectx, ecancel := context.WithCancel(bg)
			ok, err := st.Extend(WithMidCall(ectx, ecancel), d.Reservation, 5)
			ecancel()
			switch {
			case err != nil:
				callerErr(t, "Extend", err, context.Canceled)
				if d.Reservation.Extended != 0 {
					t.Errorf("round %d: Extended = %v after a failed Extend", i, d.Reservation.Extended)
				}
			case !ok || d.Reservation.Extended != 5:
				t.Errorf("round %d: Extend cancelled mid-call = %v, Extended %v; want 5 recorded", i, ok, d.Reservation.Extended)
			}
			if _, err := st.Settle(ectx, d.Reservation, 3); err != nil {
				t.Fatalf("round %d: Settle: %v", i, err)
			}
			want := 100 - float64(i+1)*3
			if got := levels(t, st, r); got[0] != want || got[1] != want {
				t.Fatalf("round %d: levels = %v, want [%v %v] and the slot free", i, got, want, want)
			}
		}
	})

	for _, mode := range []failover.Mode{failover.Closed, failover.Open} {
		name := map[failover.Mode]string{failover.Closed: "closed", failover.Open: "open"}[mode]
		t.Run("failover failing "+name+" stays healthy", func(t *testing.T) {
			clock := NewClock()
			var fallbacks atomic.Int64
			fo := failover.New(open(t, clock, 1)[0], failover.Options{
				Mode: mode, Fallback: buckets.Limit{Capacity: 1000, Rate: 1}, Now: clock.Now,
				OnFallback: func(string) { fallbacks.Add(1) },
			})
			r := request(t)
			admitted := 0
			for i := range 4 {
				ctx, cancel := context.WithCancel(bg)
				if i%2 == 0 {
					cancel()
				} else {
					ctx = WithMidCall(ctx, cancel)
				}
				d, err := fo.Reserve(ctx, r)
				cancel()
				if err != nil {
					callerErr(t, "failover Reserve", err, context.Canceled)
				} else if _, err := fo.Settle(ctx, d.Reservation, 10); err != nil {
					t.Fatalf("Settle: %v", err)
				} else {
					admitted++
				}
				if !fo.Healthy() {
					t.Fatalf("round %d: the caller's cancellation marked the store down", i)
				}
			}
			if n := fallbacks.Load(); n != 0 {
				t.Errorf("%d operations answered from the fallback; want none", n)
			}
			// An unrelated request is admitted by the shared store, which
			// holds exactly what the admitted callers used.
			d, err := fo.Reserve(bg, r)
			if err != nil || !d.OK {
				t.Fatalf("unrelated Reserve after cancellations = %+v, %v", d, err)
			}
			want := 100 - 10*float64(admitted+1)
			if got := d.Buckets[0].Remaining; got != want {
				t.Errorf("level after %d settled admissions and one more = %v, want %v", admitted, got, want)
			}
			if _, err := fo.Settle(bg, d.Reservation, 10); err != nil {
				t.Fatal(err)
			}
		})
	}
}
