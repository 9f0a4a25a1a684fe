package bucketstest

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// maxWaitLimit bounds the MaxWait of random requests; with it, admission
// ahead of time drives a bucket at most rate × maxWaitLimit below zero.
const maxWaitLimit = 2 * time.Second

// RunProperty runs random sequences of reserve, extend, settle, pause and
// clock steps against the store that open returns and, in lockstep, against
// a Memory store on the same clock. It checks that the two agree and that
// the invariants hold: level ≤ capacity; level ≥ the floor (or the depth
// that admission ahead of time allows); hard buckets ≥ 0; and tokens
// admitted over any interval ≤ capacity + rate × (interval + max wait) +
// what was refunded in it.
func RunProperty(t *testing.T, open Open, seeds, steps int) {
	for seed := range seeds {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			property(t, open, uint64(seed), steps)
		})
	}
}

type event struct {
	at       time.Duration
	admitted float64
	refunded float64
}

func property(t *testing.T, open Open, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 0x70c3))
	clock := NewClock()
	st := open(t, clock, 1)[0]
	ref := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
	ctx := context.Background()

	soft := bucket("soft", 20, 2)
	hard := bucket("hard", 15, 1.5)
	hard.Hard = true
	wide := bucket("wide", 50, 5)
	wide.Headroom, wide.MaxDebt = 5, 10
	all := []buckets.Bucket{soft, hard, wide}
	for i := range all {
		all[i].Key = t.Name() + "/" + all[i].Key
	}
	// Quotas: one of tokens, one of money that is hard, one hard in
	// another zone; their spends are compared with the memory store's.
	quotas := []buckets.Quota{
		quota("daily", 300, window("day", "UTC")),
		hardQuota(moneyQuota(quota("spend", 20_000, window("month", "Europe/Amsterdam")))),
		hardQuota(quota("weekly", 250, window("week", "Asia/Kolkata"))),
	}
	for i := range quotas {
		quotas[i].Key = t.Name() + "/" + quotas[i].Key
	}
	events := map[string][]event{}
	var elapsed time.Duration
	type pair struct{ a, b *buckets.Reservation }
	var pending []pair

	check := func(i int, what string, states []buckets.BucketState, chain []buckets.Bucket) {
		for k, s := range states {
			b := chain[k]
			low := math.Min(b.Floor(), -b.Limit.Rate*maxWaitLimit.Seconds())
			if b.Hard {
				low = 0
			}
			if s.Remaining > b.Limit.Capacity+1e-9 || s.Remaining < low-1e-9 {
				t.Fatalf("step %d %s: bucket %s level %v outside [%v, %v]", i, what, b.Name, s.Remaining, low, b.Limit.Capacity)
			}
		}
	}
	for i := range steps {
		switch op := rng.IntN(10); {
		case op < 4: // reserve
			var chain []buckets.Bucket
			for _, b := range all {
				if rng.IntN(2) == 0 {
					chain = append(chain, b)
				}
			}
			r := buckets.Request{Cost: math.Round(rng.Float64()*2200) / 100, Buckets: chain, Priority: rng.IntN(4) == 0}
			for _, q := range quotas {
				if rng.IntN(3) == 0 {
					r.Quotas = append(r.Quotas, q)
				}
			}
			r.Money, r.MoneyPerToken = float64(rng.IntN(2500)), float64(rng.IntN(40))/8
			if rng.IntN(3) == 0 {
				r.MaxWait = time.Duration(rng.IntN(int(maxWaitLimit/(100*time.Millisecond)))) * 100 * time.Millisecond
			}
			d, err := st.Reserve(ctx, r)
			if err != nil {
				t.Fatalf("step %d: Reserve: %v", i, err)
			}
			w, err := ref.Reserve(ctx, r)
			if err != nil {
				t.Fatalf("step %d: memory Reserve: %v", i, err)
			}
			if diff := cmp.Diff(got(w, outcome{}), got(d, outcome{}), durationsClose, floatsClose); diff != "" {
				t.Fatalf("step %d: Reserve(%+v) disagrees with the memory store (-memory +store):\n%s", i, r, diff)
			}
			check(i, "reserve", d.Buckets, chain)
			if d.OK {
				for _, b := range chain {
					events[b.Key] = append(events[b.Key], event{at: elapsed, admitted: r.Cost})
				}
				pending = append(pending, pair{d.Reservation, w.Reservation})
			}
		case op < 6 && len(pending) > 0: // settle, sometimes twice
			k := rng.IntN(len(pending))
			p := pending[k]
			actual := math.Round(rng.Float64()*3000) / 100
			p.a.Spent = float64(rng.IntN(3000))
			p.b.Spent = p.a.Spent
			states, err := st.Settle(ctx, p.a, actual)
			if err != nil {
				t.Fatalf("step %d: Settle: %v", i, err)
			}
			want, err := ref.Settle(ctx, p.b, actual)
			if err != nil {
				t.Fatalf("step %d: memory Settle: %v", i, err)
			}
			if diff := cmp.Diff(want, states, durationsClose, floatsClose); diff != "" {
				t.Fatalf("step %d: Settle disagrees with the memory store (-memory +store):\n%s", i, diff)
			}
			check(i, "settle", states, p.a.Buckets)
			for _, b := range p.a.Buckets {
				if delta := p.a.Charged(b) - actual; delta > 0 {
					events[b.Key] = append(events[b.Key], event{at: elapsed, refunded: delta})
				}
			}
			if rng.IntN(3) > 0 {
				pending = append(pending[:k], pending[k+1:]...)
			}
		case op < 7 && len(pending) > 0: // extend
			p := pending[rng.IntN(len(pending))]
			n := math.Round(rng.Float64()*500) / 100
			okA, err := st.Extend(ctx, p.a, n)
			if err != nil {
				t.Fatalf("step %d: Extend: %v", i, err)
			}
			okB, _ := ref.Extend(ctx, p.b, n)
			if okA != okB {
				t.Fatalf("step %d: Extend(%v) = %v, memory store says %v", i, n, okA, okB)
			}
			if okA {
				for _, b := range p.a.Buckets {
					if b.Hard {
						events[b.Key] = append(events[b.Key], event{at: elapsed, admitted: n})
					}
				}
			}
		case op < 8 && rng.IntN(8) == 0: // pause
			b := all[rng.IntN(len(all))]
			until := clock.Now().Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
			if err := st.Pause(ctx, b, until); err != nil {
				t.Fatalf("step %d: Pause: %v", i, err)
			}
			ref.Pause(ctx, b, until)
		default:
			d := time.Duration(rng.IntN(1_500_000)) * time.Microsecond
			if rng.IntN(50) == 0 { // now and then into another window
				d = time.Duration(rng.IntN(40)) * time.Hour
			}
			clock.Advance(d)
			elapsed += d
		}
		if i%50 == 49 {
			_, got := inspectAll(t, st, nil, quotas)
			_, want := inspectAll(t, ref, nil, quotas)
			if diff := cmp.Diff(want, got, durationsClose, floatsClose); diff != "" {
				t.Fatalf("step %d: quotas disagree with the memory store (-memory +store):\n%s", i, diff)
			}
		}
	}
	for _, b := range all {
		admissionBound(t, b, events[b.Key])
	}
}

// admissionBound checks that over every interval ending at an admission,
// the tokens admitted do not exceed what the bucket could give.
func admissionBound(t *testing.T, b buckets.Bucket, ev []event) {
	t.Helper()
	slack := b.Limit.Rate * maxWaitLimit.Seconds()
	if b.Hard {
		slack = 0
	}
	for j := range ev {
		if ev[j].admitted == 0 {
			continue
		}
		var admitted, refunded float64
		for i := j; i >= 0; i-- {
			admitted += ev[i].admitted
			refunded += ev[i].refunded
			bound := b.Limit.Capacity + b.Limit.Rate*(ev[j].at-ev[i].at).Seconds() + slack + refunded
			if admitted > bound+1e-6 {
				t.Fatalf("bucket %s: %v tokens admitted in [%v, %v], more than %v", b.Name, admitted, ev[i].at, ev[j].at, bound)
			}
		}
	}
}
