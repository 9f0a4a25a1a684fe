package standin

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
)

// costFilter is Envoy Gateway's BackendTrafficPolicy with a request cost of
// 0 and a response cost from metadata (§4.1, §5.1): the same actions twice,
// a check on the request path and a charge when the stream is done.
const costFilter = `
domain: default/eg/http
rate_limits:
  - actions:
      - generic_key: {descriptor_key: route, descriptor_value: route}
      - request_headers: {header_name: x-tenant-id, descriptor_key: rule-0-match-0}
    hits_addend: {number: 0}
  - actions:
      - generic_key: {descriptor_key: route, descriptor_value: route}
      - request_headers: {header_name: x-tenant-id, descriptor_key: rule-0-match-0}
    hits_addend: {format: "%DYNAMIC_METADATA(io.envoy.ai_gateway:llm_total_token)%"}
    apply_on_stream_done: true
`

// tokens is a Next handler that answers and then, as Envoy AI Gateway's
// ext_proc does, sets the response's cost in dynamic metadata.
func tokens(cost *structpb.Value) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "answer")
		if cost != nil {
			SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", &structpb.Struct{Fields: map[string]*structpb.Value{"llm_total_token": cost}})
		}
	})
}

func hitsOf(d *commonv3.RateLimitDescriptor) string {
	if d.GetHitsAddend() == nil {
		return "unset"
	}
	return fmt.Sprint(d.GetHitsAddend().GetValue())
}

// Scenario 3 (§2.5): without hits_addend anywhere the request-level
// hits_addend is 0, absent on the wire; with filter state
// envoy.ratelimit.hits_addend 5 it is 5, on the stream-done call too.
func TestRateLimitScenario03RequestLevelHits(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit)}, ok, nil)
	h.do(t, "GET", "/", "", "x-user-id", "a")
	if c := h.rls.seen()[0].req; c.GetHitsAddend() != 0 || hitsOf(c.GetDescriptors()[0]) != "unset" {
		t.Errorf("request hits %d, descriptor %s; want 0 and unset", c.GetHitsAddend(), hitsOf(c.GetDescriptors()[0]))
	}
	h = newRLHarness(t, RateLimitConfig{
		Filter:     filterConfig(t, costFilter),
		Next:       tokens(structpb.NewNumberValue(7)),
		HitsAddend: func(*http.Request) (uint32, bool) { return 5, true },
	}, ok, nil)
	h.do(t, "GET", "/", "", "x-tenant-id", "acme")
	e := h.entry(t, 1)
	if len(e.Calls) != 2 {
		t.Fatalf("%d calls", len(e.Calls))
	}
	for _, c := range e.Calls {
		if c.Request.GetHitsAddend() != 5 {
			t.Errorf("stream done %v: request hits %d, want 5", c.StreamDone, c.Request.GetHitsAddend())
		}
	}
}

// Scenario 4 (§2.5): hits_addend number 0 is sent, as a present 0.
func TestRateLimitScenario04CheckOnly(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, `
domain: d
rate_limits:
  - actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}]
    hits_addend: {number: 0}
`)}, ok, nil)
	h.do(t, "GET", "/", "", "x-user-id", "a")
	if got := hitsOf(h.rls.seen()[0].req.GetDescriptors()[0]); got != "0" {
		t.Errorf("descriptor hits %s, want a present 0", got)
	}
}

// Scenario 5 (§2.2): the request path sends the check (hits 0); after the
// whole response a second call sends only the stream-done descriptor with
// the cost from dynamic metadata. Its answer (OVER_LIMIT here) is ignored,
// and only the first call is counted.
func TestRateLimitScenario05CheckThenChargeAtStreamDone(t *testing.T) {
	answer := func(_ context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
		if req.GetDescriptors()[0].GetHitsAddend().GetValue() > 0 {
			return &rlsv3.RateLimitResponse{OverallCode: overCode}, nil
		}
		return &rlsv3.RateLimitResponse{OverallCode: okCode}, nil
	}
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, costFilter), Next: tokens(structpb.NewNumberValue(1234))}, answer, nil)
	res := h.do(t, "POST", "/v1/chat/completions", "{}", "x-tenant-id", "acme")
	if res.status != 200 || res.body != "answer" {
		t.Fatalf("got %d %q", res.status, res.body)
	}
	e := h.entry(t, 1)
	if len(e.Calls) != 2 || e.Calls[0].StreamDone || !e.Calls[1].StreamDone {
		t.Fatalf("calls %+v", e.Calls)
	}
	want := [][]string{{"route=route", "rule-0-match-0=acme"}}
	for i, c := range e.Calls {
		if got := entries(c.Request); !cmp.Equal(got, want) || len(c.Request.GetDescriptors()) != 1 || c.Request.GetDomain() != "default/eg/http" {
			t.Errorf("call %d: %s %q", i, c.Request.GetDomain(), got)
		}
	}
	if a, b := hitsOf(e.Calls[0].Request.GetDescriptors()[0]), hitsOf(e.Calls[1].Request.GetDescriptors()[0]); a != "0" || b != "1234" {
		t.Errorf("hits %s then %s, want 0 then 1234", a, b)
	}
	if e.Calls[1].Response.GetOverallCode() != overCode || h.proxy.Stats() != (RateLimitStats{OK: 1}) {
		t.Errorf("stream-done answer %v, stats %+v", e.Calls[1].Response, h.proxy.Stats())
	}
}

