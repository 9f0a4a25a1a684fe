package redisstore_test

import (
	"context"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestServerClock runs on the Redis server's TIME (S2), as in production,
// and checks that every key the store writes has a TTL, so idle buckets
// vanish.
func TestServerClock(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "user:{7}", Limit: buckets.Limit{Capacity: 100, Rate: 1}}
	r := buckets.Request{ID: "r1", Cost: 40, Buckets: []buckets.Bucket{b},
		Slots: []buckets.Slot{{Name: "conc", Key: "user:{7}", Max: 4, Lease: time.Minute}}}
	d, err := st.Reserve(ctx, r)
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	if got := d.Buckets[0].Remaining; got < 60 || got > 60.5 {
		t.Errorf("remaining = %v, want about 60", got)
	}
	if ttl := c.PTTL(ctx, "tg:c:{user:%7B7%7D}").Val(); ttl <= 0 || ttl > time.Minute+2*time.Second {
		t.Errorf("slot set TTL = %v, want about the lease (1m)", ttl)
	}
	// The open reservation's record, in its bucket's value, lives as long
	// as it may be settled.
	if ttl := c.PTTL(ctx, "tg:b:{user:%7B7%7D}").Val(); ttl < buckets.DefaultLifetime || ttl > buckets.DefaultLifetime+2*time.Second {
		t.Errorf("bucket TTL with an open reservation = %v, want about the default lifetime (%v)", ttl, buckets.DefaultLifetime)
	}
	states, err := st.Settle(ctx, d.Reservation, 50)
	if err != nil {
		t.Fatal(err)
	}
	if got := states[0].Remaining; got < 50 || got > 51 {
		t.Errorf("remaining after settling 50 = %v, want about 50", got)
	}
	keys, err := c.Keys(ctx, "tg:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	// A settled request leaves nothing behind: its record is gone from the
	// bucket, the slot set with its last member.
	if len(keys) != 1 {
		t.Errorf("keys = %q, want the bucket alone", keys)
	}
	for _, k := range keys {
		ttl, err := c.PTTL(ctx, k).Result()
		if err != nil || ttl <= 0 {
			t.Errorf("PTTL %s = %v, %v; want a positive TTL", k, ttl, err)
		}
	}
	// A bucket's key lives at least until it is full again (50 s), at most
	// as long as a refill from its floor (-100 → 100 takes 200 s) and a
	// second.
	if ttl := c.PTTL(ctx, "tg:b:{user:%7B7%7D}").Val(); ttl < 50*time.Second || ttl > 202*time.Second {
		t.Errorf("bucket TTL = %v, want between 50s and 202s", ttl)
	}
}

// TestStoreFailure checks S21's contract with the caller: an unreachable
// Redis is an error wrapping buckets.ErrStore, never a decision, and the
// store works again once Redis is back — even though the restarted server
// has forgotten the scripts.
func TestStoreFailure(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: time.Second})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 10, Rate: 1}}
	r := buckets.Request{Cost: 1, Buckets: []buckets.Bucket{b}}
	if d, err := st.Reserve(ctx, r); err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	srv.Kill()
	if _, err := st.Reserve(ctx, r); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Reserve with Redis down = %v, want ErrStore", err)
	}
	srv.Restart()
	var err error
	deadline := time.Now().Add(5 * time.Second)
	for {
		var d buckets.Decision
		d, err = st.Reserve(ctx, r)
		if err == nil {
			if !d.OK || d.Buckets[0].Remaining != 9 {
				t.Errorf("Reserve after restart = %+v; want admitted from a fresh bucket", d)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Reserve after restart still fails: %v", err)
		}
	}
}

// clusterStore starts a 3-master cluster and returns a store on it and
// its client.
func clusterStore(t *testing.T) (*redisstore.Store, *redis.ClusterClient) {
	cl := redistest.StartCluster(t)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
	t.Cleanup(func() { c.Close() })
	return redisstore.New(c, redisstore.Options{}), c
}

