package metrics

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc"
)

func TestFinish(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	m.Finish(extproc.Outcome{Policy: "default", Decision: "admitted", Model: "gpt-4o-mini-2024-07-18", Reserved: 200, Settled: 50, SettleOutcome: "complete"})
	m.Finish(extproc.Outcome{Policy: "default", Decision: "admitted", Model: "claude-3-5-haiku", Reserved: 100, Settled: 100, SettleOutcome: "cut_off", CutOff: true,
		AllowanceSource: "history", FallbackEncoding: true, Waited: 300 * time.Millisecond, InDebt: []string{"user"}})
	m.Finish(extproc.Outcome{Policy: "default", Decision: "refused_tokens", Model: "gpt-4o"})

	want := `
# HELP tokengate_requests_total Requests by policy and decision (admitted, refused_tokens, refused_requests, refused_budget, never_admissible, bad_request, unauthorized, store_error, unmetered).
# TYPE tokengate_requests_total counter
tokengate_requests_total{decision="admitted",policy="default"} 2
tokengate_requests_total{decision="refused_tokens",policy="default"} 1
# HELP tokengate_tokens_settled_total Tokens charged at settlement (the real usage).
# TYPE tokengate_tokens_settled_total counter
tokengate_tokens_settled_total{model_family="claude",policy="default"} 100
tokengate_tokens_settled_total{model_family="gpt-4o",policy="default"} 50
# HELP tokengate_cutoffs_total Streams cut off at a hard budget (S14).
# TYPE tokengate_cutoffs_total counter
tokengate_cutoffs_total{policy="default"} 1
# HELP tokengate_output_allowance_source_total Where admitted requests' output allowance came from: request (its own cap), history (learned estimate) or default (S7).
# TYPE tokengate_output_allowance_source_total counter
tokengate_output_allowance_source_total{policy="default",source="history"} 1
# HELP tokengate_unknown_model_total Requests for a model no rule knows, counted with the configured fallback encoding.
# TYPE tokengate_unknown_model_total counter
tokengate_unknown_model_total{policy="default"} 1
# HELP tokengate_debt_settlements_total Settlements that left a bucket below zero (an under-estimate, S9), by bucket.
# TYPE tokengate_debt_settlements_total counter
tokengate_debt_settlements_total{bucket="user",policy="default"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_requests_total", "tokengate_tokens_settled_total", "tokengate_cutoffs_total",
		"tokengate_output_allowance_source_total", "tokengate_unknown_model_total", "tokengate_debt_settlements_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(m.waits); n != 1 {
		t.Errorf("wait series = %d, want 1", n)
	}
	if n := testutil.CollectAndCount(m.estimateError); n != 1 {
		t.Errorf("estimate error series = %d, want 1", n)
	}
}

// Labels never carry what a client sent: unknown models map to "other".
func TestFamilyBounded(t *testing.T) {
	for model, want := range map[string]string{
		"gpt-4o-2024-08-06":        "gpt-4o",
		"gpt-4-0613":               "gpt-4",
		"openai/gpt-5-nano":        "gpt-5",
		"my-secret-deployment-123": "other",
		"":                         "none",
		"gemini-2.5-flash":         "gemini",
	} {
		if got := Family(model); got != want {
			t.Errorf("Family(%q) = %q, want %q", model, got, want)
		}
	}
}

// S9: what settlement forgives at a bucket's floor is counted by bucket
// name, and a caller's cancellation is not a store error.
func TestDebtForgivenCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	t0 := time.Unix(1_800_000_000, 0)
	st := m.Instrument(buckets.NewMemory(buckets.MemoryOptions{Now: func() time.Time { return t0 }}))
	ctx := context.Background()
	capped := buckets.Bucket{Name: "user", Key: "alice", Limit: buckets.Limit{Capacity: 10, Rate: 1e-9}, MaxDebt: 4}
	hard := buckets.Bucket{Name: "team", Key: "t", Limit: buckets.Limit{Capacity: 10, Rate: 1e-9}, Hard: true}
	d, err := st.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{capped, hard}})
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	if _, err := st.Settle(ctx, d.Reservation, 100); err != nil {
		t.Fatal(err)
	}
	// A settlement queued with SettleAsync counts too: bob's bucket takes
	// 20 used of 10 reserved down to its floor of -4, forgiving 6.
	bob := capped
	bob.Key = "bob"
	d, err = st.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{bob}})
	if err != nil || !d.OK {
		t.Fatal(d, err)
	}
	st.SettleAsync(d.Reservation, 20, nil)
	if err := st.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := st.Reserve(cancelled, buckets.Request{Cost: 1, Buckets: []buckets.Bucket{capped}}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Reserve with a cancelled context = %v", err)
	}
	want := `
# HELP tokengate_debt_forgiven_tokens_total Tokens used but not charged because settlement reached a bucket's floor (max_debt, or zero for a hard bucket; S9, S14), by bucket.
# TYPE tokengate_debt_forgiven_tokens_total counter
tokengate_debt_forgiven_tokens_total{bucket="team"} 90
tokengate_debt_forgiven_tokens_total{bucket="user"} 92
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_debt_forgiven_tokens_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(m.storeErrors); n != 0 {
		t.Errorf("store error series = %d after a cancelled call, want 0", n)
	}
}

