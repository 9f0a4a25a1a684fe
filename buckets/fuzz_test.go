package buckets_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
)

// FuzzMemory drives the memory store with operation sequences decoded from
// the input and checks the bucket invariants after every step: level ≤
// capacity; level ≥ the floor or the depth of admission ahead of time; hard
// buckets ≥ 0; a refused request changes nothing.
func FuzzMemory(f *testing.F) {
	f.Add([]byte{0, 10, 0, 20, 1, 5, 2, 3, 3, 200, 0, 1})
	f.Add([]byte{0, 255, 0, 30, 0, 30, 4, 1, 0, 9, 1, 0, 2, 50, 5, 7})
	f.Fuzz(func(t *testing.T, ops []byte) {
		clock := bucketstest.NewClock()
		m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now, SweepEvery: time.Second})
		ctx := context.Background()
		soft := buckets.Bucket{Name: "soft", Key: "soft", Limit: buckets.Limit{Capacity: 20, Rate: 2}}
		hard := buckets.Bucket{Name: "hard", Key: "hard", Limit: buckets.Limit{Capacity: 10, Rate: 1}, Hard: true}
		wide := buckets.Bucket{Name: "wide", Key: "wide", Limit: buckets.Limit{Capacity: 40, Rate: 4}, Headroom: 4, MaxDebt: 8}
		all := []buckets.Bucket{soft, hard, wide}
		const maxWait = 2 * time.Second
		var open []*buckets.Reservation
		levels := func() []float64 {
			d, err := m.Reserve(ctx, buckets.Request{Cost: 0, Buckets: all, Priority: true})
			if err != nil {
				t.Fatal(err)
			}
			var ls []float64
			for i, s := range d.Buckets {
				b := all[i]
				low := math.Min(b.Floor(), -b.Limit.Rate*maxWait.Seconds())
				if b.Hard {
					low = 0
				}
				if s.Remaining > b.Limit.Capacity || s.Remaining < low-1e-9 {
					t.Fatalf("bucket %s level %v outside [%v, %v]", b.Name, s.Remaining, low, b.Limit.Capacity)
				}
				ls = append(ls, s.Remaining)
			}
			return ls
		}
		for len(ops) >= 2 {
			op, arg := ops[0], float64(ops[1])
			ops = ops[2:]
			switch op % 6 {
			case 0, 1: // reserve a chain chosen by the argument's low bits
				var chain []buckets.Bucket
				for i, b := range all {
					if int(arg)&(1<<i) != 0 {
						chain = append(chain, b)
					}
				}
				r := buckets.Request{Cost: arg / 6, Buckets: chain, Priority: op%2 == 1}
				if op%12 >= 6 {
					r.MaxWait = maxWait
				}
				before := levels()
				d, err := m.Reserve(ctx, r)
				if err != nil {
					t.Fatal(err)
				}
				if d.OK {
					open = append(open, d.Reservation)
				} else if after := levels(); !equal(before, after) {
					t.Fatalf("refused request changed levels %v to %v", before, after)
				}
			case 2:
				if len(open) > 0 {
					r := open[int(arg)%len(open)]
					if _, err := m.Settle(ctx, r, arg/4); err != nil {
						t.Fatal(err)
					}
				}
			case 3:
				if len(open) > 0 {
					if _, err := m.Extend(ctx, open[int(arg)%len(open)], arg/32); err != nil {
						t.Fatal(err)
					}
				}
			case 4:
				if err := m.Pause(ctx, all[int(arg)%3], clock.Now().Add(time.Duration(arg)*10*time.Millisecond)); err != nil {
					t.Fatal(err)
				}
			case 5:
				clock.Advance(time.Duration(arg) * 7 * time.Millisecond)
			}
			levels()
		}
	})
}

func equal(a, b []float64) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return len(a) == len(b)
}
