package redisstore_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

var prefixes atomic.Int64

// openOn returns an Open over the clients that newClient makes: each store
// has its own client, all stores of one call share a fresh key prefix, and
// all run on the simulated clock.
func openOn(newClient func() redisstore.Scripter, cluster bool) bucketstest.Open {
	return func(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
		prefix := "t" + strconv.FormatInt(prefixes.Add(1), 10) + ":"
		stores := make([]buckets.Store, n)
		for i := range stores {
			c := newClient()
			t.Cleanup(func() { c.(interface{ Close() error }).Close() })
			c.(interface{ AddHook(redis.Hook) }).AddHook(midCallHook{})
			s := redisstore.New(c, redisstore.Options{Prefix: prefix, Cluster: cluster})
			redisstore.SetScriptClock(s, clock.Now)
			stores[i] = s
		}
		return stores
	}
}

// midCallHook calls the function of bucketstest.WithMidCall as a command
// is about to be sent: the store has started, the caller goes away.
type midCallHook struct{}

func (midCallHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (midCallHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if fn := bucketstest.MidCall(ctx); fn != nil {
			fn()
		}
		return next(ctx, cmd)
	}
}

func (midCallHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func standalone(t *testing.T) bucketstest.Open {
	srv := redistest.Start(t)
	return openOn(func() redisstore.Scripter {
		return redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 16})
	}, false)
}

func cluster(t *testing.T) bucketstest.Open {
	c := redistest.StartCluster(t)
	return openOn(func() redisstore.Scripter {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs, PoolSize: 16})
	}, true)
}

func TestContract(t *testing.T) {
	t.Run("standalone", func(t *testing.T) {
		open := standalone(t)
		bucketstest.Run(t, open)
		t.Run("invalid", func(t *testing.T) { bucketstest.RunInvalid(t, open) })
		t.Run("races", func(t *testing.T) { bucketstest.RunRaces(t, open) })
		t.Run("property", func(t *testing.T) { bucketstest.RunProperty(t, open, 4, 300) })
		t.Run("caller cancellation", func(t *testing.T) { bucketstest.RunCancel(t, open) })
		t.Run("async", func(t *testing.T) { bucketstest.RunAsync(t, open) })
		t.Run("repeat", func(t *testing.T) { bucketstest.RunRepeat(t, open) })
		t.Run("charge", func(t *testing.T) { bucketstest.RunCharge(t, open) })
	})
	t.Run("cluster", func(t *testing.T) {
		open := cluster(t)
		bucketstest.Run(t, open)
		t.Run("invalid", func(t *testing.T) { bucketstest.RunInvalid(t, open) })
		t.Run("races", func(t *testing.T) { bucketstest.RunRaces(t, open) })
		t.Run("property", func(t *testing.T) { bucketstest.RunProperty(t, open, 4, 300) })
		t.Run("caller cancellation", func(t *testing.T) { bucketstest.RunCancel(t, open) })
		t.Run("async", func(t *testing.T) { bucketstest.RunAsync(t, open) })
		t.Run("repeat", func(t *testing.T) { bucketstest.RunRepeat(t, open) })
		t.Run("charge", func(t *testing.T) { bucketstest.RunCharge(t, open) })
	})
}
