package failover_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// gateway is one gateway's store stack on a Redis: the Redis store (as
// the gateway's client configures it) and the failover store over it.
type gateway struct {
	rs *redisstore.Store
	fo *failover.Store
}

func newGateway(t *testing.T, addr string, ropts redisstore.Options, fopts failover.Options) gateway {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: 250 * time.Millisecond, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { c.Close() })
	rs := redisstore.New(c, ropts)
	if fopts.Mode == failover.Open && fopts.Fallback == (buckets.Limit{}) {
		fopts.Fallback = buckets.Limit{Capacity: 1e9, Rate: 1e9}
	}
	if fopts.Backoff == 0 {
		fopts.Backoff = 50 * time.Millisecond
	}
	return gateway{rs: rs, fo: failover.New(rs, fopts)}
}

func spentIn(t *testing.T, rs *redisstore.Store, b buckets.Bucket, q buckets.Quota) (float64, float64) {
	t.Helper()
	bs, qs, err := rs.Inspect(context.Background(), []buckets.Bucket{b}, []buckets.Quota{q})
	if err != nil {
		t.Fatal(err)
	}
	return bs[0].Remaining, qs[0].Spent
}

func dayWindow(t *testing.T) buckets.Window {
	t.Helper()
	w, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6 }

// TestReserveWithLostReplyIsCancelled: Redis busy for longer than the
// store's timeout takes a reserve whose reply never comes. Failing open,
// the request is admitted locally; once Redis answers, the reservation it
// made anyway is cancelled and the local spend added: the tenant pays the
// request once, not the reservation in Redis as well.
func TestReserveWithLostReplyIsCancelled(t *testing.T) {
	srv := redistest.Start(t)
	gw := newGateway(t, srv.Addr, redisstore.Options{Timeout: 600 * time.Millisecond}, failover.Options{Mode: failover.Open})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: dayWindow(t), Limit: 1000}
	req := buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
	if d, err := gw.fo.Reserve(ctx, buckets.Request{ID: "warm", Buckets: req.Buckets, Quotas: req.Quotas}); err != nil || !d.OK {
		t.Fatalf("warm-up Reserve = %+v, %v", d, err)
	}
	redistest.Sleep(t, srv.Addr, 1500*time.Millisecond)
	d, err := gw.fo.Reserve(ctx, req)
	if err != nil || !d.OK {
		t.Fatalf("Reserve while Redis is busy = %+v, %v; want admitted by the fallback", d, err)
	}
	if _, err := redistest.Do(srv.Addr, "PING"); err != nil { // Redis has woken and run what waited
		t.Fatal(err)
	}
	if _, err := gw.fo.Settle(ctx, d.Reservation, 40); err != nil {
		t.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if left := gw.fo.Drain(dctx); left != 0 {
		t.Fatalf("%d writes not replayed", left)
	}
	if l, s := spentIn(t, gw.rs, b, q); !near(l, 1000) || !near(s, 40) {
		t.Errorf("after the replay: bucket %v, quota %v; want 1000 (the lost reservation cancelled) and 40 (what was used, once)", l, s)
	}
}

