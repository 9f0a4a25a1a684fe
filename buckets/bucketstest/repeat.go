package bucketstest

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// RunRepeat checks that the calls a store may receive twice apply once
// (see buckets.Store and buckets.Replayer), as every store must answer
// them identically: a Reserve repeated with the ID of an open reservation
// takes nothing and is admitted; a Cancel gives a reservation back, once,
// and a Reserve of its ID is refused for buckets.RepeatWindow; a Replay
// charges the usage also after the record has expired, once; AddSpend
// adds once per ID. The stores open returns must be Replayers, SpendAdders
// and Inspectors.
func RunRepeat(t *testing.T, open Open) {
	clock := NewClock()
	st := open(t, clock, 1)[0]
	rp, ok := st.(buckets.Replayer)
	add, ok2 := st.(buckets.SpendAdder)
	in, ok3 := st.(Inspector)
	if !ok || !ok2 || !ok3 {
		t.Fatalf("%T does not implement Replayer, SpendAdder and Inspector", st)
	}
	ctx := context.Background()
	day := window("day", "UTC")
	b := bucket("b", 1000, 1e-9)
	b.Key = t.Name() + "/b"
	q := quota("q", 10_000, day)
	q.Key = t.Name() + "/q"
	req := func(id string, life time.Duration) buckets.Request {
		return buckets.Request{ID: id, Cost: 100, Lifetime: life, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
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
	reserve := func(r buckets.Request) buckets.Decision {
		t.Helper()
		d, err := st.Reserve(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}

	a := reserve(req("a", 0))
	if again := reserve(req("a", 0)); !a.OK || !again.OK {
		t.Fatalf("Reserve and its repeat = %v, %v; want both admitted", a.Reason, again.Reason)
	}
	check("a reserve and its repeat", 900, 100)
	for range 2 {
		if _, err := st.Settle(ctx, a.Reservation, 40); err != nil {
			t.Fatal(err)
		}
	}
	check("settled at 40, twice", 960, 40)

	c := reserve(req("c", 0))
	for range 2 {
		if err := rp.Cancel(ctx, c.Reservation); err != nil {
			t.Fatal(err)
		}
	}
	check("a reserve cancelled, twice", 960, 40)
	if d := reserve(req("c", 0)); d.OK {
		t.Errorf("a Reserve of a cancelled ID was admitted, want refused for the repeat window")
	}
	check("a Reserve of a cancelled ID", 960, 40)
	clock.Advance(buckets.RepeatWindow)
	d := reserve(req("c", 0))
	if !d.OK {
		t.Fatalf("a Reserve of a cancelled ID after the repeat window = %v, want admitted", d.Reason)
	}
	if _, err := st.Settle(ctx, d.Reservation, 0); err != nil {
		t.Fatal(err)
	}

	e := reserve(req("e", time.Minute))
	clock.Advance(2 * time.Minute)
	if _, err := st.Settle(ctx, e.Reservation, 10); err != nil {
		t.Fatal(err)
	}
	check("a settle after the reservation's lifetime", 860, 140)
	for range 2 {
		if _, err := rp.Replay(ctx, e.Reservation, 10, false); err != nil {
			t.Fatal(err)
		}
	}
	check("its replay, twice", 950, 50)

	spend := []buckets.Spend{{Quota: q, Window: day.Span(clock.Now()), Amount: 5}}
	for range 2 {
		if err := add.AddSpend(ctx, "s", spend); err != nil {
			t.Fatal(err)
		}
	}
	check("spend added twice under one ID", 950, 55)
}
