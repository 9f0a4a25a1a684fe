package lease_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/lease"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// While Redis is down (S21), a gateway admits against the leases it still
// holds — tokens Redis already debited, so the fleet's total holds — and
// once they run out the failover store decides (failing open: its local
// fallback limit). When Redis answers again, leases resume.
func TestOutageLeasesRunOutThenFailoverDecides(t *testing.T) {
	srv := redistest.Start(t)
	_, fo, ls, clock := outageRig(t, srv, 50)
	ctx := context.Background()
	b := buckets.Bucket{Name: "provider", Key: "provider", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9},
		Lease: &buckets.Lease{Size: 100}}
	admit := func() (n int) {
		t.Helper()
		for {
			d, err := ls.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
			if err != nil {
				t.Fatalf("Reserve after %d: %v", n, err)
			}
			if !d.OK {
				return n
			}
			n++
			if n > 100 {
				t.Fatal("more than 100 requests admitted")
			}
		}
	}
	d, err := ls.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	srv.Kill()
	// 90 tokens left in the lease: 9 requests; then the fallback's 50: 5.
	if n := admit(); n != 9+5 {
		t.Errorf("admitted %d during the outage, want 9 from the lease and 5 from the fallback", n)
	}
	if fo.Healthy() {
		t.Error("the failover store did not notice the outage")
	}
	srv.Restart() // empty: the bucket is full again
	clock.Advance(time.Second)
	if n := admit(); n != 100 {
		t.Errorf("admitted %d once Redis answered again, want the bucket's 100", n)
	}
}

// A stream on a hard leased bucket that outlives its lease during a Redis
// outage (S14, S21): failing open, its extensions come from the failover
// store's fallback, as its admission would, and stop where the fallback
// does; failing closed, an extension answers a store error, and the
// stream is cut.
func TestOutageHardLeaseExtendsFromTheFallback(t *testing.T) {
	for name, mode := range map[string]failover.Mode{"open": failover.Open, "closed": failover.Closed} {
		t.Run(name, func(t *testing.T) {
			srv := redistest.Start(t)
			c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: time.Second})
			t.Cleanup(func() { c.Close() })
			clock := bucketstest.NewClock()
			rs := redisstore.New(c, redisstore.Options{})
			opts := failover.Options{Mode: mode, Backoff: time.Second, Now: clock.Now}
			if mode == failover.Open {
				opts.Fallback = buckets.Limit{Capacity: 50, Rate: 1e-9}
			}
			fo := failover.New(rs, opts)
			ls := lease.New(fo, rs, lease.Options{Backoff: time.Second, SweepEvery: -1, Now: clock.Now})
			ctx := context.Background()
			b := buckets.Bucket{Name: "budget", Key: "budget", Hard: true, Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9},
				Lease: &buckets.Lease{Size: 20}}
			d, err := ls.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
			if err != nil || !d.OK {
				t.Fatalf("Reserve = %+v, %v", d, err)
			}
			srv.Kill()
			// 10 tokens left in the lease, then the fallback's 50 when
			// failing open.
			extended := 0
			for extended < 200 {
				ok, err := ls.Extend(ctx, d.Reservation, 5)
				if mode == failover.Closed && extended >= 10 {
					if err == nil || ok {
						t.Fatalf("failing closed, Extend past the lease = %v, %v; want a store error", ok, err)
					}
					break
				}
				if err != nil {
					t.Fatalf("Extend after %d: %v", extended, err)
				}
				if !ok {
					break
				}
				extended += 5
			}
			want := 10
			if mode == failover.Open {
				want = 10 + 50
			}
			if extended != want {
				t.Errorf("extended %d tokens during the outage, want %d", extended, want)
			}
			if got := d.Reservation.Extended; got != float64(want) {
				t.Errorf("Reservation.Extended = %v, want %d", got, want)
			}
		})
	}
}

// outageRig is a lease store over a failover store over the Redis at srv,
// failing open to a fallback of capacity tokens, on a clock of its own.
func outageRig(t *testing.T, srv *redistest.Server, capacity float64) (*redisstore.Store, *failover.Store, *lease.Store, *bucketstest.Clock) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { c.Close() })
	clock := bucketstest.NewClock()
	rs := redisstore.New(c, redisstore.Options{})
	fo := failover.New(rs, failover.Options{Mode: failover.Open, Fallback: buckets.Limit{Capacity: capacity, Rate: 1e-9},
		Backoff: time.Second, Now: clock.Now})
	ls := lease.New(fo, rs, lease.Options{Backoff: time.Second, SweepEvery: -1, Now: clock.Now})
	return rs, fo, ls, clock
}
