package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/internal/redistest"
)

// The tests in this file run the real binary, as a user does: TestMain
// provides a directory, and the first test that needs the binary builds
// `tokengate` into it, once.
var binary struct {
	dir  string
	once sync.Once
	path string
	err  error
}

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tokengate-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "cmd/tokengate tests:", err)
		os.Exit(1)
	}
	binary.dir = dir
	code := m.Run()
	if err := os.RemoveAll(dir); err != nil {
		fmt.Fprintln(os.Stderr, "cmd/tokengate tests:", err)
		code = 1
	}
	os.Exit(code)
}

// tokengateBinary returns the path of the built binary.
func tokengateBinary(t *testing.T) string {
	t.Helper()
	binary.once.Do(func() {
		binary.path = filepath.Join(binary.dir, "tokengate")
		out, err := exec.Command("go", "build", "-o", binary.path, ".").CombinedOutput()
		if err != nil {
			binary.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binary.err != nil {
		t.Fatal(binary.err)
	}
	return binary.path
}

// repoRoot is the repository root, seen from this package's directory.
const repoRoot = "../.."

// A tokengate configuration that ships with the repository.
type shippedConfig struct {
	file  string // relative to the repository root; "" runs serve without --config
	redis string // "", "standalone" or "cluster": the Redis the test starts for it
	// rewrite says what of the file the test changes, and why; the rest is
	// used as shipped. Listener addresses are never rewritten: --grpc and
	// --admin move them to free ports.
	rewrite string
}

var shippedConfigs = []shippedConfig{
	{file: ""},
	{file: "config/default.yaml"},
	{file: "cmd/tokengate/demo.yaml"},
	{file: "examples/configs/interactive-and-batch.yaml"},
	{file: "examples/configs/provider-safety.yaml"},
	{file: "examples/configs/multi-tenant.yaml", redis: "cluster",
		rewrite: "store.redis.addrs → the test's Redis Cluster, which speaks plain TCP, so store.redis.tls is removed; the password is set on the test's Redis and passed in TOKENGATE_REDIS_PASSWORD"},
	{file: "examples/rls/tokengate.yaml"},
	{file: "examples/compose/tokengate.yaml", redis: "standalone",
		rewrite: "store.redis.addrs → the test's Redis (the compose service name redis does not resolve here)"},
}

// Every tokengate configuration under config/, cmd/ and examples/ is in
// shippedConfigs, so none can be added without being run.
func TestEveryShippedConfigIsRun(t *testing.T) {
	var found []string
	for _, pattern := range []string{"config/*.yaml", "cmd/tokengate/*.yaml", "examples/*/*.yaml"} {
		m, err := filepath.Glob(filepath.Join(repoRoot, pattern))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range m {
			rel, err := filepath.Rel(repoRoot, f)
			if err != nil {
				t.Fatal(err)
			}
			if _, other := shippedOtherFiles[rel]; !isEnvoyFile(rel) && !other {
				found = append(found, rel)
			}
		}
	}
	for _, f := range found {
		if !slices.ContainsFunc(shippedConfigs, func(c shippedConfig) bool { return c.file == f }) {
			t.Errorf("%s ships but is not in shippedConfigs", f)
		}
	}
}

func isEnvoyFile(rel string) bool {
	return slices.ContainsFunc(shippedEnvoyFiles, func(f shippedEnvoyFile) bool { return f.file == rel })
}

// TestShippedConfigsServe starts `tokengate serve` (the built binary, a
// subprocess) on each shipped configuration, sends every policy an admitted
// request and a refused one through the Envoy stand-in to the mock LLM, and
// checks status, headers and body; then it stops the process with SIGTERM
// and requires a clean exit with every log line JSON.
func TestShippedConfigsServe(t *testing.T) {
	bin := tokengateBinary(t)
	for _, sc := range shippedConfigs {
		name := sc.file
		if name == "" {
			name = "embedded defaults"
		}
		t.Run(name, func(t *testing.T) {
			args, env := []string{}, []string{}
			cfgFile := "../../config/default.yaml" // what serve runs on without --config
			if sc.file != "" {
				cfgFile = filepath.Join(repoRoot, sc.file)
				switch sc.redis {
				case "standalone":
					cfgFile = rewriteRedis(t, cfgFile, []string{redistest.Start(t).Addr}, "")
				case "cluster":
					c := redistest.StartCluster(t)
					const password = "shipped-config-test"
					for _, addr := range c.Addrs {
						if _, err := redistest.Do(addr, "CONFIG", "SET", "requirepass", password); err != nil {
							t.Fatal(err)
						}
					}
					env = append(env, "TOKENGATE_REDIS_PASSWORD="+password)
					cfgFile = rewriteRedis(t, cfgFile, c.Addrs, "tls")
				}
				args = append(args, "--config", cfgFile)
			}
			cfg, err := config.Load(cfgFile)
			if err != nil {
				t.Fatal(err)
			}
			p := startServe(t, bin, env, args...)
			if out, err := exec.Command(bin, "health", "--url", p.admin+"/readyz").CombinedOutput(); err != nil {
				t.Errorf("tokengate health: %v: %s", err, out)
			}
			front := standInFor(t, p.grpc, cfg)
			for _, pol := range cfg.Policies {
				t.Run(pol.Name, func(t *testing.T) {
					checkAdmitted(t, front, pol)
					checkNeverAdmissible(t, front, pol)
				})
			}
			if sc.file == "examples/compose/tokengate.yaml" {
				checkComposeWalkthrough(t, front)
			}
			if sc.redis != "" {
				// The answers above came from Redis, not from a fail-open
				// fallback.
				m, err := getBody(p.admin + "/metrics")
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(m, "\ntokengate_store_up 1\n") || strings.Contains(m, "tokengate_store_fallback_total{") {
					t.Errorf("the Redis store was not used throughout:\n%s", grepLines(m, "tokengate_store_"))
				}
			}
			p.stop(t)
		})
	}
}

// rewriteRedis writes a copy of file whose store.redis.addrs are addrs and
// from whose store.redis the key drop (if any) is removed.
func rewriteRedis(t *testing.T, file string, addrs []string, drop string) string {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	redis := mappingValue(mappingValue(doc.Content[0], "store"), "redis")
	if redis == nil {
		t.Fatalf("%s has no store.redis", file)
	}
	for i := 0; i+1 < len(redis.Content); i += 2 {
		switch redis.Content[i].Value {
		case "addrs":
			seq := &yaml.Node{Kind: yaml.SequenceNode}
			for _, a := range addrs {
				seq.Content = append(seq.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: a})
			}
			redis.Content[i+1] = seq
		case drop:
			redis.Content = slices.Delete(redis.Content, i, i+2)
			i -= 2
		}
	}
	out, err := yaml.Marshal(&doc)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), filepath.Base(file))
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func mappingValue(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

// served is one `tokengate serve` subprocess.
type served struct {
	cmd         *exec.Cmd
	grpc, admin string // the admin listener as a URL
	stderr      *syncBuffer
	done        chan error
}

// startServe starts `tokengate serve` on free ports and waits until it
// logs that it listens.
func startServe(t *testing.T, bin string, env []string, args ...string) *served {
	t.Helper()
	p := &served{stderr: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(bin, append([]string{"serve", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"}, args...)...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			if err := p.cmd.Process.Kill(); err != nil {
				t.Errorf("kill tokengate: %v", err)
			}
			<-p.done
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, line := range strings.Split(p.stderr.String(), "\n") {
			var l struct{ Msg, GRPC, Admin string }
			if strings.Contains(line, `"msg":"listening"`) {
				if err := json.Unmarshal([]byte(line), &l); err != nil {
					t.Fatal(err)
				}
				p.grpc, p.admin = l.GRPC, "http://"+l.Admin
				return p
			}
		}
		select {
		case err := <-p.done:
			p.done <- err
			t.Fatalf("tokengate serve exited before listening: %v\n%s", err, p.stderr.String())
		case <-time.After(20 * time.Millisecond): // polling its log, with the deadline below
		}
		if time.Now().After(deadline) {
			t.Fatalf("tokengate serve did not listen within 30s:\n%s", p.stderr.String())
		}
	}
}

// stop sends SIGTERM and requires exit status 0, a "stopped" line and
// nothing but JSON on stderr.
func (p *served) stop(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("tokengate serve after SIGTERM: %v\n%s", err, p.stderr.String())
		}
	case <-time.After(40 * time.Second):
		t.Fatalf("tokengate serve did not stop within 40s of SIGTERM:\n%s", p.stderr.String())
	}
	logs := strings.TrimSpace(p.stderr.String())
	for _, line := range strings.Split(logs, "\n") {
		if !json.Valid([]byte(line)) {
			t.Errorf("log line is not JSON: %q", line)
		}
	}
	if !strings.Contains(logs, `"msg":"stopped"`) {
		t.Errorf("no \"stopped\" line:\n%s", logs)
	}
}

// standInFor puts the Envoy stand-in in front of the mock LLM, its side
// stream going to tokengate at grpcAddr. The route names the policy from
// the test's x-test-policy header, as ExtProcPerRoute would per route, and
// forwards JWT-style claims as dynamic metadata for policies that read
// identities from there.
func standInFor(t *testing.T, grpcAddr string, cfg *config.Config) string {
	t.Helper()
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := conn.Close(); err != nil {
			t.Error(err)
		}
	})
	up, err := url.Parse(httptestServer(t, mockllm.New(mockllm.Config{})))
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := standin.New(standin.Config{
		ExtProc:             conn,
		Upstream:            up,
		MessageTimeout:      10 * time.Second,
		RequestBufferLimit:  8 << 20,
		ReceivingNamespaces: []string{cfg.Namespace},
		Routes:              []standin.Route{{Prefix: "/", InitialMetadata: map[string]string{cfg.PolicyMetadataKey: "%REQ(x-test-policy)%"}}},
		Metadata:            func(r *http.Request) *corev3.Metadata { return claims(cfg, r.Header.Get("x-test-policy")) },
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	return httptestServer(t, proxy.Handler())
}

// claims is the dynamic metadata an auth filter would set for the metadata
// identities of the policy: each identity's dotted path holds "id-NAME".
func claims(cfg *config.Config, policy string) *corev3.Metadata {
	pol, ok := cfg.Policy(policy)
	if !ok {
		return nil
	}
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{}}
	for _, id := range pol.Identities {
		if id.Metadata == "" {
			continue
		}
		ns := md.FilterMetadata[id.Metadata]
		if ns == nil {
			ns = &structpb.Struct{Fields: map[string]*structpb.Value{}}
			md.FilterMetadata[id.Metadata] = ns
		}
		parts := strings.Split(id.Path, ".")
		s := ns
		for _, p := range parts[:len(parts)-1] {
			next := s.Fields[p].GetStructValue()
			if next == nil {
				next = &structpb.Struct{Fields: map[string]*structpb.Value{}}
				s.Fields[p] = structpb.NewStructValue(next)
			}
			s = next
		}
		s.Fields[parts[len(parts)-1]] = structpb.NewStringValue("id-" + id.Name)
	}
	return md
}

// llmResponse is what the test reads of an answer.
type llmResponse struct {
	status int
	header http.Header
	body   string
}

// post sends a chat completion request on the route of pol, with every
// header identity of pol set.
func post(t *testing.T, front string, pol config.Policy, body string) llmResponse {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, front+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	req.Header.Set("x-test-policy", pol.Name)
	for _, id := range pol.Identities {
		if id.Header != "" {
			req.Header.Set(id.Header, "Bearer key-"+id.Name)
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return llmResponse{resp.StatusCode, resp.Header, string(b)}
}

// checkAdmitted: a small request is answered by the mock LLM, with the
// rate-limit headers of the most limiting bucket (S17).
func checkAdmitted(t *testing.T, front string, pol config.Policy) {
	t.Helper()
	r := post(t, front, pol, `{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"What is a token bucket?"}]}`)
	if r.status != http.StatusOK {
		t.Fatalf("admitted request: %d %s", r.status, r.body)
	}
	var answer struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal([]byte(r.body), &answer); err != nil || len(answer.Choices) != 1 || answer.Usage.CompletionTokens != 20 {
		t.Errorf("admitted request's body %s (%v), want one choice and 20 completion tokens", r.body, err)
	}
	for _, h := range []string{"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"} {
		if r.header.Get(h) == "" {
			t.Errorf("admitted request lacks %s: %v", h, r.header)
		}
	}
}

// checkNeverAdmissible: a prompt larger than the smallest bucket of the
// chain is answered 413 request_too_large naming that bucket, without
// Retry-After, since waiting cannot help (S4).
func checkNeverAdmissible(t *testing.T, front string, pol config.Policy) {
	t.Helper()
	smallest, capacity := "", math.Inf(1)
	for _, b := range pol.Buckets {
		l, _, err := b.Limit()
		if err != nil {
			t.Fatal(err)
		}
		if l.Capacity < capacity {
			smallest, capacity = b.Name, l.Capacity
		}
	}
	// " hello" is one token; the prompt exceeds the capacity by 1000.
	prompt := strings.Repeat(" hello", int(capacity)+1000)
	r := post(t, front, pol, `{"model":"gpt-4o-mini","max_tokens":1,"messages":[{"role":"user","content":"`+prompt+`"}]}`)
	if r.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("a prompt above bucket %q's capacity %v: %d %.300s", smallest, capacity, r.status, r.body)
	}
	var e struct {
		Error struct {
			Code     string  `json:"code"`
			Bucket   string  `json:"bucket"`
			Capacity float64 `json:"capacity"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(r.body), &e); err != nil {
		t.Fatalf("413 body %q: %v", r.body, err)
	}
	if e.Error.Code != "request_too_large" || e.Error.Bucket != smallest || e.Error.Capacity != capacity {
		t.Errorf("413 body %s, want request_too_large naming bucket %q of capacity %v", r.body, smallest, capacity)
	}
	if ct := r.header.Get("content-type"); ct != "application/json" {
		t.Errorf("413 content-type %q", ct)
	}
	if ra := r.header.Get("retry-after"); ra != "" {
		t.Errorf("413 with Retry-After %q", ra)
	}
}

// checkComposeWalkthrough runs what the README tells a docker compose user
// to try on this configuration: a stream past the policy's 300 output
// tokens is cut with finish_reason "length"; each such stream reserves
// about 310 tokens, so the key's 1000-token bucket answers 429 with
// Retry-After and the X-RateLimit headers after three.
func checkComposeWalkthrough(t *testing.T, front string) {
	t.Helper()
	pol := config.Policy{Name: "default", Identities: []config.Identity{{Name: "walkthrough", Header: "authorization"}}}
	const stream = `{"model":"gpt-4o-mini","max_tokens":1000,"stream":true,"messages":[{"role":"user","content":"hi"}]}`
	for i := 1; ; i++ {
		r := post(t, front, pol, stream)
		if r.status == http.StatusTooManyRequests {
			if i != 4 {
				t.Errorf("refused at stream %d, want the 4th", i)
			}
			if r.header.Get("retry-after") == "" || r.header.Get("x-ratelimit-limit-tokens") != "1000" || !strings.Contains(r.body, `"code":"rate_limit_exceeded"`) {
				t.Errorf("429: headers %v, body %s", r.header, r.body)
			}
			return
		}
		if r.status != http.StatusOK {
			t.Fatalf("stream %d: %d %s", i, r.status, r.body)
		}
		if !strings.Contains(r.body, `"finish_reason":"length"`) || !strings.HasSuffix(strings.TrimSpace(r.body), "data: [DONE]") {
			t.Errorf("stream %d was not cut cleanly at 300 tokens:\n%.500s", i, lastLines(r.body, 4))
		}
		if i == 5 {
			t.Fatal("five streams admitted; the README promises a 429 after three")
		}
	}
}

func grepLines(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// A shipped Envoy configuration: Envoy YAML (bootstraps and snippets) or a
// Kubernetes manifest that embeds Envoy configuration.
type shippedEnvoyFile struct {
	file string // relative to the repository root
	// manifest marks Istio and Envoy Gateway manifests: validate checks
	// the Envoy configuration they embed and lists the kinds that carry
	// none (a ServiceEntry, say) as having nothing to check.
	manifest bool
}

// shippedEnvoyFiles lists every Envoy file the repository ships; each must
// pass `tokengate validate` (the binary) with exit status 0. Extend it with
// every new file; TestEveryShippedEnvoyFileIsListed finds the ones missing.
var shippedEnvoyFiles = []shippedEnvoyFile{
	{file: "envoy/envoy.yaml"},
	{file: "envoy/envoy-1.33-streamed.yaml"},
	{file: "examples/plain-envoy/tokengate-snippet.yaml"},
	{file: "examples/istio/envoyfilter.yaml", manifest: true},
	{file: "examples/istio/tokengate-mesh.yaml", manifest: true},
	{file: "examples/envoy-gateway/tokengate-policy.yaml", manifest: true},
	// Validated only: they run once tokengate serves the rate-limit service.
	{file: "examples/rls/envoy.yaml"},
	{file: "examples/rls/istio-envoyfilter.yaml", manifest: true},
	{file: "examples/rls/envoy-gateway.yaml", manifest: true},
	{file: "examples/rls/ai-gateway-quota.yaml", manifest: true},
	{file: "examples/rls/agentgateway.yaml"},
}

func TestShippedEnvoyFilesValidate(t *testing.T) {
	bin := tokengateBinary(t)
	for _, f := range shippedEnvoyFiles {
		t.Run(f.file, func(t *testing.T) {
			cmd := exec.Command(bin, "validate", filepath.Join(repoRoot, f.file))
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("tokengate validate %s: %v\n%s", f.file, err, out)
			}
			read := strings.Contains(string(out), ": valid Envoy configuration")
			if f.manifest && strings.Contains(string(out), ": nothing to check: ") {
				read = true
			}
			if !read {
				t.Errorf("tokengate validate %s did not read it as Envoy configuration:\n%s", f.file, out)
			}
		})
	}
}

// shippedOtherFiles are the files under examples/ that are neither
// tokengate nor Envoy configuration, each with the test that runs it.
var shippedOtherFiles = map[string]string{
	"examples/monitoring/prometheus.yaml":          "TestDashboardPanelsOnPrometheus (a real Prometheus runs it)",
	"examples/monitoring/tokengate-dashboard.json": "TestDashboardPanelsOnPrometheus (every panel's query on that Prometheus)",
	"examples/monitoring/grafana/datasource.yaml":  "TestComposeProvisionsTheDashboard",
	"examples/monitoring/grafana/dashboards.yaml":  "TestComposeProvisionsTheDashboard",
}

// Every YAML file under envoy/ and examples/ that is not a tokengate
// configuration is in shippedEnvoyFiles, and every other file under
// examples/ (JSON, nested YAML) in shippedOtherFiles.
func TestEveryShippedEnvoyFileIsListed(t *testing.T) {
	for f := range shippedOtherFiles {
		if _, err := os.Stat(filepath.Join(repoRoot, f)); err != nil {
			t.Errorf("shippedOtherFiles lists %s: %v", f, err)
		}
	}
	for _, pattern := range []string{"examples/*/*.json", "examples/*/*/*.yaml", "examples/*/*/*.json"} {
		m, err := filepath.Glob(filepath.Join(repoRoot, pattern))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range m {
			rel, err := filepath.Rel(repoRoot, f)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := shippedOtherFiles[rel]; !ok {
				t.Errorf("%s ships but is not in shippedOtherFiles", rel)
			}
		}
	}
	for _, pattern := range []string{"envoy/*.yaml", "examples/*/*.yaml"} {
		m, err := filepath.Glob(filepath.Join(repoRoot, pattern))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range m {
			rel, err := filepath.Rel(repoRoot, f)
			if err != nil {
				t.Fatal(err)
			}
			tokengate := slices.ContainsFunc(shippedConfigs, func(c shippedConfig) bool { return c.file == rel })
			_, other := shippedOtherFiles[rel]
			if !tokengate && !isEnvoyFile(rel) && !other {
				t.Errorf("%s ships but is in none of shippedEnvoyFiles, shippedConfigs and shippedOtherFiles", rel)
			}
		}
	}
}

// serve refuses a broken configuration through the binary exactly as
// validate does: the same lines, exit status 1.
func TestServeRefusesLikeValidate(t *testing.T) {
	bin := tokengateBinary(t)
	file := filepath.Join(repoRoot, "config/testdata/invalid/unknown-key.yaml")
	serveOut, serveErr := exec.Command(bin, "serve", "--config", file).CombinedOutput()
	validateOut, validateErr := exec.Command(bin, "validate", file).CombinedOutput()
	for what, err := range map[string]error{"serve": serveErr, "validate": validateErr} {
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
			t.Errorf("%s: %v, want exit status 1", what, err)
		}
	}
	if want := string(serveOut) + "1 of 1 files failed validation\n"; string(validateOut) != want {
		t.Errorf("serve printed:\n%s\nvalidate printed:\n%s", serveOut, validateOut)
	}
	if n := strings.Count(string(serveOut), "unknown-key.yaml:"); n != 2 {
		t.Errorf("serve printed %d problems, want 2:\n%s", n, serveOut)
	}
}
