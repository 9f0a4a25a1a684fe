package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/config"
)

const ratelimitExamples = "../../rls/rlconfig/testdata/ratelimit"

// `tokengate import ratelimit` prints a configuration that validate
// accepts, for a file and for a directory of them, as ratelimit's runtime
// directory is read.
func TestImportRatelimitPrintsAValidConfiguration(t *testing.T) {
	for _, args := range [][]string{
		{"import", "ratelimit", filepath.Join(ratelimitExamples, "examples/example.yaml")},
		{"import", "ratelimit", filepath.Join(ratelimitExamples, "examples")},
		{"import", "--merge-domains", "ratelimit", filepath.Join(ratelimitExamples, "merge_domain_key1.yaml"), filepath.Join(ratelimitExamples, "merge_domain_key2.yaml")},
	} {
		out, errOut, err := runCLI(args...)
		if err != nil || errOut != "" {
			t.Fatalf("%q: %v\n%s", args, err, errOut)
		}
		c, err := config.Parse("imported.yaml", []byte(out))
		if err != nil {
			t.Fatalf("%q printed a configuration Parse refuses: %v\n%s", args, err, out)
		}
		if c.RLS == nil || len(c.RLS.Domains) == 0 {
			t.Errorf("%q printed no rls domains:\n%s", args, out)
		}
		file := filepath.Join(t.TempDir(), "imported.yaml")
		if err := os.WriteFile(file, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		if vout, verr, err := runCLI("validate", file); err != nil {
			t.Errorf("validate of %q's output: %v\n%s%s", args, err, vout, verr)
		}
	}
	out, _, err := runCLI("import", "ratelimit", filepath.Join(ratelimitExamples, "examples"))
	if err != nil {
		t.Fatal(err)
	}
	for _, domain := range []string{"domain: rl\n", "domain: mongo_cps\n"} {
		if !strings.Contains(out, domain) {
			t.Errorf("the directory's import lacks %q:\n%s", domain, out)
		}
	}
}

// A file ratelimit refuses prints ratelimit's problems, one per line with
// file, line and field, and exits 1; keys ratelimit ignores print as
// warnings and the import goes on; mistakes in the command line exit 2.
func TestImportRatelimitReportsProblems(t *testing.T) {
	bad := filepath.Join(ratelimitExamples, "bad_limit_unit.yaml")
	out, errOut, err := runCLI("import", "ratelimit", bad)
	if !errors.Is(err, errReported) || out != "" {
		t.Errorf("bad unit: err %v, stdout %q", err, out)
	}
	if want := bad + ":3: descriptors[0].rate_limit.unit: invalid rate limit unit 'foo'\n"; errOut != want {
		t.Errorf("stderr %q, want %q", errOut, want)
	}

	dir := t.TempDir()
	odd := filepath.Join(dir, "odd.yaml")
	if err := os.WriteFile(odd, []byte("domain: d\ndescriptors:\n  - key: k\n    unit: minute\n    rate_limit: {unit: minute, requests_per_unit: 5}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, err = runCLI("import", "ratelimit", odd)
	if err != nil || !strings.Contains(out, "rls:") {
		t.Errorf("ignored key: err %v, stdout %q", err, out)
	}
	if want := odd + `:4: descriptors[0].unit: warning: ratelimit ignores "unit" here (it reads key, value, rate_limit, descriptors, shadow_mode, quota_mode, detailed_metric, value_to_metric, share_threshold, metadata)` + "\n"; errOut != want {
		t.Errorf("stderr %q, want %q", errOut, want)
	}

	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"import"}, "import: want a source (ratelimit) and at least one FILE"},
		{[]string{"import", "nginx", "x.conf"}, `import: unknown source "nginx"`},
		{[]string{"import", "ratelimit"}, "import ratelimit: needs at least one FILE or directory"},
	} {
		_, _, err := runCLI(tt.args...)
		var u usageError
		if !errors.As(err, &u) || !strings.Contains(u.msg, tt.want) {
			t.Errorf("%q: %v, want a usage error %q", tt.args, err, tt.want)
		}
	}
}
