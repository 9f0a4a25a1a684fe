package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	rlsconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/internal/redistest"
)

// The program's name picks the command: called ratelimit (the image's
// /bin/ratelimit) it is `tokengate ratelimit`, whatever its directory.
func TestCommandArgsDispatchOnProgramName(t *testing.T) {
	for _, tt := range []struct{ argv, want []string }{
		{[]string{"/bin/ratelimit"}, []string{"ratelimit"}},
		{[]string{"ratelimit", "--print-config"}, []string{"ratelimit", "--print-config"}},
		{[]string{"/usr/local/bin/tokengate", "serve"}, []string{"serve"}},
		{[]string{"/bin/ratelimit-old", "version"}, []string{"version"}},
		{nil, nil},
	} {
		if got := commandArgs(tt.argv); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("commandArgs(%q) = %q, want %q", tt.argv, got, tt.want)
		}
	}
	// The real binary, under a link named ratelimit, as the image has it.
	link := filepath.Join(t.TempDir(), "ratelimit")
	if err := os.Symlink(tokengateBinary(t), link); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(link, "--print-config")
	cmd.Env = []string{"CONFIG_TYPE=GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL=envoy-gateway:18001"}
	out, err := cmd.Output()
	if err != nil || !strings.Contains(string(out), "address: envoy-gateway:18001") {
		t.Errorf("ratelimit --print-config: %v\n%s", err, out)
	}
}

// TestRatelimitServesRatelimitsEnvironment runs `tokengate ratelimit` as
// a hand-made envoyproxy/ratelimit Deployment would run /bin/ratelimit:
// FILE mode on a runtime directory, plaintext gRPC, without Redis and with
// a real one. /healthcheck answers 200 OK, the gRPC health service answers
// for "ratelimit", a descriptor of 1 per minute is OK then OVER_LIMIT, the
// admin API is off, a variable tokengate does without is a warning naming
// it, and SIGHUP reads the runtime directory again; with Redis stopped
// /healthcheck is 500, and 200 once it is back.
func TestRatelimitServesRatelimitsEnvironment(t *testing.T) {
	t.Run("memory", func(t *testing.T) { testRatelimitEnvironment(t, nil, "memory", nil) })
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		testRatelimitEnvironment(t, []string{"REDIS_SOCKET_TYPE=tcp", "REDIS_URL=" + srv.Addr}, "redis", srv)
	})
	// REDIS_AUTH as user:password, split at its first colon as ratelimit
	// splits it: this Redis admits only its ACL user ratelimit, whose
	// password has colons of its own.
	t.Run("redis user", func(t *testing.T) {
		srv := redistest.Start(t)
		for _, cmd := range [][]string{
			{"ACL", "SETUSER", "ratelimit", "on", ">s3cret:with:colons", "~*", "&*", "+@all"},
			{"ACL", "SETUSER", "default", "off"},
		} {
			if _, err := redistest.Do(srv.Addr, cmd...); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := redistest.Do(srv.Addr, "PING"); err == nil {
			t.Fatal("Redis answers without a user: the test would prove nothing")
		}
		testRatelimitEnvironment(t, []string{"REDIS_SOCKET_TYPE=tcp", "REDIS_URL=" + srv.Addr, "REDIS_AUTH=ratelimit:s3cret:with:colons"}, "redis", nil)
	})
	// GRPC_UDS, and Redis on its socket: REDIS_SOCKET_TYPE unset is unix,
	// ratelimit's default. This Redis has no TCP port.
	t.Run("unix sockets", func(t *testing.T) {
		srv := redistest.StartUnix(t)
		testRatelimitEnvironment(t, []string{"GRPC_UDS=" + filepath.Join(socketDir(t), "rl.sock"), "REDIS_URL=" + srv.Addr}, "redis", srv)
	})
	// REDIS_TYPE=sentinel: the master's name, then the sentinels.
	t.Run("sentinel", func(t *testing.T) {
		master := redistest.Start(t)
		redistest.StartReplica(t, master)
		sentinel := redistest.StartSentinel(t, master, "rl")
		testRatelimitEnvironment(t, []string{"REDIS_SOCKET_TYPE=tcp", "REDIS_TYPE=sentinel", "REDIS_URL=rl," + sentinel.Addr}, "redis", nil)
		if n, err := redistest.Do(master.Addr, "DBSIZE"); err != nil || n == "0" {
			t.Errorf("the master holds %q keys (%v), want the calls' counts", n, err)
		}
	})
}

