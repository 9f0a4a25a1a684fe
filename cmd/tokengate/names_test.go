package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// A bucket and a concurrency limit of one policy may share a name, as in the
// embedded defaults (both "apikey"): the key extproc makes for each is then
// the same string (tg:<policy>:<name>:<identity>), and every store keeps
// buckets and concurrency slots apart (memory: separate tables; Redis:
// "b:{key}" strings and "c:{key}" sorted sets). Held against each store that
// serve can build.
func TestBucketAndSlotMayShareAName(t *testing.T) {
	stores := map[string]func(t *testing.T) string{
		"memory": func(*testing.T) string { return "store: {type: memory}\n" },
		"redis": func(t *testing.T) string {
			return "store: {type: redis, redis: {addrs: [" + redistest.Start(t).Addr + "]}}\n"
		},
		"redis cluster": func(t *testing.T) string {
			c := redistest.StartCluster(t)
			return "store: {type: redis, redis: {cluster: true, addrs: [" + c.Addrs[0] + "]}}\n"
		},
	}
	for name, storeYAML := range stores {
		t.Run(name, func(t *testing.T) {
			cfg, err := config.Parse("names.yaml", []byte(storeYAML(t)+`
policies:
  - name: p
    identities: [{name: user, header: x-user-id}]
    buckets: [{name: user, per: user, tokens_per_minute: 0.001, burst: 100}]
    concurrency: [{name: user, per: user, max: 1}]
`))
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			store, closeStore, err := buildStore(ctx, cfg, slog.New(slog.DiscardHandler), nil)
			if err != nil {
				t.Fatal(err)
			}
			if closeStore != nil {
				defer func() {
					if err := closeStore(); err != nil {
						t.Error(err)
					}
				}()
			}
			p := cfg.Policies[0]
			limit, _, err := p.Buckets[0].Limit()
			if err != nil {
				t.Fatal(err)
			}
			const key = "tg:p:user:alice" // what extproc makes of either rule
			req := buckets.Request{
				Cost:    30,
				Buckets: []buckets.Bucket{{Name: "user", Key: key, Limit: limit}},
				Slots:   []buckets.Slot{{Name: "user", Key: key, Max: 1, Lease: time.Minute}},
			}
			first, err := store.Reserve(ctx, req)
			if err != nil || !first.OK {
				t.Fatalf("first request: %+v, %v", first, err)
			}
			if got := first.Buckets[0].Remaining; got < 69.9 || got > 70.1 {
				t.Errorf("bucket after the first request holds %v, want 70: the slot must not touch it", got)
			}
			second, err := store.Reserve(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if second.OK || second.Reason != buckets.ConcurrencyFull {
				t.Errorf("second request while the first holds the slot: OK %v, reason %v; want refused for concurrency", second.OK, second.Reason)
			}
			states, err := store.Settle(ctx, first.Reservation, 30)
			if err != nil {
				t.Fatal(err)
			}
			if got := states[0].Remaining; got < 69.9 || got > 70.1 {
				t.Errorf("bucket after settling 30 holds %v, want 70", got)
			}
			third, err := store.Reserve(ctx, req)
			if err != nil || !third.OK {
				t.Fatalf("third request, slot released: %+v, %v", third, err)
			}
			if got := third.Buckets[0].Remaining; got < 39.9 || got > 40.1 {
				t.Errorf("bucket after the third request holds %v, want 40", got)
			}
			if _, err := store.Settle(ctx, third.Reservation, 30); err != nil {
				t.Fatal(err)
			}
		})
	}
}
