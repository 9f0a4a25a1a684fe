package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// configMap lays out a directory as Kubernetes mounts a ConfigMap: each
// key a link to ..data/key, ..data a link to a timestamped directory
// holding the files. update swaps ..data to a new directory atomically (a
// rename of a new link), as the kubelet does when the ConfigMap changes.
type configMap struct {
	t   *testing.T
	dir string
	gen int
}

func newConfigMap(t *testing.T, dir string, files map[string]string) *configMap {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	c := &configMap{t: t, dir: dir}
	c.update(files)
	return c
}

func (c *configMap) update(files map[string]string) {
	c.t.Helper()
	c.gen++
	ts := fmt.Sprintf("..2026_12_03_00_00_%02d.%d", c.gen, c.gen)
	if err := os.Mkdir(filepath.Join(c.dir, ts), 0o755); err != nil {
		c.t.Fatal(err)
	}
	for name, content := range files {
		writeFile(c.t, filepath.Join(c.dir, ts, name), content)
	}
	tmp := filepath.Join(c.dir, "..data_tmp")
	if err := os.Symlink(ts, tmp); err != nil {
		c.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(c.dir, "..data")); err != nil {
		c.t.Fatal(err)
	}
	entries, err := os.ReadDir(c.dir)
	if err != nil {
		c.t.Fatal(err)
	}
	for _, e := range entries { // the keys: links into ..data, the old ones gone
		if name := e.Name(); name[0] != '.' {
			if _, ok := files[name]; !ok {
				if err := os.Remove(filepath.Join(c.dir, name)); err != nil {
					c.t.Fatal(err)
				}
			}
		}
	}
	for name := range files {
		link := filepath.Join(c.dir, name)
		if _, err := os.Lstat(link); err == nil {
			continue
		}
		if err := os.Symlink(filepath.Join("..data", name), link); err != nil {
			c.t.Fatal(err)
		}
	}
}

// remoteAddressCaller calls ShouldRateLimit on the served tokengate at addr with one
// descriptor remote_address=ip of domain.
func remoteAddressCaller(t *testing.T, addr string) func(domain, ip string) rlsv3.RateLimitResponse_Code {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	rl := rlsv3.NewRateLimitServiceClient(conn)
	return func(domain, ip string) rlsv3.RateLimitResponse_Code {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "remote_address", Value: ip}},
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit %s: %v", domain, err)
		}
		return resp.GetOverallCode()
	}
}

// limited reports whether a fresh address of domain is OVER_LIMIT at its
// n+1-th call after n calls that are OK: a limit of n per minute applies.
func limited(call func(domain, ip string) rlsv3.RateLimitResponse_Code, domain, ip string, n int) error {
	for i := range n {
		if got := call(domain, ip); got != rlsv3.RateLimitResponse_OK {
			return fmt.Errorf("%s call %d for %s: %v, want OK", domain, i+1, ip, got)
		}
	}
	if got := call(domain, ip); got != rlsv3.RateLimitResponse_OVER_LIMIT {
		return fmt.Errorf("%s call %d for %s: %v, want OVER_LIMIT", domain, n+1, ip, got)
	}
	return nil
}

const rlFile = "domain: %s\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: %d}\n"

// ratelimit reloads its files when they change, without a signal: a
// ConfigMap's update, a key added and a key removed. tokengate ratelimit
// does too (RUNTIME_WATCH_ROOT's default, and without it), within a
// second: it polls the files' stamps and lists the directory again.
func TestRatelimitReloadsAConfigMapUpdate(t *testing.T) {
	for _, watchRoot := range []string{"true", "false"} {
		t.Run("RUNTIME_WATCH_ROOT="+watchRoot, func(t *testing.T) {
			bin := tokengateBinary(t)
			root := t.TempDir()
			cm := newConfigMap(t, filepath.Join(root, "ratelimit", "config"), map[string]string{"rl.yaml": fmt.Sprintf(rlFile, "rl", 1)})
			p := startRatelimit(t, bin, []string{
				"RUNTIME_ROOT=" + root, "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_IGNOREDOTFILES=true", "RUNTIME_WATCH_ROOT=" + watchRoot,
				"USE_STATSD=false", "LOG_LEVEL=info", "GRPC_HOST=127.0.0.1", "GRPC_PORT=0", "HOST=127.0.0.1", "PORT=0",
			})
			call := remoteAddressCaller(t, p.grpc)
			if err := limited(call, "rl", "10.0.0.1", 1); err != nil {
				t.Fatal(err)
			}
			if got := call("rl2", "10.0.0.1"); got != rlsv3.RateLimitResponse_OK {
				t.Fatalf("unknown domain rl2: %v, want OK", got)
			}

			// An update: rl's limit is 3 now, and a key rl2.yaml is added.
			cm.update(map[string]string{"rl.yaml": fmt.Sprintf(rlFile, "rl", 3), "rl2.yaml": fmt.Sprintf(rlFile, "rl2", 1)})
			ip := 0
			poll(t, func() error {
				ip++ // a fresh address each try: its counts start at nothing
				if err := limited(call, "rl2", fmt.Sprintf("10.1.0.%d", ip), 1); err != nil {
					return err
				}
				return limited(call, "rl", fmt.Sprintf("10.2.0.%d", ip), 3)
			})

			// rl2.yaml removed: its domain is unknown again, every call OK.
			cm.update(map[string]string{"rl.yaml": fmt.Sprintf(rlFile, "rl", 3)})
			poll(t, func() error {
				ip++
				for i := range 3 {
					if got := call("rl2", fmt.Sprintf("10.3.0.%d", ip)); got != rlsv3.RateLimitResponse_OK {
						return fmt.Errorf("rl2 after its file went, call %d: %v", i+1, got)
					}
				}
				return nil
			})
			if n := countLines(p.stderr.String(), `"msg":"configuration reloaded: new requests follow it"`); n < 2 {
				t.Errorf("%d reloads logged, want one per update:\n%s", n, lastLines(p.stderr.String(), 10))
			}
		})
	}
}

// serve reloads the ratelimit files its configuration names
// (ratelimit.files) when they change, as it reloads its own file.
func TestServeReloadsItsRatelimitFiles(t *testing.T) {
	bin := tokengateBinary(t)
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "rl.yaml"), fmt.Sprintf(rlFile, "rl", 1))
	file := filepath.Join(dir, "tokengate.yaml")
	writeFile(t, file, "store: {type: memory}\nratelimit: {files: [rl.yaml]}\n")
	p := startServe(t, bin, nil, "--config", file)
	call := remoteAddressCaller(t, p.grpc)
	if err := limited(call, "rl", "10.0.0.1", 1); err != nil {
		t.Fatal(err)
	}
	// ratelimit's POST /json is tokengate ratelimit's; serve has it off
	// unless rls.json_endpoint is set.
	resp, err := http.Post(p.admin+"/json", "application/json", strings.NewReader(`{"domain": "rl"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("POST /json without rls.json_endpoint: %s, want 404", resp.Status)
	}
	ip := 0
	for _, limit := range []int{4, 2} { // the second change comes after a reload of the first
		writeFile(t, filepath.Join(dir, "rl.yaml"), fmt.Sprintf(rlFile, "rl", limit))
		poll(t, func() error {
			ip++
			return limited(call, "rl", fmt.Sprintf("10.1.%d.%d", limit, ip), limit)
		})
	}
	p.stop(t)
}

// countLines counts the lines of s that contain substr.
func countLines(s, substr string) int {
	n := 0
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, substr) {
			n++
		}
	}
	return n
}
