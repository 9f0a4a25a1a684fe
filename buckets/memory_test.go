package buckets_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
)

// openMemory opens one Memory store on the clock; every caller of a test
// shares it, as every goroutine of one gateway would.
func openMemory(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
	stores := make([]buckets.Store, n)
	for i := range stores {
		stores[i] = m
	}
	return stores
}

func TestMemoryContract(t *testing.T) { bucketstest.Run(t, openMemory) }

func TestMemoryInvalid(t *testing.T) { bucketstest.RunInvalid(t, openMemory) }

func TestMemoryRaces(t *testing.T) { bucketstest.RunRaces(t, openMemory) }

func TestMemoryProperty(t *testing.T) { bucketstest.RunProperty(t, openMemory, 8, 400) }

func TestMemoryAsync(t *testing.T) { bucketstest.RunAsync(t, openMemory) }

func TestMemoryRepeat(t *testing.T) { bucketstest.RunRepeat(t, openMemory) }

func TestMemoryCharge(t *testing.T) { bucketstest.RunCharge(t, openMemory) }

// TestMemoryCallerCancellation runs the cancellation contract. The memory
// store's step is atomic, so "during the call" is as the call begins: the
// wrapper cancels just before it.
func TestMemoryCallerCancellation(t *testing.T) {
	bucketstest.RunCancel(t, func(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
		stores := openMemory(t, clock, n)
		for i, s := range stores {
			stores[i] = midCall{s.(*buckets.Memory)}
		}
		return stores
	})
}

// midCall calls the function of bucketstest.WithMidCall as each operation
// begins.
type midCall struct{ *buckets.Memory }

func fire(ctx context.Context) {
	if fn := bucketstest.MidCall(ctx); fn != nil {
		fn()
	}
}

func (m midCall) Reserve(ctx context.Context, r buckets.Request) (buckets.Decision, error) {
	fire(ctx)
	return m.Memory.Reserve(ctx, r)
}

func (m midCall) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	fire(ctx)
	return m.Memory.Extend(ctx, r, n)
}

func (m midCall) Settle(ctx context.Context, r *buckets.Reservation, n float64) ([]buckets.BucketState, error) {
	fire(ctx)
	return m.Memory.Settle(ctx, r, n)
}

// TestMemoryBounded checks that idle full buckets, expired leases and
// expired reservations are dropped, and that a settled reservation leaves
// nothing behind.
func TestMemoryBounded(t *testing.T) {
	clock := bucketstest.NewClock()
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now, SweepEvery: time.Second})
	ctx := context.Background()
	for i := range 1000 {
		r := buckets.Request{ID: "r" + strconv.Itoa(i), Cost: 1, Lifetime: 2 * time.Second,
			Buckets: []buckets.Bucket{{Name: "u", Key: "u" + strconv.Itoa(i), Limit: buckets.Limit{Capacity: 10, Rate: 1}}},
			Slots:   []buckets.Slot{{Name: "c", Key: "c" + strconv.Itoa(i), Max: 1, Lease: time.Second}}}
		d, err := m.Reserve(ctx, r)
		if err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		if i%2 == 0 {
			if _, err := m.Settle(ctx, d.Reservation, 3); err != nil {
				t.Fatal(err)
			}
		}
	}
	if b, s, open := buckets.Sizes(m); b != 1000 || s != 1000 || open != 500 {
		t.Fatalf("sizes = %d buckets, %d slots, %d open; want 1000, 1000, 500 (the unsettled)", b, s, open)
	}
	// After 3 s every bucket is full again (debt of 2 at most refills in 3 s)
	// and every lease and reservation has expired; the next admission
	// sweeps them.
	clock.Advance(3*time.Second + time.Millisecond)
	// Zero-cost requests on many keys reach every shard and leave their own
	// buckets full, so everything is swept; they settle at once.
	touch := buckets.Request{Buckets: []buckets.Bucket{{Name: "k", Limit: buckets.Limit{Capacity: 10, Rate: 1}}}}
	for i := range 2000 {
		touch.Buckets[0].Key = "touch" + strconv.Itoa(i)
		d, err := m.Reserve(ctx, touch)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Settle(ctx, d.Reservation, 0); err != nil {
			t.Fatal(err)
		}
	}
	if b, s, open := buckets.Sizes(m); b != 0 || s != 0 || open != 0 {
		t.Errorf("after the sweep: %d buckets, %d slot keys, %d open reservations; want none", b, s, open)
	}
}

