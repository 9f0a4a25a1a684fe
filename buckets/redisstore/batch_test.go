package redisstore

import (
	"context"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestBatchIsSequential runs reserves and settles that depend on each
// other in one batch — one script call — and checks that each comes out as
// it does when the memory store runs them one at a time: a refused
// reserve takes nothing, a settle's refund is there for the next reserve,
// a second settle and the settle of an unknown ID change nothing, a full
// slot refuses.
func TestBatchIsSequential(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	t0 := time.Unix(1_800_000_000, 0)
	now := func() time.Time { return t0 }
	st := New(c, Options{})
	SetScriptClock(st, now)
	mem := buckets.NewMemory(buckets.MemoryOptions{Now: now})
	ctx := context.Background()

	user := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 10, Rate: 1}}
	team := buckets.Bucket{Name: "team", Key: "t", Limit: buckets.Limit{Capacity: 100, Rate: 1}, MaxDebt: 1}
	slot := buckets.Slot{Name: "conc", Key: "u", Max: 2, Lease: time.Minute}
	chain, slots := []buckets.Bucket{user, team}, []buckets.Slot{slot}
	type step struct {
		reserve bool
		id      string
		cost    float64 // reserve: cost; settle: actual
	}
	steps := []step{
		{true, "a", 6}, {true, "b", 6}, {false, "a", 2}, {true, "c", 6},
		{false, "a", 0}, {false, "zz", 0}, {true, "d", 1}, {true, "e", 1}, {false, "c", 120},
	}
	type result struct {
		Status buckets.Reason
		Done   bool
		Levels []float64
		Forgot []float64
	}
	var want, got []result
	// The memory store, one step at a time.
	res := map[string]*buckets.Reservation{}
	for _, s := range steps {
		var r result
		if s.reserve {
			d, err := mem.Reserve(ctx, buckets.Request{ID: s.id, Cost: s.cost, Buckets: chain, Slots: slots})
			if err != nil {
				t.Fatal(err)
			}
			r.Status = d.Reason
			for _, b := range d.Buckets {
				r.Levels = append(r.Levels, b.Remaining)
			}
			res[s.id] = d.Reservation
		} else {
			rv := res[s.id]
			if rv == nil {
				rv = &buckets.Reservation{ID: s.id, Cost: 1, Buckets: chain, Slots: slots}
			}
			before := levels(t, mem, chain)
			states, err := mem.Settle(ctx, rv, s.cost)
			if err != nil {
				t.Fatal(err)
			}
			for _, b := range states {
				r.Levels = append(r.Levels, b.Remaining)
				r.Forgot = append(r.Forgot, b.Forgiven)
			}
			r.Done = cmp.Equal(before, r.Levels)
		}
		want = append(want, r)
	}
	// The Redis store, all steps in one batch.
	g := st.groups(chain, slots, nil)[0]
	ops := make([]*op, len(steps))
	for i, s := range steps {
		o := &op{reserve: s.reserve, g: g, id: s.id, record: st.recordKey(g.tag), bs: chain, ss: slots,
			cost: s.cost, life: time.Hour, obs: make([]buckets.Observation, len(chain))}
		if !s.reserve {
			charged := 6.0
			if s.id == "d" || s.id == "zz" {
				charged = 1
			}
			o.delta = func(buckets.Bucket) float64 { return charged - s.cost }
		}
		ops[i] = o
	}
	st.runBatch(ctx, ops)
	for i, o := range ops {
		if o.err != nil {
			t.Fatalf("step %d: %v", i, o.err)
		}
		r := result{Done: o.done}
		if o.reserve {
			r.Status = o.status
		}
		for _, ob := range o.obs {
			r.Levels = append(r.Levels, ob.Level)
			if !o.reserve {
				r.Forgot = append(r.Forgot, ob.Forgiven)
			}
		}
		got = append(got, r)
	}
	if d := cmp.Diff(want, got, cmpopts.EquateApprox(0, 1e-9)); d != "" {
		t.Errorf("one batch differs from one step at a time (-memory +batch):\n%s", d)
	}
}

