package redisstore_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestChargeMarkerLivesTheRepeatWindow: a charge (a rate-limit service's
// hits) leaves one marker per call, so that a copy sent again applies
// nothing; it lives buckets.RepeatWindow, not the day a replay's marker
// lives. With a day, every call of a rate-limit service would hold Redis
// memory for a day: millions of keys at a few hundred calls a second.
func TestChargeMarkerLivesTheRepeatWindow(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	s := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	day, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	r := &buckets.Reservation{ID: "charge-1",
		Buckets: []buckets.Bucket{{Name: "b", Key: "tg:p:b:u", Limit: buckets.Limit{Capacity: 100, Rate: 1}}},
		Quotas:  []buckets.Quota{{Name: "q", Key: "tg:p:q:u", Window: day, Unit: buckets.Tokens, Limit: 1000}}}
	if _, err := s.Charge(ctx, r, 7); err != nil {
		t.Fatal(err)
	}
	keys, err := c.Keys(ctx, "tg:p:{*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) == 0 {
		t.Fatal("a charge left no marker: a copy sent again would apply twice")
	}
	for _, k := range keys {
		ttl, err := c.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ttl <= 0 || ttl > buckets.RepeatWindow {
			t.Errorf("marker %s lives %v, want at most the repeat window (%v)", k, ttl, buckets.RepeatWindow)
		}
	}
	// The copy applies nothing: the bucket holds 100 − 7.
	bs, _, err := s.Inspect(ctx, r.Buckets, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Charge(ctx, r, 7); err != nil {
		t.Fatal(err)
	}
	again, _, err := s.Inspect(ctx, r.Buckets, nil)
	if err != nil {
		t.Fatal(err)
	}
	if again[0].Remaining > bs[0].Remaining+0.5 || again[0].Remaining < bs[0].Remaining-0.5 || bs[0].Remaining > 93.5 {
		t.Errorf("after a charge of 7 and its copy the bucket holds %v (%v after the first), want about 93", again[0].Remaining, bs[0].Remaining)
	}
}
