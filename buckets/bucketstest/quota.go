package bucketstest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// utc reads an RFC 3339 instant; the vectors are written in UTC.
func utc(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		panic(err)
	}
	return t
}

// at is the step offset of the UTC instant s: Clock.Set(at(s)) stands the
// clock at s.
func at(s string) time.Duration { return utc(s).Sub(Epoch) }

func window(period, zone string) buckets.Window {
	w, err := buckets.ParseWindow(period, zone)
	if err != nil {
		panic(err)
	}
	return w
}

func quota(name string, limit float64, w buckets.Window) buckets.Quota {
	return buckets.Quota{Name: name, Key: name, Window: w, Limit: limit}
}

func hardQuota(q buckets.Quota) buckets.Quota {
	q.Hard = true
	return q
}

func moneyQuota(q buckets.Quota) buckets.Quota {
	q.Unit = buckets.Money
	return q
}

func qreq(cost float64, qs ...buckets.Quota) buckets.Request {
	return buckets.Request{Cost: cost, Quotas: qs}
}

// priced is a request of cost tokens and at most money micro-units, whose
// extensions cost perToken each.
func priced(cost, money, perToken float64, bs []buckets.Bucket, qs ...buckets.Quota) buckets.Request {
	return buckets.Request{Cost: cost, Money: money, MoneyPerToken: perToken, Buckets: bs, Quotas: qs}
}

// lived gives a request a lifetime of 30 s.
func lived(r buckets.Request) buckets.Request {
	r.Lifetime = 30 * time.Second
	return r
}

func settleSpent(at time.Duration, of int, actual, spent float64) step {
	return step{at: at, op: opSettle, of: of, amount: actual, spent: spent}
}

// inWindow is an admission that leaves spent in the window id, which ends
// after reset.
func inWindow(spent float64, id string, reset time.Duration) outcome {
	return outcome{OK: true, Spent: []float64{spent}, Windows: []string{id}, QuotaReset: []time.Duration{reset}}
}

func overQuota(limiting string, wait time.Duration, spent ...float64) outcome {
	return outcome{Reason: buckets.OverQuota, Limiting: limiting, Wait: wait, Spent: spent}
}

// endOfEpochDay is the step offset of the end of the UTC day that holds
// Epoch (2027-01-15T08:00Z).
var endOfEpochDay = at("2027-01-16T00:00:00Z")