// TestQueuedSettlementGoesFirst: a settlement queued by SettleAsync goes
// with the next reserve, in the same script call, and before it, as it
// came first: the reserve meets its refund (S8).
func TestQueuedSettlementGoesFirst(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	t0 := time.Unix(1_800_000_000, 0)
	st := New(c, Options{SettleWindow: time.Hour}) // only a call takes it
	SetScriptClock(st, func() time.Time { return t0 })
	ctx := context.Background()
	b := buckets.Bucket{Name: "b", Key: "k", Limit: buckets.Limit{Capacity: 100, Rate: 1}}
	req := buckets.Request{Cost: 100, Buckets: []buckets.Bucket{b}}
	d, err := st.Reserve(ctx, req)
	if err != nil || !d.OK {
		t.Fatalf("first Reserve = %+v, %v", d, err)
	}
	settled := make(chan error, 1)
	st.SettleAsync(d.Reservation, 0, func(_ []buckets.BucketState, err error) { settled <- err })
	d, err = st.Reserve(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-settled:
		if err != nil {
			t.Fatalf("queued settlement: %v", err)
		}
	default:
		t.Fatal("the queued settlement did not go with the next reserve")
	}
	if !d.OK {
		t.Errorf("second Reserve refused (%v, level %v): it ran before the settlement queued ahead of it", d.Reason, d.Buckets[0].Remaining)
	}
}

// levels reads the levels of chain from m without changing them.
func levels(t *testing.T, m *buckets.Memory, chain []buckets.Bucket) []float64 {
	t.Helper()
	d, err := m.Reserve(context.Background(), buckets.Request{Cost: 0, Buckets: chain})
	if err != nil {
		t.Fatal(err)
	}
	if d.OK {
		if _, err := m.Settle(context.Background(), d.Reservation, 0); err != nil {
			t.Fatal(err)
		}
	}
	var ls []float64
	for _, b := range d.Buckets {
		ls = append(ls, b.Remaining)
	}
	return ls
}

// TestRecordsOverflowAndVanish: a holder bucket keeps maxInline records in
// its value and the rest go to the record key, which its spill mark says
// for the repeat window; every reservation still settles exactly once,
// and once all are settled neither holds anything, and the mark goes with
// the window.
func TestRecordsOverflowAndVanish(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := New(c, Options{})
	now := time.Unix(1_800_000_000, 0)
	SetScriptClock(st, func() time.Time { return now })
	ctx := context.Background()
	b := buckets.Bucket{Name: "b", Key: "k", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	const n = 40
	var res []*buckets.Reservation
	for range n {
		d, err := st.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}})
		if err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		res = append(res, d.Reservation)
	}
	v, err := c.Get(ctx, st.bucketKey("k")).Result()
	if err != nil {
		t.Fatal(err)
	}
	if got := c.ZCard(ctx, st.recordKey("k")).Val(); got != n-maxInline {
		t.Errorf("record key holds %d records, want %d beyond the holder's %d", got, n-maxInline, maxInline)
	}
	if want := 24 + 9 + maxInline*(9+32); len(v) != want {
		t.Errorf("holder value of %d bytes, want %d (header, spill mark and %d records of 32-byte IDs)", len(v), want, maxInline)
	}
	for round := range 2 { // the second round changes nothing
		for _, r := range res {
			if _, err := st.Settle(ctx, r, 4); err != nil {
				t.Fatal(err)
			}
		}
		d, err := st.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{b}})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.Buckets[0].Remaining; math.Abs(got-(1000-n*4)) > 1e-6 {
			t.Fatalf("round %d: level = %v, want %v", round, got, 1000-n*4)
		}
		if _, err := st.Settle(ctx, d.Reservation, 0); err != nil {
			t.Fatal(err)
		}
	}
	if v := c.Get(ctx, st.bucketKey("k")).Val(); len(v) != 24+9 {
		t.Errorf("holder value of %d bytes after all settled, want 33 (header and spill mark)", len(v))
	}
	if n := c.Exists(ctx, st.recordKey("k")).Val(); n != 0 {
		t.Errorf("record key still exists after all settled")
	}
	now = now.Add(buckets.RepeatWindow)
	d, err := st.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{b}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Settle(ctx, d.Reservation, 0); err != nil {
		t.Fatal(err)
	}
	if v := c.Get(ctx, st.bucketKey("k")).Val(); len(v) != 16 {
		t.Errorf("holder value of %d bytes once the repeat window has passed, want 16", len(v))
	}
}

