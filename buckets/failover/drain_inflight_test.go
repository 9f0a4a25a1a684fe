package failover_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// reviewClock is a clock the test advances (the failover store's back-off).
type reviewClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *reviewClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *reviewClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestDrainTimeoutDuringBackgroundReplaySavesEveryWrite: Redis comes
// back, the background replay takes the kept settlement and sends it, and
// Redis stops answering again (a failover, a fork) while that call runs.
// The gateway stops: Drain's grace ends while the background replay waits
// for its reply. Drain says one write is left; SavePending must save it
// (docs/budgets.md, "What the store guarantees under faults": "What Redis
// does not take by then is saved to store.replay_file and queued again at
// the next start"; Drain: "returns how many writes are still unreplayed;
// save them with SavePending, or they are lost"), the write in flight too,
// so that the next start replays the settlement: the usage is charged, not
// the reservation in full.
func TestDrainTimeoutDuringBackgroundReplaySavesEveryWrite(t *testing.T) {
	srv := redistest.StartPersistent(t)
	clk := &reviewClock{t: time.Now()}
	gw := newGateway(t, srv.Addr, redisstore.Options{Timeout: 5 * time.Second},
		failover.Options{Mode: failover.Closed, Now: clk.now, Backoff: time.Second})
	ctx := context.Background()
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	q := buckets.Quota{Name: "daily", Key: "team", Window: dayWindow(t), Limit: 1000}
	d, err := gw.fo.Reserve(ctx, buckets.Request{ID: "r1", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	srv.Kill()
	if _, err := gw.fo.Reserve(ctx, buckets.Request{ID: "r2", Cost: 1, Buckets: []buckets.Bucket{b}}); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Reserve with Redis down = %v, want ErrStore", err)
	}
	// Within the back-off: kept without a call, so replayed exactly.
	if _, err := gw.fo.Settle(ctx, d.Reservation, 40); !errors.Is(err, buckets.ErrStore) {
		t.Fatalf("Settle with Redis down = %v, want ErrStore (kept for replay)", err)
	}
	if n := gw.fo.Pending(); n != 1 {
		t.Fatalf("Pending = %d, want 1", n)
	}
	srv.Restart()
	// Redis answers reads but holds every write (CLIENT PAUSE WRITE).
	if _, err := redistest.Do(srv.Addr, "CLIENT", "PAUSE", "20000", "WRITE"); err != nil {
		t.Fatal(err)
	}
	clk.add(2 * time.Second) // past the back-off
	if _, _, err := gw.fo.Inspect(ctx, []buckets.Bucket{b}, nil); err != nil {
		t.Fatalf("Inspect after Redis came back = %v", err)
	}
	// The background replay has taken the settlement and waits for Redis.
	deadline := time.Now().Add(3 * time.Second)
	for !failover.ReplayInFlight(gw.fo) {
		if time.Now().After(deadline) {
			t.Fatalf("the background replay did not start: pending %d", gw.fo.Pending())
		}
		time.Sleep(5 * time.Millisecond) // polling with a deadline
	}
	// Shutdown: the grace ends while the replay's call runs.
	dctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	left := gw.fo.Drain(dctx)
	cancel()
	var file bytes.Buffer
	saved, err := gw.fo.SavePending(&file)
	if err != nil {
		t.Fatal(err)
	}
	// Redis dies before it ran the held write; the gateway has exited.
	srv.Kill()
	srv.Restart()
	next := newGateway(t, srv.Addr, redisstore.Options{}, failover.Options{Mode: failover.Closed})
	if _, err := next.fo.LoadPending(bytes.NewReader(file.Bytes())); err != nil {
		t.Fatal(err)
	}
	dctx, cancel = context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if n := next.fo.Drain(dctx); n != 0 {
		t.Fatalf("%d writes not replayed at the next start", n)
	}
	l, s := spentIn(t, next.rs, b, q)
	if saved != left || !near(l, 960) || !near(s, 40) {
		t.Errorf("Drain left %d writes (a settlement was in flight), SavePending saved %d; after the next start's replay: bucket %v, quota %v; want the settlement counted and saved, and 960 and 40 (the usage, once)",
			left, saved, l, s)
	}
}