func quotaVectors() []vector {
	monthly := quota("monthly", 1000, window("month", "Europe/Amsterdam"))
	day := window("day", "UTC")
	daily := quota("daily", 15, day)
	b := bucket("b", 10, 1)
	withBucket := func(cost float64) buckets.Request {
		r := qreq(cost, daily)
		r.Buckets = []buckets.Bucket{b}
		return r
	}
	soft := quota("daily", 10, day)
	hard := hardQuota(quota("daily", 10, day))
	hardBucket := bucket("hb", 100, never)
	hardBucket.Hard = true
	mixed := func(cost float64) buckets.Request {
		r := qreq(cost, soft)
		r.Buckets = []buckets.Bucket{hardBucket}
		return r
	}
	tokens := quota("tokens", 10000, day)
	spend := hardQuota(moneyQuota(quota("spend", 1_000_000, day)))
	money := func(cost, micros float64) buckets.Request { return priced(cost, micros, 10, nil, tokens, spend) }
	h := time.Hour
	return []vector{
		// The worked example of calendar quotas (docs: quota windows): a
		// budget of 1000 tokens a month in Europe/Amsterdam, across the DST
		// start of 2026-03-29, the month end of 2026-03-31 (local midnight
		// is 22:00Z), and the month end of 2026-10-31, after the DST end
		// (local midnight is 23:00Z). Each window starts from zero exactly
		// at local midnight, and a refusal waits for it.
		{"quota worked example: a month in Europe/Amsterdam", []step{
			reserve(at("2026-02-28T22:59:59.999999Z"), qreq(900, monthly), inWindow(900, "2026-02", time.Microsecond)),
			reserve(at("2026-02-28T23:00:00Z"), qreq(600, monthly), inWindow(600, "2026-03", 743*h)),
			reserve(at("2026-03-29T00:59:59Z"), qreq(100, monthly), inWindow(700, "2026-03", 69*h+time.Second)),
			reserve(at("2026-03-29T01:00:00Z"), qreq(100, monthly), inWindow(800, "2026-03", 69*h)),
			reserve(at("2026-03-31T21:59:59Z"), qreq(500, monthly), overQuota("monthly", time.Second, 800)),
			reserve(at("2026-03-31T21:59:59.999999Z"), qreq(200, monthly), inWindow(1000, "2026-03", time.Microsecond)),
			reserve(at("2026-03-31T22:00:00Z"), qreq(500, monthly), inWindow(500, "2026-04", 720*h)),
			// Settled after its window ended, the request of step 5 is
			// charged to March, not to April.
			settle(at("2026-03-31T22:00:01Z"), 5, 50),
			reserve(at("2026-03-31T22:00:01Z"), qreq(0, monthly), inWindow(500, "2026-04", 720*h-time.Second)),
			reserve(at("2026-04-15T00:00:00Z"), qreq(1001, monthly), outcome{Reason: buckets.NeverAdmissible, Limiting: "monthly", Spent: []float64{500}}),
			reserve(at("2026-10-31T22:30:00Z"), qreq(1000, monthly), inWindow(1000, "2026-10", 30*time.Minute)),
			reserve(at("2026-10-31T22:59:59Z"), qreq(1, monthly), overQuota("monthly", time.Second, 1000)),
			reserve(at("2026-10-31T23:00:00Z"), qreq(1000, monthly), inWindow(1000, "2026-11", 720*h)),
		}},
		{"S3 quotas and buckets are all or none", []step{
			reserve(0, withBucket(8), outcome{OK: true, Limiting: "b", Remaining: []float64{2}, Spent: []float64{8}}),
			reserve(0, withBucket(5), outcome{Reason: buckets.ShortOfTokens, Limiting: "b", Wait: 3 * time.Second, Remaining: []float64{2}, Spent: []float64{8}}),
			reserve(10*time.Second, withBucket(8), outcome{Reason: buckets.OverQuota, Limiting: "daily", Wait: endOfEpochDay - 10*time.Second, Remaining: []float64{10}, Spent: []float64{8}}),
			reserve(10*time.Second, withBucket(7), outcome{OK: true, Limiting: "b", Remaining: []float64{3}, Spent: []float64{15}}),
		}},
		{"a quota records all that is used, and an overspent window refuses until it ends", []step{
			reserve(0, qreq(5, soft), inWindow(5, "2027-01-15", endOfEpochDay)),
			settle(0, 0, 14),
			settle(0, 0, 0),
			reserve(0, qreq(0, soft), overQuota("daily", endOfEpochDay, 14)),
			reserve(endOfEpochDay, qreq(1, soft), inWindow(1, "2027-01-16", 24*h)),
		}},
		{"S14 a hard quota is debited by Extend and records what was used", []step{
			reserve(0, qreq(4, hard), inWindow(4, "2027-01-15", endOfEpochDay)),
			extend(0, 0, 5, true),
			extend(0, 0, 2, false),
			reserve(0, qreq(1, hard), inWindow(10, "2027-01-15", endOfEpochDay)),
			settle(0, 0, 12),
			reserve(0, qreq(0, hard), overQuota("daily", endOfEpochDay, 13)),
		}},
		{"S14 Extend leaves soft quotas to settlement", []step{
			reserve(0, mixed(4), outcome{OK: true, Limiting: "hb", Remaining: []float64{96}, Spent: []float64{4}}),
			extend(0, 0, 20, true),
			reserve(0, mixed(0), outcome{OK: true, Limiting: "hb", Remaining: []float64{76}, Spent: []float64{4}}),
			settle(0, 0, 24, 76),
			reserve(0, mixed(0), outcome{Reason: buckets.OverQuota, Limiting: "daily", Wait: endOfEpochDay, Remaining: []float64{76}, Spent: []float64{24}}),
		}},
		{"S8 a reservation's quotas are settled once, within its lifetime, renewed or not", []step{
			reserve(0, lived(qreq(5, soft)), inWindow(5, "2027-01-15", endOfEpochDay)),
			reserve(0, lived(qreq(3, soft)), inWindow(8, "2027-01-15", endOfEpochDay)),
			renew(20*time.Second, 1),
			settle(31*time.Second, 0, 1), // expired: the reservation's 5 stay charged
			settle(45*time.Second, 1, 1), // renewed: 3 reserved, 1 used
			settle(45*time.Second, 1, 0), // once only
			reserve(45*time.Second, qreq(0, soft), inWindow(6, "2027-01-15", endOfEpochDay-45*time.Second)),
		}},
		{"quotas of money are charged the request's money, extended per token", []step{
			reserve(0, money(100, 300_000), outcome{OK: true, Spent: []float64{100, 300_000}}),
			extend(0, 0, 1000, true),
			reserve(0, money(100, 700_000), overQuota("spend", endOfEpochDay, 100, 310_000)),
			settleSpent(0, 0, 1100, 123_456),
			reserve(0, money(0, 876_544), outcome{OK: true, Spent: []float64{1100, 1_000_000}}),
			reserve(0, money(0, 1_000_001), outcome{Reason: buckets.NeverAdmissible, Limiting: "spend", Spent: []float64{1100, 1_000_000}}),
			extend(0, 4, 1, false),
		}},
	}
}