// Scenario 6 (§2.5): a stream-done descriptor whose hits_addend format
// finds no number (absent metadata, a non-numeric string, a negative
// value, one above 1e9) is dropped; with none left there is no second
// call. A numeric string counts.
func TestRateLimitScenario06StreamDoneMissingCost(t *testing.T) {
	for _, tt := range []struct {
		cost *structpb.Value
		hits string // "" means no second call
	}{
		{nil, ""},
		{structpb.NewStringValue("many"), ""},
		{structpb.NewNumberValue(-1), ""},
		{structpb.NewNumberValue(2e9), ""},
		{structpb.NewBoolValue(true), ""},
		{structpb.NewStringValue("42"), "42"},
		{structpb.NewNumberValue(99.9), "99"},
		{structpb.NewNumberValue(1e9), "1000000000"},
	} {
		h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, costFilter), Next: tokens(tt.cost)}, ok, nil)
		h.do(t, "GET", "/", "", "x-tenant-id", "acme")
		e := h.entry(t, 1)
		switch {
		case tt.hits == "" && len(e.Calls) != 1:
			t.Errorf("cost %v: %d calls, want no stream-done call", tt.cost, len(e.Calls))
		case tt.hits != "" && (len(e.Calls) != 2 || hitsOf(e.Calls[1].Request.GetDescriptors()[0]) != tt.hits):
			t.Errorf("cost %v: calls %+v, want a charge of %s", tt.cost, e.Calls, tt.hits)
		}
	}
}

// Scenario 7 (§2.2): after a 429 from the filter the stream-done call is
// still made when its descriptors resolve.
func TestRateLimitScenario07StreamDoneAfterRateLimited(t *testing.T) {
	cost := func(*http.Request) map[string]*structpb.Struct {
		return map[string]*structpb.Struct{"io.envoy.ai_gateway": {Fields: map[string]*structpb.Value{"llm_total_token": structpb.NewNumberValue(3)}}}
	}
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, costFilter), Metadata: cost}, answerWith(&rlsv3.RateLimitResponse{OverallCode: overCode}), nil)
	if res := h.do(t, "GET", "/", "", "x-tenant-id", "acme"); res.status != 429 {
		t.Fatalf("status %d", res.status)
	}
	e := h.entry(t, 1)
	if len(e.Calls) != 2 || !e.Calls[1].StreamDone || hitsOf(e.Calls[1].Request.GetDescriptors()[0]) != "3" {
		t.Errorf("calls %+v, want the stream-done charge of 3", e.Calls)
	}
}

// Scenario 8 (§2.2): a client reset while the request's call is in flight
// cancels the call, and no stream-done call follows.
func TestRateLimitScenario08ResetDuringCall(t *testing.T) {
	answer := func(ctx context.Context, _ *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
		<-ctx.Done() // the call ends only when it is cancelled
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, costFilter), Next: tokens(structpb.NewNumberValue(1))}, answer, nil)
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "GET", h.front.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-tenant-id", "acme")
	done := make(chan error, 1)
	go func() {
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	var c rlsCall
	select {
	case c = <-h.rls.arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("no call arrived")
	}
	cancel()
	if err := <-done; err == nil {
		t.Error("the cancelled request succeeded")
	}
	waitChan(t, c.ctx.Done(), "the call's cancellation at the service")
	e := h.entry(t, 1)
	if len(e.Calls) != 1 || !e.Calls[0].Cancelled || !e.ClientCancelled || e.UpstreamRequested {
		t.Errorf("entry %+v, want one cancelled call and no upstream", e)
	}
	if n := len(h.rls.seen()); n != 1 {
		t.Errorf("the service saw %d calls, want 1", n)
	}
}

// Scenario 9 (§2.2): a client reset after the service answered, while the
// response streams, still makes the stream-done call.
func TestRateLimitScenario09ResetMidUpstream(t *testing.T) {
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", &structpb.Struct{Fields: map[string]*structpb.Value{"llm_total_token": structpb.NewNumberValue(17)}})
		endless("data: token\n\n")(w, r)
	})
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, costFilter), Next: next}, ok, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", h.front.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-tenant-id", "acme")
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(resp.Body, buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	e := h.entry(t, 1)
	if !e.ClientCancelled || len(e.Calls) != 2 || hitsOf(e.Calls[1].Request.GetDescriptors()[0]) != "17" {
		t.Errorf("entry %+v, want the stream-done charge after the reset", e)
	}
}

// hang answers a call only when its deadline (or cancellation) ends it.
func hang(ctx context.Context, _ *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	<-ctx.Done()
	return nil, status.FromContextError(ctx.Err()).Err()
}

// Scenarios 10 and 11 (§2.1 #4-5, #16, §2.8): a service slower than the
// timeout fails open (forwarded, error and failure_mode_allowed counted,
// no RLS headers) or, with failure_mode_deny, closed (status_on_error,
// default 500, empty body, flag RLSE); failure_mode_deny_percent decides
// when set.
func TestRateLimitScenario10And11Timeout(t *testing.T) {
	for _, tt := range []struct {
		name   string
		extra  string
		status int
	}{
		{"fail open", "", 200},
		{"fail closed", "failure_mode_deny: true\n", 500},
		{"status_on_error", "failure_mode_deny: true\nstatus_on_error: {code: ServiceUnavailable}\n", 503},
		{"deny percent 0", "failure_mode_deny: true\nfailure_mode_deny_percent: {default_value: {numerator: 0}, runtime_key: rl.deny}\n", 200},
		{"deny percent 100", "failure_mode_deny_percent: {default_value: {numerator: 100}, runtime_key: rl.deny}\n", 500},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"timeout: 0.05s\n"+tt.extra)}, hang, nil)
			res := h.do(t, "GET", "/", "", "x-user-id", "a")
			e := h.entry(t, 1)
			if res.status != tt.status || status.Code(e.Calls[0].Err) != codes.DeadlineExceeded {
				t.Fatalf("status %d, call error %v", res.status, e.Calls[0].Err)
			}
			if res.header.Get("x-ratelimit-limit") != "" || len(e.AddedHeaders) != 0 {
				t.Errorf("headers added: %q", e.AddedHeaders)
			}
			want := RateLimitStats{Error: 1}
			if tt.status == 200 {
				want.FailureModeAllowed = 1
				if e.Flags != "" || res.body != "upstream says hi" {
					t.Errorf("fail open: entry %+v body %q", e, res.body)
				}
			} else if e.Flags != "RLSE" || e.Details != "rate_limiter_error" || res.body != "" {
				t.Errorf("fail closed: entry %+v body %q", e, res.body)
			}
			if h.proxy.Stats() != want {
				t.Errorf("stats %+v, want %+v", h.proxy.Stats(), want)
			}
		})
	}
}

