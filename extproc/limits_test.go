package extproc

import (
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// tieredPolicy meters each team in a bucket of capacity 1000 and one slot;
// the gold tier gets 5000 tokens and three slots.
func tieredPolicy() Policy {
	return Policy{Name: "p",
		Identities: []Identity{{Name: "team", Header: "x-team"}, {Name: "key", Header: "authorization", Hash: true}},
		Tier:       &Identity{Name: "tier", Header: "x-tier"},
		Tiers: map[string]map[string]Override{
			"gold": {"team": {Limit: buckets.Limit{Capacity: 5000, Rate: 1e-9}}, "slots": {Max: 3}},
		},
		Buckets: []BucketRule{
			{Name: "team", Per: "team", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}},
			{Name: "key", Per: "key", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}},
			{Name: "global", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}},
		},
		Concurrency: []ConcurrencyRule{{Name: "slots", Per: "team", Max: 1}},
	}
}

// A request's limits are, field by field, its identity's override, else its
// tier's, else the rule's own; its bucket is the same key whatever its
// limit, so the level carries over.
func TestOverridesAndTiers(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{tieredPolicy()}})
	r.srv.SetOverrides(Overrides{{Policy: "p", Rule: "team", Identity: "acme"}: {Limit: buckets.Limit{Capacity: 9000, Rate: 1e-9}}})
	body := `{"model":"m","max_tokens":100,"messages":[]}`
	for _, tt := range []struct {
		team, tier string
		limit      int
		fresh      bool // the team's bucket has not been used yet
	}{
		{"bob", "", 1000, true},
		{"bob", "gold", 5000, false},
		{"bob", "silver", 1000, false}, // no such tier: the rule's own
		{"acme", "", 9000, true},
		{"acme", "gold", 9000, false},
	} {
		hdr := map[string]string{"x-team": tt.team, "authorization": "Bearer sk-" + tt.team}
		if tt.tier != "" {
			hdr["x-tier"] = tt.tier
		}
		resp, got := r.post(t, chatPath, body, hdr)
		if resp.StatusCode != 200 {
			t.Fatalf("%s/%s: %d %s", tt.team, tt.tier, resp.StatusCode, got)
		}
		r.outcome(t)
		if l := resp.Header.Get(headerLimit); l != strconv.Itoa(tt.limit) {
			t.Errorf("%s/%s: limit %s, want %d", tt.team, tt.tier, l, tt.limit)
		}
		// Each request reserves 110 tokens (10 input, 100 output): a fresh
		// bucket has the limit less 110 left, a used one less than that.
		rem, err := strconv.Atoi(resp.Header.Get(headerRemaining))
		if err != nil {
			t.Fatal(err)
		}
		if fresh := rem == tt.limit-110; fresh != tt.fresh {
			t.Errorf("%s/%s: remaining %d of %d: fresh bucket %v, want %v", tt.team, tt.tier, rem, tt.limit, fresh, tt.fresh)
		}
	}
	resp, got := r.postHeaders(t, chatPath, body, http.Header{"X-Team": {"bob"}, "X-Tier": {"gold", "platinum"}})
	var e errorBody
	if err := json.Unmarshal([]byte(got), &e); err != nil || resp.StatusCode != 400 || e.Error.Code != "duplicate_identity" {
		t.Errorf("two tiers: %d %s, want 400 duplicate_identity", resp.StatusCode, got)
	}
}

// IdentityKey is the key part a request's identity gets, so that an
// override set from a raw value (the admin API's) meets the request's
// bucket.
func TestIdentityKeyIsTheRequestsKey(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{tieredPolicy()}})
	resp, got := r.post(t, chatPath, `{"model":"gpt-4o","max_tokens":1,"messages":[]}`,
		map[string]string{"x-team": "a:b c", "authorization": "Bearer  sk-secret "})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, got)
	}
	r.outcome(t)
	r.store.mu.Lock()
	keys := slices.Clone(r.store.keys)
	r.store.mu.Unlock()
	for _, want := range []string{
		bucketKey("p", "team", IdentityKey("a:b c", false)),
		bucketKey("p", "key", IdentityKey("sk-secret", true)),
		bucketKey("p", "key", IdentityKey("Bearer sk-secret", true)),
	} {
		if !slices.Contains(keys, want) {
			t.Errorf("no reservation used %q: %v", want, keys)
		}
	}
	if IdentityKey("  ", false) != "" || ModelKey("") != "" {
		t.Error("a blank value has a key")
	}
}

