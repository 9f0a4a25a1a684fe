package bucketstest

import (
	"context"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/tokengate/tokengate/buckets"
)

// Open opens n stores on one fresh backend, all on clock: every store sees
// the same buckets (for Redis, each through its own client). Stores are
// closed by the test's cleanup.
type Open func(t *testing.T, clock *Clock, n int) []buckets.Store

type opKind int

const (
	opReserve opKind = iota
	opSettle
	opExtend
	opPause
	opRenew
)

// step is one operation of a vector, at a simulated instant.
type step struct {
	at     time.Duration
	op     opKind
	req    buckets.Request // opReserve
	of     int             // opSettle, opExtend: index of the reserve step
	amount float64         // opSettle: actual usage; opExtend: tokens
	spent  float64         // opSettle: Reservation.Spent, the money used
	bucket buckets.Bucket  // opPause
	until  time.Duration   // opPause
	want   outcome
}

// outcome is what a step must produce. For settle steps only Remaining
// and Forgiven count; for extend steps only OK.
type outcome struct {
	OK        bool
	Reason    buckets.Reason
	Limiting  string
	Wait      time.Duration
	Remaining []float64
	Reset     []time.Duration // checked when not nil
	Forgiven  []float64       // settle steps: checked when not nil
	// Spent holds each quota's spend; Windows and QuotaReset, when not
	// nil, each quota's window ID and time to its end.
	Spent      []float64
	Windows    []string
	QuotaReset []time.Duration
}

func reserve(at time.Duration, req buckets.Request, want outcome) step {
	return step{at: at, op: opReserve, req: req, want: want}
}

func settle(at time.Duration, of int, actual float64, remaining ...float64) step {
	return step{at: at, op: opSettle, of: of, amount: actual, want: outcome{Remaining: remaining}}
}

// forgiving is a settle step that also checks what each bucket forgave.
func forgiving(at time.Duration, of int, actual float64, remaining, forgiven []float64) step {
	return step{at: at, op: opSettle, of: of, amount: actual, want: outcome{Remaining: remaining, Forgiven: forgiven}}
}

func extend(at time.Duration, of int, n float64, ok bool) step {
	return step{at: at, op: opExtend, of: of, amount: n, want: outcome{OK: ok}}
}

func renew(at time.Duration, of int) step {
	return step{at: at, op: opRenew, of: of}
}

func pause(at time.Duration, b buckets.Bucket, until time.Duration) step {
	return step{at: at, op: opPause, bucket: b, until: until}
}

func req(cost float64, bs ...buckets.Bucket) buckets.Request {
	return buckets.Request{Cost: cost, Buckets: bs}
}

func ok(limiting string, remaining ...float64) outcome {
	return outcome{OK: true, Limiting: limiting, Remaining: remaining}
}

func short(limiting string, wait time.Duration, remaining ...float64) outcome {
	return outcome{Reason: buckets.ShortOfTokens, Limiting: limiting, Wait: wait, Remaining: remaining}
}

const ms = time.Millisecond

func bucket(name string, capacity, rate float64) buckets.Bucket {
	return buckets.Bucket{Name: name, Key: name, Limit: buckets.Limit{Capacity: capacity, Rate: rate}}
}

// vector is a named sequence of steps citing the rule it checks.
type vector struct {
	name  string
	steps []step
}

