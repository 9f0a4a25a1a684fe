package redisstore_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// A gateway's store calls under faults: Redis busy for longer than the
// client's read timeout (DEBUG SLEEP, issued from another connection right
// before the call), so the reply of a script that Redis still runs is lost
// and the call is sent again; both copies wait in Redis and run when it
// wakes, in either order. Every state-changing call must apply once.

// storeTimeout is the client's read timeout in these tests, as a gateway
// configures it (store.redis.timeout), and pause how long Redis stays busy.
const (
	storeTimeout = 250 * time.Millisecond
	pause        = 400 * time.Millisecond
)

// faulty is one Redis deployment under test: standalone or the 3-master
// cluster.
type faulty struct {
	name  string
	addrs []string
	// client returns a client configured as a gateway's: the default
	// retries of go-redis and the store's read timeout.
	client func() redisstore.Scripter
}

// busy makes every server of the deployment busy for d.
func (f faulty) busy(t *testing.T, d time.Duration) {
	t.Helper()
	for _, a := range f.addrs {
		redistest.Sleep(t, a, d)
	}
}

func deployments(t *testing.T) []faulty {
	srv := redistest.Start(t)
	cl := redistest.StartCluster(t)
	return []faulty{
		{"standalone", []string{srv.Addr}, func() redisstore.Scripter {
			return redis.NewClient(&redis.Options{Addr: srv.Addr, ReadTimeout: storeTimeout, WriteTimeout: storeTimeout})
		}},
		{"cluster", cl.Addrs, func() redisstore.Scripter {
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs, ReadTimeout: storeTimeout, WriteTimeout: storeTimeout})
		}},
	}
}

// open returns a store on a client of its own, warmed up as a serving
// gateway's: connected, the scripts loaded, the cluster's slots known.
func open(t *testing.T, f faulty, prefix string) *redisstore.Store {
	t.Helper()
	c := f.client()
	t.Cleanup(func() { c.(interface{ Close() error }).Close() })
	st := redisstore.New(c, redisstore.Options{Prefix: prefix})
	warm := buckets.Bucket{Name: "warm", Key: "warm", Limit: buckets.Limit{Capacity: 1, Rate: 1}}
	d, err := st.Reserve(context.Background(), buckets.Request{Buckets: []buckets.Bucket{warm}})
	if err != nil || !d.OK {
		t.Fatalf("warm-up Reserve = %+v, %v", d, err)
	}
	if _, err := st.Settle(context.Background(), d.Reservation, 0); err != nil {
		t.Fatal(err)
	}
	return st
}

// levels returns the bucket's level and the quota's spend, as Redis holds
// them now.
func levels(t *testing.T, st *redisstore.Store, b buckets.Bucket, q buckets.Quota) (float64, float64) {
	t.Helper()
	bs, qs, err := st.Inspect(context.Background(), []buckets.Bucket{b}, []buckets.Quota{q})
	if err != nil {
		t.Fatal(err)
	}
	return bs[0].Remaining, qs[0].Spent
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

func day(t *testing.T) buckets.Window {
	t.Helper()
	w, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestReserveRetriedAfterTimeoutAppliesOnce: a 100-token reserve while
// Redis is busy for 400 ms leaves the bucket at 900 and the quota at 100,
// not 800 and 200, and its settlement charges exactly what was used.
func TestReserveRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "reserve:")
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			q := buckets.Quota{Name: "daily", Key: "team", Window: day(t), Limit: 1000}
			f.busy(t, pause)
			d, err := st.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
			if err != nil || !d.OK {
				t.Fatalf("Reserve during a %v pause = %+v, %v; want admitted", pause, d, err)
			}
			if l, s := levels(t, st, b, q); !near(l, 900) || !near(s, 100) {
				t.Fatalf("after one reserve of 100: bucket %v, quota %v; want 900 and 100", l, s)
			}
			if _, err := st.Settle(ctx, d.Reservation, 40); err != nil {
				t.Fatal(err)
			}
			if l, s := levels(t, st, b, q); !near(l, 960) || !near(s, 40) {
				t.Errorf("after settling 40: bucket %v, quota %v; want 960 and 40", l, s)
			}
		})
	}
}