// The fleet's size and this gateway's share of the fallback are gauges.
func TestShare(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	m.Share(4, buckets.PerMinute(2500, 0))
	want := `
# HELP tokengate_fallback_tokens_per_minute This gateway's fallback limit per bucket while failing open: its share of the fleet's (S21).
# TYPE tokengate_fallback_tokens_per_minute gauge
tokengate_fallback_tokens_per_minute 2500
# HELP tokengate_fleet_gateways Gateways sharing the bucket store, this one included, at the last heartbeat that reached it.
# TYPE tokengate_fleet_gateways gauge
tokengate_fleet_gateways 4
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_fallback_tokens_per_minute", "tokengate_fleet_gateways"); err != nil {
		t.Error(err)
	}
}

// Settlements at the plausibility bound and streams forwarded unread are
// counted by policy.
func TestClampedAndUnreadCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", Reserved: 10, Settled: 4106, SettleOutcome: "complete", UsageClamped: true})
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", Reserved: 60, Settled: 60, SettleOutcome: "aborted", StreamUnread: true})
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", Reserved: 60, Settled: 20, SettleOutcome: "complete"})
	want := `
# HELP tokengate_usage_clamped_total Settlements whose provider-reported usage was beyond what the request makes plausible; the bound was charged instead.
# TYPE tokengate_usage_clamped_total counter
tokengate_usage_clamped_total{policy="p"} 1
# HELP tokengate_streams_unread_total Streams forwarded unread after one server-sent event passed the size bound; settled at the reservation.
# TYPE tokengate_streams_unread_total counter
tokengate_streams_unread_total{policy="p"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_usage_clamped_total", "tokengate_streams_unread_total"); err != nil {
		t.Error(err)
	}
}

