package redisstore_test

import (
	"context"
	"errors"
	"math"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
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
// gateway's: connected, its scripts loaded (a copy of a call whose script
// Redis does not know yet runs nothing), the cluster's slots known.
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
	if err := st.Renew(context.Background(), d.Reservation); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Settle(context.Background(), d.Reservation, 0); err != nil {
		t.Fatal(err)
	}
	if err := st.Pause(context.Background(), warm, time.Now()); err != nil {
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

// slotApart returns a key in another cluster hash slot than k.
func slotApart(k string) string {
	for i := 0; ; i++ {
		if z := "z" + strconv.Itoa(i); redisstore.HashSlot(z) != redisstore.HashSlot(k) {
			return z
		}
	}
}

// TestSettleRetriedAfterTimeoutAppliesOnce: a settlement sent again after
// a lost reply refunds once, on every group of a chain split over slots.
func TestSettleRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "settle:")
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			q := buckets.Quota{Name: "daily", Key: slotApart("u"), Window: day(t), Limit: 1000}
			d, err := st.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
			if err != nil || !d.OK {
				t.Fatalf("Reserve = %+v, %v", d, err)
			}
			f.busy(t, pause)
			if _, err := st.Settle(ctx, d.Reservation, 40); err != nil {
				t.Fatalf("Settle during a %v stall: %v", pause, err)
			}
			if l, s := levels(t, st, b, q); !near(l, 960) || !near(s, 40) {
				t.Errorf("after settling 40 of 100: bucket %v, quota %v; want 960 and 40", l, s)
			}
		})
	}
}

// TestCompensationRetriedAfterTimeoutAppliesOnce: on a cluster, a chain
// whose second group refuses gives back what its first group took, once,
// although both the reserve and its refund were sent twice.
func TestCompensationRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	f := deployments(t)[1]
	st := open(t, f, "comp:")
	ctx := context.Background()
	big := buckets.Bucket{Name: "big", Key: "a", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	small := buckets.Bucket{Name: "small", Key: slotApart("a"), Limit: buckets.Limit{Capacity: 50, Rate: 1e-9}}
	q := buckets.Quota{Name: "daily", Key: "a", Window: day(t), Limit: 1000}
	f.busy(t, pause)
	d, err := st.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{big, small}, Quotas: []buckets.Quota{q}})
	if err != nil || d.OK || d.Reason != buckets.NeverAdmissible {
		t.Fatalf("Reserve = %+v, %v; want refused by small", d, err)
	}
	if l, s := levels(t, st, big, q); !near(l, 1000) || !near(s, 0) {
		t.Errorf("after a refused chain: big %v, quota %v; want 1000 and 0", l, s)
	}
}

// TestExtendRetriedAfterTimeoutAppliesOnce: an extension sent again after
// a lost reply debits once and answers ok, and its settlement charges
// exactly what was used.
func TestExtendRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "extend:")
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Hard: true, Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			q := buckets.Quota{Name: "daily", Key: slotApart("u"), Window: day(t), Limit: 1000, Hard: true}
			d, err := st.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
			if err != nil || !d.OK {
				t.Fatalf("Reserve = %+v, %v", d, err)
			}
			// The first extension loads the script, as a serving gateway's
			// has: a copy that Redis does not know the script of runs nothing.
			if ok, err := st.Extend(ctx, d.Reservation, 10); err != nil || !ok {
				t.Fatalf("Extend(10) = %v, %v; want ok", ok, err)
			}
			f.busy(t, pause)
			if ok, err := st.Extend(ctx, d.Reservation, 50); err != nil || !ok {
				t.Fatalf("Extend(50) during a %v stall = %v, %v; want ok", pause, ok, err)
			}
			if l, s := levels(t, st, b, q); !near(l, 840) || !near(s, 160) {
				t.Errorf("after extending by 10 and 50: bucket %v, quota %v; want 840 and 160", l, s)
			}
			if d.Reservation.Extended != 60 {
				t.Errorf("Extended = %v, want 60", d.Reservation.Extended)
			}
			if _, err := st.Settle(ctx, d.Reservation, 170); err != nil {
				t.Fatal(err)
			}
			if l, s := levels(t, st, b, q); !near(l, 830) || !near(s, 170) {
				t.Errorf("after settling 170: bucket %v, quota %v; want 830 and 170", l, s)
			}
		})
	}
}

