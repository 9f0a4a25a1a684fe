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

	"github.com/tokengate/tokengate/internal/statsdmap"
	"github.com/tokengate/tokengate/rls"
)

// SanitizeStatName is ratelimit's (docs/envoy-ratelimit.md §3.6).
func TestSanitizeStatName(t *testing.T) {
	for key, want := range map[string]string{
		"d.user_alice": "d.user_alice",
		"eg.rule-0.masked_remote_address_0.0.0.0/0": "eg.rule-0.masked_remote_address_0_0_0_0/0",
		"d.header:x|y.k":         "d.header_x_y.k",
		"d.ip_10.1.2.3.port_1.2": "d.ip_10_1_2_3.port_1.2",
	} {
		if got := SanitizeStatName(key); got != want {
			t.Errorf("SanitizeStatName(%q) = %q, want %q", key, got, want)
		}
	}
}

// scrape is r's exposition.
func scrape(t *testing.T, r *Ratelimit) string {
	t.Helper()
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
	return string(body)
}

// feed gives r one of everything: two limits' stats, of one level and of
// three, two errors, two loads and a call.
func feed(t *testing.T, r *Ratelimit) {
	t.Helper()
	r.Stats(rls.RatelimitStats{Key: "eg.rule-0.masked_remote_address_0.0.0.0/0.deeper", TotalHits: 5, OverLimit: 2, NearLimit: 1, WithinLimit: 3})
	r.Stats(rls.RatelimitStats{Key: "eg.rule-0.masked_remote_address_0.0.0.0/0.deeper", TotalHits: 1, WithinLimit: 1})
	r.Stats(rls.RatelimitStats{Key: "rl.remote_address", TotalHits: 2, WithinLimit: 1, OverLimit: 1})
	r.Stats(rls.RatelimitStats{Key: "nowhere", DomainNotFound: 1})
	r.Stats(rls.RatelimitStats{Key: "nowhere", DomainNotFound: 1})
	r.GlobalShadowMode()
	r.Error(rls.ErrorStore)
	r.Error(rls.ErrorInvalid)
	r.ConfigLoad(true)
	r.ConfigLoad(false)
	call := r.UnaryInterceptor()
	if _, err := call(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"},
		func(context.Context, any) (any, error) { return "ok", nil }); err != nil {
		t.Fatal(err)
	}
}

func hasLines(t *testing.T, body string, want []string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(body, "\n"+w+"\n") {
			t.Errorf("no line %q in:\n%s", w, body)
		}
	}
}

// The default mapping names the stats as ratelimit's does: a key of one
// level labelled domain and key1, a deeper one domain, key1 and key2; a
// series appears with its first hit; a key past MaxRatelimitKeys is
// counted as dropped, not named.
func TestRatelimitExposition(t *testing.T) {
	r := NewRatelimit(nil)
	feed(t, r)
	// 250ms as ratelimit's timer takes it: 0.25s, by the mapping's scale.
	r.named("ratelimit_server.Slow.response_time", true).observe(250)
	body := scrape(t, r)
	hasLines(t, body, []string{
		`ratelimit_service_response_time_seconds_bucket{grpc_method="Slow",le="0.1"} 0`,
		`ratelimit_service_response_time_seconds_bucket{grpc_method="Slow",le="0.25"} 1`,
	})
	deep := `{domain="eg",key1="rule-0",key2="masked_remote_address_0_0_0_0/0"}`
	one := `{domain="rl",key1="remote_address"}`
	hasLines(t, body, []string{
		"ratelimit_service_rate_limit_total_hits" + deep + " 6",
		"ratelimit_service_rate_limit_over_limit" + deep + " 2",
		"ratelimit_service_rate_limit_near_limit" + deep + " 1",
		"ratelimit_service_rate_limit_within_limit" + deep + " 4",
		"ratelimit_service_rate_limit_total_hits" + one + " 2",
		"ratelimit_service_rate_limit_over_limit" + one + " 1",
		`ratelimit_service_should_rate_limit_error{err_type="redis_error"} 1`,
		`ratelimit_service_should_rate_limit_error{err_type="service_error"} 1`,
		`ratelimit_service_total_requests{grpc_method="ShouldRateLimit"} 1`,
		`ratelimit_service_response_time_seconds_count{grpc_method="ShouldRateLimit"} 1`,
		`ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="0.005"} 1`,
		"ratelimit_service_config_load_success 1",
		"ratelimit_service_config_load_error 1",
		// No line of the default mapping names these: their statsd
		// names, escaped, as ratelimit's output gives them.
		"ratelimit_service_rate_limit_nowhere_domain_not_found 2",
		"ratelimit_service_global_shadow_mode 1",
	})
	for _, absent := range []string{"ratelimit_service_rate_limit_shadow_mode{", "ratelimit_service_rate_limit_near_limit" + one} {
		if strings.Contains(body, absent) {
			t.Errorf("a series without hits (%s):\n%s", absent, body)
		}
	}
	if !strings.Contains(body, "\ngo_goroutines ") {
		t.Errorf("no go_goroutines, which ratelimit's registry has:\n%s", body)
	}

	for i := range MaxRatelimitKeys + 5 {
		r.Stats(rls.RatelimitStats{Key: fmt.Sprintf("d.user_%d", i), TotalHits: 1, WithinLimit: 1})
	}
	n, err := testutil.GatherAndCount(r.reg, "ratelimit_service_rate_limit_total_hits")
	if err != nil {
		t.Fatal(err)
	}
	// The unknown domain holds one of the keys, without total_hits.
	if n != MaxRatelimitKeys-1 {
		t.Errorf("%d total_hits series, want the bound %d less the unknown domain's key", n, MaxRatelimitKeys)
	}
	if got := testutil.ToFloat64(r.dropped); got != 8 {
		t.Errorf("dropped = %v, want 8 (the keys past the bound)", got)
	}
	r.Stats(rls.RatelimitStats{Key: "nowhere", DomainNotFound: 1})
	if body := scrape(t, r); !strings.Contains(body, "\nratelimit_service_rate_limit_nowhere_domain_not_found 3\n") {
		t.Errorf("a known key past the bound must still count:\n%s", body[:min(len(body), 2000)])
	}
}

