package lease_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestOutageExtensionOfLeasedAndInnerPartSettlesTheUsage: a stream
// on a hard leased bucket with a hard quota (the part the inner store
// reserves in Redis) outlives its lease during a Redis outage. Failing
// open, the extension comes from the failover store's fallback, for the
// leased bucket (demoted) and for the inner part alike — two Extend calls
// of the failover store under the one reservation ID. The fallback debited
// the extension locally, so Redis never took it; once Redis answers, the
// settlement must charge the quota the usage (docs/budgets.md, "Every exit
// of a request": admitted... "by its own exit's rule"; settled while Redis
// was down: "its own rule, once"), 15 here, and the leased bucket what it
// lent (10: the 5 extended came from the fallback, "the buckets only
// locally").
func TestOutageExtensionOfLeasedAndInnerPartSettlesTheUsage(t *testing.T) {
	srv := redistest.StartPersistent(t)
	rs, fo, ls, clock := outageRig(t, srv, 1000)
	ctx := context.Background()
	w, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	b := buckets.Bucket{Name: "budget", Key: "budget", Hard: true, Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9},
		Lease: &buckets.Lease{Size: 10}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: w, Limit: 1000, Hard: true}
	d, err := ls.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	srv.Kill()
	if ok, err := ls.Extend(ctx, d.Reservation, 5); err != nil || !ok {
		t.Fatalf("Extend during the outage, failing open = %v, %v; want extended from the fallback", ok, err)
	}
	srv.Restart()
	clock.Advance(2 * time.Second) // past both back-offs
	if _, err := ls.Settle(ctx, d.Reservation, 15); err != nil && !errors.Is(err, buckets.ErrStore) {
		t.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if left := fo.Drain(dctx); left != 0 {
		t.Fatalf("%d writes not replayed", left)
	}
	if err := ls.Close(dctx); err != nil {
		t.Fatal(err)
	}
	bs, qs, err := rs.Inspect(ctx, []buckets.Bucket{b}, []buckets.Quota{q})
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(qs[0].Spent-15) > 1e-6 || math.Abs(bs[0].Remaining-990) > 1e-6 {
		t.Errorf("after the settlement: quota %v, bucket %v; want 15 (the usage, once) and 990 (the 10 leased; the 5 extended came from the fallback)",
			qs[0].Spent, bs[0].Remaining)
	}
}

// TestOutageExtensionOfAFallbackReservationKeepsTheFallbackLimit: a
// request admitted during a Redis outage takes its hard leased bucket
// from what the lease still holds and its quota from the failover store's
// fallback. Its stream then outlives the lease: the extensions of the
// leased bucket come from the fallback (docs/buckets.md, Leases,
// "Outage": "so do the extensions of streams on a hard leased bucket
// (failing open, from the fallback ...)"), whose limit is the fallback's
// (50 here), capped at the bucket's own (failover package: "an outage
// never grants more than the shared bucket would", and the fleet's
// fallback is divided among its gateways, S20). They must stop at 50, as
// TestOutageHardLeaseExtendsFromTheFallback has them stop for a request
// without a quota.
func TestOutageExtensionOfAFallbackReservationKeepsTheFallbackLimit(t *testing.T) {
	srv := redistest.Start(t)
	_, _, ls, _ := outageRig(t, srv, 50)
	ctx := context.Background()
	w, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	b := buckets.Bucket{Name: "budget", Key: "budget", Hard: true, Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9},
		Lease: &buckets.Lease{Size: 20}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: w, Limit: 1e6}
	if d, err := ls.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}}); err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	srv.Kill()
	// 10 tokens left in the lease: the bucket's part; the quota's from the
	// fallback.
	d, err := ls.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve during the outage = %+v, %v", d, err)
	}
	extended := 0
	for extended < 2000 {
		ok, err := ls.Extend(ctx, d.Reservation, 5)
		if err != nil {
			t.Fatalf("Extend after %d: %v", extended, err)
		}
		if !ok {
			break
		}
		extended += 5
	}
	if extended != 50 {
		t.Errorf("extended %d tokens of the hard leased bucket from the fallback during the outage, want the fallback's 50", extended)
	}
}