// testRatelimitEnvironment runs the test on a store; with srv, the Redis
// it counts in, that Redis is stopped, /healthcheck must then answer 500,
// and 200 again once it is back.
func testRatelimitEnvironment(t *testing.T, env []string, store string, srv *redistest.Server) {
	bin := tokengateBinary(t)
	root := t.TempDir()
	app := filepath.Join(root, "ratelimit", "config")
	if err := os.MkdirAll(app, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(app, "rl.yaml"), `
domain: rl
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 1}
`)
	p := startRatelimit(t, bin, append([]string{
		"RUNTIME_ROOT=" + root, "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_IGNOREDOTFILES=true", "RUNTIME_WATCH_ROOT=false",
		"USE_STATSD=false", "USE_PROMETHEUS=true", "PROMETHEUS_ADDR=127.0.0.1:0", "LOG_LEVEL=info",
		"GRPC_HOST=127.0.0.1", "GRPC_PORT=0", "HOST=127.0.0.1", "PORT=0",
	}, env...))
	poll(t, func() error {
		resp, err := http.Get(p.admin + "/healthcheck")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK || string(body) != "OK" {
			return fmt.Errorf("/healthcheck: %s %q", resp.Status, body)
		}
		return nil
	})
	if st, body := adminCall(t, "GET", p.admin+"/v1/limits", "", ""); st != http.StatusForbidden {
		t.Errorf("/v1/limits without an admin token configured: %d %s, want 403", st, body)
	}
	if strings.Contains(p.stderr.String(), "PROMETHEUS_ADDR is set") {
		t.Errorf("PROMETHEUS_ADDR with USE_PROMETHEUS is a warning:\n%s", p.stderr.String())
	}
	if want := `"store":"` + store + `"`; !strings.Contains(p.stderr.String(), want) {
		t.Errorf("the start does not log %s:\n%s", want, p.stderr.String())
	}

	target := p.grpc
	if strings.HasPrefix(target, "/") { // GRPC_UDS
		target = "unix:" + target
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "ratelimit"})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of \"ratelimit\": %v, %v", h, err)
	}
	rl := rlsv3.NewRateLimitServiceClient(conn)
	call := func(domain string) rlsv3.RateLimitResponse_Code {
		t.Helper()
		resp, err := rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "remote_address", Value: "10.0.0.1"}},
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit %s: %v", domain, err)
		}
		return resp.GetOverallCode()
	}
	for i, want := range []rlsv3.RateLimitResponse_Code{rlsv3.RateLimitResponse_OK, rlsv3.RateLimitResponse_OVER_LIMIT} {
		if got := call("rl"); got != want {
			t.Errorf("ShouldRateLimit %d: %v, want %v", i+1, got, want)
		}
	}
	// A domain no file names: no limit (OK), and its domain_not_found.
	if got := call("nowhere"); got != rlsv3.RateLimitResponse_OK {
		t.Errorf("ShouldRateLimit of an unknown domain: %v, want OK", got)
	}
	// ratelimit's Prometheus names on PROMETHEUS_ADDR (§3.6): the limit's
	// stats key is its configured path, rl.remote_address; of its two
	// hits one was within the limit of 1 and one over it. The unknown
	// domain's stat has no line in the default mapping: its statsd name.
	key := `{domain="rl",key1="remote_address"}`
	scrapeHas(t, ratelimitMetricsURL(t, p), []string{
		"ratelimit_service_rate_limit_total_hits" + key + " 2",
		"ratelimit_service_rate_limit_within_limit" + key + " 1",
		"ratelimit_service_rate_limit_over_limit" + key + " 1",
		"ratelimit_service_rate_limit_nowhere_domain_not_found 1",
		`ratelimit_service_total_requests{grpc_method="ShouldRateLimit"} 3`,
		`ratelimit_service_total_requests{grpc_method="Check"} 1`,
		"ratelimit_service_config_load_success 1",
	})

	// ratelimit's POST /json on HOST:PORT: the same call over HTTP, 200
	// then 429 for a limit of 1 per minute; a body that is no request, 400.
	jsonCall := func(body string) (int, string) {
		t.Helper()
		return adminCall(t, http.MethodPost, p.admin+"/json", "", body)
	}
	req := `{"domain": "rl", "descriptors": [{"entries": [{"key": "remote_address", "value": "10.9.9.9"}]}]}`
	if st, body := jsonCall(req); st != http.StatusOK || !strings.Contains(body, `"overallCode":"OK"`) {
		t.Errorf("POST /json: %d %s, want 200 and OK", st, body)
	}
	if st, body := jsonCall(req); st != http.StatusTooManyRequests || !strings.Contains(body, `"overallCode":"OVER_LIMIT"`) || !strings.Contains(body, `"requestsPerUnit":1`) {
		t.Errorf("POST /json again: %d %s, want 429, OVER_LIMIT and the limit", st, body)
	}
	if st, body := jsonCall(`{"domain": "rl", "descriptors": [{"entries": [{"key": 7}]}]}`); st != http.StatusBadRequest || !strings.Contains(body, "not a RateLimitRequest") {
		t.Errorf("POST /json with a bad body: %d %s, want 400 saying why", st, body)
	}

	// A file added to the runtime directory applies on SIGHUP: its domain,
	// unknown (OK) until then, meets its limit of 1 per minute.
	for range 2 {
		if got := call("rl2"); got != rlsv3.RateLimitResponse_OK {
			t.Fatalf("the domain of a file not read yet: %v, want OK", got)
		}
	}
	writeFile(t, filepath.Join(app, "rl2.yaml"), "domain: rl2\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 1}\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	poll(t, func() error {
		if got := call("rl2"); got != rlsv3.RateLimitResponse_OVER_LIMIT {
			return fmt.Errorf("domain rl2 after SIGHUP: %v\n%s", got, lastLines(p.stderr.String(), 5))
		}
		return nil
	})

	// /healthcheck, and the gRPC health of "ratelimit" as ratelimit's
	// follows its Redis: NOT_SERVING with a 500.
	healthcheck := func(want int) func() error {
		return func() error {
			// A call meets the store, which tells whether it answers.
			_, callErr := rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "rl", Descriptors: []*commonv3.RateLimitDescriptor{{
				Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "remote_address", Value: "10.0.0.2"}},
			}}})
			resp, err := http.Get(p.admin + "/healthcheck")
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != want {
				return fmt.Errorf("/healthcheck: %s, want %d (the call: %v)", resp.Status, want, callErr)
			}
			serving := healthpb.HealthCheckResponse_SERVING
			if want != http.StatusOK {
				serving = healthpb.HealthCheckResponse_NOT_SERVING
			}
			h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "ratelimit"})
			if err != nil || h.GetStatus() != serving {
				return fmt.Errorf("gRPC health of \"ratelimit\": %v, %v; want %v beside /healthcheck's %d", h.GetStatus(), err, serving, want)
			}
			return nil
		}
	}
	if srv != nil {
		srv.Kill()
		poll(t, healthcheck(http.StatusInternalServerError))
		srv.Restart()
		poll(t, healthcheck(http.StatusOK))
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-p.done; err != nil {
		t.Errorf("tokengate ratelimit on SIGTERM: %v\n%s", err, p.stderr.String())
	}
}

