package redisstore_test

import (
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets/bucketstest"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

func TestInspect(t *testing.T) {
	t.Run("standalone", func(t *testing.T) { bucketstest.RunInspectSlots(t, standalone(t)) })
	t.Run("cluster", func(t *testing.T) { bucketstest.RunInspectSlots(t, cluster(t)) })
}

func TestOverrides(t *testing.T) {
	openOverrides := func(newClient func() redisstore.Scripter, cluster bool) func(t *testing.T, n int) []bucketstest.OverrideStore {
		return func(t *testing.T, n int) []bucketstest.OverrideStore {
			prefix := "o" + strconv.FormatInt(prefixes.Add(1), 10) + ":"
			stores := make([]bucketstest.OverrideStore, n)
			for i := range stores {
				c := newClient()
				t.Cleanup(func() { c.(interface{ Close() error }).Close() })
				stores[i] = redisstore.New(c, redisstore.Options{Prefix: prefix, Cluster: cluster}).Overrides()
			}
			return stores
		}
	}
	t.Run("standalone", func(t *testing.T) {
		srv := redistest.Start(t)
		bucketstest.RunOverrides(t, openOverrides(func() redisstore.Scripter { return redis.NewClient(&redis.Options{Addr: srv.Addr}) }, false))
	})
	t.Run("cluster", func(t *testing.T) {
		c := redistest.StartCluster(t)
		bucketstest.RunOverrides(t, openOverrides(func() redisstore.Scripter { return redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs}) }, true))
	})
}

func TestAddSpend(t *testing.T) {
	t.Run("standalone", func(t *testing.T) { bucketstest.RunAddSpend(t, standalone(t)) })
	t.Run("cluster", func(t *testing.T) { bucketstest.RunAddSpend(t, cluster(t)) })
}
