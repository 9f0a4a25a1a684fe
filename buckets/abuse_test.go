package buckets_test

import (
	"context"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
)

// abuser drives one bucket on a simulated clock with requests that reserve
// reserve tokens but use use, each lasting last, at most inFlight at once,
// sent as soon as the bucket admits them, for run. It returns the tokens
// used by requests settled within run, and how many requests were still in
// flight at its end.
func abuser(t *testing.T, b buckets.Bucket, reserve, use float64, last time.Duration, inFlight int, run time.Duration) (used float64, open int) {
	t.Helper()
	clock := bucketstest.NewClock()
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
	ctx := context.Background()
	type flight struct {
		r   *buckets.Reservation
		end time.Duration
	}
	var flights []flight
	var now time.Duration
	for now <= run {
		next := run + 1
		for len(flights) < inFlight {
			d, err := m.Reserve(ctx, buckets.Request{Cost: reserve, Buckets: []buckets.Bucket{b}})
			if err != nil {
				t.Fatal(err)
			}
			if !d.OK {
				next = now + max(d.Wait, time.Microsecond)
				break
			}
			flights = append(flights, flight{d.Reservation, now + last})
		}
		if len(flights) > 0 {
			next = min(next, flights[0].end)
		}
		now = next
		clock.Set(now)
		for len(flights) > 0 && flights[0].end <= now && now <= run {
			if _, err := m.Settle(ctx, flights[0].r, use); err != nil {
				t.Fatal(err)
			}
			used += use
			flights = flights[1:]
		}
	}
	return used, len(flights)
}

// TestSustainedAbuserHeldToTheRate is S9's bound for the default floor:
// requests that reserve 1,024 tokens but use 32,768, sent one at a time
// or 16 at a time, never get more than the configured rate over a day —
// at most capacity + rate × time + the excess of the requests in flight —
// since every token used is charged. With a floor of -capacity, as before,
// the same client got 2.9× the rate one at a time, and more in parallel.
func TestSustainedAbuserHeldToTheRate(t *testing.T) {
	const (
		reserve = 1024
		use     = 32768
		run     = 24 * time.Hour
	)
	tpm := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.PerMinute(10000, 0)}
	rate := tpm.Limit.Rate
	floored := tpm
	floored.MaxDebt = tpm.Limit.Capacity
	for _, c := range []struct {
		name     string
		b        buckets.Bucket
		last     time.Duration
		inFlight int
		// wantOver, when set, is what the factor of the rate must exceed
		// (the floor's leak); otherwise it must stay within the bound.
		wantOver float64
	}{
		{"default floor, one at a time", tpm, time.Second, 1, 0},
		{"default floor, 16 in flight", tpm, time.Minute, 16, 0},
		// U / (D + R + r·L) = 32768 / (10000 + 1024 + 167) = 2.93
		{"floor of -capacity, one at a time", floored, time.Second, 1, 2.9},
		// about k·U / (D + k·R + r·L) with k = 1 + r·L/R = 10: 10.8
		{"floor of -capacity, 16 in flight", floored, time.Minute, 16, 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			used, open := abuser(t, c.b, reserve, use, c.last, c.inFlight, run)
			factor := used / (rate * run.Seconds())
			t.Logf("used %.0f tokens in %v at %.4g tokens/s: %.3f× the rate, %d in flight at the end", used, run, rate, factor, open)
			// Every admission found the level at or above its cost, so by
			// the last one the client was charged at most capacity + rate ×
			// time; what it used beyond that is the excess of the requests
			// then in flight.
			bound := c.b.Limit.Capacity + rate*run.Seconds() + float64(c.inFlight)*(use-reserve)
			switch {
			case c.wantOver == 0 && used > bound:
				t.Errorf("used %.0f > capacity + rate × run + in flight × (use - reserve) = %.0f (%.3f× the rate)", used, bound, bound/(rate*run.Seconds()))
			case factor <= c.wantOver:
				t.Errorf("factor %.3f, want over %v", factor, c.wantOver)
			}
		})
	}
}
