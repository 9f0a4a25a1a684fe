package rls_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/rls"
)

// POST /json (rls.json_endpoint) is ShouldRateLimit over HTTP, as
// ratelimit's /json (docs/envoy-ratelimit.md §3.7): the answer in
// protobuf's JSON, 200 when OK and 429 when over the limit; a body that is
// no request 400, one past 1 MiB 413; off, 404.
func TestJSONEndpoint(t *testing.T) {
	post := func(h http.Handler, body string) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/json", strings.NewReader(body)))
		return w
	}
	off := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), mappingYAML)
	if w := post(off.svc.JSONHandler(), `{"domain":"d"}`); w.Code != http.StatusNotFound || !strings.Contains(w.Body.String(), "rls.json_endpoint") {
		t.Errorf("off: %d %s, want 404 naming the setting", w.Code, w.Body)
	}

	r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), strings.Replace(mappingYAML, "rls:\n", "rls:\n  json_endpoint: true\n", 1))
	h := r.svc.JSONHandler()
	// user's bucket holds 10 tokens: a charge of 15 goes past it.
	for i, tc := range []struct {
		body string
		code int
		want rlsv3.RateLimitResponse_Code
	}{
		{`{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"ada"}],"hitsAddend":0}]}`, http.StatusOK, rlsv3.RateLimitResponse_OK},
		{`{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"ada"}],"hitsAddend":15}]}`, http.StatusTooManyRequests, rlsv3.RateLimitResponse_OVER_LIMIT},
		{`{"domain":"d","descriptors":[{"entries":[{"key":"user","value":"ada"}],"hitsAddend":0}]}`, http.StatusTooManyRequests, rlsv3.RateLimitResponse_OVER_LIMIT},
		{`{"domain":"unknown","descriptors":[{"entries":[{"key":"user","value":"ada"}]}]}`, http.StatusOK, rlsv3.RateLimitResponse_OK},
	} {
		w := post(h, tc.body)
		var resp rlsv3.RateLimitResponse
		if err := protojson.Unmarshal(w.Body.Bytes(), &resp); err != nil {
			t.Fatalf("call %d: %d %s: %v", i, w.Code, w.Body, err)
		}
		if w.Code != tc.code || resp.GetOverallCode() != tc.want || w.Header().Get("Content-Type") != "application/json" {
			t.Errorf("call %d: %d %v (%s), want %d %v as JSON", i, w.Code, resp.GetOverallCode(), w.Header().Get("Content-Type"), tc.code, tc.want)
		}
	}
	if got := r.level(t, "user", "ada"); !near(got, -5) {
		t.Errorf("ada's bucket at %v, want -5: the charge of 15 applied once, the checks took nothing", got)
	}
	for _, tc := range []struct {
		body string
		code int
		want string
	}{
		{`{"domain":"d","descriptors":[{"entries":[{"key":7}]}]}`, http.StatusBadRequest, "not a RateLimitRequest"},
		{`{"domain":"","descriptors":[{"entries":[{"key":"user","value":"ada"}]}]}`, http.StatusBadRequest, "rate limit domain must not be empty"},
		{`{"domain":"d"}`, http.StatusBadRequest, "rate limit descriptor list must not be empty"},
		{`{"domain":"` + strings.Repeat("d", rls.MaxJSONBody) + `"}`, http.StatusRequestEntityTooLarge, "larger than 1 MiB"},
	} {
		if w := post(h, tc.body); w.Code != tc.code || !strings.Contains(w.Body.String(), tc.want) {
			t.Errorf("%.60s: %d %s, want %d and %q", tc.body, w.Code, w.Body, tc.code, tc.want)
		}
	}
}
