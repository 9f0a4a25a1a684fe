// Package peerbench holds the test that keeps the peer benchmark
// (run.sh and the driver module beside it, see README.md) from rotting: the
// driver builds and vets, and run.sh measures tokengate alone against a
// real redis-server, in a run of a few seconds.
package peerbench

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/internal/redistest"
)

// TestDriverBuildsAndVets: the driver is a module of its own, outside
// `go vet ./...` of tokengate's: vet and build it here.
func TestDriverBuildsAndVets(t *testing.T) {
	for _, args := range [][]string{{"vet", "."}, {"build", "-o", filepath.Join(t.TempDir(), "peerdriver"), "."}} {
		cmd := exec.Command(goTool(), args...)
		cmd.Dir = "driver"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s in driver/: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestRunMeasuresTokengateAlone runs run.sh as make bench-peer does, with
// only the tg system (no ratelimit binary needed), two concurrency levels
// and a few hundred requests each, and checks what it reports: a line per
// measurement, every request answered, Redis calls and CPU counted.
// TG_REDIS_EXTRA's line lands in store.redis, or validate would refuse it.
func TestRunMeasuresTokengateAlone(t *testing.T) {
	redisServer := redistest.Binary(t)
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skipf("run.sh needs curl: %v", err)
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	cmd := exec.Command("./run.sh")
	cmd.Env = append(os.Environ(), "SYSTEMS=tg", "N=300", "WARMUP=50", "CONC=1,4", "ROUNDS=1", "TG_REDIS_EXTRA=settle_window: 5ms",
		"OUT_DIR="+out, "TOKENGATE_SRC="+root, "REDIS_SERVER="+redisServer, "PATH="+filepath.Dir(goTool())+":"+os.Getenv("PATH"))
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("run.sh: %v\n%s", err, b)
	} else if !strings.Contains(string(b), "| tg | 4 |") {
		t.Errorf("run.sh printed no median row for tg at 4 callers:\n%s", b)
	}
	lines, err := filepath.Glob(filepath.Join(out, "run-*.jsonl"))
	if err != nil || len(lines) != 1 {
		t.Fatalf("results: %v, %v; want one .jsonl file", lines, err)
	}
	f, err := os.Open(lines[0])
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	type result struct {
		System     string  `json:"system"`
		Conc       int     `json:"conc"`
		N          int     `json:"n"`
		Errors     int64   `json:"errors"`
		RPS        float64 `json:"rps"`
		RedisUS    float64 `json:"redis_cpu_us_per_req"`
		RedisCalls float64 `json:"redis_calls_per_req"`
	}
	var got []result
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("result line %q: %v", sc.Text(), err)
		}
		got = append(got, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("%d measurements, want 2 (one per concurrency): %+v", len(got), got)
	}
	for _, r := range got {
		if r.System != "tg" || r.N != 300 || r.Errors != 0 || r.RPS <= 0 {
			t.Errorf("measurement %+v: want 300 tg requests, no errors", r)
		}
		// Every request reserves in Redis; at most its settlement rides
		// on another's call.
		if r.RedisCalls <= 0 || r.RedisCalls > 2 || r.RedisUS <= 0 {
			t.Errorf("measurement at %d callers: %.2f Redis calls and %.1f µs of Redis CPU per request", r.Conc, r.RedisCalls, r.RedisUS)
		}
	}
}

// goTool is the go command of the toolchain running the test.
func goTool() string { return filepath.Join(runtime.GOROOT(), "bin", "go") }