// Scenario 12 (§2.8, §3.5): any gRPC error from the service is a failure,
// as a timeout is.
func TestRateLimitScenario12GRPCErrors(t *testing.T) {
	for _, code := range []codes.Code{codes.Unknown, codes.Unavailable, codes.Internal, codes.ResourceExhausted} {
		answer := func(context.Context, *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
			return nil, status.Error(code, "rate limit domain must not be empty")
		}
		for deny, want := range map[bool]int{false: 200, true: 500} {
			extra := ""
			if deny {
				extra = "failure_mode_deny: true\n"
			}
			h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+extra)}, answer, nil)
			if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != want {
				t.Errorf("%v, deny %v: status %d, want %d", code, deny, res.status, want)
			}
		}
	}
}

// Scenario 13 (§1.1, §2.8): with no rate-limit cluster the call fails at
// once with UNAVAILABLE; the failure mode applies.
func TestRateLimitScenario13ClusterMissing(t *testing.T) {
	for deny, want := range map[bool]int{false: 200, true: 500} {
		extra := ""
		if deny {
			extra = "failure_mode_deny: true\n"
		}
		h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+extra)}, nil, nil)
		res := h.do(t, "GET", "/", "", "x-user-id", "a")
		e := h.entry(t, 1)
		if res.status != want || len(e.Calls) != 1 || status.Code(e.Calls[0].Err) != codes.Unavailable {
			t.Errorf("deny %v: status %d, calls %+v", deny, res.status, e.Calls)
		}
	}
}

// Scenario 14 (§2.1 #4): timeout 0s sends no grpc-timeout; the call waits.
func TestRateLimitScenario14NoTimeout(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"timeout: 0s\n")}, ok, nil)
	h.do(t, "GET", "/", "", "x-user-id", "a")
	if c := h.rls.seen()[0]; c.hasDeadline {
		t.Errorf("the call had a deadline of %v", c.deadline)
	}
	var f rlfilterv3.RateLimit
	fromYAML(t, "domain: d\nrate_limit_service: {grpc_service: {envoy_grpc: {cluster_name: rl}}, transport_api_version: V3}\n", &f)
	h = newRLHarness(t, RateLimitConfig{Filter: &f}, ok, nil)
	if h.proxy.timeout != 20*time.Millisecond {
		t.Errorf("default timeout %v, want Envoy's 20ms", h.proxy.timeout)
	}
}

// Scenario 15 (§1.3): overall_code UNKNOWN is OK; so is overall OK with
// descriptors over the limit (global shadow mode).
func TestRateLimitScenario15OverallCodeDecides(t *testing.T) {
	for _, resp := range []*rlsv3.RateLimitResponse{
		{OverallCode: rlsv3.RateLimitResponse_UNKNOWN},
		{OverallCode: okCode, Statuses: []*rlsv3.RateLimitResponse_DescriptorStatus{status3(overCode, 1, minute, 0, 5, "")}},
	} {
		h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit)}, answerWith(resp), nil)
		if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 200 || h.proxy.Stats() != (RateLimitStats{OK: 1}) {
			t.Errorf("%v: status %d, stats %+v", resp, res.status, h.proxy.Stats())
		}
	}
}