// The image's /bin/ratelimit is a link to the installed binary, made in
// the build stage (the image has no shell) and copied as a directory,
// which keeps it a link.
func TestDockerfileRatelimitLink(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	for _, want := range []string{
		"RUN mkdir -p /out/bin && ln -s /usr/local/bin/tokengate /out/bin/ratelimit\n",
		"COPY --from=build /out/bin/ /bin/\n",
		"COPY --from=build /out/tokengate /usr/local/bin/tokengate\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("Dockerfile has no line %q", want)
		}
	}
}

// ratelimitMetricsURL is the URL of the ratelimit-named metrics that p
// logged it serves (listeners.ratelimit_metrics).
func ratelimitMetricsURL(t *testing.T, p *served) string {
	t.Helper()
	for _, line := range strings.Split(p.stderr.String(), "\n") {
		if strings.Contains(line, `"msg":"serving ratelimit's metrics"`) {
			var l struct{ Addr, Path string }
			if err := json.Unmarshal([]byte(line), &l); err != nil {
				t.Fatal(err)
			}
			return "http://" + l.Addr + l.Path
		}
	}
	t.Fatalf("no log line says where ratelimit's metrics are served:\n%s", p.stderr.String())
	return ""
}

// scrapeHas fetches url and fails unless every line of want is in it;
// it returns what it fetched.
func scrapeHas(t *testing.T, url string, want []string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range want {
		if !strings.Contains(string(body), "\n"+w+"\n") {
			t.Errorf("%s has no line %q:\n%s", url, w, body)
		}
	}
	return string(body)
}