// TestReplayAfterAnOutageLongerThanTheLifetimeChargesTheUsage: Redis down
// for longer than a reservation's lifetime, its record has expired by the
// time the settlement kept meanwhile is replayed; the window is charged
// the usage all the same, not the reservation.
func TestReplayAfterAnOutageLongerThanTheLifetimeChargesTheUsage(t *testing.T) {
	srv := redistest.StartPersistent(t)
	gw := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Closed})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: dayWindow(t), Limit: 1000}
	const life = 500 * time.Millisecond
	d, err := gw.fo.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Lifetime: life, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	expires := redisTime(t, srv.Addr).Add(life)
	srv.Kill()
	if _, err := gw.fo.Reserve(ctx, buckets.Request{ID: "r2", Cost: 1, Buckets: []buckets.Bucket{b}}); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Reserve with Redis down = %v, want ErrStore", err)
	}
	if _, err := gw.fo.Settle(ctx, d.Reservation, 40); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Settle with Redis down = %v, want ErrStore (kept for replay)", err)
	}
	srv.Restart()
	deadline := time.Now().Add(5 * time.Second)
	for !redisTime(t, srv.Addr).After(expires) { // the outage outlives the record
		if time.Now().After(deadline) {
			t.Fatal("Redis's clock did not pass the reservation's expiry")
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if left := gw.fo.Drain(dctx); left != 0 {
		t.Fatalf("%d writes not replayed", left)
	}
	if l, s := spentIn(t, gw.rs, b, q); !near(l, 960) || !near(s, 40) {
		t.Errorf("after the replay: bucket %v, quota %v; want 960 and 40 (the usage, not the reservation)", l, s)
	}
}

// redisTime is the Redis server's clock.
func redisTime(t *testing.T, addr string) time.Time {
	t.Helper()
	v, err := redistest.Do(addr, "TIME")
	if err != nil {
		t.Fatal(err)
	}
	var sec, usec int64
	if _, err := fmt.Sscan(v, &sec, &usec); err != nil {
		t.Fatalf("TIME = %q: %v", v, err)
	}
	return time.Unix(sec, usec*1000)
}

// TestOutageSpendReplayedWithoutTraffic is the fleet's outage, end to end:
// three gateways, a daily quota of 3,000 tokens with 2,700 spent, Redis
// killed, 240 spent during the outage (80 per gateway), Redis back with
// its data. All 240 reach the window as soon as Redis answers, without a
// request; then traffic comes back to one gateway only, and the window
// ends within what it had left ± one request per gateway.
func TestOutageSpendReplayedWithoutTraffic(t *testing.T) {
	const limit, spentBefore, cost, gateways = 3000.0, 2700.0, 10.0, 3
	srv := redistest.StartPersistent(t)
	var gws []gateway
	for i := range gateways {
		var fleet failover.Fleet
		gw := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Open, GatewayID: fmt.Sprint("gw", i),
			HeartbeatEvery: 20 * time.Millisecond})
		fleet = gw.rs
		gw = newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Open, GatewayID: fmt.Sprint("gw", i),
			HeartbeatEvery: 20 * time.Millisecond, Fleet: fleet})
		gws = append(gws, gw)
	}
	ctx := context.Background()
	for range 2 {
		for _, gw := range gws {
			if err := gw.fo.Beat(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	q := buckets.Quota{Name: "daily", Key: "team", Window: dayWindow(t), Limit: limit}
	prov := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 1e9, Rate: 1e9}}
	ask := func(gw gateway, c float64) bool {
		t.Helper()
		d, err := gw.fo.Reserve(ctx, buckets.Request{Cost: c, Buckets: []buckets.Bucket{prov}, Quotas: []buckets.Quota{q}})
		if err != nil {
			t.Fatalf("Reserve: %v", err)
		}
		if d.OK {
			if _, err := gw.fo.Settle(ctx, d.Reservation, c); err != nil && !errors.Is(err, buckets.ErrStore) {
				t.Fatalf("Settle: %v", err)
			}
		}
		return d.OK
	}
	if !ask(gws[0], spentBefore) {
		t.Fatal("the spend before the outage was refused")
	}
	for _, gw := range gws { // each learns the window's spend
		ask(gw, 0)
	}
	srv.Kill()
	for _, gw := range gws {
		for range 8 {
			if !ask(gw, cost) {
				t.Fatal("a request within the gateway's share was refused during the outage")
			}
		}
	}
	srv.Restart()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{}, gateways)
	for _, gw := range gws {
		go func() { gw.fo.Run(rctx); done <- struct{}{} }()
	}
	defer func() {
		stop()
		for range gateways {
			<-done
		}
	}()
	window := func() float64 {
		_, qs, err := gws[0].rs.Inspect(ctx, nil, []buckets.Quota{q})
		if err != nil {
			t.Fatal(err)
		}
		return qs[0].Spent
	}
	deadline := time.Now().Add(5 * time.Second)
	for window() != spentBefore+gateways*8*cost {
		if time.Now().After(deadline) {
			t.Fatalf("the window holds %v 5s after Redis came back without traffic, want %v", window(), spentBefore+gateways*8*cost)
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
	for ask(gws[0], cost) {
	}
	for _, gw := range gws {
		if n := gw.fo.Pending(); n != 0 {
			t.Errorf("a gateway still has %d writes to replay", n)
		}
	}
	if got := window(); got > limit+gateways*cost || got < limit-gateways*cost {
		t.Errorf("the window ends at %v, want the budget %v ± one request per gateway", got, limit)
	}
}

// TestShutdownSavesWhatItCannotReplay: a gateway that stops while Redis
// is down saves what it could not replay; the next one loads it and
// replays it once Redis answers — once, even when it loads the same file
// twice (it died before it had replayed it).
func TestShutdownSavesWhatItCannotReplay(t *testing.T) {
	srv := redistest.StartPersistent(t)
	gw := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Open})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: dayWindow(t), Limit: 1000}
	req := buckets.Request{Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
	before, err := gw.fo.Reserve(ctx, req)
	if err != nil || !before.OK {
		t.Fatalf("Reserve = %+v, %v", before, err)
	}
	srv.Kill()
	during, err := gw.fo.Reserve(ctx, req)
	if err != nil || !during.OK {
		t.Fatalf("Reserve failing open = %+v, %v", during, err)
	}
	for _, r := range []*buckets.Reservation{before.Reservation, during.Reservation} {
		if _, err := gw.fo.Settle(ctx, r, 30); err != nil && !errors.Is(err, buckets.ErrStore) {
			t.Fatal(err)
		}
	}
	dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	left := gw.fo.Drain(dctx)
	cancel()
	if left != 2 {
		t.Fatalf("Drain with Redis down left %d writes, want 2 (a settlement and the outage's spend)", left)
	}
	var file bytes.Buffer
	if n, err := gw.fo.SavePending(&file); err != nil || n != 2 {
		t.Fatalf("SavePending = %d, %v; want 2", n, err)
	}
	srv.Restart()
	next := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Open})
	for range 2 {
		if n, err := next.fo.LoadPending(bytes.NewReader(file.Bytes())); err != nil || n != 2 {
			t.Fatalf("LoadPending = %d, %v; want 2", n, err)
		}
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		left := next.fo.Drain(dctx)
		cancel()
		if left != 0 {
			t.Fatalf("%d writes not replayed", left)
		}
		if l, s := spentIn(t, next.rs, b, q); !near(l, 970) || !near(s, 60) {
			t.Errorf("after the replay: bucket %v, quota %v; want 970 and 60 (each request's 30, once)", l, s)
		}
	}
}