// Scenarios 16, 17 and 18 (§2.9): which status the x-ratelimit-* headers
// come from, the per-descriptor switch, windows, and statuses that do not
// match the descriptors one to one.
func TestRateLimitScenario16To18XRateLimitHeaders(t *testing.T) {
	a := status3(okCode, 10, minute, 7, 40, "")
	b := status3(okCode, 100, hour, 3, 1800, "h")
	noLimit := &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode}
	unknown := status3(okCode, 5, rlsv3.RateLimitResponse_RateLimit_UNKNOWN, 9, 1, "")
	week := status3(okCode, 1, rlsv3.RateLimitResponse_RateLimit_WEEK, 50, 1, "")
	month := status3(okCode, 2, rlsv3.RateLimitResponse_RateLimit_MONTH, 50, 1, "")
	year := status3(okCode, 3, rlsv3.RateLimitResponse_RateLimit_YEAR, 50, 1, "")
	tie := status3(okCode, 20, minute, 3, 9, "tie")
	on := func(offs ...int) func(int) bool {
		return func(i int) bool { return !slices.Contains(offs, i) }
	}
	for _, tt := range []struct {
		name     string
		statuses []*rlsv3.RateLimitResponse_DescriptorStatus
		on       func(int) bool
		want     []string // limit, remaining, reset; nil for no headers
	}{
		{"smallest remaining", []*rlsv3.RateLimitResponse_DescriptorStatus{a, b}, on(), []string{`100, 10;w=60, 100;w=3600;name="h"`, "3", "1800"}},
		{"first of a tie", []*rlsv3.RateLimitResponse_DescriptorStatus{b, tie}, on(), []string{`100, 100;w=3600;name="h", 20;w=60;name="tie"`, "3", "1800"}},
		{"no current_limit skipped", []*rlsv3.RateLimitResponse_DescriptorStatus{noLimit, a}, on(), []string{"10, 10;w=60", "7", "40"}},
		{"none with current_limit", []*rlsv3.RateLimitResponse_DescriptorStatus{noLimit}, on(), nil},
		{"chosen descriptor off", []*rlsv3.RateLimitResponse_DescriptorStatus{a, b}, on(1), nil},
		{"other descriptor off", []*rlsv3.RateLimitResponse_DescriptorStatus{a, b}, on(0), []string{`100, 100;w=3600;name="h"`, "3", "1800"}},
		{"unknown unit out of the list", []*rlsv3.RateLimitResponse_DescriptorStatus{unknown, a}, on(), []string{"10, 10;w=60", "7", "40"}},
		{"unknown unit chosen", []*rlsv3.RateLimitResponse_DescriptorStatus{unknown}, on(), []string{"5", "9", "1"}},
		{"long windows", []*rlsv3.RateLimitResponse_DescriptorStatus{week, month, year}, on(), []string{"1, 1;w=604800, 2;w=2592000, 3;w=31536000", "50", "1"}},
	} {
		var got []string
		for _, h := range xRateLimitHeaders(tt.statuses, tt.on) {
			got = append(got, h.value)
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}

	// Through the proxy: descriptor 0 with DRAFT_VERSION_03 while the
	// filter is OFF turns the headers on; statuses beyond the descriptors
	// (18) fall back to the filter's setting, here off.
	f := filterConfig(t, `
domain: d
rate_limits:
  - actions: [{generic_key: {descriptor_value: a}}]
    x_ratelimit_option: DRAFT_VERSION_03
`)
	h := newRLHarness(t, RateLimitConfig{Filter: f}, answerWith(&rlsv3.RateLimitResponse{OverallCode: okCode, Statuses: []*rlsv3.RateLimitResponse_DescriptorStatus{a, b}}), nil)
	res := h.do(t, "GET", "/", "")
	if got := res.header.Get("x-ratelimit-limit"); got != "" {
		t.Errorf("chosen status beyond the descriptors, filter OFF: x-ratelimit-limit %q, want none", got)
	}
	h = newRLHarness(t, RateLimitConfig{Filter: f}, answerWith(&rlsv3.RateLimitResponse{OverallCode: okCode, Statuses: []*rlsv3.RateLimitResponse_DescriptorStatus{b, a}}), nil)
	res = h.do(t, "GET", "/", "")
	if got := res.header.Get("x-ratelimit-limit"); got != `100, 100;w=3600;name="h"` {
		t.Errorf("descriptor on, filter OFF: x-ratelimit-limit %q", got)
	}
}

// Scenario 19 (§2.6): a RateLimitPerRoute's domain goes on both calls.
func TestRateLimitScenario19PerRouteDomain(t *testing.T) {
	routes := routeConfig(t, `
virtual_hosts:
  - name: vh
    domains: ["*"]
    routes:
      - match: {prefix: /}
        route: {cluster: upstream}
        typed_per_filter_config:
          envoy.filters.http.ratelimit:
            "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
            domain: ai-gateway-quota
            rate_limits:
              - actions: [{generic_key: {descriptor_key: backend_name, descriptor_value: default/openai}}]
              - actions: [{generic_key: {descriptor_key: backend_name, descriptor_value: default/openai}}]
                hits_addend: {number: 9}
                apply_on_stream_done: true
`)
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit), Routes: routes}, ok, nil)
	h.do(t, "GET", "/", "", "x-user-id", "a")
	e := h.entry(t, 1)
	if len(e.Calls) != 2 {
		t.Fatalf("%d calls", len(e.Calls))
	}
	for _, c := range e.Calls {
		if c.Request.GetDomain() != "ai-gateway-quota" || !cmp.Equal(entries(c.Request), [][]string{{"backend_name=default/openai"}}) {
			t.Errorf("stream done %v: %s %q", c.StreamDone, c.Request.GetDomain(), entries(c.Request))
		}
	}
}

