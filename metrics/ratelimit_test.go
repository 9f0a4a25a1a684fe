package metrics

import (
	"context"
	"fmt"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"

	"github.com/tokengate/tokengate/rls"
)

// RatelimitLabels sanitizes and splits a stats key as ratelimit's
// SanitizeStatName and default mapping do (docs/envoy-ratelimit.md §3.6).
func TestRatelimitLabels(t *testing.T) {
	for _, tc := range []struct {
		key                string
		domain, key1, key2 string
	}{
		{"d.user", "d", "user", ""},
		{"d.user_alice", "d", "user_alice", ""},
		{"eg.rule-0.masked_remote_address_0.0.0.0/0", "eg", "rule-0", "masked_remote_address_0_0_0_0/0"},
		{"d.a_1.b_2.c_3", "d", "a_1", "b_2"},
		{"d.header:x|y.k", "d", "header_x_y", "k"},
		{"d.ip_10.1.2.3", "d", "ip_10_1_2_3", ""},
		{"d", "d", "", ""},
	} {
		l := RatelimitLabels(tc.key)
		if l["domain"] != tc.domain || l["key1"] != tc.key1 || l["key2"] != tc.key2 {
			t.Errorf("RatelimitLabels(%q) = %v, want domain %q key1 %q key2 %q", tc.key, l, tc.domain, tc.key1, tc.key2)
		}
	}
}

// The exposition carries ratelimit's names and labels; a key past
// MaxRatelimitKeys is counted as dropped, not labelled.
func TestRatelimitExposition(t *testing.T) {
	r := NewRatelimit()
	r.Stats(rls.RatelimitStats{Key: "eg.rule-0.masked_remote_address_0.0.0.0/0", TotalHits: 5, OverLimit: 2, NearLimit: 1, WithinLimit: 3})
	r.Stats(rls.RatelimitStats{Key: "eg.rule-0.masked_remote_address_0.0.0.0/0", TotalHits: 1, WithinLimit: 1})
	r.Error(rls.ErrorStore)
	r.Error(rls.ErrorInvalid)
	r.ConfigLoad(true)
	r.ConfigLoad(false)
	call := r.UnaryInterceptor()
	if _, err := call(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"},
		func(context.Context, any) (any, error) { return "ok", nil }); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(r.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	labels := `{domain="eg",key1="rule-0",key2="masked_remote_address_0_0_0_0/0"}`
	for _, want := range []string{
		"ratelimit_service_rate_limit_total_hits" + labels + " 6",
		"ratelimit_service_rate_limit_over_limit" + labels + " 2",
		"ratelimit_service_rate_limit_near_limit" + labels + " 1",
		"ratelimit_service_rate_limit_within_limit" + labels + " 4",
		`ratelimit_service_should_rate_limit_error{err_type="redis_error"} 1`,
		`ratelimit_service_should_rate_limit_error{err_type="service_error"} 1`,
		`ratelimit_service_total_requests{grpc_method="ShouldRateLimit"} 1`,
		`ratelimit_service_response_time_seconds_count{grpc_method="ShouldRateLimit"} 1`,
		"ratelimit_service_config_load_success 1",
		"ratelimit_service_config_load_error 1",
		"go_goroutines",
	} {
		if !strings.Contains(string(body), "\n"+want) {
			t.Errorf("no line %q in:\n%s", want, body)
		}
	}
	// Counters with nothing added make no series: shadow_mode here.
	if strings.Contains(string(body), "ratelimit_service_rate_limit_shadow_mode{") {
		t.Errorf("a shadow_mode series without hits:\n%s", body)
	}

	for i := range MaxRatelimitKeys + 5 {
		r.Stats(rls.RatelimitStats{Key: fmt.Sprintf("d.user_%d", i), TotalHits: 1, WithinLimit: 1})
	}
	if n := testutil.CollectAndCount(r.total); n != MaxRatelimitKeys {
		t.Errorf("%d total_hits series, want the bound %d", n, MaxRatelimitKeys)
	}
	if got := testutil.ToFloat64(r.dropped); got != 6 {
		t.Errorf("dropped = %v, want 6 (the keys past the bound)", got)
	}
}