func vectors() []vector {
	s6 := bucket("b", 3, 2)
	user, team := bucket("user", 10, 1), bucket("team", 5, 1)
	fast := bucket("team", 10, 4)
	b10 := bucket("b", 10, 1)
	capped := b10
	capped.Name, capped.Key, capped.MaxDebt = "capped", "capped", 4
	hard := b10
	hard.Hard = true
	hardOwn := hard
	hardOwn.Name, hardOwn.Key = "hard", "hard"
	soft5 := bucket("soft", 5, 1)
	head := b10
	head.Headroom = 3
	b2 := bucket("b", 10, 2)
	prio := req(3, head)
	prio.Priority = true
	wait := func(cost float64, d time.Duration, bs ...buckets.Bucket) buckets.Request {
		r := req(cost, bs...)
		r.MaxWait = d
		return r
	}
	slot := buckets.Slot{Name: "conc", Key: "conc", Max: 2, Lease: 10 * time.Second}
	withSlot := req(1, bucket("b", 100, 1))
	withSlot.Slots = []buckets.Slot{slot}
	shortLived := req(5, bucket("b", 100, 0.1))
	shortLived.Lifetime = 30 * time.Second
	single := req(1, bucket("b", 100, 1))
	single.Slots = []buckets.Slot{{Name: "conc", Key: "conc", Max: 1, Lease: 10 * time.Second}}
	return []vector{
		{"S6 worked example", []step{
			reserve(0, req(1, s6), ok("b", 2)),
			reserve(0, req(1, s6), ok("b", 1)),
			reserve(0, req(1, s6), outcome{OK: true, Limiting: "b", Remaining: []float64{0}, Reset: []time.Duration{1500 * ms}}),
			reserve(250*ms, req(1, s6), short("b", 250*ms, 0.5)),
			reserve(500*ms, req(1, s6), ok("b", 0)),
			reserve(500*ms, req(1, s6), short("b", 500*ms, 0)),
		}},
		{"S3 S10 chain is all or none", []step{
			reserve(0, req(4, user, team), ok("team", 6, 1)),
			reserve(0, req(2, user, team), short("team", time.Second, 6, 1)),
			reserve(0, req(1, user, team), ok("team", 5, 0)),
		}},
		{"S5 wait is the largest over short buckets", []step{
			reserve(0, req(8, user, fast), ok("user", 2, 2)),
			reserve(0, req(6, user, fast), short("user", 4*time.Second, 2, 2)),
			reserve(time.Second, req(6, user, fast), short("user", 3*time.Second, 3, 6)),
		}},
		{"S4 never admissible", []step{
			reserve(0, req(6, user, team), outcome{Reason: buckets.NeverAdmissible, Limiting: "team", Remaining: []float64{10, 5}}),
			reserve(0, req(5, user, team), ok("team", 5, 0)),
		}},
		{"S8 refund is capped and settling twice changes nothing", []step{
			reserve(0, req(8, b10), ok("b", 2)),
			settle(time.Second, 0, 2, 9),
			settle(time.Second, 0, 2, 9),
			settle(time.Second, 0, 0, 9),
			reserve(2*time.Second, req(5, b10), ok("b", 5)),
			settle(6*time.Second, 4, 0, 10),
		}},
		{"S9 debt refuses until refilled", []step{
			reserve(0, req(5, b10), ok("b", 5)),
			settle(0, 0, 12, -2),
			reserve(0, req(1, b10), short("b", 3*time.Second, -2)),
			reserve(0, req(0, b10), short("b", 2*time.Second, -2)),
			reserve(3*time.Second, req(1, b10), ok("b", 0)),
		}},
		{"S9 debt floor", []step{
			reserve(0, req(10, b10, capped), ok("b", 0, 0)),
			settle(0, 0, 100, -90, -4),
			reserve(time.Second, req(1, b10, capped), short("b", 90*time.Second, -89, -3)),
		}},
		{"S9 forgiven debt is reported per bucket", []step{
			reserve(0, req(10, b10, capped, hardOwn), ok("b", 0, 0, 0)),
			forgiving(0, 0, 100, []float64{-90, -4, 0}, []float64{0, 86, 90}),
			forgiving(0, 0, 100, []float64{-90, -4, 0}, []float64{0, 0, 0}),
			reserve(100*time.Second, req(10, b10, capped, hardOwn), ok("b", 0, 0, 0)),
			forgiving(100*time.Second, 3, 12, []float64{-2, -2, 0}, []float64{0, 0, 2}),
			forgiving(100*time.Second, 3, 0, []float64{-2, -2, 0}, []float64{0, 0, 0}),
		}},
		{"S9 a refusal writes nothing", []step{
			reserve(0, req(8, b10), ok("b", 2)),
			reserve(0, req(5, b10), short("b", 3*time.Second, 2)),
			reserve(time.Second, req(3, b10), ok("b", 0)),
		}},
		{"S9 settlement does not credit elapsed time twice", []step{
			reserve(0, req(10, b10), ok("b", 0)),
			settle(2*time.Second, 0, 10, 2),
			reserve(3*time.Second, req(3, b10), ok("b", 0)),
			reserve(4*time.Second, req(2, b10), short("b", time.Second, 1)),
		}},
		{"S14 hard bucket never goes below zero", []step{
			reserve(0, req(4, hard), ok("b", 6)),
			extend(0, 0, 5, true),
			extend(0, 0, 2, false),
			settle(0, 0, 20, 0),
			reserve(0, wait(1, 10*time.Second, hard), short("b", time.Second, 0)),
			reserve(time.Second, req(1, hard), ok("b", 0)),
		}},
		{"S14 soft buckets are charged at settlement only", []step{
			reserve(0, req(5, soft5), ok("soft", 0)),
			extend(0, 0, 100, true),
			settle(0, 0, 5, 0),
		}},
		{"S19 headroom is for priority requests", []step{
			reserve(0, req(8, head), outcome{Reason: buckets.NeverAdmissible, Limiting: "b", Remaining: []float64{10}}),
			reserve(0, req(7, head), ok("b", 3)),
			reserve(0, req(1, head), short("b", time.Second, 3)),
			reserve(0, prio, ok("b", 0)),
		}},
		{"S18 pause empties the bucket until then", []step{
			pause(0, b10, 5*time.Second),
			reserve(time.Second, req(1, b10), outcome{Reason: buckets.ShortOfTokens, Limiting: "b", Wait: 5 * time.Second, Remaining: []float64{0}, Reset: []time.Duration{14 * time.Second}}),
			reserve(5*time.Second, req(1, b10), short("b", time.Second, 0)),
			reserve(6*time.Second, req(1, b10), ok("b", 0)),
		}},
		{"S18 a pause keeps open reservations settleable", []step{
			reserve(0, req(5, b10), ok("b", 5)),
			pause(0, b10, time.Second),
			settle(0, 0, 0, 5),
			settle(0, 0, 0, 5),
		}},
		{"S18 pause keeps debt", []step{
			reserve(0, req(10, b10), ok("b", 0)),
			settle(0, 0, 12, -2),
			pause(0, b10, time.Second),
			reserve(time.Second, req(1, b10), short("b", 3*time.Second, -2)),
		}},
		{"S12 admitted ahead of time in arrival order", []step{
			reserve(0, req(10, b2), ok("b", 0)),
			reserve(0, wait(4, 3*time.Second, b2), outcome{OK: true, Limiting: "b", Wait: 2 * time.Second, Remaining: []float64{-4}}),
			reserve(0, wait(4, 3*time.Second, b2), short("b", 4*time.Second, -4)),
			reserve(0, wait(2, 5*time.Second, b2), outcome{OK: true, Limiting: "b", Wait: 3 * time.Second, Remaining: []float64{-6}}),
		}},
		{"S11 concurrency slots are released and expire", []step{
			reserve(0, withSlot, ok("b", 99)),
			reserve(0, withSlot, ok("b", 98)),
			reserve(0, withSlot, outcome{Reason: buckets.ConcurrencyFull, Limiting: "conc", Remaining: []float64{98}}),
			settle(0, 0, 1, 98),
			reserve(0, withSlot, ok("b", 97)),
			reserve(0, withSlot, outcome{Reason: buckets.ConcurrencyFull, Limiting: "conc", Remaining: []float64{97}}),
			reserve(11*time.Second, withSlot, ok("b", 99)),
		}},
		{"S8 a reservation not settled within its lifetime expires", []step{
			reserve(0, shortLived, ok("b", 95)),
			reserve(0, shortLived, ok("b", 90)),
			settle(20*time.Second, 0, 0, 97),
			settle(31*time.Second, 1, 0, 98.1),
			settle(31*time.Second, 0, 0, 98.1),
			reserve(31*time.Second, shortLived, ok("b", 93.1)),
			renew(50*time.Second, 5),
			settle(75*time.Second, 5, 3, 99.5),
		}},
		{"S11 a renewed lease keeps its slot", []step{
			reserve(0, single, ok("b", 99)),
			renew(8*time.Second, 0),
			reserve(15*time.Second, single, outcome{Reason: buckets.ConcurrencyFull, Limiting: "conc", Remaining: []float64{100}}),
			reserve(19*time.Second, single, ok("b", 99)),
		}},
	}
}