// Scenario 20 (§2.4): which lists apply.
func TestRateLimitScenario20Precedence(t *testing.T) {
	perRoute := func(opts string) string {
		return `
        typed_per_filter_config:
          envoy.filters.http.ratelimit:
            "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
` + opts
	}
	vh := func(route, vhLimits string) string {
		return `
virtual_hosts:
  - name: vh
    domains: ["*"]
    rate_limits: ` + vhLimits + `
    routes:
      - match: {prefix: /}
` + route
	}
	genericList := func(vals ...string) string {
		var out []string
		for _, v := range vals {
			out = append(out, fmt.Sprintf("{actions: [{generic_key: {descriptor_value: %s}}]}", v))
		}
		return "[" + strings.Join(out, ", ") + "]"
	}
	staged := "[{stage: 1, actions: [{generic_key: {descriptor_value: stage1}}]}, {actions: [{generic_key: {descriptor_value: stage0}}]}]"
	for _, tt := range []struct {
		name    string
		filter  string
		routes  string
		runtime map[string]uint32
		want    []string // generic_key values sent, in order; nil for no call
	}{
		{"per-route over filter", "rate_limits: " + genericList("filter"),
			vh("        route: {cluster: u, rate_limits: "+genericList("route")+"}"+perRoute("            rate_limits: "+genericList("per-route")), genericList("vhost")),
			nil, []string{"per-route"}},
		{"filter over route", "rate_limits: " + genericList("filter"),
			vh("        route: {cluster: u, rate_limits: "+genericList("route")+"}", genericList("vhost")), nil, []string{"filter"}},
		{"per-route without rate_limits falls through", "rate_limits: " + genericList("filter"),
			vh("        route: {cluster: u}"+perRoute("            domain: other"), genericList("vhost")), nil, []string{"filter"}},
		{"route overrides vhost", "", vh("        route: {cluster: u, rate_limits: "+genericList("route")+"}", genericList("vhost")), nil, []string{"route"}},
		{"vhost when the route has none", "", vh("        route: {cluster: u}", genericList("vhost")), nil, []string{"vhost"}},
		{"include", "", vh("        route: {cluster: u, rate_limits: "+genericList("route")+"}"+perRoute("            vh_rate_limits: INCLUDE"), genericList("vhost")), nil, []string{"route", "vhost"}},
		{"include_vh_rate_limits", "", vh("        route: {cluster: u, include_vh_rate_limits: true, rate_limits: "+genericList("route")+"}", genericList("vhost")), nil, []string{"route", "vhost"}},
		{"ignore", "", vh("        route: {cluster: u}"+perRoute("            vh_rate_limits: IGNORE"), genericList("vhost")), nil, nil},
		{"stage 0", "", vh("        route: {cluster: u, rate_limits: "+staged+"}", "[]"), nil, []string{"stage0"}},
		{"stage 1", "stage: 1", vh("        route: {cluster: u, rate_limits: "+staged+"}", "[]"), nil, []string{"stage1"}},
		{"disable_key off", "", vh("        route: {cluster: u, rate_limits: [{disable_key: k, actions: [{generic_key: {descriptor_value: 'off'}}]}, {actions: [{generic_key: {descriptor_value: 'on'}}]}]}", "[]"),
			map[string]uint32{"ratelimit.k.http_filter_enabled": 0}, []string{"on"}},
		{"disable_key on", "", vh("        route: {cluster: u, rate_limits: [{disable_key: k, actions: [{generic_key: {descriptor_value: 'off'}}]}]}", "[]"), nil, []string{"off"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, "domain: d\n"+tt.filter), Routes: routeConfig(t, tt.routes), Runtime: tt.runtime}, ok, nil)
			h.do(t, "GET", "/", "")
			var got []string
			for _, c := range h.rls.seen() {
				for _, d := range c.req.GetDescriptors() {
					got = append(got, d.GetEntries()[0].GetValue())
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("sent %q, want %q", got, tt.want)
			}
		})
	}
	// stage and disable_key are refused in the filter's and a
	// RateLimitPerRoute's rate_limits, as is the dynamic_metadata action.
	for _, bad := range []string{
		"rate_limits: [{stage: 1, actions: [{generic_key: {descriptor_value: x}}]}]",
		"rate_limits: [{disable_key: k, actions: [{generic_key: {descriptor_value: x}}]}]",
		"rate_limits: [{actions: [{dynamic_metadata: {descriptor_key: k, metadata_key: {key: ns, path: [{key: a}]}}}]}]",
		"rate_limits: [{actions: [{generic_key: {descriptor_value: x}}], hits_addend: {format: \"%DYNAMIC_METADATA(a:b)% and %REQ(x)%\"}}]",
	} {
		if _, err := NewRateLimitProxy(RateLimitConfig{Filter: filterConfig(t, "domain: d\n"+bad), Next: tokens(nil)}); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}

// Scenario 21 (§2.3): a failing action drops its descriptor;
// skip_if_absent leaves the entry out, even to a descriptor with no
// entries, which is sent; no descriptors at all, no call.
func TestRateLimitScenario21DescriptorComposition(t *testing.T) {
	f := filterConfig(t, `
domain: d
rate_limits:
  - actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}]
  - actions: [{request_headers: {header_name: x-team, descriptor_key: team, skip_if_absent: true}}]
  - actions:
      - generic_key: {descriptor_value: both}
      - request_headers: {header_name: x-team, descriptor_key: team, skip_if_absent: true}
      - header_value_match: {descriptor_value: post, headers: [{name: ":method", exact_match: POST}]}
  - actions: [{header_value_match: {descriptor_value: not-get, expect_match: false, headers: [{name: ":method", exact_match: GET}]}}]
  - actions: [{query_parameters: {query_parameter_name: model, descriptor_key: model}}]
  - actions: [{masked_remote_address: {v4_prefix_mask_len: 24}}]
  - actions: [{remote_address: {}}]
  - actions: [{metadata: {descriptor_key: tier, metadata_key: {key: jwt, path: [{key: tier}]}, default_value: free}}]
  - actions: [{metadata: {descriptor_key: org, metadata_key: {key: jwt, path: [{key: org}]}, skip_if_absent: true}}]
  - actions: [{source_cluster: {}}, {destination_cluster: {}}]
  - actions:
      - remote_address_match:
          descriptor_key: masked_remote_address
          descriptor_value: "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"
          address_matcher: {ranges: [{address_prefix: 10.0.0.0, prefix_len: 8}]}
  - actions: [{query_parameter_value_match: {descriptor_value: gpt, query_parameters: [{name: model, string_match: {prefix: gpt}}]}}]
  - actions: [{query_parameter_value_match: {descriptor_value: mini, query_parameters: [{name: model, string_match: {suffix: mini}}]}}]
`)
	h := newRLHarness(t, RateLimitConfig{Filter: f, ServiceCluster: "front", RemoteAddress: func(*http.Request) string { return "10.1.2.3:5555" }}, ok, nil)
	h.do(t, "GET", "/?model=gpt-4o", "")
	want := [][]string{
		nil,
		{"model=gpt-4o"},
		{"masked_remote_address=10.1.2.0/24"},
		{"remote_address=10.1.2.3"},
		{"tier=free"},
		nil,
		{"source_cluster=front", "destination_cluster=upstream"},
		{"masked_remote_address=10.1.2.3"},
		{"query_match=gpt"},
	}
	// No x-user-id drops the first; no x-team leaves the second with no
	// entries at all; GET drops both header_value_match descriptors.
	if got := entries(h.rls.seen()[0].req); !cmp.Equal(got, want) {
		t.Errorf("descriptors (-want +got):\n%s", cmp.Diff(want, got))
	}
	h = newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, "domain: d\nrate_limits: [{actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}]}]")}, ok, nil)
	if res := h.do(t, "GET", "/", ""); res.status != 200 || len(h.rls.seen()) != 0 || len(h.entry(t, 1).Calls) != 0 {
		t.Errorf("no descriptors: status %d, %d calls", res.status, len(h.rls.seen()))
	}
}