// TestLeaseRetriedAfterTimeoutAppliesOnce: a lease call sent again after a
// lost reply takes once, and answers the grant of the copy that ran.
func TestLeaseRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "lease:")
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			other := buckets.Bucket{Name: "team", Key: slotApart("u"), Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			// Load the script first, as a serving gateway has.
			warm := []buckets.LeaseOp{{Bucket: buckets.Bucket{Name: "w", Key: "w", Limit: b.Limit}}, {Bucket: buckets.Bucket{Name: "w", Key: slotApart("w"), Limit: b.Limit}}}
			if err := st.Lease(ctx, warm); err != nil {
				t.Fatal(err)
			}
			f.busy(t, pause)
			ops := []buckets.LeaseOp{{Bucket: b, Need: 10, Want: 300}, {Bucket: other, Give: -100, Need: 0, Want: 200}}
			if err := st.Lease(ctx, ops); err != nil {
				t.Fatalf("Lease during a %v stall: %v", pause, err)
			}
			if !ops[0].OK || ops[0].Granted != 300 || ops[1].Granted != 200 {
				t.Fatalf("grants %+v, %+v; want 300 and 200", ops[0], ops[1])
			}
			for i, want := range []float64{700, 700} {
				bk := []buckets.Bucket{b, other}[i]
				if l, _ := levels(t, st, bk, buckets.Quota{Name: "q", Key: "q", Window: day(t), Limit: 1}); !near(l, want) {
					t.Errorf("bucket %s at %v after one lease call, want %v", bk.Name, l, want)
				}
			}
		})
	}
}

// TestAddSpendRetriedAfterTimeoutAppliesOnce: an outage's spend added
// again after a lost reply counts once, and once more under the same ID
// changes nothing.
func TestAddSpendRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "spend:")
			ctx := context.Background()
			w := day(t)
			q := buckets.Quota{Name: "daily", Key: "team", Window: w, Limit: 3000}
			q2 := buckets.Quota{Name: "key", Key: slotApart("team"), Window: w, Limit: 3000}
			span := w.Span(time.Now())
			ss := []buckets.Spend{{Quota: q, Window: span, Amount: 240}, {Quota: q2, Window: span, Amount: 80}}
			f.busy(t, pause)
			if err := st.AddSpend(ctx, "local-1", ss); err != nil {
				t.Fatalf("AddSpend during a %v stall: %v", pause, err)
			}
			if err := st.AddSpend(ctx, "local-1", ss); err != nil {
				t.Fatal(err)
			}
			_, qs, err := st.Inspect(ctx, nil, []buckets.Quota{q, q2})
			if err != nil {
				t.Fatal(err)
			}
			if !near(qs[0].Spent, 240) || !near(qs[1].Spent, 80) {
				t.Errorf("spent %v and %v, want 240 and 80", qs[0].Spent, qs[1].Spent)
			}
		})
	}
}