// marked returns v with mark applied to every bucket of its steps.
func (v vector) marked(mark func(buckets.Bucket) buckets.Bucket) vector {
	steps := slices.Clone(v.steps)
	for i := range steps {
		s := &steps[i]
		if s.op == opPause {
			s.bucket = mark(s.bucket)
		}
		bs := make([]buckets.Bucket, len(s.req.Buckets))
		for j, b := range s.req.Buckets {
			bs[j] = mark(b)
		}
		s.req.Buckets = bs
	}
	v.steps = steps
	return v
}

// scope gives the keys of a request their test's namespace, so that
// vectors sharing one Redis do not meet.
func scope(ns string, r buckets.Request) buckets.Request {
	bs := make([]buckets.Bucket, len(r.Buckets))
	for i, b := range r.Buckets {
		b.Key = ns + "/" + b.Key
		bs[i] = b
	}
	ss := make([]buckets.Slot, len(r.Slots))
	for i, s := range r.Slots {
		s.Key = ns + "/" + s.Key
		ss[i] = s
	}
	qs := make([]buckets.Quota, len(r.Quotas))
	for i, q := range r.Quotas {
		q.Key = ns + "/" + q.Key
		qs[i] = q
	}
	r.Buckets, r.Slots, r.Quotas = bs, ss, qs
	if len(qs) == 0 {
		r.Quotas = nil
	}
	return r
}

