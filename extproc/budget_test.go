package extproc

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/pricing"
)

// budgetClock stands at 2026-03-31T20:00:00Z, 22:00 in Amsterdam: a
// monthly quota there resets in two hours, at local midnight.
func budgetClock() func() time.Time {
	t0 := time.Date(2026, 3, 31, 20, 0, 0, 0, time.UTC)
	return func() time.Time { return t0 }
}

func mustWindow(t *testing.T, period, zone string) buckets.Window {
	t.Helper()
	w, err := buckets.ParseWindow(period, zone)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// testPrices prices gpt-4o-mini at round test prices: an input token costs
// 10,000 micro-units (a cent), a cached one 1,000, an output token 50,000.
func testPrices(t *testing.T) *pricing.Table {
	t.Helper()
	p, err := pricing.NewTable("USD", []pricing.Entry{{Model: "gpt-4o-mini", Input: "10000", CachedInput: "1000", Output: "50000"}})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// quotaSpent reads what quota q of the rig's policy has spent in its
// current window, for the identity key the request used.
func (r *rig) quotaSpent(t *testing.T, q QuotaRule, key string) float64 {
	t.Helper()
	bq := buckets.Quota{Name: q.Name, Key: key, Window: q.Window, Unit: q.Unit, Limit: q.Limit, Hard: q.Hard}
	if q.Unit == buckets.Money && r.srv.cfg.Prices != nil {
		bq.Currency = r.srv.cfg.Prices.Currency()
	}
	_, qs, err := r.store.inner.(buckets.Inspector).Inspect(context.Background(), nil, []buckets.Quota{bq})
	if err != nil {
		t.Fatal(err)
	}
	return qs[0].Spent
}

// A request that does not fit what is left of a quota's window is refused
// with 429 until the window ends at local midnight, error type "budget",
// and the budget headers; one that could cost more than the whole budget
// is a 413 (S4); admitted requests carry the budget headers too.
func TestBudgetRefusals(t *testing.T) {
	now := budgetClock()
	monthly := QuotaRule{Name: "monthly", Window: mustWindow(t, "month", "Europe/Amsterdam"), Limit: 250}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}, Quotas: []QuotaRule{monthly}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, now: now, store: buckets.NewMemory(buckets.MemoryOptions{Now: now})})
	body := `{"model":"gpt-4o-mini","max_tokens":100,"messages":[]}` // 10 + 100 tokens
	resp, _ := r.post(t, chatPath, body, nil)
	if resp.StatusCode != 200 {
		t.Fatalf("first request: %d", resp.StatusCode)
	}
	got := map[string]string{}
	for _, k := range []string{headerLimitBudget, headerRemainingBudget, headerResetBudget, headerUnitBudget} {
		got[k] = resp.Header.Get(k)
	}
	want := map[string]string{headerLimitBudget: "250", headerRemainingBudget: "140", headerResetBudget: "2h0m0s", headerUnitBudget: "tokens"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("admitted request's budget headers (-want +got):\n%s", diff)
	}
	if o := r.outcome(t); o.Decision != "admitted" || len(o.Quotas) != 1 || o.Quotas[0] != (QuotaCharge{Name: "monthly", Amount: 110}) {
		t.Errorf("outcome %+v; want admitted, 110 tokens charged to the quota", o)
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("second request: %d", resp.StatusCode)
	}
	r.outcome(t)

	// 220 spent: 30 left, the request may cost 110.
	resp, text := r.post(t, chatPath, body, nil)
	if resp.StatusCode != 429 {
		t.Fatalf("third request: %d, want 429", resp.StatusCode)
	}
	var e errorBody
	if err := json.Unmarshal([]byte(text), &e); err != nil {
		t.Fatal(err)
	}
	wantErr := errorDetail{Code: "budget_exceeded", Type: "budget", Quota: "monthly",
		Message: `budget "monthly" has 30 tokens left in this window but the request may cost up to 110 tokens; it resets in 2h0m0s`}
	if diff := cmp.Diff(wantErr, e.Error); diff != "" {
		t.Errorf("429 body (-want +got):\n%s", diff)
	}
	got = map[string]string{}
	for _, k := range []string{headerRetryAfter, headerLimitBudget, headerRemainingBudget, headerResetBudget, headerUnitBudget} {
		got[k] = resp.Header.Get(k)
	}
	want = map[string]string{headerRetryAfter: "7200", headerLimitBudget: "250", headerRemainingBudget: "30", headerResetBudget: "2h0m0s", headerUnitBudget: "tokens"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("429 headers (-want +got):\n%s", diff)
	}
	if o := r.outcome(t); o.Decision != "refused_budget" || o.Budget != "monthly" {
		t.Errorf("outcome %+v; want refused_budget by monthly", o)
	}
	if md := r.entry(t, 3).DynamicMetadata["tokengate"].AsMap(); md["decision"] != "refused_budget" {
		t.Errorf("dynamic metadata %v", md)
	}

	// More than the whole budget: never admissible, no Retry-After.
	resp, text = r.post(t, chatPath, `{"model":"gpt-4o-mini","max_tokens":300,"messages":[]}`, nil)
	if resp.StatusCode != 413 || resp.Header.Get(headerRetryAfter) != "" {
		t.Fatalf("status %d, Retry-After %q; want 413 without", resp.StatusCode, resp.Header.Get(headerRetryAfter))
	}
	if err := json.Unmarshal([]byte(text), &e); err != nil {
		t.Fatal(err)
	}
	wantErr = errorDetail{Code: "request_too_large", Type: "budget", Quota: "monthly",
		Message: `request may cost up to 310 tokens but budget "monthly" allows 250 tokens per window: it can never be admitted`}
	if diff := cmp.Diff(wantErr, e.Error); diff != "" {
		t.Errorf("413 body (-want +got):\n%s", diff)
	}
	if o := r.outcome(t); o.Decision != "never_admissible" || o.Budget != "monthly" {
		t.Errorf("outcome %+v; want never_admissible by monthly", o)
	}
	if n := u.requests.Load(); n != 2 {
		t.Errorf("upstream saw %d requests, want 2", n)
	}
}