// TestMemorySettleOnce checks S8 with copies of a reservation: the ID, not
// the pointer, makes settlement happen once.
func TestMemorySettleOnce(t *testing.T) {
	m := buckets.NewMemory(buckets.MemoryOptions{Now: bucketstest.NewClock().Now})
	ctx := context.Background()
	b := buckets.Bucket{Name: "b", Key: "b", Limit: buckets.Limit{Capacity: 10, Rate: 1}}
	d, err := m.Reserve(ctx, buckets.Request{Cost: 5, Buckets: []buckets.Bucket{b}})
	if err != nil || !d.OK || d.Reservation.ID == "" {
		t.Fatalf("Reserve = %+v, %v; want admitted with an ID", d, err)
	}
	cp := *d.Reservation
	if _, err := m.Settle(ctx, d.Reservation, 1); err != nil {
		t.Fatal(err)
	}
	states, err := m.Settle(ctx, &cp, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := states[0].Remaining; got != 9 {
		t.Errorf("remaining after settling a copy again = %v, want 9", got)
	}
}

// ExampleMemory shows the reserve-then-settle cycle (S7, S8).
func ExampleMemory() {
	ctx := context.Background()
	store := buckets.NewMemory(buckets.MemoryOptions{})
	user := buckets.Bucket{Name: "user", Key: "user:42", Limit: buckets.PerMinute(600, 0)}

	d, err := store.Reserve(ctx, buckets.Request{ID: "req-1", Cost: 500, Buckets: []buckets.Bucket{user}})
	if err != nil {
		fmt.Println("store error:", err)
		return
	}
	fmt.Println(d.OK, d.Buckets[0].Remaining)

	d2, _ := store.Reserve(ctx, buckets.Request{ID: "req-2", Cost: 200, Buckets: []buckets.Bucket{user}})
	fmt.Println(d2.OK, d2.Reason, d2.Limiting, d2.Wait.Round(time.Second))

	states, _ := store.Settle(ctx, d.Reservation, 120) // the response used 120 tokens
	fmt.Println(states[0].Remaining >= 480)
	// Output:
	// true 100
	// false short_of_tokens user 10s
	// true
}

// TestMemoryChargeMarksAreForgottenAfterTheRepeatWindow: each charge (a
// rate-limit service's hits) is remembered by its ID so that a copy
// applies nothing, for buckets.RepeatWindow only; a day, as a replay's
// mark, would keep a mark per rate-limit call in memory for a day.
func TestMemoryChargeMarksAreForgottenAfterTheRepeatWindow(t *testing.T) {
	clock := bucketstest.NewClock()
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
	ctx := context.Background()
	b := buckets.Bucket{Name: "u", Key: "u", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e6}}
	for i := range 1000 {
		r := &buckets.Reservation{ID: "c" + strconv.Itoa(i), Buckets: []buckets.Bucket{b}}
		if _, err := m.Charge(ctx, r, 1); err != nil {
			t.Fatal(err)
		}
	}
	// A copy of the last applies nothing while it is remembered.
	before, _, err := m.Inspect(ctx, []buckets.Bucket{b}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Charge(ctx, &buckets.Reservation{ID: "c999", Buckets: []buckets.Bucket{b}}, 1000); err != nil {
		t.Fatal(err)
	}
	after, _, err := m.Inspect(ctx, []buckets.Bucket{b}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if after[0].Remaining < before[0].Remaining {
		t.Fatalf("a copy of a charge applied again: %v → %v", before[0].Remaining, after[0].Remaining)
	}
	if n := buckets.Marks(m); n < 1000 {
		t.Fatalf("%d marks after 1000 charges, want one each", n)
	}
	clock.Advance(buckets.RepeatWindow + 2*time.Minute)
	touch := buckets.Request{Buckets: []buckets.Bucket{{Name: "k", Limit: buckets.Limit{Capacity: 10, Rate: 1}}}}
	for i := range 2000 {
		touch.Buckets[0].Key = "touch" + strconv.Itoa(i)
		d, err := m.Reserve(ctx, touch)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Settle(ctx, d.Reservation, 0); err != nil {
			t.Fatal(err)
		}
	}
	if n := buckets.Marks(m); n != 0 {
		t.Errorf("%d marks past the repeat window, want none", n)
	}
}