// inflight counts the batch script calls in flight and the most at once.
type inflight struct {
	now, most atomic.Int32
}

func (h *inflight) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *inflight) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "evalsha" {
			return next(ctx, cmd)
		}
		n := h.now.Add(1)
		for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
		}
		defer h.now.Add(-1)
		return next(ctx, cmd)
	}
}

func (h *inflight) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestLaneCallsOneAtATime: while fewer ops wait than a batch holds, a lane
// has one call in flight, so the waiting ops go together in the next (Redis
// pays per call); only a whole waiting batch starts a second.
func TestLaneCallsOneAtATime(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 32})
	defer c.Close()
	h := new(inflight)
	c.AddHook(h)
	st := New(c, Options{})
	ctx := context.Background()
	b := buckets.Bucket{Name: "b", Key: "k", Limit: buckets.Limit{Capacity: 1e12, Rate: 1e9}}
	var wg sync.WaitGroup
	const callers, each = 16, 200 // at most 32 ops wait: less than a batch
	for range callers {
		wg.Go(func() {
			for range each {
				d, err := st.Reserve(ctx, buckets.Request{Cost: 1, Buckets: []buckets.Bucket{b}})
				if err != nil || !d.OK {
					t.Errorf("Reserve = %+v, %v", d, err)
					return
				}
				st.SettleAsync(d.Reservation, 1, nil)
			}
		})
	}
	wg.Wait()
	if err := st.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if m := h.most.Load(); m != 1 {
		t.Errorf("%d batch calls were in flight at once, want 1 while less than a batch waits", m)
	}
	calls, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := evalshaCallsIn(t, calls)
	t.Logf("%d script calls for %d requests", n, callers*each)
	if n > callers*each/2 {
		t.Errorf("%d script calls for %d requests of %d callers: the waiting ops did not go together", n, callers*each, callers)
	}

	l := &lane{inflight: 1, queue: make([]*op, maxBatchOps-1)}
	if !l.canCall(1) {
		t.Error("a whole batch waits (with the caller's op) and no second call may start")
	}
	if l.canCall(0) {
		t.Error("less than a batch waits and a second call may start")
	}
	l.inflight = maxInflight
	if l.canCall(1) {
		t.Errorf("a call may start with %d in flight", maxInflight)
	}
}

// evalshaCallsIn reads the EVALSHA calls from INFO commandstats.
func evalshaCallsIn(t *testing.T, info string) int {
	t.Helper()
	_, rest, ok := strings.Cut(info, "cmdstat_evalsha:calls=")
	v, _, ok2 := strings.Cut(rest, ",")
	n, err := strconv.Atoi(v)
	if !ok || !ok2 || err != nil {
		t.Fatalf("INFO commandstats has no evalsha calls: %q", info)
	}
	return n
}

// fakeTimers stands in for time.AfterFunc in a store: it records every
// timer armed, which a test fires by hand.
type fakeTimers struct {
	mu     sync.Mutex
	armed  []*fakeTimer
	window []time.Duration
}

type fakeTimer struct {
	f       func()
	stopped atomic.Bool
}

func (t *fakeTimer) Stop() bool { return !t.stopped.Swap(true) }

func (ft *fakeTimers) afterFunc(d time.Duration, f func()) stopper {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	t := &fakeTimer{f: f}
	ft.armed = append(ft.armed, t)
	ft.window = append(ft.window, d)
	return t
}

// fire runs timer i as if its time had come, stopped or not (a stopped
// time.Timer may already be running its function).
func (ft *fakeTimers) fire(i int) {
	ft.mu.Lock()
	t := ft.armed[i]
	ft.mu.Unlock()
	t.f()
}

func (ft *fakeTimers) count() int {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	return len(ft.armed)
}