// A cost budget answers in the pricing currency: the most the request can
// cost (its prompt at the dearest input rate, its output allowance at the
// output rate) is reserved, and headers show money with up to six
// decimals. A model without a price is refused (400) when no fallback
// prices it.
func TestCostBudgetRefusalAndUnpriced(t *testing.T) {
	now := budgetClock()
	spend := QuotaRule{Name: "spend", Window: mustWindow(t, "day", "UTC"), Unit: buckets.Money, Limit: 1_000_000}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}, Quotas: []QuotaRule{spend}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, now: now, store: buckets.NewMemory(buckets.MemoryOptions{Now: now}), prices: testPrices(t)})
	// 10 × 10,000 + 12 × 50,000 = 700,000 micro-units at most.
	body := `{"model":"gpt-4o-mini","max_tokens":12,"messages":[]}`
	resp, _ := r.post(t, chatPath, body, nil)
	if resp.StatusCode != 200 || resp.Header.Get(headerRemainingBudget) != "0.30" || resp.Header.Get(headerUnitBudget) != "USD" ||
		resp.Header.Get(headerLimitBudget) != "1.00" || resp.Header.Get(headerResetBudget) != "4h0m0s" {
		t.Fatalf("first request: %d, headers %v", resp.StatusCode, resp.Header)
	}
	// Not streamed, no usage reported: the reservation stands.
	if o := r.outcome(t); len(o.Quotas) != 1 || o.Quotas[0] != (QuotaCharge{Name: "spend", Money: true, Amount: 700_000}) {
		t.Errorf("outcome quotas %+v; want 700000 micro-units charged", o.Quotas)
	}
	resp, text := r.post(t, chatPath, body, nil)
	if resp.StatusCode != 429 || resp.Header.Get(headerRetryAfter) != "14400" {
		t.Fatalf("second request: %d, Retry-After %q; want 429 until midnight UTC (14400)", resp.StatusCode, resp.Header.Get(headerRetryAfter))
	}
	if !strings.Contains(text, `has 0.30 USD left in this window but the request may cost up to 0.70 USD`) {
		t.Errorf("429 body %s", text)
	}
	r.outcome(t)

	resp, text = r.post(t, chatPath, `{"model":"nobody-prices-this","max_tokens":1,"messages":[]}`, nil)
	if resp.StatusCode != 400 || !strings.Contains(text, `"code":"unpriced_model"`) {
		t.Errorf("unpriced model: %d %s; want 400 unpriced_model", resp.StatusCode, text)
	}
	if o := r.outcome(t); o.Decision != "bad_request" || o.Reserved != 0 {
		t.Errorf("outcome %+v; want bad_request, nothing reserved", o)
	}
	if got := r.quotaSpent(t, spend, bucketKey("p", "spend", globalPart)); got != 700_000 {
		t.Errorf("spent %v, want 700000", got)
	}
}

