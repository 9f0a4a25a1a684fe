package bucketstest

import (
	"context"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// Lender is a store that lends slices of its buckets (S20): Memory and the
// Redis store. Package lease builds local sub-budgets on it.
type Lender interface {
	buckets.Store
	Lease(ctx context.Context, ops []buckets.LeaseOp) error
}

// leaseStep is one step of a lease vector at a simulated instant: a lease
// op, or a pause, reservation or settlement of the vector's bucket.
type leaseStep struct {
	at     time.Duration
	kind   leaseKind
	op     buckets.LeaseOp
	want   leaseOutcome
	amount float64       // reserve: the cost (must be admitted); settle: the usage
	until  time.Duration // pause
}

type leaseKind int

const (
	leaseLend leaseKind = iota
	leasePause
	leaseReserve
	leaseSettle // the last reservation
)

type leaseOutcome struct {
	OK       bool
	Granted  float64
	Level    float64
	Hold     time.Duration
	Forgiven float64
}

func lend(at time.Duration, b buckets.Bucket, give, need, want float64, out leaseOutcome) leaseStep {
	return leaseStep{at: at, op: buckets.LeaseOp{Bucket: b, Give: give, Need: need, Want: want}, want: out}
}

func granted(n, level float64) leaseOutcome { return leaseOutcome{OK: true, Granted: n, Level: level} }

// RunLender checks the lease op of a lending store (buckets.LeaseOp) step
// by step, on a simulated clock: what it grants, where the headroom, the
// floor, a pause and admission ahead of time stop it, that a refusal
// writes nothing, and that it keeps the records of open reservations in
// the buckets it rewrites. Every lending store must answer identically.
func RunLender(t *testing.T, open Open) {
	head := bucket("b", 10, 1)
	head.Headroom = 2
	capped := bucket("b", 10, 1)
	capped.MaxDebt = 4
	soft := bucket("soft", 10, 2)
	hard := bucket("hard", 10, 2)
	hard.Hard = true
	b10 := bucket("b", 10, 1)
	prio := func(s leaseStep) leaseStep { s.op.Priority = true; return s }
	wait := func(s leaseStep, d time.Duration) leaseStep { s.op.MaxWait = d; return s }
	vectors := []struct {
		name  string
		steps []leaseStep
	}{
		{"S19 a lease takes need and what lies above the headroom, up to want", []leaseStep{
			lend(0, head, 0, 3, 6, granted(6, 4)),
			lend(0, head, 0, 1, 6, granted(2, 2)),
			lend(0, head, 0, 1, 6, leaseOutcome{Level: 2}),
			prio(lend(0, head, 0, 1, 6, granted(1, 1))),
			lend(0, head, 0, 0, 6, leaseOutcome{Level: 1}),
			prio(lend(0, head, 0, 0, 6, granted(0, 1))),
		}},
		{"S9 a refusal writes nothing", []leaseStep{
			lend(0, b10, 0, 8, 0, granted(8, 2)),
			lend(0, b10, 0, 5, 9, leaseOutcome{Level: 2}),
			lend(time.Second, b10, 0, 3, 0, granted(3, 0)),
		}},
		{"S4 a need above capacity is refused", []leaseStep{
			lend(0, b10, 0, 11, 11, leaseOutcome{Level: 10}),
			lend(0, b10, 0, 10, 11, granted(10, 0)),
		}},
		{"S8 S9 give refunds up to capacity and debits down to the floor", []leaseStep{
			lend(0, capped, 0, 10, 0, granted(10, 0)),
			lend(0, capped, -20, 0, 0, leaseOutcome{Level: -4, Forgiven: 16}),
			lend(time.Second, capped, -2, 0, 0, leaseOutcome{Level: -4, Forgiven: 1}),
			lend(time.Second, capped, 6, 0, 0, granted(0, 2)),
			lend(time.Second, capped, 100, 4, 5, granted(5, 5)),
		}},
		{"S12 S14 ahead of time for need only, and never for hard buckets", []leaseStep{
			lend(0, soft, 0, 10, 0, granted(10, 0)),
			wait(lend(0, soft, 0, 4, 8, granted(4, -4)), 3*time.Second),
			wait(lend(0, soft, 0, 4, 8, leaseOutcome{Level: -4}), 3*time.Second),
			lend(0, hard, 0, 10, 0, granted(10, 0)),
			wait(lend(0, hard, 0, 4, 8, leaseOutcome{Level: 0}), 3*time.Second),
			lend(2*time.Second, hard, 0, 4, 8, granted(4, 0)),
		}},
		{"S18 a paused bucket lends nothing until refill resumes", []leaseStep{
			{kind: leasePause, op: buckets.LeaseOp{Bucket: b10}, until: 2 * time.Second},
			lend(time.Second, b10, 0, 0, 5, leaseOutcome{Level: 0, Hold: time.Second}),
			lend(time.Second, b10, 3, 0, 5, leaseOutcome{Level: 3, Hold: time.Second}),
			lend(2*time.Second, b10, 0, 0, 5, granted(3, 0)),
			lend(3*time.Second, b10, 0, 0, 5, granted(1, 0)),
		}},
		{"S8 a lease keeps the records of open reservations", []leaseStep{
			{kind: leaseReserve, op: buckets.LeaseOp{Bucket: b10}, amount: 4},
			lend(0, b10, 0, 2, 3, granted(3, 3)),
			lend(0, b10, 2, 0, 0, granted(0, 5)),
			{kind: leaseSettle, op: buckets.LeaseOp{Bucket: b10}, amount: 1},
			lend(0, b10, 0, 0, 0, granted(0, 8)),
			{kind: leaseSettle, op: buckets.LeaseOp{Bucket: b10}, amount: 0},
			lend(0, b10, 0, 0, 0, granted(0, 8)),
		}},
	}
	for _, v := range vectors {
		t.Run(v.name, func(t *testing.T) {
			clock := NewClock()
			st, ok := open(t, clock, 1)[0].(Lender)
			if !ok {
				t.Fatal("the store does not lend (no Lease method)")
			}
			ctx := context.Background()
			var res *buckets.Reservation
			for i, s := range v.steps {
				clock.Set(s.at)
				b := s.op.Bucket
				b.Key = t.Name() + "/" + b.Key
				switch s.kind {
				case leasePause:
					if err := st.Pause(ctx, b, Epoch.Add(s.until)); err != nil {
						t.Fatalf("step %d: Pause: %v", i, err)
					}
				case leaseReserve:
					d, err := st.Reserve(ctx, buckets.Request{Cost: s.amount, Buckets: []buckets.Bucket{b}})
					if err != nil || !d.OK {
						t.Fatalf("step %d: Reserve(%v) = %+v, %v; want admitted", i, s.amount, d, err)
					}
					res = d.Reservation
				case leaseSettle:
					if _, err := st.Settle(ctx, res, s.amount); err != nil {
						t.Fatalf("step %d: Settle: %v", i, err)
					}
				default:
					ops := []buckets.LeaseOp{s.op}
					ops[0].Bucket = b
					if err := st.Lease(ctx, ops); err != nil {
						t.Fatalf("step %d: Lease: %v", i, err)
					}
					op := ops[0]
					if !op.Done {
						t.Errorf("step %d: op not Done after a Lease without error", i)
					}
					got := leaseOutcome{OK: op.OK, Granted: op.Granted, Level: op.Observation.Level, Hold: op.Observation.Hold, Forgiven: op.Observation.Forgiven}
					if diff := cmp.Diff(s.want, got, durationsClose, floatsClose); diff != "" {
						t.Errorf("step %d: Lease(give %v, need %v, want %v) at +%v (-want +got):\n%s", i, s.op.Give, s.op.Need, s.op.Want, s.at, diff)
					}
				}
			}
		})
	}
}