// With the runtime guard enable_formatter_for_ratelimit_action_descriptor_value
// on, a generic_key value is formatted: empty takes default_value, and with
// no default the descriptor is dropped (§2.3). Off (Envoy's default), the
// value is literal.
func TestRateLimitScenario21FormattedDescriptorValues(t *testing.T) {
	const f = `
domain: d
rate_limits:
  - actions: [{generic_key: {descriptor_key: tenant, descriptor_value: "%REQ(x-tenant)%", default_value: none}}]
  - actions: [{generic_key: {descriptor_key: team, descriptor_value: "team-%REQ(x-team)%"}}]
  - actions: [{generic_key: {descriptor_key: org, descriptor_value: "%REQ(x-org)%"}}]
`
	for _, tt := range []struct {
		format bool
		hdr    []string
		want   [][]string
	}{
		{false, nil, [][]string{{"tenant=%REQ(x-tenant)%"}, {"team=team-%REQ(x-team)%"}, {"org=%REQ(x-org)%"}}},
		{true, []string{"x-tenant", "acme", "x-team", "red", "x-org", "o"}, [][]string{{"tenant=acme"}, {"team=team-red"}, {"org=o"}}},
		{true, nil, [][]string{{"tenant=none"}, {"team=team-"}}},
	} {
		h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, f), FormatDescriptorValues: tt.format}, ok, nil)
		h.do(t, "GET", "/", "", tt.hdr...)
		if got := entries(h.rls.seen()[0].req); !cmp.Equal(got, tt.want) {
			t.Errorf("format %v, headers %q: %q, want %q", tt.format, tt.hdr, got, tt.want)
		}
	}
}

// Scenario 22 (§4.1): two rate-limit filters, each with its own domain,
// make one call each with only their own descriptors.
func TestRateLimitScenario22TwoFilters(t *testing.T) {
	inner := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, "domain: shared/policy\nrate_limits: [{actions: [{generic_key: {descriptor_value: shared}}]}]")}, ok, nil)
	outer := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, "domain: default/eg/http\nrate_limits: [{actions: [{generic_key: {descriptor_value: route}}]}]"), Next: inner.proxy}, ok, nil)
	if res := outer.do(t, "GET", "/", ""); res.status != 200 || res.body != "upstream says hi" {
		t.Fatalf("got %d %q", res.status, res.body)
	}
	for _, tt := range []struct {
		h      *rlHarness
		domain string
		value  string
	}{{outer, "default/eg/http", "route"}, {inner, "shared/policy", "shared"}} {
		calls := tt.h.rls.seen()
		if len(calls) != 1 || calls[0].req.GetDomain() != tt.domain || !cmp.Equal(entries(calls[0].req), [][]string{{"generic_key=" + tt.value}}) {
			t.Errorf("%s: calls %v", tt.domain, calls)
		}
	}
}

// Scenario 23 (§2.3): a static or dynamic-metadata limit override is sent
// in the descriptor's limit; metadata that is not a valid override sets
// none.
func TestRateLimitScenario23LimitOverride(t *testing.T) {
	f := filterConfig(t, `
domain: d
rate_limits:
  - actions: [{generic_key: {descriptor_value: static}}]
    limit: {rate_limit: {requests_per_unit: 7, unit: HOUR}}
  - actions: [{generic_key: {descriptor_value: dynamic}}]
    limit: {dynamic_metadata: {metadata_key: {key: eg, path: [{key: limit}]}}}
  - actions: [{generic_key: {descriptor_value: bad}}]
    limit: {dynamic_metadata: {metadata_key: {key: eg, path: [{key: bad}]}}}
`)
	md := func(*http.Request) map[string]*structpb.Struct {
		s, err := structpb.NewStruct(map[string]any{
			"limit": map[string]any{"requests_per_unit": 50, "unit": "MINUTE"},
			"bad":   map[string]any{"requests_per_unit": 50, "unit": "fortnight"},
		})
		if err != nil {
			panic(err)
		}
		return map[string]*structpb.Struct{"eg": s}
	}
	h := newRLHarness(t, RateLimitConfig{Filter: f, Metadata: md}, ok, nil)
	h.do(t, "GET", "/", "")
	got := h.rls.seen()[0].req.GetDescriptors()
	want := []*commonv3.RateLimitDescriptor_RateLimitOverride{
		{RequestsPerUnit: 7, Unit: typev3.RateLimitUnit_HOUR},
		{RequestsPerUnit: 50, Unit: typev3.RateLimitUnit_MINUTE},
		nil,
	}
	for i, d := range got {
		if diff := cmp.Diff(want[i], d.GetLimit(), protocmp.Transform()); diff != "" {
			t.Errorf("descriptor %d limit (-want +got):\n%s", i, diff)
		}
	}
}

