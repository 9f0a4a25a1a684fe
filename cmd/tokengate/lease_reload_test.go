package main

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// A reload that gives a bucket a lease takes effect like any other policy
// change (S20): before it, a request takes its own cost from the shared
// bucket in Redis; after it, the gateway takes a whole lease there and
// admits from it.
func TestReloadAddsALease(t *testing.T) {
	bin := tokengateBinary(t)
	srv := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	const capacity, leaseSize = 1_000_000.0, 100_000.0
	conf := func(lease string) string {
		return fmt.Sprintf(`store: {type: redis, redis: {addrs: [%s]}}
policies:
  - name: default
    identities: [{name: apikey, header: authorization, hash: true}]
    buckets:
      - {name: global, tokens_per_minute: 6, burst: %d%s}
`, srv.Addr, int(capacity), lease)
	}
	writeFile(t, file, conf(""))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, nil, "--config", file)
	front := standInFor(t, p.grpc, cfg)
	user := map[string]string{"authorization": "Bearer sk-1"}

	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	shared := redisstore.New(c, redisstore.Options{Prefix: cfg.Store.Redis.KeyPrefix})
	global := buckets.Bucket{Name: "global", Key: "tg:default:global:%2A", Limit: buckets.PerMinute(6, capacity)}
	level := func() float64 {
		t.Helper()
		st, _, err := shared.Inspect(context.Background(), []buckets.Bucket{global}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return st[0].Remaining
	}

	if st, _ := chat(t, front, user); st != 200 {
		t.Fatalf("before the reload: status %d", st)
	}
	before := level()
	if taken := capacity - before; taken <= 0 || taken > 1000 {
		t.Fatalf("without a lease the request took %v tokens from Redis, want its own cost", taken)
	}

	if n := leaseCalls(t, p.admin); n != 0 {
		t.Errorf("%d lease calls before any bucket is leased", n)
	}
	writeFile(t, file, conf(fmt.Sprintf(", lease: {size: %d}", int(leaseSize))))
	waitMetric(t, p.admin, `tokengate_config_reload_total{result="applied"}`, 1)
	if st, _ := chat(t, front, user); st != 200 {
		t.Fatalf("after the reload: status %d", st)
	}
	if taken := before - level(); taken < leaseSize-1000 {
		t.Errorf("after the reload the request took %v tokens from Redis, want a lease of %v", taken, leaseSize)
	}
	if n := leaseCalls(t, p.admin); n < 1 {
		t.Errorf("tokengate_store_seconds_count{op=\"lease\"} = %d after a leased request, want at least 1", n)
	}
}

var leaseCallsRE = regexp.MustCompile(`(?m)^tokengate_store_seconds_count\{op="lease"\} (\d+)$`)

// leaseCalls is the number of lease calls the server at admin has made.
func leaseCalls(t *testing.T, admin string) int {
	t.Helper()
	m, err := getBody(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	sm := leaseCallsRE.FindStringSubmatch(m)
	if sm == nil {
		return 0
	}
	n, err := strconv.Atoi(sm[1])
	if err != nil {
		t.Fatal(err)
	}
	return n
}
