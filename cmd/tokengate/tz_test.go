package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The binary carries the IANA time zone database (time/tzdata), so quota
// windows in any zone load on hosts and images without one.
func TestZoneDatabaseEmbedded(t *testing.T) {
	out, err := exec.Command("go", "tool", "nm", tokengateBinary(t)).CombinedOutput()
	if err != nil {
		t.Fatalf("go tool nm: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "time/tzdata.loadFromEmbeddedTZData") {
		t.Error("the tokengate binary does not embed time/tzdata")
	}
}
