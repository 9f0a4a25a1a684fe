package extproc

import (
	"context"
	"encoding/binary"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/pricing"
)

// onEveryStore runs fn on the memory store, standalone Redis and a Redis
// Cluster; the Redis stores name windows by now, as the rig does. fn gets
// the store and, for Redis, its client.
func onEveryStore(t *testing.T, now func() time.Time, memory bool, fn func(t *testing.T, store buckets.Store, c redis.Cmdable)) {
	if memory {
		t.Run("memory", func(t *testing.T) { fn(t, buckets.NewMemory(buckets.MemoryOptions{Now: now}), nil) })
	}
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { c.Close() })
		fn(t, redisstore.New(c, redisstore.Options{Now: now}), c)
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t)
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
		t.Cleanup(func() { c.Close() })
		fn(t, redisstore.New(c, redisstore.Options{Now: now, Cluster: true}), c)
	})
}

// quotaSpentNow is what the usage report shows quota name of policy "p"
// has spent, and in which unit.
func quotaSpentNow(t *testing.T, r *rig, name string) (float64, buckets.Unit) {
	t.Helper()
	u, err := r.srv.Usage(context.Background(), UsageQuery{Policy: "p"})
	if err != nil {
		t.Fatal(err)
	}
	for _, ru := range u.Rules {
		if ru.Quota != nil && ru.Name == name {
			return ru.Quota.Spent, ru.Quota.Unit
		}
	}
	t.Fatalf("no quota %q in the usage report", name)
	return 0, 0
}

// postOK sends the request body and waits for its outcome.
func postOK(t *testing.T, r *rig, body string) {
	t.Helper()
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	r.outcome(t)
}

// A quota keeps its key whatever its unit; the store records the unit with
// the spend and reads another unit's spend as nothing spent. Switching a
// quota between tokens: and cost: on reload starts a fresh spend in the new
// unit, instead of reading 110 tokens already spent as 110 micro-units (or
// 5,100,000 micro-units as 5,100,000 tokens). Switching back before the new
// unit admitted anything finds the old spend where it was; once the new
// unit has admitted a request, its spend replaced the old one, and
// switching back starts afresh again. Repricing in another currency (a
// restart with a price table in EUR) starts afresh the same way. The
// memory store and Redis agree.
func TestQuotaUnitSwitchOnReloadStartsAFreshSpend(t *testing.T) {
	now := budgetClock()
	onEveryStore(t, now, true, func(t *testing.T, store buckets.Store, _ redis.Cmdable) { quotaUnitSwitch(t, store, now) })
}

func quotaUnitSwitch(t *testing.T, store buckets.Store, now func() time.Time) {
	day := mustWindow(t, "day", "UTC")
	policy := func(unit buckets.Unit, limit float64) Policy {
		return Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e9, Rate: 1e6}}},
			Quotas: []QuotaRule{{Name: "daily", Window: day, Unit: unit, Limit: limit}}}
	}
	tokens, money := []Policy{policy(buckets.Tokens, 1_000_000)}, []Policy{policy(buckets.Money, 10_000_000)}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: tokens, now: now, store: store, prices: testPrices(t)})
	const body = `{"model":"gpt-4o-mini","max_tokens":100,"messages":[]}` // 10 + 100 tokens, 10 × 10,000 + 100 × 50,000 micro-units
	check := func(r *rig, want float64, unit buckets.Unit, what string) {
		t.Helper()
		if got, gotUnit := quotaSpentNow(t, r, "daily"); got != want || gotUnit != unit {
			t.Errorf("%s: spent %v %v, want %v %v", what, got, gotUnit, want, unit)
		}
	}
	postOK(t, r, body)
	check(r, 110, buckets.Tokens, "tokens")

	r.srv.Reload(money, "p")
	check(r, 0, buckets.Money, "switched to cost (the 110 tokens are not micro-units)")
	r.srv.Reload(tokens, "p")
	check(r, 110, buckets.Tokens, "back to tokens before cost admitted anything")

	r.srv.Reload(money, "p")
	postOK(t, r, body)
	check(r, 5_100_000, buckets.Money, "cost after an admission")
	r.srv.Reload(tokens, "p")
	check(r, 0, buckets.Tokens, "back to tokens after cost admitted (the money replaced the tokens)")
	postOK(t, r, body)
	check(r, 110, buckets.Tokens, "tokens afresh")

	// A restart repriced in EUR: the USD spend is not EUR's.
	r.srv.Reload(money, "p")
	postOK(t, r, body)
	check(r, 5_100_000, buckets.Money, "cost in USD")
	eur, err := pricing.NewTable("EUR", []pricing.Entry{{Model: "gpt-4o-mini", Input: "10000", CachedInput: "1000", Output: "50000"}})
	if err != nil {
		t.Fatal(err)
	}
	r2 := newRig(t, u, rigOptions{policies: money, now: now, store: store, prices: eur})
	check(r2, 0, buckets.Money, "repriced in EUR (USD micro-units are not EUR's)")
	postOK(t, r2, body)
	check(r2, 5_100_000, buckets.Money, "cost in EUR after an admission")
}