// A mapping of Envoy Gateway's shape (PROMETHEUS_MAPPER_YAML): keys of
// exactly two levels by glob, the response time without a scale
// (milliseconds) and with the deprecated timer_type, and everything else
// dropped.
const egShapedMapping = `mappings:
  - match: "ratelimit.service.rate_limit.*.*.total_hits"
    name: "ratelimit_service_rate_limit_total_hits"
    timer_type: "histogram"
    labels: {domain: "$1", key1: "$2"}
  - match: "ratelimit.service.rate_limit.*.*.*.over_limit"
    name: "ratelimit_service_rate_limit_over_limit"
    labels: {domain: "$1", key1: "$2", key2: "$3"}
  - match: "ratelimit_server.*.response_time"
    name: "ratelimit_service_response_time_seconds"
    timer_type: histogram
    histogram_options: {buckets: [5, 50, 500]}
    labels: {grpc_method: "$1"}
  - match: "."
    match_type: "regex"
    action: "drop"
    name: "dropped"
`

func TestRatelimitExpositionWithAMapping(t *testing.T) {
	m, err := statsdmap.Parse([]byte(egShapedMapping))
	if err != nil {
		t.Fatal(err)
	}
	r := NewRatelimit(m)
	feed(t, r)
	r.Stats(rls.RatelimitStats{Key: "eg.rule-0.masked_remote_address_0.0.0.0/0", OverLimit: 3, TotalHits: 3})
	// 250ms: in the mapping's bucket of 500, as it has no scale.
	r.named("ratelimit_server.Slow.response_time", true).observe(250)
	body := scrape(t, r)
	hasLines(t, body, []string{
		`ratelimit_service_response_time_seconds_bucket{grpc_method="Slow",le="50"} 0`,
		`ratelimit_service_response_time_seconds_bucket{grpc_method="Slow",le="500"} 1`,
		`ratelimit_service_rate_limit_total_hits{domain="rl",key1="remote_address"} 2`,
		`ratelimit_service_rate_limit_over_limit{domain="eg",key1="rule-0",key2="masked_remote_address_0_0_0_0/0"} 3`,
		// In milliseconds: a call of under 5ms is in the first bucket.
		`ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="5"} 1`,
	})
	for _, absent := range []string{"should_rate_limit_error", "config_load", "total_requests", "key2=\"masked_remote_address_0_0_0_0/0\"} 6"} {
		if strings.Contains(body, absent) {
			t.Errorf("%s is in the exposition, which the mapping drops:\n%s", absent, body)
		}
	}
}