// TestPauseAndRenewAreSafeToRepeat: a pause and a renewal sent again after
// a lost reply leave the state that one leaves: the bucket empty until
// the pause's end (a copy that ran later ends it at most that much later),
// the record and the lease renewed, and the reservation settles once.
func TestPauseAndRenewAreSafeToRepeat(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "pause:")
			ctx := context.Background()
			b := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}
			u := buckets.Bucket{Name: "user", Key: slotApart("p"), Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			slot := buckets.Slot{Name: "conc", Key: slotApart("p"), Max: 1, Lease: time.Minute}
			d, err := st.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{u}, Slots: []buckets.Slot{slot}})
			if err != nil || !d.OK {
				t.Fatalf("Reserve = %+v, %v", d, err)
			}
			f.busy(t, pause)
			if err := st.Pause(ctx, b, time.Now().Add(time.Minute)); err != nil {
				t.Fatalf("Pause during a %v stall: %v", pause, err)
			}
			f.busy(t, pause)
			if err := st.Renew(ctx, d.Reservation); err != nil {
				t.Fatalf("Renew during a %v stall: %v", pause, err)
			}
			bs, _, err := st.Inspect(ctx, []buckets.Bucket{b}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if bs[0].Remaining != 0 || bs[0].Reset < time.Minute || bs[0].Reset > time.Minute+1000*time.Second+2*pause {
				t.Errorf("paused bucket %+v; want empty, full again a minute and a refill later", bs[0])
			}
			if _, err := st.Settle(ctx, d.Reservation, 10); err != nil {
				t.Fatal(err)
			}
			d, err = st.Reserve(ctx, buckets.Request{ID: "r2", Cost: 0, Buckets: []buckets.Bucket{u}, Slots: []buckets.Slot{slot}})
			if err != nil || !d.OK || !near(d.Buckets[0].Remaining, 990) {
				t.Errorf("after the settlement = %+v, %v; want the slot free and 990 left", d, err)
			}
		})
	}
}

// TestLostReserveIsCancelled: a reserve whose every reply is lost (Redis
// busy for longer than the store's timeout) fails with an
// IncompleteError, although Redis takes once it wakes; cancelling its
// Rest gives everything back, and a copy of the reserve that arrives after
// the cancellation takes nothing.
func TestLostReserveIsCancelled(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			c := f.client()
			t.Cleanup(func() { c.(interface{ Close() error }).Close() })
			st := redisstore.New(c, redisstore.Options{Prefix: "lost:", Timeout: 600 * time.Millisecond})
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			q := buckets.Quota{Name: "daily", Key: slotApart("u"), Window: day(t), Limit: 1000}
			req := buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
			if _, _, err := st.Inspect(ctx, req.Buckets, req.Quotas); err != nil { // connect, load the script
				t.Fatal(err)
			}
			if d, err := st.Reserve(ctx, buckets.Request{ID: "warm", Buckets: req.Buckets, Quotas: req.Quotas}); err != nil || !d.OK {
				t.Fatalf("warm-up Reserve = %+v, %v", d, err)
			}
			f.busy(t, 1500*time.Millisecond)
			_, err := st.Reserve(ctx, req)
			var inc *buckets.IncompleteError
			if !errors.As(err, &inc) || !errors.Is(err, buckets.ErrStore) {
				t.Fatalf("Reserve while Redis is busy past the store's timeout: %v; want an IncompleteError wrapping ErrStore", err)
			}
			for _, a := range f.addrs { // answered once Redis has woken and run what waited
				if _, err := redistest.Do(a, "PING"); err != nil {
					t.Fatal(err)
				}
			}
			if l, s := levels(t, st, b, q); !near(l, 900) || !near(s, 100) {
				t.Fatalf("after the lost reserve: bucket %v, quota %v; want it taken once, 900 and 100", l, s)
			}
			f.busy(t, pause)
			if err := st.Cancel(ctx, inc.Rest); err != nil { // sent twice
				t.Fatal(err)
			}
			if err := st.Cancel(ctx, inc.Rest); err != nil { // and once more
				t.Fatal(err)
			}
			if l, s := levels(t, st, b, q); !near(l, 1000) || !near(s, 0) {
				t.Errorf("after the cancellation: bucket %v, quota %v; want 1000 and 0", l, s)
			}
			d, err := st.Reserve(ctx, req) // a copy arriving late
			if err != nil || d.OK {
				t.Errorf("a copy of the cancelled reserve = %+v, %v; want refused", d, err)
			}
			if l, s := levels(t, st, b, q); !near(l, 1000) || !near(s, 0) {
				t.Errorf("after a late copy: bucket %v, quota %v; want 1000 and 0", l, s)
			}
		})
	}
}