// A release before the unit tag kept a quota's spend as a packed double
// alone, under the same key for tokens and money. Its spend is read as the
// quota's configured unit, so an upgrade keeps every window's spend, and
// the next write tags it.
func TestQuotaSpendSurvivesAnUpgrade(t *testing.T) {
	now := budgetClock()
	onEveryStore(t, now, false, func(t *testing.T, store buckets.Store, c redis.Cmdable) {
		day := mustWindow(t, "day", "UTC")
		pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e9, Rate: 1e6}}},
			Quotas: []QuotaRule{
				{Name: "daily", Window: day, Unit: buckets.Tokens, Limit: 1_000_000},
				{Name: "spend", Window: day, Unit: buckets.Money, Limit: 100_000_000},
			}}
		ctx := context.Background()
		// The earlier release's Redis key of a global quota: the store's
		// default prefix, the bucket key tg:p:<quota>:%2A, escaped ('%' as
		// %25), and the window.
		legacy := func(quota string) string { return "tg:q:{tg:p:" + quota + ":%252A}:" + day.Span(now()).ID }
		put := func(quota string, spent float64) {
			t.Helper()
			v := binary.LittleEndian.AppendUint64(nil, math.Float64bits(spent))
			if err := c.Set(ctx, legacy(quota), v, 48*time.Hour).Err(); err != nil {
				t.Fatal(err)
			}
		}
		put("daily", 300)
		put("spend", 2_000_000)
		u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
		r := newRig(t, u, rigOptions{policies: []Policy{pol}, now: now, store: store, prices: testPrices(t)})
		if got, _ := quotaSpentNow(t, r, "daily"); got != 300 {
			t.Errorf("after the upgrade the quota of tokens has spent %v, want the 300 tokens written before", got)
		}
		if got, _ := quotaSpentNow(t, r, "spend"); got != 2_000_000 {
			t.Errorf("after the upgrade the quota of money has spent %v, want the 2,000,000 micro-units written before", got)
		}
		postOK(t, r, `{"model":"gpt-4o-mini","max_tokens":100,"messages":[]}`)
		if got, _ := quotaSpentNow(t, r, "daily"); got != 410 {
			t.Errorf("the quota of tokens has spent %v, want 300 + 110", got)
		}
		if got, _ := quotaSpentNow(t, r, "spend"); got != 7_100_000 {
			t.Errorf("the quota of money has spent %v, want 2,000,000 + 5,100,000", got)
		}
		for quota, tag := range map[string]string{"daily": "t", "spend": "$USD"} {
			v, err := c.Get(ctx, legacy(quota)).Result()
			if err != nil {
				t.Fatal(err)
			}
			if len(v) != 8+len(tag) || v[8:] != tag {
				t.Errorf("quota %s is stored as %q; want its spend and the tag %q", quota, v, tag)
			}
		}
	})
}
