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

// ratelimitFile writes a tokengate configuration that reads one
// envoyproxy/ratelimit file, of ratelimitYAML, through ratelimit.files,
// and returns the configuration's path.
func ratelimitFile(t *testing.T, ratelimitYAML string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range map[string]string{
		"tokengate.yaml": "store: {type: memory}\ntokenizer: {fallback_encoding: o200k_base}\nratelimit:\n  files: [ratelimit.yaml]\n",
		"ratelimit.yaml": ratelimitYAML,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(dir, "tokengate.yaml")
}

// ratelimitRig is a service on the memory store serving one
// envoyproxy/ratelimit file, of ratelimitYAML, read through
// ratelimit.files.
func ratelimitRig(t *testing.T, ratelimitYAML string) *rig {
	t.Helper()
	cfg, err := config.Load(ratelimitFile(t, ratelimitYAML))
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
	return &rig{svc: svc, cfg: cfg}
}

// TestRatelimitFilesServeAsRatelimit: envoyproxy/ratelimit's own file,
// read through ratelimit.files, answers as ratelimit does: 2 per minute per
// user, the third hit OVER_LIMIT, the status's current_limit the file's.
func TestRatelimitFilesServeAsRatelimit(t *testing.T) {
	r := ratelimitRig(t, "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n")
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

// TestZeroLimitCountsNothing: a rule of requests_per_unit 0 becomes a
// deny, which counts nothing: every hit is OVER_LIMIT, and a check
// (hits_addend 0) is OK before hits and after them alike. ratelimit
// counts the hits of such a rule in its window (§3.4: "still counted"),
// so a check after a hit in the same window is OVER_LIMIT there; the
// deny keeps no window (docs/rls.md, "Deny").
func TestZeroLimitCountsNothing(t *testing.T) {
	r := ratelimitRig(t, "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 0}\n  - key: other\n    rate_limit: {unit: minute, requests_per_unit: 5}\n")
	if got := r.call(t, hits(desc("user", "ann"), 0)); got.GetOverallCode() != ok {
		t.Errorf("a check before any hit: %v, want OK", got)
	}
	if got := r.call(t, hits(desc("user", "ann"), 3)); got.GetOverallCode() != over {
		t.Errorf("3 hits on a limit of 0: %v, want OVER_LIMIT", got)
	}
	if got := r.call(t, hits(desc("user", "ann"), 0)); got.GetOverallCode() != ok {
		t.Errorf("a check after 3 hits on a limit of 0: %v, want OK (a deny counts nothing)", got)
	}
	if got := r.call(t, desc("user", "ann")); got.GetOverallCode() != over {
		t.Errorf("a hit after the check: %v, want OVER_LIMIT", got)
	}
}

// TestRatelimitFileWithCollectionKeyIsAnError: a ratelimit file whose
// metadata has a mapping as a key is a configuration error, as ratelimit's
// yaml.v2 refuses it ("invalid map key"); config.Load, which serve runs at
// start and on every reload of ratelimit.files, returns it as an error so
// that a reload keeps the configuration in force (docs/rls.md "Reading
// ratelimit's files as they are").
func TestRatelimitFileWithCollectionKeyIsAnError(t *testing.T) {
	path := ratelimitFile(t, "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n    metadata: {[tier]: gold}\n")
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("config.Load panicked on a bad ratelimit file: %v; want an error", p)
		}
	}()
	if _, err := config.Load(path); err == nil {
		t.Error("config.Load accepted metadata with a list as a key; ratelimit refuses it")
	}
}