// A release before quotas recorded their unit saved quotas of money
// without a currency; loaded with Options.Currency, their replay charges
// the window in that currency, which the fleet reads and writes since.
func TestLoadPendingGivesQuotasOfMoneyTheCurrency(t *testing.T) {
	srv := redistest.StartPersistent(t)
	gw := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Open})
	ctx := context.Background()
	earlier := buckets.Quota{Name: "spend", Key: "team", Window: dayWindow(t), Unit: buckets.Money, Limit: 5_000_000}
	usd := earlier
	usd.Currency = "USD"
	d, err := gw.rs.Reserve(ctx, buckets.Request{Money: 1000, Quotas: []buckets.Quota{usd}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	d.Reservation.Spent = 1000
	if _, err := gw.rs.Settle(ctx, d.Reservation, 0); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	during, err := gw.fo.Reserve(ctx, buckets.Request{Money: 500, Quotas: []buckets.Quota{earlier}})
	if err != nil || !during.OK {
		t.Fatalf("Reserve failing open = %+v, %v", during, err)
	}
	during.Reservation.Spent = 400
	if _, err := gw.fo.Settle(ctx, during.Reservation, 0); err != nil && !errors.Is(err, buckets.ErrStore) {
		t.Fatal(err)
	}
	var file bytes.Buffer
	if n, err := gw.fo.SavePending(&file); err != nil || n == 0 {
		t.Fatalf("SavePending = %d, %v; want the outage's spend", n, err)
	}
	srv.Restart()
	next := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Open, Currency: "USD"})
	if _, err := next.fo.LoadPending(bytes.NewReader(file.Bytes())); err != nil {
		t.Fatal(err)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	left := next.fo.Drain(dctx)
	cancel()
	if left != 0 {
		t.Fatalf("%d writes not replayed", left)
	}
	_, qs, err := next.rs.Inspect(ctx, nil, []buckets.Quota{usd})
	if err != nil {
		t.Fatal(err)
	}
	if qs[0].Spent != 1400 {
		t.Errorf("after the replay the quota in USD has spent %v, want 1000 + the outage's 400", qs[0].Spent)
	}
}

// TestLostChargeReplayedOnce: a rate-limit service's charges (one waited
// for, one queued) while Redis is busy for longer than the store's
// timeout: every copy of their call loses its reply, and the failover
// store keeps both for replay. Redis then wakes and runs the copies that
// waited in its connections; the replays, once Redis answers, find the
// call's marker and apply nothing more: each charge counts once.
func TestLostChargeReplayedOnce(t *testing.T) {
	srv := redistest.Start(t)
	gw := newGateway(t, srv.Addr, redisstore.Options{Timeout: 600 * time.Millisecond}, failover.Options{Mode: failover.Closed})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: dayWindow(t), Limit: 1000}
	charge := func(id string) *buckets.Reservation {
		return &buckets.Reservation{ID: id, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
	}
	if _, err := gw.fo.Charge(ctx, charge("warm"), 0); err != nil { // connected, the script loaded
		t.Fatal(err)
	}
	redistest.Sleep(t, srv.Addr, 1500*time.Millisecond)
	queued := make(chan error, 1)
	gw.fo.ChargeAsync(charge("queued"), 30, func(_ []buckets.BucketState, err error) { queued <- err })
	if _, err := gw.fo.Charge(ctx, charge("waited"), 70); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Charge while Redis is busy past the store's timeout = %v, want ErrStore (kept for replay)", err)
	}
	if err := <-queued; !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("ChargeAsync while Redis is busy past the store's timeout = %v, want ErrStore (kept for replay)", err)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if left := gw.fo.Drain(dctx); left != 0 {
		t.Fatalf("%d writes not replayed", left)
	}
	if l, s := spentIn(t, gw.rs, b, q); !near(l, 900) || !near(s, 100) {
		t.Errorf("after charges of 30 and 70 lost and replayed: bucket %v, quota %v; want 900 and 100", l, s)
	}
}