// A streamed request that would cross a hard cost budget is cut off
// (S14). In STREAMED mode the upstream runs to its end and reports its
// usage, which is what the provider bills: the spend recorded is the
// price table applied to that usage, to the micro-unit. On the memory
// store, on Redis, and on a Redis Cluster, where the quota and the bucket
// live in different hash slots.
func TestHardCostBudgetCutsStreamAndRecordsBilledUsage(t *testing.T) {
	t.Run("memory", func(t *testing.T) { hardCostBudgetCut(t, nil) })
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr})
		t.Cleanup(func() { c.Close() })
		hardCostBudgetCut(t, redisstore.New(c, redisstore.Options{}))
	})
	t.Run("redis cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t)
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs})
		t.Cleanup(func() { c.Close() })
		hardCostBudgetCut(t, redisstore.New(c, redisstore.Options{}))
	})
}

func hardCostBudgetCut(t *testing.T, store buckets.Store) {
	spend := QuotaRule{Name: "spend", Window: mustWindow(t, "month", "Europe/Amsterdam"), Unit: buckets.Money, Limit: 1_000_000, Hard: true}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}, Quotas: []QuotaRule{spend}}
	usage := `{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],` +
		`"usage":{"prompt_tokens":10,"completion_tokens":30,"total_tokens":40,"prompt_tokens_details":{"cached_tokens":4}}}`
	u := &upstream{Chunks: [][]byte{sse(words(10)...), sse(words(10)...), sse(words(10)...), streamOf(usage)}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: streamedMode(), prices: testPrices(t), store: store})
	// Reserved: 10 × 10,000 + 4 × 50,000 = 300,000; each further token
	// extends by 50,000 while it fits: 14 more, 1,000,000 in all.
	_, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"max_tokens":4,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if n := strings.Count(got, `" w"`); n != 18 {
		t.Errorf("client got %d content events, want 18 (4 reserved and 14 extended)", n)
	}
	if !strings.Contains(got, `"finish_reason":"length"`) || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Errorf("stream does not end with a length finish and [DONE]:\n%s", got)
	}
	o := r.outcome(t)
	// Billed: 6 × 10,000 + 4 cached × 1,000 + 30 × 50,000.
	const billed = 6*10_000 + 4*1_000 + 30*50_000
	if !o.CutOff || o.Settled != 40 || len(o.Quotas) != 1 || o.Quotas[0] != (QuotaCharge{Name: "spend", Money: true, Amount: billed}) {
		t.Errorf("outcome %+v; want cut off, 40 tokens settled, %d micro-units charged", o, billed)
	}
	want, err := testPrices(t).Cost("gpt-4o-mini", pricing.Usage{InputTokens: 10, OutputTokens: 30, CachedInputTokens: 4})
	if err != nil || want != billed {
		t.Fatalf("the price table prices the usage at %v, %v; the test expects %d", want, err, billed)
	}
	if got := r.quotaSpent(t, spend, bucketKey("p", "spend", globalPart)); got != float64(want) {
		t.Errorf("quota spent %v, want the billed %d", got, want)
	}
}

