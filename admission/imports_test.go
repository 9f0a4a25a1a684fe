package admission_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestImportGraph holds the fronts apart: the admission core imports
// neither front, and neither front imports the other. A front is its
// package and the packages under it, but for rls/rlconfig and rls/rlxds,
// which read envoyproxy/ratelimit's configuration for package config.
func TestImportGraph(t *testing.T) {
	const mod = "github.com/tokengate/tokengate/"
	forbidden := map[string][]string{
		"admission": {"extproc", "rls"},
		"extproc":   {"rls"},
		"rls":       {"extproc"},
	}
	for pkg, not := range forbidden {
		out, err := exec.Command("go", "list", "-deps", "-test", "-e", "-f", "{{.ImportPath}}", "../"+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		deps := strings.Fields(string(out))
		if !slices.Contains(deps, mod+pkg) {
			t.Fatalf("go list %s does not list the package itself:\n%s", pkg, out)
		}
		for _, d := range deps {
			for _, n := range not {
				if d == mod+n || n == "extproc" && strings.HasPrefix(d, mod+n+"/") {
					t.Errorf("%s imports %s", pkg, d)
				}
			}
		}
	}
}
