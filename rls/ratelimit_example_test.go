package rls_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/rls"
)

// TestRatelimitExampleAnswersAsRatelimit: envoyproxy/ratelimit's own
// example configuration (examples/ratelimit/config/example.yaml in its
// repository, kept with its licence in rls/rlconfig/testdata/ratelimit),
// read as is through ratelimit.files, gives the answers ratelimit gives
// (docs/envoy-ratelimit.md §3.2–§3.5) to a sequence of hits made within
// one window: the same codes, limit_remaining and current_limit, one hit
// at a time. Within a window the two agree exactly: a bucket of N
// refilling N per unit, from full, admits the N hits a fixed window of N
// does. They differ over time (a bucket refills continuously where a
// window resets at its end: docs/rls.md), so the store's clock stands
// still here.
func TestRatelimitExampleAnswersAsRatelimit(t *testing.T) {
	dir := t.TempDir()
	example, err := os.ReadFile("rlconfig/testdata/ratelimit/examples/example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string][]byte{
		"tokengate.yaml": []byte("store: {type: memory}\ntokenizer: {fallback_encoding: o200k_base}\nratelimit:\n  files: [example.yaml]\n"),
		"example.yaml":   example,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), content, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := config.Load(filepath.Join(dir, "tokengate.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	pols, err := admission.FromConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	svc, err := rls.New(rls.Config{Store: buckets.NewMemory(buckets.MemoryOptions{Now: func() time.Time { return now }})})
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Load(rls.Mapping{Config: cfg, Policies: pols}); err != nil {
		t.Fatal(err)
	}
	call := func(domain string, ds ...*commonv3.RateLimitDescriptor) *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: domain, Descriptors: ds})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		if len(resp.GetStatuses()) != len(ds) {
			t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(ds))
		}
		return resp
	}
	const (
		minute = rlsv3.RateLimitResponse_RateLimit_MINUTE
		second = rlsv3.RateLimitResponse_RateLimit_SECOND
	)
	// status is what ratelimit answers for one descriptor: its code, its
	// remaining, its limit (perUnit < 0: none).
	type status struct {
		code      rlsv3.RateLimitResponse_Code
		remaining uint32
		perUnit   int
		unit      rlsv3.RateLimitResponse_RateLimit_Unit
	}
	check := func(what string, st *rlsv3.RateLimitResponse_DescriptorStatus, want status) {
		t.Helper()
		got := status{code: st.GetCode(), remaining: st.GetLimitRemaining(), perUnit: -1}
		if l := st.GetCurrentLimit(); l != nil {
			got.perUnit, got.unit = int(l.GetRequestsPerUnit()), l.GetUnit()
		}
		if got != want {
			t.Errorf("%s: %+v, want %+v (as ratelimit answers)", what, got, want)
		}
	}
	seq := func(what, domain string, d *commonv3.RateLimitDescriptor, want ...status) {
		t.Helper()
		for i, w := range want {
			check(what+" hit "+string(rune('1'+i)), call(domain, d).Statuses[0], w)
		}
	}

	seq("1 per minute", "rl", desc("source_cluster", "proxy", "destination_cluster", "mock"),
		status{ok, 0, 1, minute}, status{over, 0, 1, minute})
	seq("2 per minute, a counter per value", "rl", desc("foo", "a"),
		status{ok, 1, 2, minute}, status{ok, 0, 2, minute}, status{over, 0, 2, minute})
	seq("another value of the entry without value", "rl", desc("foo", "b"),
		status{ok, 1, 2, minute})
	seq("nested, 3 per minute", "rl", desc("foo", "a", "bar", "x"),
		status{ok, 2, 3, minute}, status{ok, 1, 3, minute}, status{ok, 0, 3, minute}, status{over, 0, 3, minute})
	seq("nested, another value", "rl", desc("foo", "a", "bar", "y"),
		status{ok, 2, 3, minute})
	// requests_per_unit 0: OVER_LIMIT. The one difference in the status:
	// ratelimit names the file's unit beside the 0, tokengate's deny has
	// none (docs/rls.md).
	seq("requests_per_unit 0", "rl", desc("foo", "a", "bar", "banned"),
		status{over, 0, 0, rlsv3.RateLimitResponse_RateLimit_UNKNOWN})
	seq("1 per second", "rl", desc("foo", "a", "baz", "q"),
		status{ok, 0, 1, second}, status{over, 0, 1, second})
	// Shadow mode: over the limit, answered OK with nothing remaining.
	seq("shadow mode", "rl", desc("foo", "a", "baz", "shady"),
		status{ok, 2, 3, minute}, status{ok, 1, 3, minute}, status{ok, 0, 3, minute}, status{ok, 0, 3, minute})
	if r := call("rl", desc("foo", "a", "baz", "shady")); r.GetOverallCode() != ok {
		t.Errorf("shadow mode over the limit: overall %v, want OK", r.GetOverallCode())
	}
	// unlimited: OK, nothing counted, no limit in the status.
	for range 5 {
		check("unlimited", call("rl", desc("qux", "anything")).Statuses[0], status{ok, 0xffffffff, -1, 0})
	}
	// A descriptor that lands on no limit, and a domain nobody configured.
	check("no limit", call("rl", desc("nothing", "here")).Statuses[0], status{ok, 0, -1, 0})
	check("unknown domain", call("no-such-domain", desc("foo", "a")).Statuses[0], status{ok, 0, -1, 0})

	// replaces: the limit named bkthomps (foo, bar=bkthomps: 1 per minute)
	// is replaced where a request also meets category=account's limit,
	// which replaces it: that descriptor is OK without a limit and not
	// counted; alone it is counted.
	for i := range 3 {
		r := call("rl", desc("category", "account"), desc("foo", "c", "bar", "bkthomps"))
		check("replacing limit", r.Statuses[0], status{ok, uint32(3 - i), 4, minute})
		check("replaced limit", r.Statuses[1], status{ok, 0, -1, 0})
	}
	seq("the replaced limit alone", "rl", desc("foo", "c", "bar", "bkthomps"),
		status{ok, 0, 1, minute}, status{over, 0, 1, minute})

	// quota mode (§3.5): a request over only some of its quota-mode limits
	// is OK; over all of them, OVER_LIMIT.
	// service_1's 1 per minute spent, then service_2's 2 per minute hit
	// twice with service_1 over: OK both times.
	call("rl", desc("service", "service_1"))
	for i := range 2 {
		if r := call("rl", desc("service", "service_1"), desc("service", "service_2")); r.GetOverallCode() != ok {
			t.Errorf("call %d: one of two quota-mode limits over: overall %v, want OK", i+1, r.GetOverallCode())
		}
	}
	if r := call("rl", desc("service", "service_1"), desc("service", "service_2")); r.GetOverallCode() != over {
		t.Errorf("both quota-mode limits over: overall %v, want OVER_LIMIT", r.GetOverallCode())
	}
}
