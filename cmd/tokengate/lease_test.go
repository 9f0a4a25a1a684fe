package main

import (
	"context"
	"log/slog"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/lease"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// A bucket with `lease:` makes serve lease it from Redis (S20): the store
// is a lease store over the failover store, a request takes a lease of
// the configured size from Redis, and closing the parts — as serve does
// after the server has settled every stream — gives back what is unused.
func TestServeLeasesFromRedis(t *testing.T) {
	srv := redistest.Start(t)
	cfg, err := config.Parse("t.yaml", []byte(`
store: {type: redis, redis: {addrs: ["`+srv.Addr+`"]}, on_failure: open, fallback: {tokens_per_minute: 600}}
policies:
  - name: p
    buckets:
      - {name: global, tokens_per_minute: 600, burst: 60000, lease: {size: 5000}}
`))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	p, err := build(ctx, cfg, slog.New(slog.DiscardHandler), buildOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := p.store.(*lease.Store); !ok {
		p.close()
		t.Fatalf("store is %T, want a lease store", p.store)
	}
	sc, err := serverConfig(cfg, p.store, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		p.close()
		t.Fatal(err)
	}
	rule := sc.Policies[0].Buckets[0]
	if rule.Lease == nil || rule.Lease.Size != 5000 {
		p.close()
		t.Fatalf("bucket rule lease = %+v, want size 5000", rule.Lease)
	}
	b := buckets.Bucket{Name: rule.Name, Key: "global", Limit: rule.Limit, Lease: rule.Lease}
	d, err := p.store.Reserve(ctx, buckets.Request{Cost: 100, Buckets: []buckets.Bucket{b}})
	if err != nil || !d.OK {
		p.close()
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	if _, err := p.store.Settle(ctx, d.Reservation, 60); err != nil {
		p.close()
		t.Fatal(err)
	}
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	probe := redisstore.New(c, redisstore.Options{Prefix: cfg.Store.Redis.KeyPrefix})
	level := func() float64 {
		t.Helper()
		d, err := probe.Reserve(ctx, buckets.Request{Buckets: []buckets.Bucket{{Name: "global", Key: "global", Limit: b.Limit}}})
		if err != nil {
			t.Fatal(err)
		}
		return d.Buckets[0].Remaining
	}
	// Redis refills at 10/s meanwhile: 100 tokens of slack is 10s.
	if got := level(); got > 60000-5000+100 {
		t.Errorf("Redis holds %v while the gateway holds its lease, want about %v", got, 60000-5000)
	}
	p.close()
	if got := level(); got < 60000-60-1 {
		t.Errorf("Redis holds %v after shutdown, want all but the 60 used back (%v)", got, 60000-60)
	}
}
