package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The repository stands on its own: a git clone of it, in an empty
// directory with nothing beside it, refers to no path outside itself, and
// builds and vets there (go vet compiles every package's tests too).
// Running the whole suite inside the clone would double `make test`; the
// static check finds what a test could read from outside (a relative path
// in Go source, a link in Markdown, a path in any tracked file), and the
// build proves the module needs nothing beside it. The binary built there
// also reports the clone's commit (tokengate version).
func TestRepositoryStandsAlone(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: cloning and vetting the repository takes a minute")
	}
	if _, err := exec.LookPath("git"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("git is not installed: %v", err)
		}
		t.Skipf("git is not installed: %v", err)
	}
	top, err := exec.Command("git", "-C", repoRoot, "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Skipf("not a git checkout (%v): nothing to clone", err)
	}
	clone := filepath.Join(t.TempDir(), "tokengate")
	git(t, "", "clone", "--quiet", "--no-hardlinks", strings.TrimSpace(string(top)), clone)

	files := strings.Split(strings.TrimSpace(git(t, clone, "ls-files")), "\n")
	if len(files) < 100 {
		t.Fatalf("the clone holds %d files", len(files))
	}
	outside := regexp.MustCompile(`\.\./shared\b|/work/(shared|main|wt)\b|shared/(testdata|bench|docs|SPEC)`)
	goPath := regexp.MustCompile(`"(\.\.(?:/[^"]*)?)"`)
	mdLink := regexp.MustCompile(`\]\(([^)\s#]+)`)
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(clone, f))
		if err != nil {
			t.Fatal(err)
		}
		if bytes.IndexByte(data, 0) >= 0 {
			continue // binary
		}
		for i, line := range strings.Split(string(data), "\n") {
			if m := outside.FindString(line); m != "" {
				t.Errorf("%s:%d names %q, outside the repository", f, i+1, m)
			}
			var paths []string
			switch {
			case strings.HasSuffix(f, ".go"):
				for _, m := range goPath.FindAllStringSubmatch(line, -1) {
					paths = append(paths, m[1])
				}
			case strings.HasSuffix(f, ".md"):
				for _, m := range mdLink.FindAllStringSubmatch(line, -1) {
					if !strings.Contains(m[1], "://") && !strings.HasPrefix(m[1], "mailto:") {
						paths = append(paths, m[1])
					}
				}
			}
			for _, p := range paths {
				target := filepath.Join(clone, filepath.Dir(f), p)
				if rel, err := filepath.Rel(clone, target); err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
					t.Errorf("%s:%d: %q leads outside the repository", f, i+1, p)
				}
			}
		}
	}
	mod, err := os.ReadFile(filepath.Join(clone, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	if regexp.MustCompile(`(?m)^\s*replace\b`).Match(mod) {
		t.Error("go.mod has a replace directive")
	}

	goCmd(t, clone, "vet", "./...")
	bin := filepath.Join(t.TempDir(), "tokengate")
	goCmd(t, clone, "build", "-buildvcs=true", "-o", bin, "./cmd/tokengate")
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("tokengate version: %v: %s", err, out)
	}
	head := strings.TrimSpace(git(t, clone, "rev-parse", "HEAD"))
	if !strings.Contains(string(out), "commit "+head) {
		t.Errorf("tokengate version printed %q, want the clone's commit %s", out, head)
	}
}

func git(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func goCmd(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s in the clone: %v\n%s", strings.Join(args, " "), err, out)
	}
}