// egShapedMapping is a statsd_exporter mapping in the shape of Envoy
// Gateway's (§4.4's PROMETHEUS_MAPPER_YAML): limits' stats of two levels
// by glob, with the deprecated timer_type; the response time without a
// scale, in milliseconds; the calls of one method only; everything else
// dropped.
const egShapedMapping = `mappings:
  - match: "ratelimit.service.rate_limit.*.*.*"
    name: "ratelimit_service_rate_limit_$3"
    timer_type: "histogram"
    labels: {domain: "$1", key1: "$2"}
  - match: "ratelimit_server.ShouldRateLimit.response_time"
    name: "ratelimit_service_response_time_seconds"
    timer_type: histogram
    histogram_options: {buckets: [1000]}
    labels: {grpc_method: "ShouldRateLimit"}
  - match: "ratelimit.service.config_load_success"
    name: "ratelimit_service_config_load_success"
    match_metric_type: counter
  - match: "."
    match_type: "regex"
    action: "drop"
    name: "dropped"
`

// startRatelimit starts `tokengate ratelimit` with env as its whole
// environment and waits until it logs that it listens.
func startRatelimit(t *testing.T, bin string, env []string) *served {
	t.Helper()
	p := &served{stderr: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(bin, "ratelimit")
	p.cmd.Env = env
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
	poll(t, func() error {
		for _, line := range strings.Split(p.stderr.String(), "\n") {
			var l struct{ GRPC, Admin string }
			if strings.Contains(line, `"msg":"listening"`) {
				if err := json.Unmarshal([]byte(line), &l); err != nil {
					return err
				}
				p.grpc, p.admin = l.GRPC, "http://"+l.Admin
				return nil
			}
		}
		select {
		case err := <-p.done:
			t.Fatalf("tokengate ratelimit exited: %v\n%s", err, p.stderr.String())
		default:
		}
		return fmt.Errorf("not listening yet:\n%s", p.stderr.String())
	})
	return p
}

// TestRatelimitEnvoyGatewayEnvironment runs `tokengate ratelimit` on
// Envoy Gateway's exact environment (§4.4), its /certs a temporary
// directory of one CA's certificates as Envoy Gateway's certgen makes
// them, and its management server go-control-plane's on a free port: the
// xDS stream dials over TLS with the client certificate, the gRPC
// listener refuses a client without a certificate (GRPC_SERVER_TLS_CA_CERT
// is honoured), and a snapshot's limit of 2 per minute is OK OK
// OVER_LIMIT for Envoy's certificate.
func TestRatelimitEnvoyGatewayEnvironment(t *testing.T) {
	const node = "envoy-ratelimit"
	certs := t.TempDir()
	ca := newTestCA(t, "envoy-gateway")
	gwCert, gwKey, _ := ca.issue(t, "envoy-gateway", true)
	rlCert, rlKey, _ := ca.issue(t, "*", true) // tokengate's: its gRPC server's and its xDS client's
	for name, data := range map[string][]byte{"ca.crt": ca.pem, "tls.crt": rlCert, "tls.key": rlKey, "conf.yaml": []byte(egShapedMapping)} {
		replace(t, filepath.Join(certs, name), data)
	}
	gw, err := tls.X509KeyPair(gwCert, gwKey)
	if err != nil {
		t.Fatal(err)
	}
	// The certificate is required; its use (server, like Envoy Gateway's
	// one certificate for both ends) is not checked here.
	m := startXDSServer(t, "127.0.0.1:0", credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{gw}, ClientAuth: tls.RequireAnyClientCert}), nil)
	m.publish(t, node, "1", perUser("default/eg/http", rlsconfv3.RateLimitUnit_MINUTE, 2))

	crt, key, caFile := filepath.Join(certs, "tls.crt"), filepath.Join(certs, "tls.key"), filepath.Join(certs, "ca.crt")
	p := startRatelimit(t, tokengateBinary(t), []string{
		"RUNTIME_ROOT=/data", "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_IGNOREDOTFILES=true", "RUNTIME_WATCH_ROOT=false",
		"LOG_LEVEL=info", "USE_STATSD=false", "CONFIG_TYPE=GRPC_XDS_SOTW",
		"CONFIG_GRPC_XDS_SERVER_URL=" + m.addr, "CONFIG_GRPC_XDS_NODE_ID=" + node,
		"GRPC_SERVER_USE_TLS=true", "GRPC_SERVER_TLS_CERT=" + crt, "GRPC_SERVER_TLS_KEY=" + key, "GRPC_SERVER_TLS_CA_CERT=" + caFile,
		"CONFIG_GRPC_XDS_SERVER_USE_TLS=true", "CONFIG_GRPC_XDS_CLIENT_TLS_CERT=" + crt, "CONFIG_GRPC_XDS_CLIENT_TLS_KEY=" + key,
		"CONFIG_GRPC_XDS_SERVER_TLS_CACERT=" + caFile, "FORCE_START_WITHOUT_INITIAL_CONFIG=true",
		"USE_PROMETHEUS=true", "PROMETHEUS_MAPPER_YAML=" + filepath.Join(certs, "conf.yaml"),
		// Free ports instead of 8081, 8080 and 19001, on loopback.
		"GRPC_HOST=127.0.0.1", "GRPC_PORT=0", "HOST=127.0.0.1", "PORT=0", "PROMETHEUS_ADDR=127.0.0.1:0",
	})
	poll(t, func() error { return getOK(p.admin + "/healthcheck") })

	dial := func(certs ...tls.Certificate) *rlsCaller {
		conn, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: ca.pool(), Certificates: certs})))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		t.Cleanup(cancel)
		return &rlsCaller{rl: rlsv3.NewRateLimitServiceClient(conn), ctx: ctx}
	}
	if _, err := dial().call("default/eg/http", "ann", 1); err == nil {
		t.Error("a call without a client certificate was answered")
	}
	c := dial(ca.clientCert(t, "envoy"))
	c.limitIs(t, "default/eg/http", 2)
	if got := c.codes(t, "default/eg/http", "ann", 3); got != "OK OK OVER_LIMIT" {
		t.Errorf("three hits of 2 per minute: %s", got)
	}
	// What Envoy Gateway's Prometheus reads on :19001 (its e2e queries
	// over_limit), named by its statsd-exporter mapping: the snapshot's
	// limit by its stats key, its one load, the response time in
	// milliseconds; the health checks' calls dropped.
	labels := `{domain="default/eg/http",key1="user"}`
	url := ratelimitMetricsURL(t, p)
	// The calls are limitIs's polls and the three; the mapping's one
	// bucket holds them all (its buckets are in milliseconds).
	calls := ""
	for _, line := range strings.Split(scrapeHas(t, url, nil), "\n") {
		if v, ok := strings.CutPrefix(line, `ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="1000"} `); ok {
			calls = v
		}
	}
	if n, err := strconv.Atoi(calls); err != nil || n < 4 {
		t.Errorf("%q calls in the response time's millisecond bucket, want at least the 4 made", calls)
	}
	body := scrapeHas(t, url, []string{
		"ratelimit_service_rate_limit_total_hits" + labels + " 3",
		"ratelimit_service_rate_limit_within_limit" + labels + " 2",
		"ratelimit_service_rate_limit_over_limit" + labels + " 1",
		"ratelimit_service_rate_limit_near_limit" + labels + " 1",
		"ratelimit_service_config_load_success 1",
		`ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="+Inf"} ` + calls,
	})
	if strings.Contains(body, `grpc_method="Check"`) {
		t.Errorf("%s has the health checks' calls, which the mapping drops:\n%s", url, body)
	}
	m.mu.Lock()
	id := m.requests[0].GetNode().GetId()
	m.mu.Unlock()
	if id != node {
		t.Errorf("node %q, want %s", id, node)
	}
}