// RunQuotaRaces checks quotas under concurrency (S3, S14): streams that
// extend a hard quota in batches never spend more than the budget plus one
// batch each, and a quota that lives in another cluster slot than the
// buckets of its chain stays all or none with them.
func RunQuotaRaces(t *testing.T, open Open) {
	t.Run("streams never overrun a hard quota by more than one batch each", func(t *testing.T) {
		const (
			limit     = 2000.0
			prompt    = 10 // reserved: the prompt and the output allowance
			event     = 3  // tokens per streamed event
			batch     = 8  // tokens per Extend
			generates = 90 // what each stream would produce uncut
		)
		q := hardQuota(quota("monthly", limit, window("month", "Europe/Amsterdam")))
		clock := NewClock()
		stores := open(t, clock, Clients)
		ctx := context.Background()
		var used, cut atomic.Int64
		var admitted atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range Callers {
			wg.Go(func() {
				st := stores[i%Clients]
				<-start
				d, err := st.Reserve(ctx, scope(t.Name(), qreq(prompt, q)))
				if err != nil {
					t.Errorf("Reserve: %v", err)
					return
				}
				if !d.OK {
					return
				}
				admitted.Add(1)
				r := d.Reservation
				// The stream as the gateway meters it: an event that the
				// charge does not cover is extended by a batch (or by
				// what it needs when less is left); an event that cannot
				// be covered is withheld and the stream cut, but it was
				// generated and is charged.
				produced := 0
				for produced < generates {
					produced += event
					need := float64(produced) - r.Cost - r.Extended
					if need <= 0 {
						continue
					}
					ok, err := st.Extend(ctx, r, max(need, batch))
					if err == nil && !ok {
						ok, err = st.Extend(ctx, r, need)
					}
					if err != nil {
						t.Errorf("Extend: %v", err)
						return
					}
					if !ok {
						cut.Add(1)
						break
					}
				}
				if _, err := st.Settle(ctx, r, float64(produced)); err != nil {
					t.Errorf("Settle: %v", err)
				}
				used.Add(int64(produced))
			})
		}
		close(start)
		wg.Wait()
		if cut.Load() == 0 {
			t.Fatalf("no stream was cut: %d streams of %d tokens fit a budget of %v", admitted.Load(), generates, limit)
		}
		states := inspect(t, stores[0], nil, []buckets.Quota{scope(t.Name(), qreq(0, q)).Quotas[0]})
		spent := states[0].Spent
		if spent != float64(used.Load()) {
			t.Errorf("quota spent %v; the streams used %d", spent, used.Load())
		}
		if bound := limit + float64(admitted.Load())*batch; spent > bound {
			t.Errorf("%d streams spent %v, more than the budget %v plus one batch each (%v)", admitted.Load(), spent, limit, bound)
		}
	})
	t.Run("quotas and buckets in other slots stay all or none", func(t *testing.T) {
		// Four quotas and a team bucket: on a cluster some of them lie in
		// other slots than the others, so a refusal by one group must
		// refund what the others took.
		const cost = 3.0
		for _, tight := range []string{"bucket", "quota"} {
			t.Run("tight "+tight, func(t *testing.T) {
				k, m := 10.0, 13.0 // room for k requests in the team bucket, m in each quota
				if tight == "quota" {
					k, m = m, k
				}
				team := bucket("team", k*cost, never)
				var qs []buckets.Quota
				for j := range 4 {
					qs = append(qs, quota(fmt.Sprintf("quota%d", j), m*cost, window("day", "UTC")))
				}
				stores := open(t, NewClock(), Clients)
				mk := func(i int) buckets.Request {
					r := qreq(cost, qs...)
					r.Buckets = []buckets.Bucket{bucket(fmt.Sprintf("user%d", i), 100, never), team}
					return scope(t.Name(), r)
				}
				// Racing callers may refuse each other while a split chain
				// compensates (the safe side), so the race admits at most
				// the room; one caller after another then fills exactly
				// the room that is left, which shows that every refusal
				// gave back what its other groups took.
				most := int(min(k, m))
				admitted := raceOn(t, stores, mk)
				if admitted > most {
					t.Fatalf("the race admitted %d, more than the room for %d", admitted, most)
				}
				for i := 0; ; i++ {
					d, err := stores[i%Clients].Reserve(context.Background(), mk(Callers+i))
					if err != nil {
						t.Fatalf("Reserve: %v", err)
					}
					if !d.OK {
						break
					}
					admitted++
				}
				if admitted != most {
					t.Fatalf("admitted %d in all, want exactly %d", admitted, most)
				}
				probe := scope(t.Name(), req(0, team))
				probe.Quotas = scope(t.Name(), qreq(0, qs...)).Quotas
				bs, quotas := inspectAll(t, stores[0], probe.Buckets, probe.Quotas)
				if got, want := bs[0].Remaining, k*cost-float64(admitted)*cost; got != want {
					t.Errorf("team remaining %v after %d admissions, want %v", got, admitted, want)
				}
				for _, q := range quotas {
					if got, want := q.Spent, float64(admitted)*cost; got != want {
						t.Errorf("quota %s spent %v after %d admissions, want %v", q.Name, got, admitted, want)
					}
				}
			})
		}
	})
}