// In FULL_DUPLEX_STREAMED mode the cut-off cancels the upstream: the
// budget is overrun by no more than the event in flight, and what was
// counted is charged at the price table.
func TestHardCostBudgetDuplexOverrunsByOneEventAtMost(t *testing.T) {
	spend := QuotaRule{Name: "spend", Window: mustWindow(t, "day", "UTC"), Unit: buckets.Money, Limit: 1_000_000, Hard: true}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}, Quotas: []QuotaRule{spend}}
	u := &upstream{Chunks: [][]byte{sse(words(10)...), sse(words(10)...), sse(words(10)...)}, Hang: true}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: duplexMode(), prices: testPrices(t)})
	_, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"max_tokens":4,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if n := strings.Count(got, `" w"`); n != 18 {
		t.Errorf("client got %d content events, want 18", n)
	}
	if e := r.entry(t, 1); !e.UpstreamCancelled {
		t.Errorf("entry %+v: want the upstream cancelled", e)
	}
	o := r.outcome(t)
	// 10 input and 19 output tokens counted (the 19th was withheld).
	const charged = 10*10_000 + 19*50_000
	if !o.CutOff || len(o.Quotas) != 1 || o.Quotas[0].Amount != charged {
		t.Errorf("outcome %+v; want cut off and %d micro-units charged", o, charged)
	}
	spent := r.quotaSpent(t, spend, bucketKey("p", "spend", globalPart))
	if spent != charged || spent > spend.Limit+extendBatch*50_000 {
		t.Errorf("spent %v; want %d, within the budget and one extend batch", spent, charged)
	}
}

// Usage shows an identity what a request of theirs would meet: the
// buckets and quotas keyed by their identities (hashed ones hashed alike),
// shared buckets included, per-model rules only for a model, rules keyed
// by an identity not given left out.
func TestUsage(t *testing.T) {
	now := budgetClock()
	monthly := QuotaRule{Name: "team-monthly", Per: "team", Window: mustWindow(t, "month", "Europe/Amsterdam"), Unit: buckets.Money, Limit: 5_000_000}
	daily := QuotaRule{Name: "key-daily", Per: "key", Window: mustWindow(t, "day", "UTC"), Limit: 1000}
	pol := Policy{
		Name: "p",
		Identities: []Identity{
			{Name: "team", Header: "x-team"},
			{Name: "key", Header: "authorization", Hash: true},
		},
		Buckets: []BucketRule{
			{Name: "key", Per: "key", Limit: buckets.Limit{Capacity: 500, Rate: 1}},
			{Name: "model", Per: "model", Limit: buckets.Limit{Capacity: 9000, Rate: 1}},
			{Name: "global", Limit: buckets.Limit{Capacity: 10000, Rate: 1}},
		},
		Quotas: []QuotaRule{monthly, daily},
	}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, now: now, store: buckets.NewMemory(buckets.MemoryOptions{Now: now}), prices: testPrices(t)})
	hdr := map[string]string{"x-team": "acme", "authorization": "Bearer sk-alice"}
	if resp, _ := r.post(t, chatPath, `{"model":"gpt-4o-mini","max_tokens":12,"messages":[]}`, hdr); resp.StatusCode != 200 {
		t.Fatalf("request: %d", resp.StatusCode)
	}
	r.outcome(t)

	ids := map[string]string{"team": IdentityKey("acme", false), "key": IdentityKey("sk-alice", true)}
	got, err := r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: ids})
	if err != nil {
		t.Fatal(err)
	}
	want := Usage{
		Policy: "p", Currency: "USD", At: now(),
		Rules: []RuleUsage{
			{Name: "key", Kind: KindBucket, Per: "key", Source: "rule",
				Bucket: &buckets.BucketState{Name: "key", Limit: buckets.Limit{Capacity: 500, Rate: 1}, Remaining: 478, Reset: 22 * time.Second}},
			{Name: "global", Kind: KindBucket, Source: "rule",
				Bucket: &buckets.BucketState{Name: "global", Limit: buckets.Limit{Capacity: 10000, Rate: 1}, Remaining: 9978, Reset: 22 * time.Second}},
			// 20:00Z on March 31 is 22:00 in Amsterdam: April begins in
			// two hours.
			{Name: "team-monthly", Kind: KindQuota, Per: "team", Source: "rule",
				Quota: &buckets.QuotaState{Name: "team-monthly", Unit: buckets.Money, Limit: 5_000_000, Spent: 700_000, Remaining: 4_300_000, Window: "2026-03", Reset: 2 * time.Hour}},
			{Name: "key-daily", Kind: KindQuota, Per: "key", Source: "rule",
				Quota: &buckets.QuotaState{Name: "key-daily", Unit: buckets.Tokens, Limit: 1000, Spent: 22, Remaining: 978, Window: "2026-03-31", Reset: 4 * time.Hour}},
		},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Usage (-want +got):\n%s", diff)
	}
	// Another team, with a model: its own quota is untouched, the per-model
	// bucket appears (any spelling of the model), the shared one is the
	// same, the key's rules are left out.
	got, err = r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: map[string]string{"team": "globex"}, Model: "openai/GPT-4o-mini-2024-07-18"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, ru := range got.Rules {
		names = append(names, ru.Name)
	}
	if !slices.Equal(names, []string{"model", "global", "team-monthly"}) ||
		got.Rules[0].Bucket.Remaining != 8978 || got.Rules[1].Bucket.Remaining != 9978 || got.Rules[2].Quota.Spent != 0 {
		t.Errorf("Usage of another team = %+v", got)
	}
	if _, err := r.srv.Usage(context.Background(), UsageQuery{Policy: "nope"}); !errors.Is(err, ErrUnknownPolicy) {
		t.Errorf("Usage of an unknown policy: %v; want ErrUnknownPolicy", err)
	}
	if _, err := r.srv.Usage(context.Background(), UsageQuery{Policy: "p", Identities: map[string]string{"user": "x"}}); !errors.Is(err, ErrUnknownIdentity) {
		t.Errorf("Usage of an unknown identity: %v; want ErrUnknownIdentity", err)
	}
}