// otherSlot returns the first of prefix0, prefix1, ... whose cluster slot
// is not key's.
func otherSlot(key, prefix string) string {
	for i := 0; ; i++ {
		if k := prefix + strconv.Itoa(i); redisstore.HashSlot(k) != redisstore.HashSlot(key) {
			return k
		}
	}
}

// TestClusterChainAcrossSlots checks the compensation of a chain split
// over cluster slots: when a later group refuses, the earlier group's take
// is refunded and its slot released.
func TestClusterChainAcrossSlots(t *testing.T) {
	st, _ := clusterStore(t)
	ctx := context.Background()
	a := "a"
	z := otherSlot(a, "z")
	big := buckets.Bucket{Name: "big", Key: a, Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	small := buckets.Bucket{Name: "small", Key: z, Limit: buckets.Limit{Capacity: 5, Rate: 1e-9}}
	slot := buckets.Slot{Name: "conc", Key: a, Max: 1}
	r := buckets.Request{Cost: 4, Buckets: []buckets.Bucket{big, small}, Slots: []buckets.Slot{slot}}
	if d, err := st.Reserve(ctx, r); err != nil || !d.OK {
		t.Fatalf("first Reserve = %+v, %v", d, err)
	} else if _, err := st.Settle(ctx, d.Reservation, 4); err != nil {
		t.Fatal(err)
	}
	d, err := st.Reserve(ctx, r)
	if err != nil || d.OK || d.Limiting != "small" {
		t.Fatalf("second Reserve = %+v, %v; want refused by small", d, err)
	}
	// big was taken and refunded, and the slot released: a request that
	// needs only big and the slot fits exactly.
	d, err = st.Reserve(ctx, buckets.Request{Cost: 96, Buckets: []buckets.Bucket{big}, Slots: []buckets.Slot{slot}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve of the rest of big = %+v, %v; want admitted", d, err)
	}
}

// idHook calls fn before each command that names id (a script call of
// its reservation), with how many it has seen.
type idHook struct {
	id string
	n  atomic.Int64
	fn func(n int64)
}

func (h *idHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *idHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if slices.ContainsFunc(cmd.Args(), func(a any) bool { s, _ := a.(string); return s == h.id }) {
			h.fn(h.n.Add(1))
		}
		return next(ctx, cmd)
	}
}

func (h *idHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestClusterChainAsksAgainInOrder plays the moment that requests racing
// for the last tokens of a chain across two slots meet: the second bucket
// is held by another request when the first is taken, and freed right
// after. A request refused by one group while another admitted it is
// refunded and asks again group by group; here the second try finds the
// room and admits it, once: each bucket ends exactly one cost lower.
func TestClusterChainAsksAgainInOrder(t *testing.T) {
	st, c := clusterStore(t)
	ctx := context.Background()
	a := "team"
	z := otherSlot(a, "provider")
	team := buckets.Bucket{Name: "team", Key: a, Limit: buckets.Limit{Capacity: 3, Rate: 1e-9}}
	prov := buckets.Bucket{Name: "provider", Key: z, Limit: buckets.Limit{Capacity: 3, Rate: 1e-9}}
	other, err := st.Reserve(ctx, buckets.Request{Cost: 3, Buckets: []buckets.Bucket{prov}})
	if err != nil || !other.OK {
		t.Fatalf("Reserve of the provider's tokens = %+v, %v", other, err)
	}
	// The request's calls: its reserve in both groups at once, the
	// provider refusing; the team's refund; then, asking again, the
	// team's reserve — before which the other request gives its tokens
	// back — and the provider's.
	hook := &idHook{id: "x1", fn: func(n int64) {
		if n == 4 {
			if _, err := st.Settle(ctx, other.Reservation, 0); err != nil {
				t.Error(err)
			}
		}
	}}
	c.AddHook(hook)
	d, err := st.Reserve(ctx, buckets.Request{ID: "x1", Cost: 3, Buckets: []buckets.Bucket{team, prov}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v; want admitted when it asks again in order (%d calls)", d, err, hook.n.Load())
	}
	if n := hook.n.Load(); n != 5 {
		t.Errorf("%d calls of the reservation, want 5: two at once, a refund, two in order", n)
	}
	if d.Reservation.ID != "x1" {
		t.Errorf("reservation ID %q, want the request's x1", d.Reservation.ID)
	}
	// Each bucket holds the request's cost, once (refilled by next to
	// nothing since).
	for _, b := range []buckets.Bucket{team, prov} {
		d, err := st.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{b}})
		if err != nil || d.Buckets[0].Remaining > 1e-6 {
			t.Errorf("%s after the request: %+v, %v; want 0 remaining", b.Name, d.Buckets, err)
		}
	}
	if _, err := st.Settle(ctx, d.Reservation, 3); err != nil {
		t.Fatal(err)
	}
}

// TestClusterExtendAcrossSlots checks that Extend over hard buckets in two
// slots is all or none: when the second refuses, the first is refunded.
func TestClusterExtendAcrossSlots(t *testing.T) {
	st, _ := clusterStore(t)
	ctx := context.Background()
	a := "a"
	z := otherSlot(a, "z")
	first := buckets.Bucket{Name: "first", Key: a, Hard: true, Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	second := buckets.Bucket{Name: "second", Key: z, Hard: true, Limit: buckets.Limit{Capacity: 10, Rate: 1e-9}}
	d, err := st.Reserve(ctx, buckets.Request{Cost: 5, Buckets: []buckets.Bucket{first, second}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	if ok, err := st.Extend(ctx, d.Reservation, 4); err != nil || !ok {
		t.Fatalf("Extend(4) = %v, %v; want true", ok, err)
	}
	if ok, err := st.Extend(ctx, d.Reservation, 2); err != nil || ok {
		t.Fatalf("Extend(2) with 1 left in second = %v, %v; want false", ok, err)
	}
	if d.Reservation.Extended != 4 {
		t.Errorf("Extended = %v, want 4", d.Reservation.Extended)
	}
	probe, err := st.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{first, second}})
	if err != nil {
		t.Fatal(err)
	}
	if got := []float64{probe.Buckets[0].Remaining, probe.Buckets[1].Remaining}; math.Abs(got[0]-91) > 1e-6 || math.Abs(got[1]-1) > 1e-6 {
		t.Errorf("levels after a refused Extend = %v, want [91 1]", got)
	}
}

// TestLongIDAndKeyAreBounded: a 60 KB reservation ID (a client's request
// ID, say) and a 10 KB bucket key never become Redis keys or slot members
// of that size; hashed, they still settle once, and two long IDs that
// differ only at their end stay two reservations.
func TestLongIDAndKeyAreBounded(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	longKey := strings.Repeat("k", 10<<10)
	b := buckets.Bucket{Name: "user", Key: longKey, Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
	slot := buckets.Slot{Name: "conc", Key: longKey, Max: 2, Lease: time.Minute}
	idA, idB := strings.Repeat("x", 60<<10)+"a", strings.Repeat("x", 60<<10)+"b"
	var res []*buckets.Reservation
	for _, id := range []string{idA, idB} {
		d, err := st.Reserve(ctx, buckets.Request{ID: id, Cost: 10, Buckets: []buckets.Bucket{b}, Slots: []buckets.Slot{slot}})
		if err != nil || !d.OK {
			t.Fatalf("Reserve = %+v, %v", d, err)
		}
		res = append(res, d.Reservation)
	}
	if _, err := st.Settle(ctx, res[0], 4); err != nil {
		t.Fatal(err)
	}
	// The second reservation is not taken for the first: its settlement
	// refunds too, and settling the first again changes nothing.
	for _, r := range []*buckets.Reservation{res[1], res[0]} {
		if _, err := st.Settle(ctx, r, 4); err != nil {
			t.Fatal(err)
		}
	}
	d, err := st.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{b}, Slots: []buckets.Slot{slot}})
	if err != nil || !d.OK || math.Abs(d.Buckets[0].Remaining-92) > 1e-6 {
		t.Fatalf("after two settlements of 4 = %+v, %v; want 92 left and the slots free", d, err)
	}
	keys, err := c.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if len(k) > 128 {
			t.Errorf("key of %d bytes: %.60q…", len(k), k)
		}
		if typ := c.Type(ctx, k).Val(); typ == "zset" {
			for _, m := range c.ZRange(ctx, k, 0, -1).Val() {
				if len(m) > 64 {
					t.Errorf("slot member of %d bytes in %s", len(m), k)
				}
			}
		}
	}
	if len(keys) != 2 {
		t.Errorf("keys = %q; want the bucket and the slot set of the last Reserve", keys)
	}
}