// TestReplayAfterTheRecordExpiredChargesTheUsage: a settlement replayed
// after an outage longer than the reservation's lifetime replaces the
// reservation by the usage all the same, once; when an earlier copy of
// it may have applied, only what charges more applies (the usage beyond
// the reservation, never a refund).
func TestReplayAfterTheRecordExpiredChargesTheUsage(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			c := f.client()
			t.Cleanup(func() { c.(interface{ Close() error }).Close() })
			st := redisstore.New(c, redisstore.Options{Prefix: "replay:"})
			now := time.Unix(1_800_000_000, 0)
			redisstore.SetScriptClock(st, func() time.Time { return now })
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			q := buckets.Quota{Name: "daily", Key: slotApart("u"), Window: day(t), Limit: 10000}
			reserve := func(id string) *buckets.Reservation {
				t.Helper()
				d, err := st.Reserve(ctx, buckets.Request{ID: id, Cost: 100, Lifetime: time.Minute, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
				if err != nil || !d.OK {
					t.Fatalf("Reserve %s = %+v, %v", id, d, err)
				}
				return d.Reservation
			}
			check := func(what string, level, spent float64) {
				t.Helper()
				if l, s := levels(t, st, b, q); !near(l, level) || !near(s, spent) {
					t.Errorf("%s: bucket %v, quota %v; want %v and %v", what, l, s, level, spent)
				}
			}
			unsent, over, applied, maybe := reserve("unsent"), reserve("over"), reserve("applied"), reserve("maybe")
			if _, err := st.Settle(ctx, applied, 30); err != nil {
				t.Fatal(err)
			}
			check("four reserves of 100, one settled at 30", 670, 330)
			now = now.Add(2 * time.Minute) // every record has expired
			if _, err := st.Settle(ctx, unsent, 40); err != nil {
				t.Fatal(err)
			}
			check("a settle after the lifetime", 670, 330)
			f.busy(t, pause) // the replay is sent twice, and then once more
			for range 2 {
				if _, err := st.Replay(ctx, unsent, 40, false); err != nil {
					t.Fatal(err)
				}
			}
			check("the replay of a settlement that never reached Redis", 730, 270)
			// May have applied: the usage beyond the reservation applies,
			// a refund does not.
			for _, r := range []struct {
				res    *buckets.Reservation
				actual float64
			}{{over, 150}, {applied, 30}, {maybe, 30}} {
				if _, err := st.Replay(ctx, r.res, r.actual, true); err != nil {
					t.Fatal(err)
				}
			}
			check("replays that may have applied", 680, 320)
		})
	}
}

