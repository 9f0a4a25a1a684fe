package extproc

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// queueStore settles asynchronously, as the Redis store does: SettleAsync
// queues a settlement, and nothing reaches the store until release (a
// call that takes the queue along) or Flush. The settlements go through
// the rig's recording store, which checks they are made exactly once.
type queueStore struct {
	*recordingStore

	mu     sync.Mutex
	queue  []queuedSettle
	asyncs int // SettleAsync calls
}

type queuedSettle struct {
	r      buckets.Reservation
	actual float64
	done   func([]buckets.BucketState, error)
}

var _ buckets.AsyncSettler = (*queueStore)(nil)

func (q *queueStore) SettleAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.asyncs++
	q.queue = append(q.queue, queuedSettle{*r, actual, done})
}

// release writes every queued settlement and calls its done.
func (q *queueStore) release() {
	q.mu.Lock()
	queue := q.queue
	q.queue = nil
	q.mu.Unlock()
	for _, s := range queue {
		st, err := q.recordingStore.Settle(context.Background(), &s.r, s.actual)
		if s.done != nil {
			s.done(st, err)
		}
	}
}

func (q *queueStore) Flush(ctx context.Context) error {
	q.release()
	return nil
}

func (q *queueStore) queued() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.queue)
}

// waitQueued polls, with a deadline, until n settlements are queued.
func (q *queueStore) waitQueued(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for q.queued() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d settlements queued after 5s, want %d", q.queued(), n)
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
}

// S8: a store that settles asynchronously gets the settlement through
// SettleAsync, exactly once, and the request's outcome waits for the
// store's answer: it names the bucket the settlement left in debt, which
// only that answer tells.
func TestAsyncSettlementIsAnsweredBeforeTheOutcome(t *testing.T) {
	var q *queueStore
	u := &upstream{Chunks: [][]byte{streamOf(words(30)...)}}
	g := BucketRule{Name: "g", Limit: buckets.Limit{Capacity: 20, Rate: 1e-9}}
	r := newRig(t, u, rigOptions{policies: []Policy{{Name: "p", Buckets: []BucketRule{g}}},
		wrap: func(s *recordingStore) buckets.Store { q = &queueStore{recordingStore: s}; return q }})
	// 10 input + 5 reserved; the upstream ignores the cap and sends 30.
	if resp, _ := r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	q.waitQueued(t, 1)
	q.release()
	o := r.outcome(t)
	if o.Settled != 40 {
		t.Errorf("settled %d, want 40 (10 input + 30 output)", o.Settled)
	}
	if !slices.Equal(o.InDebt, []string{"g"}) {
		t.Errorf("outcome names %q in debt, want [g]: the outcome did not wait for the store's answer", o.InDebt)
	}
	q.mu.Lock()
	asyncs := q.asyncs
	q.mu.Unlock()
	if asyncs != 1 {
		t.Errorf("SettleAsync called %d times, want 1", asyncs)
	}
	r.store.settlements(t)
	if got := r.level(t, g, bucketKey("p", "g", globalPart)); got > -20+1e-6 || got < -20-1e-6 {
		t.Errorf("bucket at %v, want -20 (20 - 40)", got)
	}
}

// S8: settlements still queued at shutdown are written before Shutdown
// returns: a stream open at the deadline is settled with what it used, and
// the store holds exactly that afterwards.
func TestShutdownFlushesQueuedSettlements(t *testing.T) {
	var q *queueStore
	u := &upstream{Chunks: [][]byte{sse(words(3)...)}, Hang: true}
	g := BucketRule{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	r := newRig(t, u, rigOptions{policies: []Policy{{Name: "p", Buckets: []BucketRule{g}}},
		wrap: func(s *recordingStore) buckets.Store { q = &queueStore{recordingStore: s}; return q }})
	req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"max_tokens":100,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 4096)
	for n := 0; n < len(sse(words(3)...)); {
		k, err := resp.Body.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		n += k
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the grace is over at once: the open stream is settled now
	if err := r.srv.Shutdown(ctx); err != context.Canceled {
		t.Errorf("Shutdown = %v, want context.Canceled (a stream was still open)", err)
	}
	if n := q.queued(); n != 0 {
		t.Errorf("%d settlements still queued after Shutdown", n)
	}
	if got, want := r.level(t, g, bucketKey("p", "g", globalPart)), 1000.0-13; got < want-1e-6 || got > want+1e-6 {
		t.Errorf("bucket at %v after Shutdown, want %v (10 input + 3 output charged, the rest of the reservation refunded)", got, want)
	}
	resp.Body.Close()
	if o := r.outcome(t); o.SettleOutcome != "shutdown" || o.Settled != 13 {
		t.Errorf("outcome %+v, want settled 13 at shutdown", o)
	}
	r.store.settlements(t)
}

// S8: a request that stays open longer than its reservation's lifetime in
// the store, with no concurrency slot to renew, is still settled with what
// it used: the reservation is renewed on a timer. Unrenewed, its record
// would expire, and the settlement would change nothing: the reservation
// would stay charged.
func TestRequestOutlivingItsLifetimeStillSettles(t *testing.T) {
	clk := newFakeClock()
	u := &upstream{Chunks: [][]byte{sse(words(3)...)}, Hang: true}
	g := BucketRule{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}
	r := newRig(t, u, rigOptions{policies: []Policy{{Name: "p", Buckets: []BucketRule{g}}}, clock: clk,
		store: buckets.NewMemory(buckets.MemoryOptions{Now: clk.now}), idleTimeout: time.Minute})
	req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"max_tokens":100,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := resp.Body.Read(make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	// Two hours on the store's clock, past any lifetime a request is
	// given by default.
	for range 2 * 60 * 6 {
		clk.advance(10 * time.Second)
	}
	resp.Body.Close()
	o := r.outcome(t)
	if o.Settled != 10+o.Output || o.Output < 3 {
		t.Fatalf("outcome %+v, want the prompt and the output counted settled", o)
	}
	if got, want := r.level(t, g, bucketKey("p", "g", globalPart)), 1000-float64(o.Settled); got < want-1e-3 || got > want+1e-3 {
		t.Errorf("bucket at %v, want %v: the settlement of a request older than its lifetime changed nothing", got, want)
	}
	if n := clk.pending(); n != 0 {
		t.Errorf("%d renewal timers left after settlement", n)
	}
}
