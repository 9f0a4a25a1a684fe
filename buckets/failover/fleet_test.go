package failover_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestFleetFallbackIsShared is S20 during an outage (S21): three gateways
// fail open on one Redis with a fleet fallback of 3,000 tokens. Each saw
// three gateways alive, so each admits a third: the fleet's admissions
// while Redis is down stay within the fleet fallback plus one request per
// gateway. Without the fleet count each gateway admitted the whole
// fallback: three times the quota.
func TestFleetFallbackIsShared(t *testing.T) {
	const fleetCap, cost, gateways = 3000.0, 100.0, 3
	for _, shared := range []bool{true, false} {
		t.Run(fmt.Sprint("fleet counted: ", shared), func(t *testing.T) {
			srv := redistest.Start(t)
			clock := bucketstest.NewClock() // stands still: the fallback does not refill
			var stores []*failover.Store
			var shares []buckets.Limit
			for i := range gateways {
				c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
				t.Cleanup(func() { c.Close() })
				rs := redisstore.New(c, redisstore.Options{})
				opts := failover.Options{Mode: failover.Open, Fallback: buckets.Limit{Capacity: fleetCap, Rate: 1e-9},
					Now: clock.Now, GatewayID: fmt.Sprint("gw", i)}
				if shared {
					opts.Fleet = rs
					opts.OnShare = func(n int, l buckets.Limit) { shares = append(shares, l) }
				}
				stores = append(stores, failover.New(rs, opts))
			}
			ctx := context.Background()
			for range 2 { // the first round's early beats see fewer gateways
				for _, s := range stores {
					if err := s.Beat(ctx); err != nil {
						t.Fatal(err)
					}
				}
			}
			if shared {
				for i, s := range stores {
					if s.Gateways() != gateways {
						t.Fatalf("gateway %d saw %d gateways alive, want %d", i, s.Gateways(), gateways)
					}
				}
				if last := shares[len(shares)-1]; last.Capacity != fleetCap/gateways {
					t.Errorf("reported share %+v, want a capacity of %v", last, fleetCap/gateways)
				}
			}
			prov := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}
			ask := func(s *failover.Store) bool {
				d, err := s.Reserve(ctx, buckets.Request{Cost: cost, Buckets: []buckets.Bucket{prov}})
				if err != nil {
					t.Fatalf("Reserve: %v", err)
				}
				return d.OK
			}
			for _, s := range stores { // the shared bucket answers before the outage
				if !ask(s) || !s.Healthy() {
					t.Fatal("Reserve before the outage refused")
				}
			}
			srv.Kill()
			for _, s := range stores { // heartbeats fail; the last count stands
				if err := s.Beat(ctx); shared && !errors.Is(err, buckets.ErrStore) {
					t.Fatalf("Beat with Redis down = %v, want ErrStore", err)
				}
			}
			admitted := 0.0
			for range 100 {
				for _, s := range stores {
					if ask(s) {
						admitted += cost
					}
				}
			}
			t.Logf("the fleet admitted %v tokens during the outage; fleet fallback %v", admitted, fleetCap)
			bound := fleetCap + gateways*cost
			if shared && (admitted > bound || admitted < fleetCap-gateways*cost) {
				t.Errorf("admitted %v during the outage, want within %v ± one request per gateway", admitted, fleetCap)
			}
			if !shared && admitted <= bound {
				t.Errorf("without the fleet count the gateways admitted %v; expected each to admit the whole fallback", admitted)
			}
		})
	}
}