// Scenario 24 (§1.2, §2.5): is_negative_hits sets the descriptor's field 4.
func TestRateLimitScenario24NegativeHits(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, "domain: d\nrate_limits: [{actions: [{generic_key: {descriptor_value: x}}], hits_addend: {number: 3, is_negative_hits: true}}]")}, ok, nil)
	h.do(t, "GET", "/", "")
	d := h.rls.seen()[0].req.GetDescriptors()[0]
	if !d.GetIsNegativeHits() || d.GetHitsAddend().GetValue() != 3 {
		t.Errorf("descriptor %v", d)
	}
}

// Scenario 25 (§2.8): not enforced, OVER_LIMIT forwards the request; the
// upstream's response gets x-envoy-ratelimited and x-ratelimit-*.
func TestRateLimitScenario25NotEnforced(t *testing.T) {
	f := filterConfig(t, userLimit+"filter_enforced: {default_value: {numerator: 0}, runtime_key: rl.enforced}\n")
	h := newRLHarness(t, RateLimitConfig{Filter: f}, answerWith(&rlsv3.RateLimitResponse{
		OverallCode: overCode, Statuses: []*rlsv3.RateLimitResponse_DescriptorStatus{status3(overCode, 10, minute, 0, 9, "")},
	}), nil)
	res := h.do(t, "GET", "/", "", "x-user-id", "a")
	if res.status != 200 || res.header.Get("x-envoy-ratelimited") != "true" || res.header.Get("x-ratelimit-remaining") != "0" {
		t.Errorf("status %d, headers %v", res.status, res.header)
	}
	if h.proxy.Stats() != (RateLimitStats{OverLimit: 1}) || h.entry(t, 1).Flags != "" {
		t.Errorf("stats %+v", h.proxy.Stats())
	}
	// The runtime overrides the default fraction.
	h = newRLHarness(t, RateLimitConfig{Filter: f, Runtime: map[string]uint32{"rl.enforced": 100}}, answerWith(&rlsv3.RateLimitResponse{OverallCode: overCode}), nil)
	if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 429 {
		t.Errorf("enforced by runtime: status %d", res.status)
	}
}

// Scenario 26 (§2.2): disabled, no call is made, and no stream-done call.
func TestRateLimitScenario26Disabled(t *testing.T) {
	f := filterConfig(t, costFilter+"filter_enabled: {default_value: {numerator: 0}}\n")
	h := newRLHarness(t, RateLimitConfig{Filter: f, Next: tokens(structpb.NewNumberValue(5))}, ok, nil)
	if res := h.do(t, "GET", "/", "", "x-tenant-id", "a"); res.status != 200 {
		t.Fatalf("status %d", res.status)
	}
	if e := h.entry(t, 1); len(e.Calls) != 0 || len(h.rls.seen()) != 0 {
		t.Errorf("calls %+v", e.Calls)
	}
	// A fraction in between is drawn from Random.
	draws := []uint64{10, 90}
	f = filterConfig(t, userLimit+"filter_enabled: {default_value: {numerator: 50}}\n")
	h = newRLHarness(t, RateLimitConfig{Filter: f, Random: func() uint64 { d := draws[0]; draws = draws[1:]; return d }}, ok, nil)
	h.do(t, "GET", "/", "", "x-user-id", "a")
	h.do(t, "GET", "/", "", "x-user-id", "b")
	if calls := h.rls.seen(); len(calls) != 1 || !cmp.Equal(entries(calls[0].req), [][]string{{"user=a"}}) {
		t.Errorf("50%% enabled with draws 10, 90: calls %v", calls)
	}
}

// Scenario 27 (§2.1 #3): request_type internal calls only for requests
// with x-envoy-internal: true; external only for the others.
func TestRateLimitScenario27RequestType(t *testing.T) {
	for _, tt := range []struct {
		kind     string
		internal bool
		calls    int
	}{{"internal", true, 1}, {"internal", false, 0}, {"external", true, 0}, {"external", false, 1}, {"both", true, 1}} {
		h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"request_type: "+tt.kind+"\n")}, ok, nil)
		hdr := []string{"x-user-id", "a"}
		if tt.internal {
			hdr = append(hdr, "x-envoy-internal", "true")
		}
		h.do(t, "GET", "/", "", hdr...)
		if n := len(h.rls.seen()); n != tt.calls {
			t.Errorf("%s, internal %v: %d calls, want %d", tt.kind, tt.internal, n, tt.calls)
		}
	}
}

