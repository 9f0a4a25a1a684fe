package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
)

// leavers is how many clients leave while their request is reserved.
const leavers = 5

// TestClientLeavesMidCountUnderLoad makes clients leave while their request
// is on its way to Redis, in the middle of a load of other users, wired as
// the tokengate command wires it (Redis behind the failover store). One
// client's leaving is never a store failure (S21): failing closed, no other
// request gets a 503; failing open, no request is admitted against the
// local fallback; the store stays healthy. The leavers' reservations are
// made and given back in full (S8): their buckets end at capacity, their
// concurrency slots are free, every reservation settled exactly once.
func TestClientLeavesMidCountUnderLoad(t *testing.T) {
	for _, mode := range []failover.Mode{failover.Closed, failover.Open} {
		name := map[failover.Mode]string{failover.Closed: "fail closed", failover.Open: "fail open"}[mode]
		t.Run(name, func(t *testing.T) { leaveMidCount(t, mode) })
	}
}

func leaveMidCount(t *testing.T, mode failover.Mode) {
	checkGoroutines(t)
	const userCap, globalCap = 1e7, 1e8
	users := []string{"alice", "bob", "carol", "dave"}
	mix := loadRecordings(t)
	srv := redistest.Start(t)
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 64})
	t.Cleanup(func() { rc.Close() })
	mid := &midReserve{Store: redisstore.New(rc, redisstore.Options{}), leave: map[string]func(){}}
	var fallbacks atomic.Int64
	fo := failover.New(mid, failover.Options{
		Mode:       mode,
		Fallback:   buckets.Limit{Capacity: fallbackCap, Rate: tinyRate},
		Backoff:    time.Second,
		OnFallback: func(string) { fallbacks.Add(1) },
	})
	led := newLedger(fo)
	up := newLLM()
	pol := loadPolicy(userCap, globalCap, loadSlots)
	g := startGateway(t, gatewayConfig{store: led, policies: []extproc.Policy{pol}, upstream: startLLM(t, up)})

	stop := make(chan struct{})
	done := make(chan []result)
	go func() {
		done <- loadPlan{gateways: []*gateway{g}, mix: mix, users: users, workers: loadWorkers, requests: 50 * loadRequests, stop: stop}.run(t)
	}()
	stopped := false
	stopLoad := func() []result {
		if !stopped {
			stopped = true
			close(stop)
			return <-done
		}
		return nil
	}
	t.Cleanup(func() { stopLoad() })
	pollUntil(t, "the load under way", func() bool { return g.outcomes.len() >= 20 })

	var gone []string
	for i := range leavers {
		user := fmt.Sprintf("leaver-%d", i)
		gone = append(gone, user)
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		mid.expect(user, cancel)
		if x := g.replay(ctx, mix[0], user, ""); x.err == nil {
			t.Errorf("%s: got status %d, want the client gone before an answer", user, x.status)
		}
		cancel()
	}
	// The load runs on past the failover's back-off, which a leaver counted
	// as an outage would have started.
	after := g.outcomes.len()
	pollUntil(t, "the load after the leavers", func() bool { return g.outcomes.len() >= after+40 })
	results := stopLoad()

	for _, r := range results {
		if r.err != nil || r.status != 200 {
			t.Errorf("%v: want 200 (nothing refuses this load)", r)
		}
	}
	if n := fallbacks.Load(); n > 0 {
		t.Errorf("%d operations answered by the failover store's fallback: a client's leaving was taken for a store outage", n)
	}
	if !fo.Healthy() {
		t.Error("the failover store reports the store down")
	}
	outs := g.outcomes.wait(t, len(results)+leavers)
	for _, o := range outs {
		if o.Decision == "store_error" {
			t.Errorf("outcome %+v: a store error", o)
		}
	}
	led.checkSettled(t)
	var levels []float64
	for _, b := range led.named("user") {
		for _, u := range gone {
			if strings.HasSuffix(b.Key, ":"+u) {
				levels = append(levels, led.level(t, b))
			}
		}
	}
	want := make([]float64, leavers)
	for i := range want {
		want[i] = userCap
	}
	if diff := cmp.Diff(want, levels, levelsEqual); diff != "" {
		t.Errorf("leavers' buckets (-want +got): a reservation of a client that left was not given back:\n%s", diff)
	}
	checkSlotsFree(t, g, up, mix[0], gone, loadSlots)
}

// midReserve sits between the failover store and Redis and makes a client
// leave while its reservation is on its way: for a request of a user it was
// told to expect, it cancels that client, waits until the stand-in has
// closed the ext_proc stream (Envoy does so when its client goes), then
// passes the call on with the context it was handed, as a Redis round trip
// that the client's leaving interrupts would see it.
type midReserve struct {
	buckets.Store

	mu    sync.Mutex
	leave map[string]func() // user → cancels that client's request
}

// expect arranges for the next request of user to lose its client.
func (m *midReserve) expect(user string, cancel func()) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.leave[user] = cancel
}

func (m *midReserve) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if cancel := m.take(req); cancel != nil {
		cancel()
		if stream, ok := ctx.Value(streamKey{}).(context.Context); ok {
			select {
			case <-stream.Done():
			case <-time.After(waitFor):
			}
		}
	}
	return m.Store.Reserve(ctx, req)
}

func (m *midReserve) take(req buckets.Request) func() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, b := range req.Buckets {
		for u, cancel := range m.leave {
			if b.Name == "user" && strings.HasSuffix(b.Key, ":"+u) {
				delete(m.leave, u)
				return cancel
			}
		}
	}
	return nil
}
