package redisstore_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestChargesShareTheirCallsMarker: charges (a rate-limit service's hits)
// that go in one call leave one marker, that call's, so that a copy of it
// sent again applies none of them (TestChargeRetriedAfterTimeoutAppliesOnce);
// it lives buckets.RepeatWindow, not the day a replay's marker lives. With
// a day, every call of a rate-limit service would hold Redis memory for a
// day: millions of keys at a few hundred calls a second.
func TestChargesShareTheirCallsMarker(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	s := redisstore.New(c, redisstore.Options{SettleWindow: 500 * time.Millisecond})
	ctx := context.Background()
	day, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	b := buckets.Bucket{Name: "b", Key: "tg:p:b:u", Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	q := buckets.Quota{Name: "q", Key: "tg:p:q:u", Window: day, Unit: buckets.Tokens, Limit: 1000}
	errs := make(chan error, 3)
	for i := range 3 {
		r := &buckets.Reservation{ID: "charge-" + strconv.Itoa(i), Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
		s.ChargeAsync(r, 7, func(_ []buckets.BucketState, err error) { errs <- err })
	}
	for range 3 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	keys, err := c.Keys(ctx, "tg:p:{*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 {
		t.Fatalf("three charges in one call left markers %q, want one", keys)
	}
	ttl, err := c.PTTL(ctx, keys[0]).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ttl <= 0 || ttl > buckets.RepeatWindow {
		t.Errorf("marker %s lives %v, want at most the repeat window (%v)", keys[0], ttl, buckets.RepeatWindow)
	}
	bs, qs, err := s.Inspect(ctx, []buckets.Bucket{b}, []buckets.Quota{q})
	if err != nil {
		t.Fatal(err)
	}
	if bs[0].Remaining < 78.5 || bs[0].Remaining > 79.5 || qs[0].Spent != 21 {
		t.Errorf("after three charges of 7 the bucket holds %v and the quota %v, want 79 and 21", bs[0].Remaining, qs[0].Spent)
	}
}