// durationsClose compares durations to the microsecond, the Redis store's
// resolution.
var durationsClose = cmp.Comparer(func(a, b time.Duration) bool {
	d := a - b
	return d <= time.Microsecond && d >= -time.Microsecond
})

var floatsClose = cmpopts.EquateApprox(0, 1e-9)

func got(d buckets.Decision, want outcome) outcome {
	o := outcome{OK: d.OK, Reason: d.Reason, Limiting: d.Limiting, Wait: d.Wait}
	for _, b := range d.Buckets {
		o.Remaining = append(o.Remaining, b.Remaining)
		if want.Reset != nil {
			o.Reset = append(o.Reset, b.Reset)
		}
	}
	for _, q := range d.Quotas {
		o.Spent = append(o.Spent, q.Spent)
		if q.Remaining != q.Limit-q.Spent {
			o.Spent = append(o.Spent, math.NaN()) // an inconsistent state never matches
		}
		if want.Windows != nil {
			o.Windows = append(o.Windows, q.Window)
		}
		if want.QuotaReset != nil {
			o.QuotaReset = append(o.QuotaReset, q.Reset)
		}
	}
	return o
}

// Run runs every step vector against the stores open returns.
func Run(t *testing.T, open Open) { runVectors(t, open, nil, nil) }

// runVectors runs the step vectors not named in skip, with mark applied to
// every bucket when it is not nil.
func runVectors(t *testing.T, open Open, mark func(buckets.Bucket) buckets.Bucket, skip []string) {
	for _, v := range append(vectors(), quotaVectors()...) {
		if slices.Contains(skip, v.name) {
			continue
		}
		if mark != nil {
			v = v.marked(mark)
		}
		t.Run(v.name, func(t *testing.T) {
			clock := NewClock()
			st := open(t, clock, 1)[0]
			ctx := context.Background()
			res := make([]*buckets.Reservation, len(v.steps))
			for i, s := range v.steps {
				clock.Set(s.at)
				switch s.op {
				case opReserve:
					d, err := st.Reserve(ctx, scope(t.Name(), s.req))
					if err != nil {
						t.Fatalf("step %d: Reserve: %v", i, err)
					}
					if diff := cmp.Diff(s.want, got(d, s.want), durationsClose, floatsClose); diff != "" {
						t.Errorf("step %d: Reserve at +%v (-want +got):\n%s", i, s.at, diff)
					}
					if d.OK != (d.Reservation != nil) {
						t.Errorf("step %d: OK = %v but Reservation = %v", i, d.OK, d.Reservation)
					}
					res[i] = d.Reservation
				case opSettle:
					res[s.of].Spent = s.spent
					states, err := st.Settle(ctx, res[s.of], s.amount)
					if err != nil {
						t.Fatalf("step %d: Settle: %v", i, err)
					}
					var rem, forgiven []float64
					for _, b := range states {
						rem = append(rem, b.Remaining)
						forgiven = append(forgiven, b.Forgiven)
					}
					if diff := cmp.Diff(s.want.Remaining, rem, floatsClose); diff != "" {
						t.Errorf("step %d: Settle(%v) at +%v remaining (-want +got):\n%s", i, s.amount, s.at, diff)
					}
					if s.want.Forgiven != nil {
						if diff := cmp.Diff(s.want.Forgiven, forgiven, floatsClose); diff != "" {
							t.Errorf("step %d: Settle(%v) at +%v forgiven (-want +got):\n%s", i, s.amount, s.at, diff)
						}
					}
				case opExtend:
					ok, err := st.Extend(ctx, res[s.of], s.amount)
					if err != nil {
						t.Fatalf("step %d: Extend: %v", i, err)
					}
					if ok != s.want.OK {
						t.Errorf("step %d: Extend(%v) at +%v = %v, want %v", i, s.amount, s.at, ok, s.want.OK)
					}
				case opRenew:
					rn, ok := st.(buckets.Renewer)
					if !ok {
						t.Fatalf("step %d: the store does not implement buckets.Renewer", i)
					}
					if err := rn.Renew(ctx, res[s.of]); err != nil {
						t.Fatalf("step %d: Renew: %v", i, err)
					}
				case opPause:
					b := s.bucket
					b.Key = t.Name() + "/" + b.Key
					if err := st.Pause(ctx, b, Epoch.Add(s.until)); err != nil {
						t.Fatalf("step %d: Pause: %v", i, err)
					}
				}
			}
		})
	}
	t.Run("inspect", func(t *testing.T) { RunInspect(t, open) })
	t.Run("list spend", func(t *testing.T) { RunListSpend(t, open) })
	t.Run("unit switch", func(t *testing.T) { RunUnitSwitch(t, open) })
}

