package extproc

import (
	"context"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// checkGoroutines fails the test when, after every cleanup registered later
// has run, more goroutines remain than before the test (polled with a
// deadline: closed connections take a moment to wind down).
func checkGoroutines(t *testing.T) {
	t.Helper()
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= base {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<16)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("%d goroutines remain, %d before the test:\n%s", n, base, buf)
				return
			}
			runtime.Gosched()
			time.Sleep(10 * time.Millisecond) // polling a deadline, not waiting for an event
		}
	})
}

// Scenario 29: concurrent streams share one hard budget. Every stream is
// charged what it counted; the total stays within the budget plus one
// in-flight event per stream; every reservation settles exactly once; no
// goroutine leaks.
func TestScenario29ConcurrentStreamsShareHardBudget(t *testing.T) {
	checkGoroutines(t)
	const (
		streams  = 8
		capacity = 400
	)
	u := &upstream{Chunks: [][]byte{sse(words(500)...)}, Hang: true}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "team", Hard: true, Limit: buckets.Limit{Capacity: capacity, Rate: 1e-6}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, chunkSize: 97})
	var wg sync.WaitGroup
	bodies := make([]string, streams)
	status := make([]int, streams)
	for i := range streams {
		wg.Go(func() {
			req, _ := http.NewRequest("POST", r.front.URL+chatPath,
				strings.NewReader(`{"model":"m","stream":true,"max_tokens":20,"stream_options":{"include_usage":true},"messages":[]}`))
			resp, err := r.front.Client().Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Errorf("stream %d did not end cleanly: %v", i, err)
			}
			bodies[i], status[i] = string(b), resp.StatusCode
		})
	}
	wg.Wait()
	cut, admitted := 0, 0
	for range streams {
		o := r.outcome(t)
		if o.CutOff {
			cut++
		}
		if o.Decision == "admitted" {
			admitted++
		}
	}
	var total float64
	for _, s := range r.store.settlements(t) {
		total += s
	}
	if len(r.store.errs) > 0 {
		t.Errorf("store errors: %v", r.store.errs)
	}
	for i, b := range bodies {
		// A stream that starts after the budget is spent is refused.
		if status[i] == 429 {
			continue
		}
		if !strings.HasSuffix(b, "data: [DONE]\n\n") || !strings.Contains(b, `"finish_reason":"length"`) {
			t.Errorf("stream %d (status %d) does not end with a length finish and [DONE]", i, status[i])
		}
	}
	if total > capacity+streams {
		t.Errorf("charged %v tokens, more than the budget %d plus one event per stream", total, capacity)
	}
	if total < capacity-streams*extendBatch {
		t.Errorf("charged only %v of %d: the budget was not used", total, capacity)
	}
	if cut != admitted || cut == 0 {
		t.Errorf("%d of %d admitted streams cut off, want all (500 words each exceed the whole budget)", cut, admitted)
	}
}

// Shutdown waits for open streams, then settles what is still open and
// refuses new streams.
func TestShutdownSettlesOpenStreams(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(3)...)}, Hang: true}
	r := newRig(t, u, rigOptions{})
	req, _ := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`))
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 1)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := r.srv.Shutdown(ctx); err == nil {
		t.Error("Shutdown returned nil while a stream was open")
	}
	got := r.store.settlements(t)
	if len(got) != 1 || got[0] < 10 {
		t.Errorf("settled %v, want one settlement of at least the prompt", got)
	}
	if resp, _ := r.post(t, chatPath, `{"model":"m","messages":[]}`, nil); resp.StatusCode < 500 {
		t.Errorf("new request during shutdown: %d, want a 5xx", resp.StatusCode)
	}
}

// S11: a concurrency slot is renewed on a timer while its request is open,
// not only when response chunks arrive: a slow non-streamed call keeps its
// slot past its lease, and a second request is refused meanwhile.
func TestSlowCallKeepsItsSlot(t *testing.T) {
	clk := newFakeClock()
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	var calls atomic.Int32
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			arrived <- struct{}{}
			<-release // the answer takes longer than the slot's lease
		}
		w.Header().Set("content-type", "application/json")
		w.Write([]byte(`{"choices":[]}`))
	})
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1}}},
		Concurrency: []ConcurrencyRule{{Name: "inflight", Max: 1, Lease: time.Minute}}}
	r := newRig(t, nil, rigOptions{policies: []Policy{pol}, upstream: slow, clock: clk,
		store: buckets.NewMemory(buckets.MemoryOptions{Now: clk.now})})
	body := `{"model":"m","max_tokens":10,"messages":[]}`
	first := make(chan int, 1)
	go func() {
		resp, _ := r.post(t, chatPath, body, nil)
		first <- resp.StatusCode
	}()
	<-arrived
	for range 4 { // two leases pass while the first request is open
		clk.advance(30 * time.Second)
	}
	if resp, got := r.post(t, chatPath, body, nil); resp.StatusCode != 429 || !strings.Contains(got, `"type":"requests"`) {
		t.Errorf("second request while the first is open: %d %s, want 429 of type requests", resp.StatusCode, got)
	}
	close(release)
	if got := <-first; got != 200 {
		t.Errorf("first request: %d, want 200", got)
	}
	for range 2 {
		r.outcome(t)
	}
	if n := clk.pending(); n != 0 {
		t.Errorf("%d renewal timers left after every request settled", n)
	}
}
