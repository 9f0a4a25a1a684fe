package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
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