// TestFleetQuotaIsShared: a quota's window spend lives in Redis; when Redis
// dies, three gateways failing open may spend together only what the
// window had left — each its share of what Redis last reported left, not
// the whole budget each from zero — and refuse the rest over quota (429
// with Retry-After to the window's end), as the shared quota would.
// Without a fleet count one gateway alone spends what was left.
func TestFleetQuotaIsShared(t *testing.T) {
	const limit, spentBefore, cost = 10_000.0, 4_000.0, 100.0
	for _, gateways := range []int{3, 1} {
		t.Run(fmt.Sprint(gateways, " gateways"), func(t *testing.T) {
			srv := redistest.Start(t)
			clock := bucketstest.NewClock()
			var stores []*failover.Store
			for i := range gateways {
				c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
				t.Cleanup(func() { c.Close() })
				rs := redisstore.New(c, redisstore.Options{Now: clock.Now})
				opts := failover.Options{Mode: failover.Open, Fallback: buckets.Limit{Capacity: 1e9, Rate: 1e9},
					Now: clock.Now, GatewayID: fmt.Sprint("gw", i)}
				if gateways > 1 {
					opts.Fleet = rs
				}
				stores = append(stores, failover.New(rs, opts))
			}
			ctx := context.Background()
			for range 2 {
				for _, s := range stores {
					if err := s.Beat(ctx); err != nil {
						t.Fatal(err)
					}
				}
			}
			month, err := buckets.ParseWindow("month", "UTC")
			if err != nil {
				t.Fatal(err)
			}
			quota := buckets.Quota{Name: "team-monthly", Key: "team", Window: month, Unit: buckets.Tokens, Limit: limit}
			prov := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 1e9, Rate: 1e9}}
			ask := func(s *failover.Store, cost float64) buckets.Decision {
				d, err := s.Reserve(ctx, buckets.Request{Cost: cost, Buckets: []buckets.Bucket{prov}, Quotas: []buckets.Quota{quota}})
				if err != nil {
					t.Fatalf("Reserve: %v", err)
				}
				return d
			}
			if d := ask(stores[0], spentBefore); !d.OK {
				t.Fatalf("Reserve of %v before the outage refused: %+v", spentBefore, d)
			}
			for _, s := range stores { // each learns the window's spend
				if d := ask(s, 0); !d.OK || d.Quotas[0].Spent != spentBefore {
					t.Fatalf("Reserve before the outage = %+v, want the spend %v", d, spentBefore)
				}
			}
			srv.Kill()
			admitted := 0.0
			var refused buckets.Decision
			taken := make([][]*buckets.Reservation, gateways)
			for range int(limit / cost) {
				for i, s := range stores {
					if d := ask(s, cost); d.OK {
						admitted += cost
						taken[i] = append(taken[i], d.Reservation)
					} else {
						refused = d
					}
				}
			}
			left := limit - spentBefore
			t.Logf("%d gateways spent %v during the outage; the window had %v left", gateways, admitted, left)
			slack := float64(gateways) * cost
			if admitted > left+slack || admitted < left-slack {
				t.Errorf("spent %v during the outage, want the %v the window had left ± one request per gateway", admitted, left)
			}
			if refused.OK || refused.Reason != buckets.OverQuota || refused.Wait <= 0 {
				t.Errorf("a refusal during the outage = %v (wait %v), want over quota until the window ends", refused.Reason, refused.Wait)
			}

			// The outage spend reaches the shared window once Redis is back
			// (it comes back empty: no persistence).
			for i, s := range stores {
				for _, r := range taken[i] {
					if _, err := s.Settle(ctx, r, cost); err != nil {
						t.Fatalf("Settle of a reservation taken during the outage: %v", err)
					}
				}
			}
			srv.Restart()
			clock.Advance(2 * time.Second) // past the back-off
			deadline := time.Now().Add(10 * time.Second)
			for _, s := range stores {
				for ask(s, 0); s.Pending() > 0; {
					if time.Now().After(deadline) {
						t.Fatalf("%d settlements still wait for replay", s.Pending())
					}
					time.Sleep(10 * time.Millisecond) // polling with a deadline
				}
			}
			if d := ask(stores[0], 0); d.Quotas[0].Spent != admitted {
				t.Errorf("the shared window spent %v after the outage, want the %v spent during it", d.Quotas[0].Spent, admitted)
			}
		})
	}
}