// Chain describes the rules a request would reserve against, with the same
// limits and keys the request path uses, and where each limit comes from.
func TestChain(t *testing.T) {
	srv, err := NewServer(Config{Policies: []Policy{tieredPolicy()}, DefaultPolicy: "p", Store: buckets.NewMemory(buckets.MemoryOptions{}), counter: &fakeCounter{}})
	if err != nil {
		t.Fatal(err)
	}
	srv.SetOverrides(Overrides{{Policy: "p", Rule: "slots", Identity: "acme"}: {Max: 7}})
	got, err := srv.Chain(ChainQuery{Policy: "p", Identities: map[string]string{"team": "acme"}, Tier: "gold"})
	if err != nil {
		t.Fatal(err)
	}
	want := []ChainRule{
		{Bucket: &buckets.Bucket{Name: "team", Key: "tg:p:team:acme", Limit: buckets.Limit{Capacity: 5000, Rate: 1e-9}}, Per: "team", Source: "tier"},
		{Bucket: &buckets.Bucket{Name: "global", Key: "tg:p:global:%2A", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}, Source: "rule"},
		{Slot: &buckets.Slot{Name: "slots", Key: "tg:p:slots:acme", Max: 7, Lease: 10 * time.Minute}, Per: "team", Source: "override"},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("chain (-want +got):\n%s", d)
	}
	for _, q := range []ChainQuery{{Policy: "nope"}, {Policy: "p", Identities: map[string]string{"user": "x"}}} {
		if _, err := srv.Chain(q); err == nil {
			t.Errorf("Chain(%+v) succeeded", q)
		}
	}
}

// Reload applies to requests that start afterwards; a stream in flight
// keeps the reservation it took under the old limits and settles it once.
// The bucket is the same key (keys name no limit), so its level carries
// over.
func TestReloadKeepsStreamsInFlight(t *testing.T) {
	hold := make(chan struct{})
	handler := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(200)
		f := w.(http.Flusher)
		if _, err := w.Write(sse(chatChunk("a"))); err != nil {
			return
		}
		f.Flush()
		if req.Header.Get("x-hold") != "" {
			select {
			case <-hold:
			case <-req.Context().Done():
				return
			}
		}
		if _, err := w.Write(sse(chatChunk("b"), `{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2}}`, "[DONE]")); err != nil {
			return
		}
		f.Flush()
	})
	v1 := Policy{Name: "p", InjectUsage: true, Identities: []Identity{{Name: "user", Header: "x-user"}},
		Buckets: []BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}}}
	r := newRig(t, nil, rigOptions{policies: []Policy{v1}, upstream: handler})
	var release sync.Once
	t.Cleanup(func() { release.Do(func() { close(hold) }) }) // before the rig's cleanup
	body := `{"model":"m","max_tokens":100,"stream":true,"messages":[]}`

	// The held stream has reserved once its response headers are out.
	type result struct {
		status int
		limit  string
		err    error
	}
	started, done := make(chan result, 1), make(chan error, 1)
	go func() {
		req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(body))
		if err != nil {
			started <- result{err: err}
			return
		}
		req.Header.Set("x-user", "alice")
		req.Header.Set("x-hold", "1")
		resp, err := r.front.Client().Do(req)
		if err != nil {
			started <- result{err: err}
			return
		}
		defer resp.Body.Close()
		started <- result{status: resp.StatusCode, limit: resp.Header.Get(headerLimit)}
		_, err = io.Copy(io.Discard, resp.Body)
		done <- err
	}()
	var h result
	select {
	case h = <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("the held stream did not start within 5s")
	}
	if h.err != nil || h.status != 200 || h.limit != "1000" {
		t.Fatalf("held stream: %+v, want 200 with limit 1000", h)
	}

	v2 := v1
	v2.Buckets = []BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: 2000, Rate: 1e-9}}}
	r.srv.Reload([]Policy{v2}, "p")

	// alice's bucket keeps its level: 1000 less the held stream's 110,
	// less this request's 110; a fresh one would have 1890 left.
	resp, got := r.post(t, chatPath, body, map[string]string{"x-user": "alice"})
	if resp.StatusCode != 200 || resp.Header.Get(headerLimit) != "2000" || resp.Header.Get(headerRemaining) != "780" {
		t.Fatalf("after the reload: %d, limit %q, remaining %q %s; want 200, 2000, 780", resp.StatusCode,
			resp.Header.Get(headerLimit), resp.Header.Get(headerRemaining), got)
	}
	after := r.outcome(t)

	release.Do(func() { close(hold) })
	if err := <-done; err != nil {
		t.Fatalf("held stream: %v", err)
	}
	before := r.outcome(t)
	for _, o := range []Outcome{before, after} {
		if o.Decision != "admitted" || o.SettleOutcome != "complete" || o.Reserved != 110 || o.Settled != 12 {
			t.Errorf("outcome %+v, want admitted, complete, 110 reserved, 12 settled", o)
		}
	}
	r.store.settlements(t) // each reservation settled exactly once
}