// TestChargeRetriedAfterTimeoutAppliesOnce: charges sent while Redis is
// busy for longer than the client's read timeout — one waited for, three
// queued together, which share a call and its marker — are sent again by
// the store after their replies are lost, and both copies run: each
// applies once, on every group of a chain split over slots.
func TestChargeRetriedAfterTimeoutAppliesOnce(t *testing.T) {
	for _, f := range deployments(t) {
		t.Run(f.name, func(t *testing.T) {
			st := open(t, f, "charge:")
			ctx := context.Background()
			b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
			q := buckets.Quota{Name: "daily", Key: slotApart("u"), Window: day(t), Limit: 1000}
			charge := func(id string) *buckets.Reservation {
				return &buckets.Reservation{ID: id, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
			}
			f.busy(t, pause)
			errs := make(chan error, 3)
			for i, n := range []float64{10, 20, 30} {
				st.ChargeAsync(charge("queued"+strconv.Itoa(i)), n, func(_ []buckets.BucketState, err error) { errs <- err })
			}
			if _, err := st.Charge(ctx, charge("waited"), 40); err != nil {
				t.Fatalf("Charge during a %v stall: %v", pause, err)
			}
			for range 3 {
				if err := <-errs; err != nil {
					t.Fatalf("ChargeAsync during a %v stall: %v", pause, err)
				}
			}
			if l, s := levels(t, st, b, q); !near(l, 900) || !near(s, 100) {
				t.Errorf("after charges of 10, 20, 30 and 40: bucket %v, quota %v; want 900 and 100", l, s)
			}
		})
	}
}

// holder is a gateway's client that loses the replies of the batch calls
// it holds: while held is set, such a call is not sent, and fails as a
// call whose reply timed out does; its arguments are kept, so that the
// test can deliver the copy late, as a copy waiting in a dead connection
// runs when Redis reads it.
type holder struct {
	redisstore.Scripter
	mu    sync.Mutex
	held  bool
	calls [][]any
}

func (h *holder) Process(ctx context.Context, cmd redis.Cmder) error {
	h.mu.Lock()
	hold := h.held && len(cmd.Args()) > 0 && cmd.Args()[0] == "evalsha"
	if hold {
		h.calls = append(h.calls, append([]any(nil), cmd.Args()...))
	}
	h.mu.Unlock()
	if hold {
		err := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
		cmd.SetErr(err)
		return err
	}
	return h.Scripter.Process(ctx, cmd)
}

// deliver runs each held call now, once: the copies of one call are
// alike, and a charge split over hash slots makes a call per slot.
func (h *holder) deliver(t *testing.T) {
	t.Helper()
	h.mu.Lock()
	calls := h.calls
	h.mu.Unlock()
	if len(calls) == 0 {
		t.Fatal("no call was held")
	}
	var sent [][]any
	for _, c := range calls {
		if slices.ContainsFunc(sent, func(d []any) bool { return slices.Equal(c, d) }) {
			continue
		}
		sent = append(sent, c)
		cmd := redis.NewCmd(context.Background(), c...)
		if err := h.Scripter.Process(context.Background(), cmd); err != nil {
			t.Fatalf("the late copy: %v", err)
		}
	}
}

// TestLostChargeIsReplayedOnce: two charges of a bucket and a quota in
// another hash slot, whose shared call (a call per slot in the cluster)
// goes unanswered (every copy's reply lost), fail with an IncompleteError
// that names the calls. Replaying each (as the failover store does once Redis
// answers) applies it once, whether the lost call ran before the replays,
// between them (its copy arrives late: it finds the first replay's mark
// and applies neither charge, and the second replay applies its own), or
// never. A refund replayed within half the repeat window applies, as the
// call surely did not run; replayed later, when the call's marker may
// have expired, it does not (never less than what was used).
func TestLostChargeIsReplayedOnce(t *testing.T) {
	for _, f := range deployments(t) {
		for _, late := range []string{"before", "between", "never"} {
			t.Run(f.name+"/"+late, func(t *testing.T) {
				h := &holder{Scripter: f.client()}
				t.Cleanup(func() { h.Scripter.(interface{ Close() error }).Close() })
				clock := time.Now()
				var mu sync.Mutex
				st := redisstore.New(h, redisstore.Options{Prefix: "lostcharge:" + late + ":", SettleWindow: 50 * time.Millisecond,
					Cluster: f.name == "cluster", Now: func() time.Time { mu.Lock(); defer mu.Unlock(); return clock }})
				ctx := context.Background()
				b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
				q := buckets.Quota{Name: "daily", Key: slotApart("u"), Window: day(t), Limit: 10000}
				if _, err := st.Charge(ctx, &buckets.Reservation{ID: "warm", Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}, 0); err != nil {
					t.Fatal(err)
				}
				h.mu.Lock()
				h.held = true
				h.mu.Unlock()
				type result struct {
					i   int
					err error
				}
				done := make(chan result, 2)
				for i, n := range []float64{100, 200} {
					r := &buckets.Reservation{ID: "hit" + strconv.Itoa(i), Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}
					st.ChargeAsync(r, n, func(_ []buckets.BucketState, err error) { done <- result{i, err} })
				}
				rests := make([]*buckets.IncompleteError, 2)
				for range 2 {
					res := <-done
					var inc *buckets.IncompleteError
					// A call per hash slot: one in standalone mode, two in
					// the cluster (the quota is in another slot).
					calls := 1
					if f.name == "cluster" {
						calls = 2
					}
					if !errors.As(res.err, &inc) || !inc.Sent || len(inc.Rest.Unanswered) != calls {
						t.Fatalf("a charge whose reply was lost: %v; want an IncompleteError, sent, naming its %d calls", res.err, calls)
					}
					rests[res.i] = inc
				}
				if inc := rests[0]; !slices.Equal(inc.Rest.Unanswered, rests[1].Rest.Unanswered) {
					t.Fatalf("charges queued together name calls %q and %q; want one", inc.Rest.Unanswered, rests[1].Rest.Unanswered)
				}
				h.mu.Lock()
				h.held = false
				h.mu.Unlock()
				replay := func(i int, actual float64) {
					t.Helper()
					if _, err := st.Replay(ctx, rests[i].Rest, actual, true); err != nil {
						t.Fatal(err)
					}
				}
				level := func() float64 {
					t.Helper()
					bs, qs, err := st.Inspect(ctx, []buckets.Bucket{b}, []buckets.Quota{q})
					if err != nil {
						t.Fatal(err)
					}
					if !near(bs[0].Remaining+qs[0].Spent, 1000) {
						t.Errorf("bucket %v and quota %v disagree: each charge applies to both once", bs[0].Remaining, qs[0].Spent)
					}
					return bs[0].Remaining
				}
				if late == "before" {
					h.deliver(t)
				}
				replay(0, 100)
				replay(0, 100) // a replay sent again
				if late == "between" {
					h.deliver(t)
				}
				replay(1, 200)
				if l := level(); !near(l, 700) {
					t.Fatalf("after charges of 100 and 200, the lost call delivered %s the replays: level %v, want 700", late, l)
				}
				h.deliver(t) // a copy later still
				if l := level(); !near(l, 700) {
					t.Fatalf("after a copy of the lost call arrived last: level %v, want 700", l)
				}

				// A refund of 50 in a call that never reaches Redis:
				// replayed at once it applies; a second one, replayed past
				// half the repeat window, does not.
				h.mu.Lock()
				h.held, h.calls = true, nil
				h.mu.Unlock()
				var refunds []*buckets.IncompleteError
				for i := range 2 {
					_, err := st.Charge(ctx, &buckets.Reservation{ID: "refund" + strconv.Itoa(i), Cost: 50, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}}, 0)
					var inc *buckets.IncompleteError
					if !errors.As(err, &inc) {
						t.Fatalf("a refund whose reply was lost: %v; want an IncompleteError", err)
					}
					refunds = append(refunds, inc)
				}
				h.mu.Lock()
				h.held = false
				h.mu.Unlock()
				if _, err := st.Replay(ctx, refunds[0].Rest, 0, true); err != nil {
					t.Fatal(err)
				}
				if l := level(); !near(l, 750) {
					t.Errorf("a refund of 50 replayed at once: level %v, want 750", l)
				}
				mu.Lock()
				clock = clock.Add(buckets.RepeatWindow/2 + time.Second)
				mu.Unlock()
				if _, err := st.Replay(ctx, refunds[1].Rest, 0, true); err != nil {
					t.Fatal(err)
				}
				if l := level(); !near(l, 750) {
					t.Errorf("a refund of 50 replayed past half the repeat window: level %v, want 750 (not refunded)", l)
				}
			})
		}
	}
}
