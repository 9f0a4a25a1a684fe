package bucketstest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// Callers is how many goroutines compete in the race tests, spread over
// Clients stores (for Redis, separate clients).
const (
	Callers = 64
	Clients = 4
)

// never is a refill rate so slow that no token returns during a test.
const never = 1e-9

// RunRaces checks the boundaries under concurrency (S3, S8, S11): callers
// competing for room for exactly K requests admit exactly K; concurrent
// settlements, duplicated, stay exact; the slots of a client that vanished
// expire.
func RunRaces(t *testing.T, open Open) {
	t.Run("exactly K admitted", func(t *testing.T) {
		const k, cost = 10, 3.0
		user := bucket("user", k*cost, never)
		big := bucket("team", 1000, never)
		prov := bucket("provider", 1000, never)
		admitted := race(t, open, func(i int) buckets.Request { return scope(t.Name(), req(cost, big, user, prov)) })
		if admitted != k {
			t.Errorf("admitted %d of %d callers, want exactly %d", admitted, Callers, k)
		}
	})
	t.Run("shared bucket limits callers with their own buckets", func(t *testing.T) {
		const k, cost = 10, 3.0
		team := bucket("team", k*cost, never)
		admitted := race(t, open, func(i int) buckets.Request {
			u := bucket(fmt.Sprintf("user%d", i), 100, never)
			return scope(t.Name(), req(cost, u, team))
		})
		if admitted != k {
			t.Errorf("admitted %d of %d callers, want exactly %d", admitted, Callers, k)
		}
	})
	t.Run("two tight buckets are never over-admitted", func(t *testing.T) {
		// team and provider usually live in different cluster slots; the
		// Redis Cluster store may then refuse more than necessary while it
		// compensates, but never admits more than K, and leaves each bucket
		// at exactly its capacity less what was admitted.
		const k, cost = 10, 3.0
		team, prov := bucket("team", k*cost, never), bucket("provider", k*cost, never)
		clock := NewClock()
		stores := open(t, clock, Clients)
		admitted := raceOn(t, stores, func(i int) buckets.Request { return scope(t.Name(), req(cost, team, prov)) })
		if admitted > k || admitted == 0 {
			t.Fatalf("admitted %d, want 1..%d", admitted, k)
		}
		d, err := stores[0].Reserve(context.Background(), scope(t.Name(), req(0, team, prov)))
		if err != nil {
			t.Fatal(err)
		}
		want := k*cost - float64(admitted)*cost
		for _, b := range d.Buckets {
			if b.Remaining != want {
				t.Errorf("bucket %s: remaining %v after %d admissions, want %v", b.Name, b.Remaining, admitted, want)
			}
		}
	})
	t.Run("concurrent settlements stay exact", func(t *testing.T) {
		b := bucket("b", 1000, never)
		clock := NewClock()
		stores := open(t, clock, Clients)
		ctx := context.Background()
		res := make([]*buckets.Reservation, Callers)
		var wg sync.WaitGroup
		for i := range Callers {
			wg.Go(func() {
				d, err := stores[i%Clients].Reserve(ctx, scope(t.Name(), req(10, b)))
				if err != nil || !d.OK {
					t.Errorf("Reserve: %+v, %v", d, err)
					return
				}
				res[i] = d.Reservation
			})
		}
		wg.Wait()
		for i := range 2 * Callers { // every reservation settled twice, concurrently
			wg.Go(func() {
				if r := res[i%Callers]; r != nil {
					if _, err := stores[i%Clients].Settle(ctx, r, 4); err != nil {
						t.Errorf("Settle: %v", err)
					}
				}
			})
		}
		wg.Wait()
		d, err := stores[0].Reserve(ctx, scope(t.Name(), req(0, b)))
		if err != nil {
			t.Fatal(err)
		}
		if got, want := d.Buckets[0].Remaining, 1000.0-Callers*4; got != want {
			t.Errorf("remaining after %d settlements of 4 = %v, want %v", Callers, got, want)
		}
	})
	t.Run("slots of a vanished client expire", func(t *testing.T) {
		clock := NewClock()
		stores := open(t, clock, 2)
		ctx := context.Background()
		r := req(1, bucket("b", 100, 1))
		r.Slots = []buckets.Slot{{Name: "conc", Key: "conc", Max: 1, Lease: 5 * time.Second}}
		r = scope(t.Name(), r)
		if d, err := stores[0].Reserve(ctx, r); err != nil || !d.OK {
			t.Fatalf("first Reserve = %+v, %v; want admitted", d, err)
		}
		// stores[0] now vanishes without settling.
		if d, err := stores[1].Reserve(ctx, r); err != nil || d.Reason != buckets.ConcurrencyFull {
			t.Fatalf("Reserve while leased = %+v, %v; want ConcurrencyFull", d, err)
		}
		clock.Advance(5*time.Second + time.Microsecond)
		if d, err := stores[1].Reserve(ctx, r); err != nil || !d.OK {
			t.Fatalf("Reserve after the lease = %+v, %v; want admitted", d, err)
		}
	})
	RunQuotaRaces(t, open)
}

func race(t *testing.T, open Open, mk func(i int) buckets.Request) int {
	return raceOn(t, open(t, NewClock(), Clients), mk)
}

// raceOn has Callers goroutines, over the stores, reserve at once and
// returns how many were admitted.
func raceOn(t *testing.T, stores []buckets.Store, mk func(i int) buckets.Request) int {
	var admitted atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range Callers {
		wg.Go(func() {
			r := mk(i)
			<-start
			d, err := stores[i%len(stores)].Reserve(context.Background(), r)
			if err != nil {
				t.Errorf("Reserve: %v", err)
				return
			}
			if d.OK {
				admitted.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	return int(admitted.Load())
}