// TestRatelimitResponseMetadataAndHeaders runs `tokengate ratelimit` with
// RESPONSE_DYNAMIC_METADATA and LIMIT_RESPONSE_HEADERS_ENABLED (one header
// renamed by LIMIT_RESET_HEADER): a real answer carries ratelimit's
// dynamic metadata, the rule's metadata while it passes, and the
// RateLimit-* headers, retry-after after them once over; the variables
// are mapped, not warned about.
func TestRatelimitResponseMetadataAndHeaders(t *testing.T) {
	root := t.TempDir()
	app := filepath.Join(root, "config")
	if err := os.MkdirAll(app, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(app, "rl.yaml"), `
domain: rl
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {route: {cluster: llm}, weight: 3}
`)
	p := startRatelimit(t, tokengateBinary(t), []string{
		"RUNTIME_ROOT=" + root, "GRPC_HOST=127.0.0.1", "GRPC_PORT=0", "HOST=127.0.0.1", "PORT=0", "LOG_LEVEL=info",
		"RESPONSE_DYNAMIC_METADATA=true", "LIMIT_RESPONSE_HEADERS_ENABLED=true", "LIMIT_RESET_HEADER=X-RateLimit-Reset-In",
	})
	for _, v := range []string{"RESPONSE_DYNAMIC_METADATA", "LIMIT_RESPONSE_HEADERS_ENABLED", "LIMIT_RESET_HEADER"} {
		if strings.Contains(p.stderr.String(), v) {
			t.Errorf("the log names %s:\n%s", v, p.stderr.String())
		}
	}
	c := newRLSCaller(t, p.grpc)
	call := func() *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := c.rl.ShouldRateLimit(c.ctx, &rlsv3.RateLimitRequest{Domain: "rl", HitsAddend: 1, Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "remote_address", Value: "10.0.0.1"}},
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		return resp
	}
	metadata := func(rule map[string]any) *structpb.Struct {
		m := map[string]any{
			"domain":      "rl",
			"descriptors": []any{map[string]any{"entries": []any{"remote_address=10.0.0.1"}}},
			"hitsAddend":  1,
		}
		if rule != nil {
			m["metadata"] = rule
		}
		s, err := structpb.NewStruct(m)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	headers := func(resp *rlsv3.RateLimitResponse) (out []string) {
		for _, h := range resp.GetResponseHeadersToAdd() {
			out = append(out, h.GetKey()+": "+h.GetValue())
		}
		return out
	}
	got := call()
	if d := cmp.Diff(metadata(map[string]any{"route": map[string]any{"cluster": "llm"}, "weight": 3}), got.GetDynamicMetadata(), protocmp.Transform()); got.GetOverallCode() != rlsv3.RateLimitResponse_OK || d != "" {
		t.Errorf("first hit of 2 a minute: %v, dynamic metadata (-want +got):\n%s", got.GetOverallCode(), d)
	}
	// One hit of 2 refilling 2 a minute: full again in 30s.
	if d := cmp.Diff([]string{"RateLimit-Limit: 2", "RateLimit-Remaining: 1", "X-RateLimit-Reset-In: 30"}, headers(got)); d != "" {
		t.Errorf("first hit: headers (-want +got):\n%s", d)
	}
	call()
	got = call()
	if d := cmp.Diff(metadata(nil), got.GetDynamicMetadata(), protocmp.Transform()); got.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || d != "" {
		t.Errorf("third hit of 2 a minute: %v, dynamic metadata (-want +got):\n%s", got.GetOverallCode(), d)
	}
	// One token of debt and one asked for: 2 tokens at 2 a minute.
	if d := cmp.Diff([]string{"RateLimit-Limit: 2", "RateLimit-Remaining: 0", "X-RateLimit-Reset-In: 60", "retry-after: 60"}, headers(got)); d != "" {
		t.Errorf("third hit: headers (-want +got):\n%s", d)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-p.done; err != nil {
		t.Errorf("tokengate ratelimit on SIGTERM: %v\n%s", err, p.stderr.String())
	}
}

// TestRatelimitMetricsOnPrometheus runs Envoy Gateway's e2e check of its
// rate-limit service (docs/envoy-ratelimit.md §3.6) on a real Prometheus
// scraping `tokengate ratelimit`'s PROMETHEUS_ADDR: a limit on client
// CIDR 0.0.0.0/0 in the shape Envoy Gateway configures it, and the query
// ratelimit_service_rate_limit_over_limit{key2="masked_remote_address_0_0_0_0/0"},
// which finds nothing while every hit is within the limit and the over
// hit once one is past it.
func TestRatelimitMetricsOnPrometheus(t *testing.T) {
	prometheusBinary(t)
	root := t.TempDir()
	app := filepath.Join(root, "config")
	if err := os.MkdirAll(app, 0o700); err != nil {
		t.Fatal(err)
	}
	const rule = "default/ratelimit-all-ips/rule-0-match-0"
	writeFile(t, filepath.Join(app, "eg.yaml"), `
domain: default/eg/http
descriptors:
  - key: `+rule+`
    value: `+rule+`
    descriptors:
      - key: masked_remote_address
        value: 0.0.0.0/0
        rate_limit: {unit: hour, requests_per_unit: 3}
`)
	p := startRatelimit(t, tokengateBinary(t), []string{
		"RUNTIME_ROOT=" + root, "GRPC_HOST=127.0.0.1", "GRPC_PORT=0", "HOST=127.0.0.1", "PORT=0", "LOG_LEVEL=info",
		"USE_PROMETHEUS=true", "PROMETHEUS_ADDR=127.0.0.1:0",
	})
	metrics := ratelimitMetricsURL(t, p)
	prom := startPrometheus(t, strings.TrimSuffix(strings.TrimPrefix(metrics, "http://"), "/metrics"))
	c := newRLSCaller(t, p.grpc)
	hit := func() rlsv3.RateLimitResponse_Code {
		t.Helper()
		resp, err := c.rl.ShouldRateLimit(c.ctx, &rlsv3.RateLimitRequest{Domain: "default/eg/http", Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: rule, Value: rule}, {Key: "masked_remote_address", Value: "0.0.0.0/0"}},
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		return resp.GetOverallCode()
	}
	const key2 = `key2="masked_remote_address_0_0_0_0/0"`
	for range 3 {
		if got := hit(); got != rlsv3.RateLimitResponse_OK {
			t.Fatalf("a hit within 3 per hour: %v", got)
		}
	}
	// Once Prometheus has scraped the three hits, over_limit has no series.
	waitProm(t, prom, `ratelimit_service_rate_limit_total_hits{`+key2+`} == 3`)
	if s, err := promQuery(prom, `ratelimit_service_rate_limit_over_limit{`+key2+`}`); err != nil || len(s) != 0 {
		t.Fatalf("over_limit before any hit was over: %v, %v; want no series (Envoy Gateway's check would pass)", s, err)
	}
	if got := hit(); got != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("the fourth hit of 3 per hour: %v", got)
	}
	waitProm(t, prom, `ratelimit_service_rate_limit_over_limit{domain="default/eg/http",key1="`+rule+"_"+rule+`",`+key2+`} == 1`)
}

