package extproc

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// gateStore holds the first Reserve or Extend until released, then answers
// as the Redis store does: a call whose context ended while it was in
// flight fails with the context's error wrapped in buckets.ErrStore — for
// Extend after the debit was already written (the reply was lost), which
// is what a Redis round trip interrupted by the caller's cancellation does.
type gateStore struct {
	buckets.Store
	gateReserve, gateExtend bool
	entered                 chan struct{} // receives once, when the held call starts
	release                 chan struct{} // closed by the test

	once sync.Once
}

var _ buckets.Store = (*gateStore)(nil)

func newGateStore(reserve, extend bool) *gateStore {
	return &gateStore{
		Store:       buckets.NewMemory(buckets.MemoryOptions{}),
		gateReserve: reserve, gateExtend: extend,
		entered: make(chan struct{}, 1), release: make(chan struct{}),
	}
}

func (g *gateStore) hold() {
	g.once.Do(func() {
		g.entered <- struct{}{}
		<-g.release
	})
}

func (g *gateStore) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if g.gateReserve {
		g.hold()
	}
	if err := ctx.Err(); err != nil {
		return buckets.Decision{}, fmt.Errorf("%w: %w", buckets.ErrStore, err)
	}
	return g.Store.Reserve(ctx, req)
}

func (g *gateStore) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if !g.gateExtend {
		return g.Store.Extend(ctx, r, n)
	}
	g.hold()
	before := r.Extended
	ok, err := g.Store.Extend(context.WithoutCancel(ctx), r, n)
	if cerr := ctx.Err(); cerr != nil {
		r.Extended = before // the debit stands, the reply never arrived
		return false, fmt.Errorf("%w: %w", buckets.ErrStore, cerr)
	}
	return ok, err
}

// waitEntered waits for the gated call to start.
func (g *gateStore) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the gated store call never started")
	}
}

// startRequest sends body through the rig with a context the test cancels
// to make the client leave; the returned channel yields once the client's
// call has returned.
func startRequest(r *rig, body string) (cancel func(), done <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		req, err := http.NewRequestWithContext(ctx, "POST", r.front.URL+chatPath, strings.NewReader(body))
		if err != nil {
			return
		}
		resp, err := r.front.Client().Do(req)
		if err != nil {
			return
		}
		// The client reads on until the test makes it leave: closing the
		// body at the headers would leave before the first chunk arrives.
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}()
	return cancel, ch
}

// A client that leaves while its reservation is being made is not a store
// failure (S21): the reservation is made on a context of its own, so the
// store never sees the client's cancellation, and it is then given back in
// full (never forwarded, S8), exactly once.
func TestClientCancelDuringReserveIsNoStoreError(t *testing.T) {
	gs := newGateStore(true, false)
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{store: gs})
	leave, done := startRequest(r, `{"model":"m","max_tokens":50,"messages":[]}`)
	gs.waitEntered(t)
	leave()
	r.streamGone(t)
	close(gs.release)
	<-done
	o := r.outcome(t)
	if o.Decision == "store_error" {
		t.Fatalf("outcome %+v: a client's cancellation was reported as a store error", o)
	}
	if o.Decision != "admitted" || o.SettleOutcome != "not_forwarded" || o.Settled != 0 {
		t.Errorf("outcome %+v, want admitted, then settled 0 as not_forwarded", o)
	}
	if got := r.store.settlements(t); len(got) != 1 {
		t.Errorf("settlements %v, want the one reservation settled once", got)
	}
	if u.requests.Load() != 0 {
		t.Errorf("the upstream saw %d requests from a client that had left", u.requests.Load())
	}
}

// A client that leaves while a hard bucket is being extended loses nothing
// either (S14, S8): the extension runs on a context of its own, so a debit
// the store made is known and settled; the bucket ends exactly at capacity
// minus what was charged.
func TestClientGoneMidExtendLeaksNothing(t *testing.T) {
	const capacity = 1000
	gs := newGateStore(false, true)
	u := &upstream{Chunks: [][]byte{sse(words(30)...)}, Hang: true}
	team := BucketRule{Name: "team", Hard: true, Limit: buckets.Limit{Capacity: capacity, Rate: 1e-9}}
	r := newRig(t, u, rigOptions{store: gs, policies: []Policy{{Name: "p", Buckets: []BucketRule{team}}}})
	leave, done := startRequest(r, `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`)
	gs.waitEntered(t)
	leave()
	r.streamGone(t)
	close(gs.release)
	<-done
	o := r.outcome(t)
	if o.SettleOutcome != "aborted" || o.Settled != 10+o.Output || o.Output < 6 {
		t.Errorf("outcome %+v, want aborted, charged the prompt and at least the 6 tokens counted", o)
	}
	r.store.settlements(t)
	b := buckets.Bucket{Name: team.Name, Key: bucketKey("p", team.Name, globalPart), Limit: team.Limit, Hard: true}
	d, err := gs.Store.Reserve(context.Background(), buckets.Request{Buckets: []buckets.Bucket{b}})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := d.Buckets[0].Remaining, float64(capacity-o.Settled); got < want-1e-3 || got > want+1e-3 {
		t.Errorf("hard bucket at %v after the request, want %v: an extension the client's leaving interrupted was never settled", got, want)
	}
}
