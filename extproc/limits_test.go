package extproc

import (
	"context"
	"encoding/json"
	"io"
	"math"
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

// A quota's budget is, as a bucket's limit, the identity's override, else
// its tier's, else the rule's own ("team=acme gets $2,000 a month"), in
// tokens and in money; the budget in force decides admission and shows in
// the budget headers.
func TestQuotaOverridesAndTiers(t *testing.T) {
	now := budgetClock()
	daily := QuotaRule{Name: "team-daily", Per: "team", Window: mustWindow(t, "day", "UTC"), Limit: 200}
	monthly := QuotaRule{Name: "team-monthly", Per: "team", Window: mustWindow(t, "month", "UTC"), Unit: buckets.Money, Limit: 1_000_000}
	pol := Policy{Name: "p",
		Identities: []Identity{{Name: "team", Header: "x-team"}},
		Tier:       &Identity{Name: "tier", Header: "x-tier"},
		Tiers:      map[string]map[string]Override{"gold": {"team-daily": {Tokens: 1000}}},
		Buckets:    []BucketRule{{Name: "global", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}},
		Quotas:     []QuotaRule{daily, monthly},
	}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, now: now, store: buckets.NewMemory(buckets.MemoryOptions{Now: now}), prices: testPrices(t)})
	r.srv.SetOverrides(Overrides{
		{Policy: "p", Rule: "team-daily", Identity: "acme"}:   {Tokens: 5000},
		{Policy: "p", Rule: "team-monthly", Identity: "acme"}: {Money: 2_000_000_000},
	})
	// Each request reserves 110 tokens (10 input, 100 output) and at most
	// 10×$0.01 + 100×$0.05 = $5.10 of gpt-4o-mini.
	const body = `{"model":"gpt-4o-mini","max_tokens":100,"messages":[]}`
	post := func(team, tier string) (int, string, string) {
		t.Helper()
		hdr := map[string]string{"x-team": team}
		if tier != "" {
			hdr["x-tier"] = tier
		}
		resp, text := r.post(t, chatPath, body, hdr)
		r.outcome(t)
		return resp.StatusCode, resp.Header.Get(headerLimitBudget), text
	}
	// bob has the rules' own budgets: 200 tokens a day, $1 a month, which
	// $5.10 can never fit.
	if st, _, text := post("bob", ""); st != 413 || !strings.Contains(text, `"quota":"team-monthly"`) {
		t.Errorf("bob: %d %s; want 413 from team-monthly", st, text)
	}
	r.srv.SetOverrides(Overrides{
		{Policy: "p", Rule: "team-daily", Identity: "acme"}:   {Tokens: 5000},
		{Policy: "p", Rule: "team-monthly", Identity: "acme"}: {Money: 2_000_000_000},
		{Policy: "p", Rule: "team-monthly", Identity: "bob"}:  {Money: 100_000_000},
	})
	// bob with $100 a month: the 200-token day admits one request.
	if st, limit, _ := post("bob", ""); st != 200 || limit != "200" {
		t.Errorf("bob's first: %d, budget %q; want 200 under the daily 200", st, limit)
	}
	if st, _, text := post("bob", ""); st != 429 || !strings.Contains(text, `"quota":"team-daily"`) {
		t.Errorf("bob's second: %d %s; want 429 from team-daily", st, text)
	}
	// The gold tier's 1000 tokens a day admit bob's next: same key, so
	// the 110 spent carry over.
	if st, _, _ := post("bob", "gold"); st != 200 {
		t.Errorf("bob of the gold tier: %d; want 200", st)
	}
	// acme's override beats its tier: 5000 tokens and $2,000.
	for range 3 {
		if st, _, _ := post("acme", "gold"); st != 200 {
			t.Fatalf("acme: %d; want 200", st)
		}
	}
	got, err := r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: map[string]string{"team": "acme"}, Tier: "gold"})
	if err != nil {
		t.Fatal(err)
	}
	want := []RuleUsage{
		{Name: "global", Kind: KindBucket, Source: "rule", Bucket: got.Rules[0].Bucket},
		{Name: "team-daily", Kind: KindQuota, Per: "team", Source: "override",
			Quota: &buckets.QuotaState{Name: "team-daily", Limit: 5000, Spent: 330, Remaining: 4670, Window: "2026-03-31", Reset: 4 * time.Hour}},
		{Name: "team-monthly", Kind: KindQuota, Per: "team", Source: "override",
			Quota: &buckets.QuotaState{Name: "team-monthly", Unit: buckets.Money, Limit: 2_000_000_000, Spent: 3 * 5_100_000, Remaining: 2_000_000_000 - 3*5_100_000, Window: "2026-03", Reset: 4 * time.Hour}},
	}
	if d := cmp.Diff(want, got.Rules); d != "" {
		t.Errorf("usage of acme (-want +got):\n%s", d)
	}
	got, err = r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: map[string]string{"team": "carol"}, Tier: "gold"})
	if err != nil {
		t.Fatal(err)
	}
	if q := got.Rules[1]; q.Source != "tier" || q.Quota.Limit != 1000 || got.Rules[2].Source != "rule" {
		t.Errorf("usage of carol of the gold tier: %+v, %+v", q, got.Rules[2])
	}
}

