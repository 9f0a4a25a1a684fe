package redisstore_test

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
)

// A release before the unit tag stored a quota's spend as one packed
// double, 8 bytes, at q:{K}:W. Every script reads such a value as the
// spend of the quota's configured unit, tokens or money alike: reserve,
// extend, settle, AddSpend, Inspect and ListSpend; the next write appends
// the unit's tag.
func TestSpendWrittenBeforeTheUnitTag(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		srv := redistest.Start(t)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { c.Close() })
		legacySpend(t, c, false)
	})
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t)
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
		t.Cleanup(func() { c.Close() })
		legacySpend(t, c, true)
	})
}

func legacySpend(t *testing.T, c redis.UniversalClient, cluster bool) {
	ctx := context.Background()
	t0 := time.Date(2026, 3, 31, 20, 0, 0, 0, time.UTC)
	now := func() time.Time { return t0 }
	s := redisstore.New(c, redisstore.Options{Now: now, Cluster: cluster})
	day, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	span := day.Span(t0)
	tokens := buckets.Quota{Name: "daily", Key: "tg:p:daily:id", Window: day, Unit: buckets.Tokens, Limit: 1000, Hard: true}
	money := buckets.Quota{Name: "spend", Key: "tg:p:spend:id", Window: day, Unit: buckets.Money, Currency: "USD", Limit: 5_000_000, Hard: true}
	added := buckets.Quota{Name: "added", Key: "tg:p:added:id", Window: day, Unit: buckets.Money, Currency: "USD", Limit: 5_000_000}
	key := func(q buckets.Quota) string { return "tg:q:{" + q.Key + "}:" + span.ID }
	for q, v := range map[*buckets.Quota]float64{&tokens: 300, &money: 2_000_000, &added: 50} {
		raw := binary.LittleEndian.AppendUint64(nil, math.Float64bits(v))
		if err := c.Set(ctx, key(*q), raw, 48*time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
	}
	spent := func() [3]float64 {
		t.Helper()
		_, qs, err := s.Inspect(ctx, nil, []buckets.Quota{tokens, money, added})
		if err != nil {
			t.Fatal(err)
		}
		return [3]float64{qs[0].Spent, qs[1].Spent, qs[2].Spent}
	}
	if got := spent(); got != [3]float64{300, 2_000_000, 50} {
		t.Fatalf("Inspect of the spend written before the tag = %v, want [300 2e6 50]", got)
	}
	list, err := s.ListSpend(ctx, buckets.SpendQuery{Prefix: "tg:p:spend:", Window: day, Unit: buckets.Money, Currency: "USD", Top: 5})
	if err != nil || len(list.Top) != 1 || list.Top[0] != (buckets.KeySpend{Key: "id", Spent: 2_000_000}) {
		t.Errorf("ListSpend of the money written before the tag = %+v, %v; want id at 2e6", list, err)
	}
	// 300 + 700 fits the budget of 1,000 tokens, 2e6 + 3e6 the 5e6 of money:
	// read as anything but their own unit's, one would not fit.
	d, err := s.Reserve(ctx, buckets.Request{Cost: 690, Money: 2_990_000, MoneyPerToken: 1000, Quotas: []buckets.Quota{tokens, money}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v; want admitted", d, err)
	}
	if ok, err := s.Extend(ctx, d.Reservation, 10); err != nil || !ok {
		t.Fatalf("Extend of 10 tokens = %v, %v; want debited", ok, err)
	}
	if ok, err := s.Extend(ctx, d.Reservation, 1); err != nil || ok {
		t.Fatalf("Extend past the budget = %v, %v; want refused", ok, err)
	}
	d.Reservation.Spent = 2_000_000
	if _, err := s.Settle(ctx, d.Reservation, 500); err != nil {
		t.Fatal(err)
	}
	if err := s.AddSpend(ctx, "outage", []buckets.Spend{{Quota: added, Window: span, Amount: 25}}); err != nil {
		t.Fatal(err)
	}
	if got := spent(); got != [3]float64{800, 4_000_000, 75} {
		t.Errorf("after reserve, extend, settle and AddSpend the spend is %v, want [800 4e6 75]", got)
	}
	for q, tag := range map[*buckets.Quota]string{&tokens: "t", &money: "$USD", &added: "$USD"} {
		v, err := c.Get(ctx, key(*q)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(v) != 8+len(tag) || v[8:] != tag {
			t.Errorf("quota %s is stored as %q, want its spend and the tag %q", q.Name, v, tag)
		}
	}
}
