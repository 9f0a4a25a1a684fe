package extproc

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// A quota's spend is kept per unit: switching a quota between tokens: and
// cost: on reload starts a fresh spend in the new unit, instead of reading
// 110 tokens already spent as 110 micro-units (or 700,000 micro-units as
// 700,000 tokens). Switching back finds the spend of the old unit where it
// was. The memory store and Redis agree: the unit is in the quota's key.
func TestQuotaUnitSwitchOnReloadStartsAFreshSpend(t *testing.T) {
	t.Run("memory", func(t *testing.T) { quotaUnitSwitch(t, nil) })
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { c.Close() })
		quotaUnitSwitch(t, redisstore.New(c, redisstore.Options{}))
	})
}

func quotaUnitSwitch(t *testing.T, store buckets.Store) {
	now := budgetClock()
	if store == nil {
		store = buckets.NewMemory(buckets.MemoryOptions{Now: now})
	}
	day := mustWindow(t, "day", "UTC")
	policy := func(unit buckets.Unit, limit float64) Policy {
		return Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e9, Rate: 1e6}}},
			Quotas: []QuotaRule{{Name: "daily", Window: day, Unit: unit, Limit: limit}}}
	}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{policy(buckets.Tokens, 1_000_000)}, now: now, store: store, prices: testPrices(t)})
	const body = `{"model":"gpt-4o-mini","max_tokens":100,"messages":[]}` // 10 + 100 tokens, 10 × 10,000 + 100 × 50,000 micro-units
	spent := func(t *testing.T) (float64, buckets.Unit) {
		t.Helper()
		u, err := r.srv.Usage(context.Background(), UsageQuery{Policy: "p"})
		if err != nil {
			t.Fatal(err)
		}
		for _, ru := range u.Rules {
			if ru.Quota != nil {
				return ru.Quota.Spent, ru.Quota.Unit
			}
		}
		t.Fatal("no quota in the usage report")
		return 0, 0
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	r.outcome(t)
	if got, unit := spent(t); got != 110 || unit != buckets.Tokens {
		t.Fatalf("tokens spent %v %v, want 110", got, unit)
	}

	r.srv.Reload([]Policy{policy(buckets.Money, 10_000_000)}, "p")
	if got, _ := spent(t); got != 0 {
		t.Errorf("after the switch to cost the quota has spent %v micro-units; want a fresh window, not the 110 tokens reread", got)
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	r.outcome(t)
	if got, unit := spent(t); got != 5_100_000 || unit != buckets.Money {
		t.Errorf("money spent %v %v, want 5100000", got, unit)
	}

	r.srv.Reload([]Policy{policy(buckets.Tokens, 1_000_000)}, "p")
	if got, _ := spent(t); got != 110 {
		t.Errorf("back to tokens: spent %v, want the 110 tokens spent before", got)
	}
}
