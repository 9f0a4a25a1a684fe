package standin

import (
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The tests in this file are the scenarios of docs/envoy-ratelimit.md §6,
// each named after its scenario and citing the sections it follows.

// userLimit is a filter whose one descriptor is the x-user-id header.
const userLimit = `
domain: ai-gateway
enable_x_ratelimit_headers: DRAFT_VERSION_03
rate_limits:
  - actions:
      - request_headers: {header_name: x-user-id, descriptor_key: user}
`

func status3(code rlsv3.RateLimitResponse_Code, rpu uint32, unit rlsv3.RateLimitResponse_RateLimit_Unit, remaining uint32, reset int64, name string) *rlsv3.RateLimitResponse_DescriptorStatus {
	return &rlsv3.RateLimitResponse_DescriptorStatus{
		Code:               code,
		CurrentLimit:       &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: rpu, Unit: unit, Name: name},
		LimitRemaining:     remaining,
		DurationUntilReset: durationpb.New(time.Duration(reset) * time.Second),
	}
}

const (
	okCode   = rlsv3.RateLimitResponse_OK
	overCode = rlsv3.RateLimitResponse_OVER_LIMIT
	minute   = rlsv3.RateLimitResponse_RateLimit_MINUTE
	hour     = rlsv3.RateLimitResponse_RateLimit_HOUR
)

// Scenario 1 (§2.8): an OK answer forwards the request with the RLS's
// request_headers_to_add appended, and appends its response_headers_to_add
// and the x-ratelimit-* headers to the upstream's response. The wire
// request carries the domain, the entries and hits_addend 0; the call
// carries the filter's timeout.
func TestRateLimitScenario01BasicOK(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"timeout: 3s\n")}, answerWith(&rlsv3.RateLimitResponse{
		OverallCode:          okCode,
		Statuses:             []*rlsv3.RateLimitResponse_DescriptorStatus{status3(okCode, 100, minute, 99, 42, "")},
		RequestHeadersToAdd:  []*corev3.HeaderValue{{Key: "X-From-RLS", Value: "request"}},
		ResponseHeadersToAdd: []*corev3.HeaderValue{{Key: "X-Quota", Value: "response"}},
	}), nil)
	res := h.do(t, "GET", "/v1/models", "", "x-user-id", "alice")
	if res.status != 200 || res.body != "upstream says hi" {
		t.Fatalf("got %d %q", res.status, res.body)
	}
	for k, want := range map[string]string{"x-quota": "response", "x-ratelimit-limit": "100, 100;w=60", "x-ratelimit-remaining": "99", "x-ratelimit-reset": "42"} {
		if got := res.header.Get(k); got != want {
			t.Errorf("response %s = %q, want %q", k, got, want)
		}
	}
	if got := h.upHeader(t, 0).Get("x-from-rls"); got != "request" {
		t.Errorf("upstream saw x-from-rls %q", got)
	}
	calls := h.rls.seen()
	want := &rlsv3.RateLimitRequest{Domain: "ai-gateway", Descriptors: desc("user", "alice")}
	if len(calls) != 1 {
		t.Fatalf("%d calls", len(calls))
	}
	if diff := cmp.Diff(want, calls[0].req, protocmp.Transform()); diff != "" {
		t.Errorf("request (-want +got):\n%s", diff)
	}
	if !calls[0].hasDeadline || calls[0].deadline > 3*time.Second || calls[0].deadline < 2*time.Second {
		t.Errorf("call deadline %v (%v), want about 3s", calls[0].deadline, calls[0].hasDeadline)
	}
	e := h.entry(t, 1)
	if e.Details != "via_upstream" || e.Flags != "" || h.proxy.Stats() != (RateLimitStats{OK: 1}) {
		t.Errorf("entry %+v, stats %+v", e, h.proxy.Stats())
	}
}

// Scenario 2 (§2.1 #9-11, §2.8): OVER_LIMIT answers 429 with raw_body and,
// in order, the RLS's headers, x-envoy-ratelimited, the x-ratelimit-*
// headers, then the filter's response_headers_to_add; an RLS content-type
// replaces the default; flag RL; no upstream request.
func TestRateLimitScenario02OverLimit(t *testing.T) {
	f := filterConfig(t, userLimit+`
response_headers_to_add:
  - header: {key: x-filter, value: "%REQ(x-user-id)%"}
`)
	h := newRLHarness(t, RateLimitConfig{Filter: f}, answerWith(&rlsv3.RateLimitResponse{
		OverallCode:          overCode,
		Statuses:             []*rlsv3.RateLimitResponse_DescriptorStatus{status3(overCode, 10, minute, 0, 30, "")},
		ResponseHeadersToAdd: []*corev3.HeaderValue{{Key: "Content-Type", Value: "application/json"}, {Key: "x-rls", Value: "1"}},
		RawBody:              []byte(`{"error":"slow down"}`),
	}), nil)
	req, err := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-user-id", "bob")
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if got := resp.Header.Values("content-type"); !slices.Equal(got, []string{"application/json"}) {
		t.Errorf("content-type %q, want the RLS's alone", got)
	}
	for k, want := range map[string]string{"x-rls": "1", "x-envoy-ratelimited": "true", "x-ratelimit-limit": "10, 10;w=60", "x-ratelimit-remaining": "0", "x-ratelimit-reset": "30", "x-filter": "bob"} {
		if got := resp.Header.Get(k); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	e := h.entry(t, 1)
	if e.Status != 429 || e.Details != "request_rate_limited" || e.Flags != "RL" || e.UpstreamRequested {
		t.Errorf("entry %+v", e)
	}
	if calls, _, _ := h.up.snapshot(); calls != 0 || h.proxy.Stats() != (RateLimitStats{OverLimit: 1}) {
		t.Errorf("upstream calls %d, stats %+v", calls, h.proxy.Stats())
	}
	want := []string{"content-type: application/json", "x-rls: 1", "x-envoy-ratelimited: true",
		"x-ratelimit-limit: 10, 10;w=60", "x-ratelimit-remaining: 0", "x-ratelimit-reset: 30", "x-filter: bob"}
	if !slices.Equal(e.AddedHeaders, want) {
		t.Errorf("headers added %q, want %q", e.AddedHeaders, want)
	}
}

// desc is a request's descriptors of key/value pairs, one descriptor.
func desc(kv ...string) []*commonv3.RateLimitDescriptor {
	d := &commonv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return []*commonv3.RateLimitDescriptor{d}
}