// Quotas: spend per policy and quota, tokens and money apart, and the
// requests a quota refused; labels are configuration names only.
func TestQuotaSpendAndExhaustion(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	charges := []extproc.QuotaCharge{{Name: "team-monthly", Money: true, Amount: 1_564_000}, {Name: "key-daily", Amount: 40}}
	m.Finish(extproc.Outcome{Policy: "teams", Decision: "admitted", Reserved: 28, Settled: 40, SettleOutcome: "cut_off", CutOff: true, Quotas: charges})
	m.Finish(extproc.Outcome{Policy: "teams", Decision: "admitted", Reserved: 10, Settled: 10, SettleOutcome: "complete", Quotas: charges})
	m.Finish(extproc.Outcome{Policy: "teams", Decision: "refused_budget", Budget: "team-monthly"})
	m.Finish(extproc.Outcome{Policy: "teams", Decision: "never_admissible", Budget: "key-daily"})
	m.Finish(extproc.Outcome{Policy: "teams", Decision: "refused_budget", Budget: "team-monthly"})
	want := `
# HELP tokengate_quota_spent_tokens_total Tokens charged to quotas of tokens at settlement, by policy and quota.
# TYPE tokengate_quota_spent_tokens_total counter
tokengate_quota_spent_tokens_total{policy="teams",quota="key-daily"} 80
# HELP tokengate_quota_spent_micros_total Money charged to quotas of money at settlement, in micro-units of the pricing currency (1,000,000 to the unit), by policy and quota.
# TYPE tokengate_quota_spent_micros_total counter
tokengate_quota_spent_micros_total{policy="teams",quota="team-monthly"} 3.128e+06
# HELP tokengate_quota_exhausted_total Requests refused by a quota: its window had too little left (429, refused_budget) or the request could cost more than the whole budget (413, never_admissible), by policy and quota.
# TYPE tokengate_quota_exhausted_total counter
tokengate_quota_exhausted_total{policy="teams",quota="key-daily"} 1
tokengate_quota_exhausted_total{policy="teams",quota="team-monthly"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"tokengate_quota_spent_tokens_total", "tokengate_quota_spent_micros_total", "tokengate_quota_exhausted_total"); err != nil {
		t.Error(err)
	}
}

// Refusals reads back what the counters hold: the decisions that refused
// a request, by policy, and the quotas that refused, for the budget page.
// A request admitted or passed unmetered was not refused.
func TestRefusalsReadBackFromTheCounters(t *testing.T) {
	m := New(prometheus.NewRegistry(), Options{})
	for _, o := range []extproc.Outcome{
		{Policy: "teams", Decision: "admitted", Reserved: 10, Settled: 10},
		{Policy: "teams", Decision: "unmetered"},
		{Policy: "demo", Decision: "unmetered"},
		{Policy: "demo", Decision: "bad_request"},
		{Policy: "teams", Decision: "refused_budget", Budget: "team-monthly"},
		{Policy: "teams", Decision: "refused_budget", Budget: "team-monthly"},
		{Policy: "teams", Decision: "never_admissible", Budget: "key-daily"},
		{Policy: "teams", Decision: "refused_tokens"},
		{Policy: "demo", Decision: "refused_tokens"},
	} {
		m.Finish(o)
	}
	want := Refusals{
		Decisions: map[string]map[string]int{
			"teams": {"refused_budget": 2, "never_admissible": 1, "refused_tokens": 1},
			"demo":  {"refused_tokens": 1, "bad_request": 1},
		},
		Quotas: map[string]map[string]int{"teams": {"team-monthly": 2, "key-daily": 1}},
	}
	if d := cmp.Diff(want, m.Refusals()); d != "" {
		t.Errorf("Refusals (-want +got):\n%s", d)
	}
}

// Every decision extproc sets is in refuses, said to be a refusal or not,
// and refuses names no decision extproc no longer sets: a new decision
// cannot reach the budget page's refusals, or leave them, unnoticed.
func TestRefusesKnowsEveryDecision(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("..", "extproc", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	set := regexp.MustCompile(`\.decision = "([a-z_]+)"`)
	seen := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range set.FindAllStringSubmatch(string(src), -1) {
			seen[m[1]] = true
		}
	}
	if len(seen) == 0 {
		t.Fatalf("found no decision set in %v", files)
	}
	for d := range seen {
		if _, ok := refuses[d]; !ok {
			t.Errorf("extproc sets decision %q, which refuses does not classify", d)
		}
	}
	for d := range refuses {
		if !seen[d] {
			t.Errorf("refuses classifies %q, which extproc never sets", d)
		}
	}
}

// An instrumented store inspects through the store it wraps, timed.
func TestInspectThroughInstrumentedStore(t *testing.T) {
	m := New(prometheus.NewRegistry(), Options{})
	s := m.Instrument(buckets.NewMemory(buckets.MemoryOptions{}))
	b := buckets.Bucket{Name: "b", Key: "b", Limit: buckets.Limit{Capacity: 10, Rate: 1}}
	states, quotas, err := s.Inspect(context.Background(), []buckets.Bucket{b}, nil)
	if err != nil || len(states) != 1 || states[0].Remaining != 10 || len(quotas) != 0 {
		t.Fatalf("Inspect = %+v, %+v, %v", states, quotas, err)
	}
	held, err := s.InUse(context.Background(), []buckets.Slot{{Name: "s", Key: "s", Max: 1}})
	if err != nil || len(held) != 1 || held[0] != 0 {
		t.Fatalf("InUse = %v, %v", held, err)
	}
	if n := testutil.CollectAndCount(m.storeLatency); n != 1 {
		t.Errorf("latency series = %d, want 1 (inspect)", n)
	}
}

// TestAddSpendThroughInstrumentedStore: the failover store replays an
// outage's quota spend through the instrumented store, so it must pass
// AddSpend through (timed as op "add_spend"), or the spend is never added.
func TestAddSpendThroughInstrumentedStore(t *testing.T) {
	m := New(prometheus.NewRegistry(), Options{})
	mem := buckets.NewMemory(buckets.MemoryOptions{})
	var s buckets.Store = m.Instrument(mem)
	add, ok := s.(buckets.SpendAdder)
	if !ok {
		t.Fatalf("%T does not pass AddSpend through", s)
	}
	w, err := buckets.ParseWindow("month", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	q := buckets.Quota{Name: "q", Key: "q", Window: w, Limit: 100}
	ctx := context.Background()
	if err := add.AddSpend(ctx, "r1", []buckets.Spend{{Quota: q, Window: w.Span(time.Now()), Amount: 7}}); err != nil {
		t.Fatal(err)
	}
	if _, qs, err := mem.Inspect(ctx, nil, []buckets.Quota{q}); err != nil || qs[0].Spent != 7 {
		t.Fatalf("spent after AddSpend = %+v, %v; want 7", qs, err)
	}
	if n := testutil.CollectAndCount(m.storeLatency); n != 1 {
		t.Errorf("latency series = %d, want 1 (add_spend)", n)
	}
}

// tokengate_store_up reads the store's health when it is scraped: 1 while
// the failover store reaches the shared store, 0 during an outage, 1 with
// no health to read (the memory store).
func TestStoreUpFollowsTheStoresState(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	value := func() float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "tokengate_store_up" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatal("no tokengate_store_up")
		return 0
	}
	if v := value(); v != 1 {
		t.Errorf("store up before any state = %v, want 1", v)
	}
	m.StoreState(false, 3)
	if v := value(); v != 0 {
		t.Errorf("store up during an outage = %v, want 0", v)
	}
	m.StoreState(true, 0)
	if v := value(); v != 1 {
		t.Errorf("store up after the outage = %v, want 1", v)
	}
}