func inspect(t *testing.T, st buckets.Store, bs []buckets.Bucket, qs []buckets.Quota) []buckets.QuotaState {
	t.Helper()
	_, quotas := inspectAll(t, st, bs, qs)
	return quotas
}

func inspectAll(t *testing.T, st buckets.Store, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState) {
	t.Helper()
	in, ok := st.(buckets.Inspector)
	if !ok {
		t.Fatalf("%T does not implement buckets.Inspector", st)
	}
	states, quotas, err := in.Inspect(context.Background(), bs, qs)
	if err != nil {
		t.Fatalf("Inspect: %v", err)
	}
	if len(states) != len(bs) || len(quotas) != len(qs) {
		t.Fatalf("Inspect returned %d bucket and %d quota states for %d and %d", len(states), len(quotas), len(bs), len(qs))
	}
	return states, quotas
}

// RunInspect checks buckets.Inspector: it shows what a request would meet —
// levels refilled to now, the spend of the window that holds now — and
// writes nothing.
func RunInspect(t *testing.T, open Open) {
	clock := NewClock()
	st := open(t, clock, 1)[0]
	ctx := context.Background()
	b := bucket("b", 10, 1)
	q := quota("daily", 100, window("day", "UTC"))
	mq := moneyQuota(quota("spend", 5_000_000, window("month", "Europe/Amsterdam")))
	r := scope(t.Name(), priced(6, 1_250_000, 0, []buckets.Bucket{b}, q, mq))
	d, err := st.Reserve(ctx, r)
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	clock.Advance(2 * time.Second)
	for range 2 { // twice: inspecting changes nothing
		bs, qs := inspectAll(t, st, r.Buckets, r.Quotas)
		wantB := []buckets.BucketState{{Name: "b", Limit: b.Limit, Remaining: 6, Reset: 4 * time.Second}}
		if diff := cmp.Diff(wantB, bs, durationsClose, floatsClose); diff != "" {
			t.Errorf("bucket states (-want +got):\n%s", diff)
		}
		wantQ := []buckets.QuotaState{
			{Name: "daily", Unit: buckets.Tokens, Limit: 100, Spent: 6, Remaining: 94, Window: "2027-01-15", Reset: endOfEpochDay - 2*time.Second},
			// Amsterdam's January ends at 2027-01-31T23:00Z.
			{Name: "spend", Unit: buckets.Money, Limit: 5_000_000, Spent: 1_250_000, Remaining: 3_750_000, Window: "2027-01", Reset: at("2027-01-31T23:00:00Z") - 2*time.Second},
		}
		if diff := cmp.Diff(wantQ, qs, durationsClose, floatsClose); diff != "" {
			t.Errorf("quota states (-want +got):\n%s", diff)
		}
	}
	// A quota nothing was spent from, and a new window.
	clock.Set(endOfEpochDay)
	_, qs := inspectAll(t, st, nil, r.Quotas)
	if qs[0].Spent != 0 || qs[0].Window != "2027-01-16" || qs[1].Spent != 1_250_000 {
		t.Errorf("after the day ended: %+v; want the daily quota empty in 2027-01-16 and the monthly one unchanged", qs)
	}
	if _, _, err := st.(buckets.Inspector).Inspect(ctx, nil, []buckets.Quota{{Name: "x", Key: "x"}}); err == nil {
		t.Error("Inspect of a quota without window and limit succeeded, want an error")
	}
}