// RunInvalid checks that every store refuses invalid input with an error
// naming the problem, and writes nothing.
func RunInvalid(t *testing.T, open Open) {
	clock := NewClock()
	st := open(t, clock, 1)[0]
	ctx := context.Background()
	good := bucket("b", 10, 1)
	good.Key = t.Name() + "/b"
	cases := []struct {
		name string
		req  buckets.Request
		want string
	}{
		{"zero capacity", req(1, bucket("b", 0, 1)), "capacity"},
		{"negative rate", req(1, bucket("b", 1, -1)), "rate"},
		{"NaN cost", req(math.NaN(), good), "cost"},
		{"negative cost", req(-1, good), "cost"},
		{"empty key", req(1, buckets.Bucket{Name: "x", Limit: buckets.Limit{Capacity: 1, Rate: 1}}), "key"},
		{"headroom over capacity", req(1, buckets.Bucket{Name: "x", Key: "x", Limit: buckets.Limit{Capacity: 1, Rate: 1}, Headroom: 1}), "headroom"},
		{"duplicate key", req(1, good, good), "share the key"},
		{"slot without max", buckets.Request{Cost: 1, Slots: []buckets.Slot{{Name: "c", Key: "c"}}}, "max"},
		{"quota without limit", qreq(1, buckets.Quota{Name: "q", Key: "q", Window: window("day", "UTC")}), "limit"},
		{"quota without window", qreq(1, buckets.Quota{Name: "q", Key: "q", Limit: 10}), "window"},
		{"quota without key", qreq(1, buckets.Quota{Name: "q", Window: window("day", "UTC"), Limit: 10}), "key"},
		{"duplicate quota key", qreq(1, quota("q", 10, window("day", "UTC")), quota("q", 20, window("month", "UTC"))), "share the key"},
		{"NaN money", priced(1, math.NaN(), 0, nil, moneyQuota(quota("q", 10, window("day", "UTC")))), "money"},
		{"negative money per token", priced(1, 1, -1, nil), "money per token"},
	}
	for _, c := range cases {
		_, err := st.Reserve(ctx, c.req)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Reserve error = %v, want one naming %q", c.name, err, c.want)
		}
	}
	d, err := st.Reserve(ctx, req(1, good))
	if err != nil || !d.OK || d.Buckets[0].Remaining != 9 {
		t.Fatalf("Reserve after refusals = %+v, %v; want admitted with 9 remaining", d, err)
	}
	if _, err := st.Settle(ctx, d.Reservation, -1); err == nil {
		t.Error("Settle(-1) succeeded, want an error")
	}
	if _, err := st.Extend(ctx, d.Reservation, math.Inf(1)); err == nil {
		t.Error("Extend(+Inf) succeeded, want an error")
	}
	q := scope(t.Name(), qreq(1, quota("q", 10, window("day", "UTC"))))
	dq, err := st.Reserve(ctx, q)
	if err != nil || !dq.OK {
		t.Fatalf("Reserve with a quota = %+v, %v; want admitted", dq, err)
	}
	forged := *dq.Reservation
	forged.Windows = nil
	if _, err := st.Settle(ctx, &forged, 1); err == nil || !strings.Contains(err.Error(), "windows") {
		t.Errorf("Settle of a reservation without its windows: %v; want an error naming them", err)
	}
	dq.Reservation.Spent = -1
	if _, err := st.Settle(ctx, dq.Reservation, 1); err == nil || !strings.Contains(err.Error(), "spent") {
		t.Errorf("Settle with negative Spent: %v; want an error naming it", err)
	}
}