// TestRatelimitHealthyWithAConfigLoaded: with
// HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED, `tokengate ratelimit` on xDS is
// unhealthy until a snapshot gives it a domain, as ratelimit is
// (§3.7): /healthcheck 500 and the gRPC health of "ratelimit" NOT_SERVING,
// then 200 and SERVING once a snapshot arrives, and unhealthy again when
// a snapshot takes every domain away.
func TestRatelimitHealthyWithAConfigLoaded(t *testing.T) {
	const node = "envoy-ratelimit"
	m := startXDSServer(t, "127.0.0.1:0", nil, nil)
	p := startRatelimit(t, tokengateBinary(t), []string{
		"CONFIG_TYPE=GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL=" + m.addr, "CONFIG_GRPC_XDS_NODE_ID=" + node,
		"HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED=true", "FORCE_START_WITHOUT_INITIAL_CONFIG=true",
		"GRPC_HOST=127.0.0.1", "GRPC_PORT=0", "HOST=127.0.0.1", "PORT=0", "LOG_LEVEL=info",
	})
	conn, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	healthy := func(want bool) func() error {
		return func() error {
			resp, err := http.Get(p.admin + "/healthcheck")
			if err != nil {
				return err
			}
			resp.Body.Close()
			code, serving := http.StatusOK, healthpb.HealthCheckResponse_SERVING
			if !want {
				code, serving = http.StatusInternalServerError, healthpb.HealthCheckResponse_NOT_SERVING
			}
			h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "ratelimit"})
			if resp.StatusCode != code || err != nil || h.GetStatus() != serving {
				return fmt.Errorf("/healthcheck %d, gRPC health %v (%v); want %d and %v", resp.StatusCode, h.GetStatus(), err, code, serving)
			}
			return nil
		}
	}
	// Before any snapshot, and without one: unhealthy at once, as it stays.
	if err := healthy(false)(); err != nil {
		t.Fatal(err)
	}
	m.publish(t, node, "1", perUser("d", rlsconfv3.RateLimitUnit_MINUTE, 5))
	poll(t, healthy(true))
	m.publish(t, node, "2")
	poll(t, healthy(false))
}