// Usage names, per rule, the limit in force and where it comes from, with
// the same keys the request path uses; a concurrency limit shows the
// slots held.
func TestUsageSourcesAndSlots(t *testing.T) {
	hold := make(chan struct{})
	handler := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("content-type", "application/json")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		select {
		case <-hold:
		case <-req.Context().Done():
		}
	})
	r := newRig(t, nil, rigOptions{policies: []Policy{tieredPolicy()}, upstream: handler})
	var release sync.Once
	t.Cleanup(func() { release.Do(func() { close(hold) }) })
	r.srv.SetOverrides(Overrides{{Policy: "p", Rule: "slots", Identity: "acme"}: {Max: 7}})
	// One request of acme holds a slot until released.
	held := make(chan *http.Response, 1)
	req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","max_tokens":100,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-team", "bob")
	req.Header.Set("x-tier", "gold")
	go func() {
		resp, err := r.front.Client().Do(req)
		if err == nil {
			held <- resp
		}
		close(held)
	}()
	deadline := time.Now().Add(10 * time.Second)
	var got Usage
	for {
		var err error
		got, err = r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: map[string]string{"team": "bob"}, Tier: "gold"})
		if err != nil {
			t.Fatal(err)
		}
		if got.Rules[len(got.Rules)-1].Slot.InUse == 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond) // polling the store, with the deadline above
	}
	want := []RuleUsage{
		{Name: "team", Kind: KindBucket, Per: "team", Source: "tier", Bucket: got.Rules[0].Bucket},
		{Name: "global", Kind: KindBucket, Source: "rule", Bucket: got.Rules[1].Bucket},
		{Name: "slots", Kind: KindConcurrency, Per: "team", Source: "tier", Slot: &SlotUsage{Max: 3, InUse: 1}},
	}
	if d := cmp.Diff(want, got.Rules); d != "" {
		t.Errorf("usage (-want +got):\n%s", d)
	}
	if b := got.Rules[0].Bucket; b.Limit.Capacity != 5000 || math.Abs(b.Remaining-(5000-110)) > 0.01 {
		t.Errorf("team bucket %+v; want the gold tier's 5000 less the held request's 110", b)
	}
	got, err = r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: map[string]string{"team": "acme"}})
	if err != nil {
		t.Fatal(err)
	}
	if s := got.Rules[len(got.Rules)-1]; s.Source != "override" || s.Slot.Max != 7 || s.Slot.InUse != 0 {
		t.Errorf("acme's slots: %+v %+v", s, s.Slot)
	}
	release.Do(func() { close(hold) })
	if resp := <-held; resp != nil {
		resp.Body.Close()
	}
	r.outcome(t)
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