// TestHeartbeat counts the gateways alive: one that leaves is gone at
// once, one that stops beating once its heartbeat's TTL has passed.
func TestHeartbeat(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{})
	now := time.Unix(1_800_000_000, 0)
	redisstore.SetScriptClock(st, func() time.Time { return now })
	ctx := context.Background()
	beat := func(gw string, want int) {
		t.Helper()
		if n, err := st.Heartbeat(ctx, gw, 3*time.Second); err != nil || n != want {
			t.Fatalf("Heartbeat(%s) = %d, %v; want %d alive", gw, n, err, want)
		}
	}
	beat("a", 1)
	beat("b", 2)
	beat("c", 3)
	if err := st.Leave(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	beat("a", 2)
	now = now.Add(2 * time.Second)
	beat("a", 2) // c's heartbeat has a second left
	now = now.Add(1500 * time.Millisecond)
	beat("a", 1)
}

// A quota's spend is keyed by its window and lives until the window's end
// and the slack (buckets.QuotaSlack), whatever writes it later; spend that
// returns to nothing leaves no key.
func TestQuotaKeysExpireWithTheirWindow(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	now := time.Now()
	st := redisstore.New(c, redisstore.Options{Now: func() time.Time { return now }})
	ctx := context.Background()
	w, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	q := buckets.Quota{Name: "daily", Key: "team:{acme}", Window: w, Limit: 1000}
	key := "tg:q:{team:%7Bacme%7D}:" + w.ID(now)
	_, end := w.Bounds(now)
	want := end.Add(buckets.QuotaSlack).Sub(now)
	checkTTL := func(what string) {
		t.Helper()
		ttl, err := c.PTTL(ctx, key).Result()
		if err != nil || ttl > want+time.Millisecond || ttl < want-2*time.Second {
			t.Errorf("%s: PTTL %s = %v, %v; want about %v", what, key, ttl, err, want)
		}
	}
	d1, err := st.Reserve(ctx, buckets.Request{Cost: 40, Quotas: []buckets.Quota{q}})
	if err != nil || !d1.OK {
		t.Fatalf("Reserve = %+v, %v", d1, err)
	}
	checkTTL("after a reserve")
	d2, err := st.Reserve(ctx, buckets.Request{Cost: 10, Quotas: []buckets.Quota{q}})
	if err != nil || !d2.OK || d2.Quotas[0].Spent != 50 {
		t.Fatalf("second Reserve = %+v, %v", d2, err)
	}
	checkTTL("after a second reserve")
	for _, r := range []*buckets.Reservation{d1.Reservation, d2.Reservation} {
		if _, err := st.Settle(ctx, r, 0); err != nil {
			t.Fatal(err)
		}
	}
	keys, err := c.Keys(ctx, "tg:*").Result()
	if err != nil || len(keys) != 0 {
		t.Errorf("keys after refunding everything = %q, %v; want none", keys, err)
	}
}