// Spenders lists a quota's current window by identity in the form store
// keys use: a hashed identity hashed, never its raw value; a quota of
// money keyed by its currency finds its own spend, not the token quota's.
func TestSpendersListTheWindowHashedIdentitiesHashed(t *testing.T) {
	now := budgetClock()
	monthly := QuotaRule{Name: "team-monthly", Per: "team", Window: mustWindow(t, "month", "Europe/Amsterdam"), Unit: buckets.Money, Limit: 5_000_000}
	daily := QuotaRule{Name: "key-daily", Per: "key", Window: mustWindow(t, "day", "UTC"), Limit: 100000}
	pol := Policy{
		Name:       "p",
		Identities: []Identity{{Name: "team", Header: "x-team"}, {Name: "key", Header: "authorization", Hash: true}},
		Buckets:    []BucketRule{{Name: "global", Limit: buckets.Limit{Capacity: 100000, Rate: 1}}},
		Quotas:     []QuotaRule{monthly, daily},
	}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, now: now, store: buckets.NewMemory(buckets.MemoryOptions{Now: now}), prices: testPrices(t)})
	for _, c := range []struct{ team, key string }{{"acme", "sk-alice"}, {"acme", "sk-bob"}, {"globex", "sk-alice"}} {
		hdr := map[string]string{"x-team": c.team, "authorization": "Bearer " + c.key}
		if resp, _ := r.post(t, chatPath, `{"model":"gpt-4o-mini","max_tokens":12,"messages":[]}`, hdr); resp.StatusCode != 200 {
			t.Fatalf("request: %d", resp.StatusCode)
		}
		r.outcome(t)
	}
	ctx := context.Background()
	keys, err := r.srv.Spenders(ctx, "p", "key-daily", 10)
	if err != nil {
		t.Fatal(err)
	}
	want := buckets.SpendList{
		Window: daily.Window.Span(now()),
		Top:    []buckets.KeySpend{{Key: IdentityKey("sk-alice", true), Spent: 44}, {Key: IdentityKey("sk-bob", true), Spent: 22}},
		Read:   2, Complete: true,
	}
	if d := cmp.Diff(want, keys); d != "" {
		t.Errorf("Spenders of key-daily (-want +got):\n%s", d)
	}
	teams, err := r.srv.Spenders(ctx, "p", "team-monthly", 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(teams.Top) != 1 || teams.Top[0] != (buckets.KeySpend{Key: "acme", Spent: 1_400_000}) || teams.Read != 2 || teams.Window.ID != "2026-03" {
		t.Errorf("Spenders of team-monthly, top 1 = %+v; want acme with $1.40 of 2 teams in 2026-03", teams)
	}
	if _, err := r.srv.Spenders(ctx, "p", "global", 1); !errors.Is(err, ErrUnknownQuota) {
		t.Errorf("Spenders of a bucket: %v; want ErrUnknownQuota", err)
	}
	if _, err := r.srv.Spenders(ctx, "nope", "key-daily", 1); !errors.Is(err, ErrUnknownPolicy) {
		t.Errorf("Spenders of an unknown policy: %v; want ErrUnknownPolicy", err)
	}
}
