package standin

import (
	"context"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// stockRLS answers as envoyproxy/ratelimit does with its Redis backend,
// from docs/envoy-ratelimit.md §3.2-§3.5 (not from its code): GetLimit over
// an rlconfig configuration, hits by §3.3, epoch-aligned fixed windows on
// the test's clock counted in memory (a hit that crosses the limit is
// counted too), shadow and quota mode per rule and globally. It is the
// stand-in's other side when a scenario is about what ratelimit answers.
type stockRLS struct {
	rlsv3.UnimplementedRateLimitServiceServer
	cfg    *rlconfig.Config
	now    time.Time
	shadow bool // SHADOW_MODE
	quota  bool // QUOTA_MODE

	mu     sync.Mutex
	counts map[string]uint64
}

func newStockRLS(t *testing.T, yaml string) *stockRLS {
	t.Helper()
	f, err := rlconfig.Parse("config.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	c, err := rlconfig.Load([]*rlconfig.File{f}, rlconfig.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// 10s into a minute: a minute window resets in 50s.
	return &stockRLS{cfg: c, now: time.Unix(1_800_000_000/60*60+10, 0), counts: map[string]uint64{}}
}

func (s *stockRLS) ShouldRateLimit(_ context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	if req.GetDomain() == "" {
		return nil, status.Error(codes.Unknown, "rate limit domain must not be empty")
	}
	if len(req.GetDescriptors()) == 0 {
		return nil, status.Error(codes.Unknown, "rate limit descriptor list must not be empty")
	}
	rules := make([]*rlconfig.Rule, len(req.GetDescriptors()))
	for i, d := range req.GetDescriptors() {
		rules[i], _ = s.cfg.Limit(req.GetDomain(), d)
	}
	replaced := rlconfig.Replaced(rules,
		func(r *rlconfig.Rule) string {
			if r == nil {
				return ""
			}
			return r.Name
		},
		func(r *rlconfig.Rule) []string {
			if r == nil {
				return nil
			}
			return r.Replaces
		})
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &rlsv3.RateLimitResponse{Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(rules))}
	failedLimit, failedQuota, quotas := 0, 0, 0
	for i, d := range req.GetDescriptors() {
		r := rules[i]
		switch {
		case r != nil && r.Unlimited:
			resp.Statuses[i] = &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode, LimitRemaining: math.MaxUint32}
			continue
		case r == nil || replaced[i]:
			resp.Statuses[i] = &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode}
			continue
		}
		hits := uint64(max(1, req.GetHitsAddend())) // §3.3
		if h := d.GetHitsAddend(); h != nil {
			hits = h.GetValue()
		}
		div := rlconfig.UnitSeconds(r.Unit)
		now := s.now.Unix()
		key := s.counterKey(req.GetDomain(), d) + strconv.FormatInt(now/div*div, 10)
		after := s.counts[key] + hits
		s.counts[key] = after
		st := &rlsv3.RateLimitResponse_DescriptorStatus{
			Code: okCode, CurrentLimit: r.CurrentLimit(),
			DurationUntilReset: durationpb.New(time.Duration(div-now%div) * time.Second),
		}
		if after > uint64(r.RequestsPerUnit) {
			st.Code = overCode
		} else {
			st.LimitRemaining = r.RequestsPerUnit - uint32(after)
		}
		if r.ShadowMode {
			st.Code = okCode
		}
		quota := s.quota || r.QuotaMode
		if st.Code == overCode {
			if quota {
				failedQuota++
			} else {
				failedLimit++
			}
		}
		if quota {
			quotas++
		}
		resp.Statuses[i] = st
	}
	resp.OverallCode = okCode
	if failedLimit > 0 || quotas > 0 && quotas == failedQuota {
		resp.OverallCode = overCode
	}
	if s.shadow {
		resp.OverallCode = okCode
	}
	return resp, nil
}

