package lease_test

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/lease"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// BenchmarkReserveSettle measures reserve+settle pairs of a chain of a
// user's bucket (16 users) and the provider's, from 64 callers: the memory
// store, the Redis store, and lease stores (lease: auto on both buckets)
// over each. Compare lease-redis with memory; the Redis targets report
// their script calls per request.
func BenchmarkReserveSettle(b *testing.B) {
	ctx := context.Background()
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	chains := func(leased bool) []buckets.Request {
		var l *buckets.Lease
		if leased {
			l = &buckets.Lease{}
		}
		prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim, Lease: l}
		reqs := make([]buckets.Request, 16)
		for i := range reqs {
			user := buckets.Bucket{Name: "user", Key: "user" + strconv.Itoa(i), Limit: lim, Lease: l}
			reqs[i] = buckets.Request{Cost: 486, Buckets: []buckets.Bucket{user, prov}}
		}
		return reqs
	}
	redisStore := func(b *testing.B, calls *atomic.Int64) *redisstore.Store {
		srv := redistest.Start(b)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 128})
		c.AddHook(countCalls{calls})
		b.Cleanup(func() { c.Close() })
		return redisstore.New(c, redisstore.Options{})
	}
	type target struct {
		name   string
		leased bool
		open   func(*testing.B, *atomic.Int64) buckets.Store
	}
	for _, tg := range []target{
		{"memory", false, func(*testing.B, *atomic.Int64) buckets.Store { return buckets.NewMemory(buckets.MemoryOptions{}) }},
		{"lease-memory", true, func(*testing.B, *atomic.Int64) buckets.Store {
			m := buckets.NewMemory(buckets.MemoryOptions{})
			return lease.New(m, m, lease.Options{})
		}},
		{"redis", false, func(b *testing.B, calls *atomic.Int64) buckets.Store { return redisStore(b, calls) }},
		{"lease-redis", true, func(b *testing.B, calls *atomic.Int64) buckets.Store {
			rs := redisStore(b, calls)
			return lease.New(rs, rs, lease.Options{})
		}},
	} {
		b.Run(tg.name, func(b *testing.B) {
			var calls atomic.Int64
			st := tg.open(b, &calls)
			if ls, ok := st.(*lease.Store); ok {
				b.Cleanup(func() {
					if err := ls.Close(ctx); err != nil {
						b.Error(err)
					}
				})
			}
			reqs := chains(tg.leased)
			var next atomic.Int64
			b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0)))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r := reqs[next.Add(1)%int64(len(reqs))]
					d, err := st.Reserve(ctx, r)
					if err != nil || !d.OK {
						b.Errorf("Reserve = %+v, %v", d, err)
						return
					}
					if _, err := st.Settle(ctx, d.Reservation, 430); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(calls.Load())/float64(b.N), "redis-calls/req")
		})
	}
}

// countCalls is a go-redis hook counting script calls.
type countCalls struct{ n *atomic.Int64 }

func (c countCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c countCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n == "evalsha" || n == "eval" {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (c countCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
