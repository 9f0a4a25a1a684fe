package bucketstest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// RunAsync checks buckets.AsyncSettler on the stores open returns: a
// settlement queued by SettleAsync comes out exactly as Settle's (once per
// reservation, its slot released), whether it goes with other calls,
// with Flush, or on its own once its window has passed; and many callers
// reserving and settling asynchronously at once stay exact (S8).
func RunAsync(t *testing.T, open Open) {
	ctx := context.Background()
	settler := func(t *testing.T, st buckets.Store) buckets.AsyncSettler {
		as, ok := st.(buckets.AsyncSettler)
		if !ok {
			t.Fatalf("%T does not implement buckets.AsyncSettler", st)
		}
		return as
	}
	type result struct {
		states []buckets.BucketState
		err    error
	}

	t.Run("queued settlements settle once each", func(t *testing.T) {
		st := open(t, NewClock(), 1)[0]
		as := settler(t, st)
		team := bucket("team", 1000, never)
		slot := buckets.Slot{Name: "conc", Key: "conc", Max: 10, Lease: time.Minute}
		var res []*buckets.Reservation
		for i := range 10 {
			r := req(10, bucket(fmt.Sprintf("user%d", i), 100, never), team)
			r.Slots = []buckets.Slot{slot}
			d, err := st.Reserve(ctx, scope(t.Name(), r))
			if err != nil || !d.OK {
				t.Fatalf("Reserve %d = %+v, %v", i, d, err)
			}
			res = append(res, d.Reservation)
		}
		results := make(chan result, 20)
		done := func(s []buckets.BucketState, err error) { results <- result{s, err} }
		for i, r := range res {
			as.SettleAsync(r, float64(i), done) // 10 reserved, i used
			if i%3 == 0 {
				as.SettleAsync(r, 100, done) // a second settlement changes nothing
			}
		}
		if err := as.Flush(ctx); err != nil {
			t.Fatalf("Flush: %v", err)
		}
		if n := len(results); n != 14 {
			t.Fatalf("%d settlements reported done after Flush, want 14", n)
		}
		close(results)
		for r := range results {
			if r.err != nil || len(r.states) != 2 {
				t.Errorf("settlement done with %+v, %v", r.states, r.err)
			}
		}
		// The team bucket was charged what was used, 0+1+…+9, once each; the
		// slots are free again.
		probe := req(0, team)
		probe.Slots = []buckets.Slot{{Name: "conc", Key: "conc", Max: 1, Lease: time.Minute}}
		d, err := st.Reserve(ctx, scope(t.Name(), probe))
		if err != nil || !d.OK {
			t.Fatalf("probe = %+v, %v; want admitted (slots released)", d, err)
		}
		if got := d.Buckets[0].Remaining; got != 1000-45 {
			t.Errorf("team level = %v, want %v", got, 1000-45)
		}
	})

	t.Run("a queued settlement is written without Flush", func(t *testing.T) {
		st := open(t, NewClock(), 1)[0]
		d, err := st.Reserve(ctx, scope(t.Name(), req(10, bucket("b", 100, never))))
		if err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		got := make(chan result, 1)
		settler(t, st).SettleAsync(d.Reservation, 4, func(s []buckets.BucketState, err error) { got <- result{s, err} })
		select {
		case r := <-got:
			if r.err != nil || r.states[0].Remaining != 96 {
				t.Errorf("settlement done with %+v, %v; want 96 left", r.states, r.err)
			}
		case <-time.After(10 * time.Second): // a deadline, not a wait: it ends at the answer
			t.Fatal("a queued settlement was not written within 10s")
		}
	})

	t.Run("many callers settling asynchronously stay exact", func(t *testing.T) {
		clock := NewClock()
		stores := open(t, clock, Clients)
		shared := bucket("shared", 1e6, never)
		const rounds = 5
		var wg sync.WaitGroup
		for i := range Callers {
			wg.Go(func() {
				st := stores[i%Clients]
				user := bucket(fmt.Sprintf("user%d", i), 1000, never)
				for range rounds {
					d, err := st.Reserve(ctx, scope(t.Name(), req(10, user, shared)))
					if err != nil || !d.OK {
						t.Errorf("Reserve = %+v, %v", d, err)
						return
					}
					settler(t, st).SettleAsync(d.Reservation, 3, nil)
				}
			})
		}
		wg.Wait()
		for _, st := range stores {
			if err := settler(t, st).Flush(ctx); err != nil {
				t.Fatalf("Flush: %v", err)
			}
		}
		d, err := stores[0].Reserve(ctx, scope(t.Name(), req(0, shared)))
		if err != nil {
			t.Fatal(err)
		}
		if got, want := d.Buckets[0].Remaining, 1e6-Callers*rounds*3; got != want {
			t.Errorf("shared level after %d settlements of 3 = %v, want %v", Callers*rounds, got, want)
		}
	})
}