// TestSettleWindowStartsWithTheSettlement: a settlement queued by
// SettleAsync waits its whole window for a call to join. The timer armed
// for an earlier settlement, which a reserve took along, neither sends a
// later one before its window (at one caller that made every third
// settlement a script call of its own) nor keeps the later one from
// getting a timer of its own.
func TestSettleWindowStartsWithTheSettlement(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := New(c, Options{SettleWindow: time.Minute})
	ft := &fakeTimers{}
	st.afterFunc = ft.afterFunc
	ctx := context.Background()
	b := buckets.Bucket{Name: "b", Key: "k", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}
	req := buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}}
	settled := make(chan error, 4)
	done := func(_ []buckets.BucketState, err error) { settled <- err }

	a, err := st.Reserve(ctx, req)
	if err != nil || !a.OK {
		t.Fatalf("Reserve a = %+v, %v", a, err)
	}
	st.SettleAsync(a.Reservation, 5, done)
	if ft.count() != 1 {
		t.Fatalf("%d timers armed after one settlement, want 1", ft.count())
	}
	// The next reserve takes a's settlement along.
	bd, err := st.Reserve(ctx, req)
	if err != nil || !bd.OK {
		t.Fatalf("Reserve b = %+v, %v", bd, err)
	}
	if err := <-settled; err != nil {
		t.Fatalf("a's settlement: %v", err)
	}
	if !ft.armed[0].stopped.Load() {
		t.Error("a's timer still armed once a call took every queued settlement")
	}
	st.SettleAsync(bd.Reservation, 5, done)
	if ft.count() != 2 {
		t.Fatalf("%d timers armed after the second settlement, want 2 (one of its own)", ft.count())
	}
	calls0 := scriptCalls(t, c)
	ft.fire(0) // a's timer, late: b's settlement must keep waiting
	select {
	case err := <-settled:
		t.Fatalf("b's settlement sent by a's timer, before its own window (err %v)", err)
	default:
	}
	if n := scriptCalls(t, c) - calls0; n != 0 {
		t.Errorf("a's timer made %d script calls, want 0", n)
	}
	ft.fire(1) // b's own window has passed: it goes alone
	if err := <-settled; err != nil {
		t.Fatalf("b's settlement: %v", err)
	}
	if ft.window[1] != time.Minute {
		t.Errorf("b's timer armed for %v, want the settle window", ft.window[1])
	}
}

// scriptCalls is how many EVALSHA calls the server has run.
func scriptCalls(t *testing.T, c *redis.Client) int {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	return evalshaCallsIn(t, info)
}