// Scenario 28 (§1.3): the answer's dynamic_metadata is stored under
// metadata_namespace, visible to later filters; the stream-done answer's
// is ignored.
func TestRateLimitScenario28ResponseDynamicMetadata(t *testing.T) {
	answer := func(_ context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
		which := "request"
		if req.GetDescriptors()[0].GetHitsAddend().GetValue() > 0 {
			which = "stream done"
		}
		return &rlsv3.RateLimitResponse{OverallCode: okCode, DynamicMetadata: &structpb.Struct{Fields: map[string]*structpb.Value{"from": structpb.NewStringValue(which)}}}, nil
	}
	for _, ns := range []string{"", "custom.ns"} {
		f := filterConfig(t, costFilter+"metadata_namespace: \""+ns+"\"\n")
		seen := make(chan string, 1)
		want := ns
		if want == "" {
			want = "envoy.filters.http.ratelimit"
		}
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			seen <- DynamicMetadataOf(r.Context(), want).GetFields()["from"].GetStringValue()
			tokens(structpb.NewNumberValue(4)).ServeHTTP(w, r)
		})
		h := newRLHarness(t, RateLimitConfig{Filter: f, Next: next}, answer, nil)
		h.do(t, "GET", "/", "", "x-tenant-id", "a")
		if got := <-seen; got != "request" {
			t.Errorf("%q: the next filter saw %q", ns, got)
		}
		e := h.entry(t, 1)
		if len(e.Calls) != 2 || e.DynamicMetadata[want].GetFields()["from"].GetStringValue() != "request" {
			t.Errorf("%q: metadata at the end %v", ns, e.DynamicMetadata)
		}
	}
}

// Scenario 29 (§2.1 #6): a gRPC client over the limit gets HTTP 200 with
// grpc-status 14, or 8 with rate_limited_as_resource_exhausted.
func TestRateLimitScenario29GRPCClient(t *testing.T) {
	for extra, want := range map[string]string{"": "14", "rate_limited_as_resource_exhausted: true\n": "8"} {
		h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+extra)}, answerWith(&rlsv3.RateLimitResponse{OverallCode: overCode}), nil)
		res := h.do(t, "POST", "/pkg.Service/Method", "\x00\x00\x00\x00\x00", "content-type", "application/grpc", "x-user-id", "a")
		if res.status != 200 || res.header.Get("grpc-status") != want || res.header.Get("content-type") != "application/grpc" {
			t.Errorf("%q: status %d, headers %v", extra, res.status, res.header)
		}
	}
}

// Scenario 30 (§2.1 #10, #12): rate_limited_status below 400 is 429; a
// status_on_error outside Envoy's HttpStatus enum (600) is refused by
// Envoy's own constraints before the filter's rule (outside 100..511 →
// 500) could apply.
func TestRateLimitScenario30StatusCodes(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"rate_limited_status: {code: Found}\n")}, answerWith(&rlsv3.RateLimitResponse{OverallCode: overCode}), nil)
	if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 429 {
		t.Errorf("rate_limited_status 302: status %d, want 429", res.status)
	}
	h = newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"rate_limited_status: {code: ServiceUnavailable}\n")}, answerWith(&rlsv3.RateLimitResponse{OverallCode: overCode}), nil)
	if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 503 {
		t.Errorf("rate_limited_status 503: status %d", res.status)
	}
	f := filterConfig(t, userLimit)
	f.StatusOnError = &typev3.HttpStatus{Code: typev3.StatusCode(600)}
	if _, err := NewRateLimitProxy(RateLimitConfig{Filter: f, Next: tokens(nil)}); err == nil {
		t.Error("status_on_error 600 accepted")
	}
}

// Scenario 34 (§1.1): many streams at once on one HTTP/2 connection, each
// with its own call on the one gRPC connection; every call arrives with its
// own hits.
func TestRateLimitScenario34Concurrency(t *testing.T) {
	f := filterConfig(t, "domain: d\nrate_limits: [{actions: [{request_headers: {header_name: x-n, descriptor_key: num}}], hits_addend: {number: 7}}]")
	h := newRLHarness(t, RateLimitConfig{Filter: f}, ok, nil)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	c := &http.Client{Transport: &http.Transport{Protocols: &protos}}
	const n = 40
	errs := make(chan error, n)
	for i := range n {
		go func() {
			req, err := http.NewRequest("GET", h.front.URL+"/", nil)
			if err != nil {
				errs <- err
				return
			}
			req.Header.Set("x-n", fmt.Sprint(i))
			resp, err := c.Do(req)
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.ProtoMajor != 2 {
					err = fmt.Errorf("protocol %s", resp.Proto)
				}
			}
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]bool{}
	for _, call := range h.rls.seen() {
		d := call.req.GetDescriptors()[0]
		if d.GetHitsAddend().GetValue() != 7 {
			t.Errorf("hits %v", d.GetHitsAddend())
		}
		seen[d.GetEntries()[0].GetValue()] = true
	}
	if len(seen) != n {
		t.Errorf("%d distinct calls, want %d", len(seen), n)
	}
}

// The stand-in refuses a configuration Envoy refuses.
func TestRateLimitConfigRefused(t *testing.T) {
	for name, f := range map[string]string{
		"no domain":          "rate_limits: []\n",
		"v2 transport":       "domain: d\nrate_limit_service: {grpc_service: {envoy_grpc: {cluster_name: rl}}, transport_api_version: V2}\n",
		"transport unstated": "domain: d\nrate_limit_service: {grpc_service: {envoy_grpc: {cluster_name: rl}}}\n",
		"hits both":          "domain: d\nrate_limits: [{actions: [{generic_key: {descriptor_value: x}}], hits_addend: {number: 1, format: \"%REQ(x)%\"}}]\n",
		"extension action":   "domain: d\nrate_limits: [{actions: [{extension: {name: x, typed_config: {\"@type\": type.googleapis.com/google.protobuf.Struct, value: {}}}}]}]\n",
	} {
		var cfg RateLimitConfig
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("%s: panic %v", name, r)
				}
			}()
			cfg.Filter = filterConfig(t, f)
		}()
		cfg.Next = tokens(nil)
		if _, err := NewRateLimitProxy(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
