package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// writeFiles writes name → content into a fresh directory and returns it.
func writeFiles(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

const ratelimitFile = `
domain: ai-gateway
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
`

// ratelimit.files are read at load: each domain becomes a policy and an
// rls domain, beside the file's own.
func TestRatelimitFilesAreImported(t *testing.T) {
	dir := writeFiles(t, map[string]string{
		"tokengate.yaml": "store: {type: memory}\nratelimit:\n  files: [rl.yaml]\n",
		"rl.yaml":        ratelimitFile,
	})
	c, err := Load(filepath.Join(dir, "tokengate.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Policies) != 1 || c.Policies[0].Name != "ai-gateway" || c.DefaultPolicy != "ai-gateway" {
		t.Fatalf("policies %+v, default %q", c.Policies, c.DefaultPolicy)
	}
	m, known, ok := c.MatchRLS("ai-gateway", &commonv3.RateLimitDescriptor{Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: "ann"}}})
	if !known || !ok || m.Descriptor().Policy != "ai-gateway" {
		t.Fatalf("match %+v known %v ok %v", m, known, ok)
	}
	if v, ok := m.Identity("user"); !ok || v != "ann" {
		t.Errorf("identity %q %v", v, ok)
	}
}

// A ratelimit file that does not load is a problem of the tokengate file,
// at its entry.
func TestRatelimitFileProblems(t *testing.T) {
	for name, tt := range map[string]struct {
		files map[string]string
		want  string
	}{
		"missing":  {map[string]string{"tokengate.yaml": "ratelimit: {files: [nope.yaml]}\n"}, "ratelimit.files[0]"},
		"bad unit": {map[string]string{"tokengate.yaml": "ratelimit: {files: [rl.yaml]}\n", "rl.yaml": strings.Replace(ratelimitFile, "minute", "fortnight", 1)}, "ratelimit.files"},
		"none":     {map[string]string{"tokengate.yaml": "ratelimit: {files: []}\n"}, "names no file"},
	} {
		t.Run(name, func(t *testing.T) {
			dir := writeFiles(t, tt.files)
			_, err := Load(filepath.Join(dir, "tokengate.yaml"))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one naming %s", err, tt.want)
			}
		})
	}
}

// ratelimit.xds is checked with the file: an address, plaintext only when
// insecure says so, a client certificate with its key, TLS files that can
// be read, node metadata a mapping.
func TestRatelimitXDSProblems(t *testing.T) {
	for name, tt := range map[string]struct {
		xds, want string
	}{
		"no address":      {"{node_id: n, insecure: true}", "ratelimit.xds.address: is required"},
		"bad address":     {"{address: envoy-gateway, insecure: true}", `ratelimit.xds.address: "envoy-gateway" is not host:port`},
		"cert alone":      {"{address: 'envoy-gateway:18001', cert_file: tls.crt}", "ratelimit.xds: cert_file and key_file go together"},
		"unreadable ca":   {"{address: 'envoy-gateway:18001', ca_file: nope.crt}", "ratelimit.xds.ca_file: open"},
		"insecure and ca": {"{address: ':18002', insecure: true, ca_file: tls.crt}", "ratelimit.xds.insecure: contradicts ratelimit.xds.ca_file"},
		"metadata list":   {"{address: ':18002', insecure: true, node_metadata: [a]}", "ratelimit.xds.node_metadata"},
		"negative size":   {"{address: ':18002', insecure: true, max_message_bytes: -1}", "ratelimit.xds.max_message_bytes: is -1"},
	} {
		t.Run(name, func(t *testing.T) {
			dir := writeFiles(t, map[string]string{"tokengate.yaml": "ratelimit:\n  xds: " + tt.xds + "\n", "tls.crt": "x"})
			_, err := Load(filepath.Join(dir, "tokengate.yaml"))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one saying %s", err, tt.want)
			}
		})
	}
}

// With ratelimit.xds the file stands before the first snapshot with no
// policy; WithRatelimitXDS imports a snapshot beside ratelimit.files,
// replacing the previous one; a snapshot clashing with the files' domain
// is refused; and a change of ratelimit.xds needs a restart.
func TestWithRatelimitXDS(t *testing.T) {
	dir := writeFiles(t, map[string]string{
		"tokengate.yaml": "store: {type: memory}\nratelimit:\n  xds: {address: ':18002', node_id: envoy-ai-gateway-ratelimit, node_metadata: {zone: a}, insecure: true}\n",
	})
	c, err := Load(filepath.Join(dir, "tokengate.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Policies) != 0 || c.RLS != nil || c.Ratelimit.XDS.NodeMetadata["zone"] != "a" {
		t.Fatalf("before a snapshot: policies %+v, rls %+v, xds %+v", c.Policies, c.RLS, c.Ratelimit.XDS)
	}
	snap := func(domain string, rpu int) []*rlconfig.File {
		f, err := rlconfig.Parse("xds", []byte(fmt.Sprintf("domain: %s\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: %d}\n", domain, rpu)))
		if err != nil {
			t.Fatal(err)
		}
		return []*rlconfig.File{f}
	}
	n, err := c.WithRatelimitXDS(snap("ai", 5))
	if err != nil {
		t.Fatal(err)
	}
	if len(n.Policies) != 1 || n.Policies[0].Name != "ai" || n.DefaultPolicy != "ai" || len(n.RLS.Domains) != 1 {
		t.Fatalf("policies %+v, default %q, rls %+v", n.Policies, n.DefaultPolicy, n.RLS)
	}
	n2, err := n.WithRatelimitXDS(snap("other", 5))
	if err != nil {
		t.Fatal(err)
	}
	if len(n2.Policies) != 1 || n2.Policies[0].Name != "other" {
		t.Errorf("the next snapshot keeps the previous one's: %+v", n2.Policies)
	}
	if keys := c.NeedsRestart(n2); len(keys) != 0 {
		t.Errorf("a snapshot needs a restart of %v", keys)
	}

	dir = writeFiles(t, map[string]string{
		"tokengate.yaml": "ratelimit:\n  files: [rl.yaml]\n  xds: {address: ':18002', insecure: true}\n",
		"rl.yaml":        ratelimitFile,
	})
	c, err = Load(filepath.Join(dir, "tokengate.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.WithRatelimitXDS(snap("ai-gateway", 5)); err == nil || !strings.Contains(err.Error(), "ratelimit.xds") {
		t.Errorf("a snapshot of the files' domain: %v, want a problem at ratelimit.xds", err)
	}
	moved, err := Parse(filepath.Join(dir, "tokengate.yaml"), []byte("ratelimit:\n  files: [rl.yaml]\n  xds: {address: ':18003', insecure: true}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if keys := c.NeedsRestart(moved); fmt.Sprint(keys) != "[ratelimit.xds]" {
		t.Errorf("a new management server needs a restart of %v, want [ratelimit.xds]", keys)
	}
}