// TestSettleKeepsOrExtendsTheTTL: a bucket key lives until its bucket
// would be full again. A settlement that gives tokens back keeps the key's
// TTL, which covers the refill from the lower level the reserve left; one
// that charges usage beyond the reservation sets the longer TTL the debt
// needs (S9).
func TestSettleKeepsOrExtendsTheTTL(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := New(c, Options{})
	ctx := context.Background()
	b := buckets.Bucket{Name: "b", Key: "ttl", Limit: buckets.Limit{Capacity: 1000, Rate: 1}} // no floor
	key := st.bucketKey(b.Key)
	// fullIn is the time the bucket at level needs to refill to full.
	fullIn := func(level float64) time.Duration { return time.Duration((1000 - level) * float64(time.Second)) }
	pttl := func() time.Duration {
		t.Helper()
		d, err := c.PTTL(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	reserve := func() *buckets.Reservation {
		t.Helper()
		d, err := st.Reserve(ctx, buckets.Request{Cost: 100, Buckets: []buckets.Bucket{b}})
		if err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		return d.Reservation
	}
	settle := func(r *buckets.Reservation, actual float64) float64 {
		t.Helper()
		states, err := st.Settle(ctx, r, actual)
		if err != nil {
			t.Fatal(err)
		}
		return states[0].Remaining
	}
	r := reserve()
	if got := pttl(); got < fullIn(900) {
		t.Fatalf("after the reserve: TTL %v, want at least %v", got, fullIn(900))
	}
	before := pttl()
	level := settle(r, 10) // 90 back
	if got := pttl(); got < fullIn(level) || got > before {
		t.Errorf("after a refund to %v: TTL %v, want the reserve's (%v at most), at least %v", level, got, before, fullIn(level))
	}
	r = reserve()
	level = settle(r, 6000) // 5,900 beyond the reservation: deep in debt
	if got := pttl(); got < fullIn(level) {
		t.Errorf("after a debt down to %v: TTL %v, want at least %v", level, got, fullIn(level))
	}
}

// TestRefundToABucketWithoutKeyWritesATTL: a chain's second bucket (not
// the holder of the record) refills to full and its key expires while the
// request runs; the settlement's refund then writes a key that does not
// exist, which must get a TTL, not keep one it does not have.
// docs/buckets.md: "a TTL on every key (a bucket's key expires once it
// would be full again ...)"; lua.go: "Every write sets the TTL".
func TestRefundToABucketWithoutKeyWritesATTL(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := New(c, Options{})
	ctx := context.Background()
	holder := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	fast := buckets.Bucket{Name: "provider", Key: "p", Limit: buckets.Limit{Capacity: 10, Rate: 1000}}
	d, err := st.Reserve(ctx, buckets.Request{Cost: 5, Buckets: []buckets.Bucket{holder, fast}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	key := st.bucketKey(fast.Key)
	deadline := time.Now().Add(5 * time.Second)
	for c.Exists(ctx, key).Val() == 1 {
		if time.Now().After(deadline) {
			t.Fatal("the fast bucket's key never expired")
		}
	}
	if _, err := st.Settle(ctx, d.Reservation, 1); err != nil {
		t.Fatal(err)
	}
	if ttl := c.PTTL(ctx, key).Val(); ttl == -1 {
		t.Errorf("after a refund to a bucket whose key had expired: PTTL %v, the key lives forever; want a TTL (or no key)", ttl)
	}
	// The rate-limit service's refund (negative hits: a charge of a
	// reservation of the hits settled at 0, rls plan.reservation) to a
	// bucket that is full, so has no key, does the same.
	idle := buckets.Bucket{Name: "idle", Key: "idle", Limit: buckets.Limit{Capacity: 100, Rate: 1}}
	if _, err := st.Charge(ctx, &buckets.Reservation{ID: "refund", Cost: 5, Buckets: []buckets.Bucket{idle}}, 0); err != nil {
		t.Fatal(err)
	}
	if ttl := c.PTTL(ctx, st.bucketKey(idle.Key)).Val(); ttl == -1 {
		t.Errorf("after a refund charged to a full bucket: PTTL %v, the key lives forever; want a TTL (or no key)", ttl)
	}
}

// TestAnIDLikeATombstoneIsItsOwn: a reservation ID that starts with "%t"
// is the tombstone "%t"+ID that a cancellation (or a settle of a reserve
// sent twice) leaves for another ID, unless the store hashes it: a reserve
// with ID "%tX" after X was cancelled must take its cost (S3: "then c is
// taken from all of them"), and its settlement charge the usage (S8).
func TestAnIDLikeATombstoneIsItsOwn(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := New(c, Options{})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	d, err := st.Reserve(ctx, buckets.Request{ID: "X", Cost: 100, Buckets: []buckets.Bucket{b}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve X = %+v, %v", d, err)
	}
	if err := st.Cancel(ctx, d.Reservation); err != nil {
		t.Fatal(err)
	}
	d, err = st.Reserve(ctx, buckets.Request{ID: "%tX", Cost: 100, Buckets: []buckets.Bucket{b}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve %%tX = %+v, %v", d, err)
	}
	if got := d.Buckets[0].Remaining; math.Abs(got-900) > 1e-6 {
		t.Errorf("a reserve of 100 with ID %%tX after X was cancelled leaves %v, want 900", got)
	}
	if _, err := st.Settle(ctx, d.Reservation, 100); err != nil {
		t.Fatal(err)
	}
	bs, _, err := st.Inspect(ctx, []buckets.Bucket{b}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := bs[0].Remaining; math.Abs(got-900) > 1e-6 {
		t.Errorf("after using 100 tokens the bucket holds %v, want 900", got)
	}
}
