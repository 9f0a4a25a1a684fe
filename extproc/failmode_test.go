package extproc

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
)

// hardPolicy has one hard bucket with room for far more than any test
// stream, so only the store's answers decide a cut-off.
func hardPolicy() Policy {
	return Policy{Name: "p", Buckets: []BucketRule{{Name: "team", Hard: true, Limit: buckets.Limit{Capacity: 1e6, Rate: 1}}}}
}

// S14, S21: failing closed, a hard budget the store cannot confirm is spent:
// when Extend fails, the stream is cut off at what was reserved, not run on
// unmetered.
func TestFailClosedExtendErrorCutsStream(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(30)...)}, Hang: true}
	r := newRig(t, u, rigOptions{policies: []Policy{hardPolicy()}})
	r.store.failExtend.Store(true)
	_, got := r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`, nil)
	if n := strings.Count(got, `" w"`); n != 5 || !strings.Contains(got, `"finish_reason":"length"`) {
		t.Errorf("client got %d content events, want the 5 reserved and a length finish:\n%s", n, got)
	}
	if o := r.outcome(t); !o.CutOff {
		t.Errorf("outcome %+v, want cut off", o)
	}
}

// A hard budget's extension is a store call, which can wait as long as the
// store timeout: the stream gives the live counter's scratch space back
// for it, and holds none once its chunk is read.
func TestExtendHoldsNoCounterScratch(t *testing.T) {
	u := &upstream{Chunks: [][]byte{streamOf(words(30)...)}}
	r := newRig(t, u, rigOptions{policies: []Policy{hardPolicy()}})
	var extends, heldDuring atomic.Int64
	r.store.onExtend = func() {
		extends.Add(1)
		heldDuring.Add(r.counter.held.Load())
	}
	_, got := r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`, nil)
	if n := strings.Count(got, `" w"`); n != 30 {
		t.Errorf("client got %d content events, want all 30 (the budget extends)", n)
	}
	r.outcome(t)
	if extends.Load() == 0 {
		t.Fatal("the stream past its reservation made no extension")
	}
	if h := heldDuring.Load(); h != 0 {
		t.Errorf("live counts held scratch space %d times during an extension, want never", h)
	}
	if h := r.counter.held.Load(); h != 0 {
		t.Errorf("%d live counts hold scratch space after the stream, want 0", h)
	}
}

// failingExtend is a primary store whose Extend fails as an unreachable
// Redis does; everything else works.
type failingExtend struct{ buckets.Store }

func (failingExtend) Extend(context.Context, *buckets.Reservation, float64) (bool, error) {
	return false, fmt.Errorf("%w: connection refused", buckets.ErrStore)
}

// S21: failing open, the stream follows the failover store's answer, which
// lets a reservation made by the unreachable primary run on.
func TestFailOpenExtendFollowsFallback(t *testing.T) {
	stream := streamOf(words(30)...)
	u := &upstream{Chunks: [][]byte{stream}}
	fo := failover.New(failingExtend{buckets.NewMemory(buckets.MemoryOptions{})},
		failover.Options{Mode: failover.Open, Fallback: buckets.Limit{Capacity: 1e6, Rate: 1}})
	r := newRig(t, u, rigOptions{policies: []Policy{hardPolicy()}, store: fo})
	_, got := r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`, nil)
	if got != string(stream) {
		t.Errorf("the stream was altered failing open:\n%s", got)
	}
	if o := r.outcome(t); o.CutOff || o.Settled != 40 {
		t.Errorf("outcome %+v, want no cut-off and 40 settled", o)
	}
}

// Once Shutdown has settled an open stream, the stream debits nothing more:
// an extension after settlement would never be refunded. The stream is cut
// off instead, since nothing backs more output. Run with -race: the
// reservation is never touched by two goroutines at once.
func TestNoExtendAfterShutdownSettles(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(3)...), sse(words(40)...)}, Pause: make(chan struct{}), Hang: true}
	r := newRig(t, u, rigOptions{policies: []Policy{hardPolicy()}})
	req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"max_tokens":5,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, 1)
	if _, err := resp.Body.Read(first); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // no grace: settle what is open at once
	if err := r.srv.Shutdown(ctx); err == nil {
		t.Fatal("Shutdown returned nil while a stream was open")
	}
	if got := r.store.settlements(t); len(got) != 1 {
		t.Fatalf("settlements %v, want the open stream settled", got)
	}
	close(u.Pause)
	rest, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("stream after shutdown did not end cleanly: %v", err)
	}
	if !strings.Contains(string(rest), `"finish_reason":"length"`) {
		t.Errorf("stream after settlement was not cut off:\n%s", rest)
	}
	select {
	case o := <-r.outcomes:
		if o.SettleOutcome != "shutdown" || !o.CutOff {
			t.Errorf("outcome %+v, want settled at shutdown and cut off", o)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the stream never finished")
	}
	r.store.mu.Lock()
	defer r.store.mu.Unlock()
	if r.store.lateExtends != 0 {
		t.Errorf("%d extensions after the reservation was settled", r.store.lateExtends)
	}
}