// counterKey is the counter of a descriptor without its window (§3.4): the
// domain and every entry, a share_threshold pattern in place of a value.
func (s *stockRLS) counterKey(domain string, d *commonv3.RateLimitDescriptor) string {
	vals := make([]string, len(d.GetEntries()))
	for i, e := range d.GetEntries() {
		vals[i] = e.GetValue()
	}
	if t := s.cfg.Tree(domain); t != nil && d.GetLimit() == nil {
		for n := t.Match(d.GetEntries()); n != nil && n.Depth() > 0; n = n.Parent() {
			if n.Shared() {
				vals[n.Depth()-1] = n.Value
			}
		}
	}
	var b strings.Builder
	b.WriteString(domain + "_")
	for i, e := range d.GetEntries() {
		b.WriteString(e.GetKey() + "_" + vals[i] + "_")
	}
	return b.String()
}

// stockHarness puts the stand-in in front of the upstream with stock as
// its rate-limit service.
func stockHarness(t *testing.T, stock *stockRLS, cfg RateLimitConfig) *rlHarness {
	t.Helper()
	cfg.RLS = serveRLS(t, stock)
	h := newRLHarness(t, cfg, nil, nil)
	return h
}

// Scenario 3 against ratelimit (§3.3): with no hits_addend anywhere
// ratelimit counts 1 per request.
func TestRateLimitScenario03StockCountsOnePerRequest(t *testing.T) {
	stock := newStockRLS(t, "domain: ai-gateway\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n")
	h := stockHarness(t, stock, RateLimitConfig{Filter: filterConfig(t, userLimit)})
	for i, want := range []int{200, 200, 429} {
		res := h.do(t, "GET", "/", "", "x-user-id", "alice")
		if res.status != want {
			t.Errorf("request %d: %d, want %d", i+1, res.status, want)
		}
	}
	if res := h.do(t, "GET", "/", "", "x-user-id", "bob"); res.status != 200 || res.header.Get("x-ratelimit-remaining") != "1" || res.header.Get("x-ratelimit-reset") != "50" {
		t.Errorf("bob: %d, headers %v", res.status, res.header)
	}
}

// Scenarios 4 and 5 against ratelimit (§3.3, §3.4): Envoy Gateway's check
// (hits 0) then charge at stream end. A check at count == limit is OK with
// remaining 0; the charge still counts; the next check is over the limit.
func TestRateLimitScenario04And05StockCheckThenCharge(t *testing.T) {
	stock := newStockRLS(t, `
domain: default/eg/http
descriptors:
  - key: route
    value: route
    descriptors:
      - key: rule-0-match-0
        rate_limit: {unit: minute, requests_per_unit: 2}
`)
	costs := make(chan float64, 2)
	costs <- 2
	costs <- 1
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tokens(structpb.NewNumberValue(<-costs)).ServeHTTP(w, r)
	})
	h := stockHarness(t, stock, RateLimitConfig{Filter: filterConfig(t, costFilter+"enable_x_ratelimit_headers: DRAFT_VERSION_03\n"), Next: next})
	for i, want := range []struct {
		status    int
		remaining string
	}{{200, "2"}, {200, "0"}, {429, "0"}} {
		res := h.do(t, "POST", "/v1/chat/completions", "{}", "x-tenant-id", "acme")
		if res.status != want.status || res.header.Get("x-ratelimit-remaining") != want.remaining {
			t.Errorf("request %d: %d remaining %q, want %d remaining %s", i+1, res.status, res.header.Get("x-ratelimit-remaining"), want.status, want.remaining)
		}
		h.entry(t, i+1) // the stream-done charge has been made
	}
}

// Scenario 21 against ratelimit: a descriptor with no entries meets no
// limit: OK.
func TestRateLimitScenario21StockEmptyDescriptor(t *testing.T) {
	stock := newStockRLS(t, "domain: d\ndescriptors:\n  - key: team\n    rate_limit: {unit: minute, requests_per_unit: 0}\n")
	f := filterConfig(t, "domain: d\nrate_limits: [{actions: [{request_headers: {header_name: x-team, descriptor_key: team, skip_if_absent: true}}]}]\n")
	h := stockHarness(t, stock, RateLimitConfig{Filter: f})
	if res := h.do(t, "GET", "/", ""); res.status != 200 {
		t.Errorf("no entries: %d", res.status)
	}
	if res := h.do(t, "GET", "/", "", "x-team", "a"); res.status != 429 {
		t.Errorf("team a, 0 per minute: %d", res.status)
	}
}

