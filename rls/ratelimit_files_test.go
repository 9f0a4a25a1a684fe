package rls_test

import (
	"os"
	"path/filepath"
	"testing"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/rls"
)

// TestRatelimitFilesServeAsRatelimit: envoyproxy/ratelimit's own file,
// read through ratelimit.files, answers as ratelimit does: 2 per minute per
// user, the third hit OVER_LIMIT, the status's current_limit the file's.
func TestRatelimitFilesServeAsRatelimit(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"tokengate.yaml": "store: {type: memory}\ntokenizer: {fallback_encoding: o200k_base}\nratelimit:\n  files: [ratelimit.yaml]\n",
		"ratelimit.yaml": "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
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
	svc, err := rls.New(rls.Config{Store: buckets.NewMemory(buckets.MemoryOptions{})})
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Load(rls.Mapping{Config: cfg, Policies: pols}); err != nil {
		t.Fatal(err)
	}
	r := &rig{svc: svc}
	for i, want := range []rlsv3.RateLimitResponse_Code{ok, ok, over} {
		st := r.call(t, desc("user", "ann")).Statuses[0]
		if st.GetCode() != want || st.GetCurrentLimit().GetRequestsPerUnit() != 2 || st.GetCurrentLimit().GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE {
			t.Errorf("hit %d: %v, want %v of 2 per minute", i+1, st, want)
		}
	}
	if st := r.call(t, desc("user", "bob")).Statuses[0]; st.GetCode() != ok || st.GetLimitRemaining() != 1 {
		t.Errorf("another user: %v, want a counter of its own", st)
	}
}