// Scenario 31 against ratelimit (§3.2): an unknown domain is OK with no
// current_limit, so no x-ratelimit-* headers.
func TestRateLimitScenario31StockUnknownDomain(t *testing.T) {
	stock := newStockRLS(t, "domain: known\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n")
	h := stockHarness(t, stock, RateLimitConfig{Filter: filterConfig(t, userLimit)})
	for range 3 {
		if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 200 || res.header.Get("x-ratelimit-limit") != "" {
			t.Errorf("unknown domain: %d, headers %v", res.status, res.header)
		}
	}
}

// Scenario 32 against ratelimit (§3.5): with two quota-mode descriptors one
// over is OK, both over is OVER_LIMIT; a non-quota descriptor over is
// OVER_LIMIT.
func TestRateLimitScenario32StockQuotaMode(t *testing.T) {
	stock := newStockRLS(t, `
domain: ai-gateway-quota
descriptors:
  - key: backend_name
    value: a
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: backend_name
    value: b
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 1}
`)
	f := filterConfig(t, `
domain: ai-gateway-quota
rate_limits:
  - actions: [{generic_key: {descriptor_key: backend_name, descriptor_value: a}}]
  - actions: [{generic_key: {descriptor_key: backend_name, descriptor_value: b}}]
  - actions: [{request_headers: {header_name: x-plain, descriptor_key: plain, skip_if_absent: true}}]
`)
	h := stockHarness(t, stock, RateLimitConfig{Filter: f})
	for i, tt := range []struct {
		hdr  []string
		want int
	}{
		{nil, 200},                      // a 1/1, b 1/2
		{nil, 200},                      // a over, b 2/2: one quota over
		{nil, 429},                      // both over
		{[]string{"x-plain", "p"}, 429}, // quotas over, plain 1/1: still both quotas over
	} {
		if res := h.do(t, "GET", "/", "", tt.hdr...); res.status != tt.want {
			t.Errorf("request %d: %d, want %d", i+1, res.status, tt.want)
		}
	}
	stock = newStockRLS(t, "domain: d\ndescriptors:\n  - {key: q, quota_mode: true, rate_limit: {unit: minute, requests_per_unit: 5}}\n  - {key: plain, rate_limit: {unit: minute, requests_per_unit: 0}}\n")
	f = filterConfig(t, "domain: d\nrate_limits:\n  - actions: [{generic_key: {descriptor_key: q, descriptor_value: x}}]\n  - actions: [{generic_key: {descriptor_key: plain, descriptor_value: x}}]\n")
	h = stockHarness(t, stock, RateLimitConfig{Filter: f})
	if res := h.do(t, "GET", "/", ""); res.status != 429 {
		t.Errorf("a non-quota descriptor over: %d, want 429", res.status)
	}
}

// Scenario 33 against ratelimit (§3.4, §3.5): a shadow-mode rule is OK with
// remaining 0 once over; global SHADOW_MODE answers OK while the statuses
// say OVER_LIMIT, and Envoy forwards with x-ratelimit-remaining 0.
func TestRateLimitScenario33StockShadowMode(t *testing.T) {
	stock := newStockRLS(t, "domain: ai-gateway\ndescriptors:\n  - key: user\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 1}\n")
	h := stockHarness(t, stock, RateLimitConfig{Filter: filterConfig(t, userLimit)})
	for i, want := range []string{"0", "0"} {
		if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 200 || res.header.Get("x-ratelimit-remaining") != want {
			t.Errorf("shadow rule, request %d: %d remaining %q", i+1, res.status, res.header.Get("x-ratelimit-remaining"))
		}
	}
	stock = newStockRLS(t, "domain: ai-gateway\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n")
	stock.shadow = true
	h = stockHarness(t, stock, RateLimitConfig{Filter: filterConfig(t, userLimit)})
	h.do(t, "GET", "/", "", "x-user-id", "a")
	res := h.do(t, "GET", "/", "", "x-user-id", "a")
	if res.status != 200 || res.header.Get("x-ratelimit-remaining") != "0" || res.header.Get("x-envoy-ratelimited") != "" {
		t.Errorf("global shadow: %d, headers %v", res.status, res.header)
	}
	if e := h.entry(t, 2); e.Calls[0].Response.GetStatuses()[0].GetCode() != overCode {
		t.Errorf("global shadow: status %v, want OVER_LIMIT", e.Calls[0].Response.GetStatuses()[0])
	}
}
