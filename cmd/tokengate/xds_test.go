package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	rlsconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tokengate/tokengate/config"
)

// xdsServer is go-control-plane's xDS server with a snapshot cache on a
// TCP port, as Envoy Gateway and AI Gateway run it for the rate-limit
// service; it records the requests it receives (ACKs and NACKs).
type xdsServer struct {
	cache cachev3.SnapshotCache
	addr  string
	gs    *grpc.Server

	mu       sync.Mutex
	requests []*discoveryv3.DiscoveryRequest
}

// startXDSServer serves on addr ("127.0.0.1:0" for a free port) with
// creds (nil: plaintext), keeping cache (nil: a new one).
func startXDSServer(t *testing.T, addr string, creds credentials.TransportCredentials, cache cachev3.SnapshotCache) *xdsServer {
	t.Helper()
	if cache == nil {
		cache = cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	m := &xdsServer{cache: cache}
	srv := serverv3.NewServer(ctx, cache, serverv3.CallbackFuncs{
		StreamRequestFunc: func(_ int64, req *discoveryv3.DiscoveryRequest) error {
			m.mu.Lock()
			m.requests = append(m.requests, req)
			m.mu.Unlock()
			return nil
		},
	})
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	m.gs = grpc.NewServer(grpc.Creds(creds))
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(m.gs, srv)
	go m.gs.Serve(lis)
	t.Cleanup(m.gs.Stop)
	m.addr = lis.Addr().String()
	return m
}

func (m *xdsServer) publish(t *testing.T, node, version string, configs ...*rlsconfv3.RateLimitConfig) {
	t.Helper()
	var rs []types.Resource
	for _, c := range configs {
		rs = append(rs, c)
	}
	snap, err := cachev3.NewSnapshot(version, map[resource.Type][]types.Resource{resource.RateLimitConfigType: rs})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.cache.SetSnapshot(context.Background(), node, snap); err != nil {
		t.Fatal(err)
	}
}

// nack polls for a NACK whose message holds want.
func (m *xdsServer) nack(t *testing.T, want string) {
	t.Helper()
	poll(t, func() error {
		m.mu.Lock()
		defer m.mu.Unlock()
		var seen []string
		for _, r := range m.requests {
			if msg := r.GetErrorDetail().GetMessage(); r.GetErrorDetail() != nil {
				if strings.Contains(msg, want) {
					return nil
				}
				seen = append(seen, msg)
			}
		}
		return fmt.Errorf("no NACK saying %q among %d requests (NACKs: %q)", want, len(m.requests), seen)
	})
}

// perUser is a ratelimit configuration of domain: rpu hits per minute for
// each user, in unit.
func perUser(domain string, unit rlsconfv3.RateLimitUnit, rpu uint32) *rlsconfv3.RateLimitConfig {
	return &rlsconfv3.RateLimitConfig{
		Name: domain, Domain: domain,
		Descriptors: []*rlsconfv3.RateLimitDescriptor{{
			Key:       "user",
			RateLimit: &rlsconfv3.RateLimitPolicy{Unit: unit, RequestsPerUnit: rpu},
		}},
	}
}

// rlsCaller calls ShouldRateLimit on a tokengate's gRPC listener.
type rlsCaller struct {
	rl  rlsv3.RateLimitServiceClient
	ctx context.Context
}

func newRLSCaller(t *testing.T, addr string) *rlsCaller {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return &rlsCaller{rl: rlsv3.NewRateLimitServiceClient(conn), ctx: ctx}
}

func (c *rlsCaller) call(domain, user string, hits uint64) (*rlsv3.RateLimitResponse, error) {
	return c.rl.ShouldRateLimit(c.ctx, &rlsv3.RateLimitRequest{Domain: domain, Descriptors: []*commonv3.RateLimitDescriptor{{
		Entries:    []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: user}},
		HitsAddend: wrapperspb.UInt64(hits),
	}}})
}

// limitIs polls until a call of domain meets a limit of rpu per minute.
func (c *rlsCaller) limitIs(t *testing.T, domain string, rpu uint32) {
	t.Helper()
	poll(t, func() error {
		resp, err := c.call(domain, "probe", 0)
		if err != nil {
			return err
		}
		if got := resp.GetStatuses()[0].GetCurrentLimit().GetRequestsPerUnit(); got != rpu {
			return fmt.Errorf("domain %s: current limit %d per minute, want %d", domain, got, rpu)
		}
		return nil
	})
}

// codes calls n times as user and lists the overall codes.
func (c *rlsCaller) codes(t *testing.T, domain, user string, n int) string {
	t.Helper()
	var out []string
	for range n {
		resp, err := c.call(domain, user, 1)
		if err != nil {
			t.Fatalf("ShouldRateLimit %s: %v", domain, err)
		}
		out = append(out, resp.GetOverallCode().String())
	}
	return strings.Join(out, " ")
}

// serveReloading runs serve on the file at path as runServe does, with
// hup standing for SIGHUP.
func serveReloading(t *testing.T, path string, hup chan os.Signal) (*inProcess, *testWriter) {
	t.Helper()
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	gl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	al, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &inProcess{grpc: gl.Addr().String(), admin: "http://" + al.Addr().String(), cancel: cancel, done: make(chan error, 1)}
	src := &reloadSource{path: path, hup: hup, stamps: []fileStamp{stampOf(path)}}
	logs := &testWriter{t: t}
	logger := slog.New(slog.NewJSONHandler(logs, nil))
	go func() { s.done <- serveWith(ctx, cfg, logger, &listeners{grpc: gl, admin: al}, src) }()
	t.Cleanup(func() { s.stop(t) })
	poll(t, func() error { return getOK(s.admin + "/readyz") })
	return s, logs
}

// testWriter logs each line through t.Log and keeps it for has.
type testWriter struct {
	t     *testing.T
	mu    sync.Mutex
	lines []string
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	w.mu.Lock()
	w.lines = append(w.lines, string(p))
	w.mu.Unlock()
	return len(p), nil
}

// has polls for a line holding every one of want.
func (w *testWriter) has(t *testing.T, want ...string) {
	t.Helper()
	poll(t, func() error {
		w.mu.Lock()
		defer w.mu.Unlock()
	lines:
		for _, l := range w.lines {
			for _, s := range want {
				if !strings.Contains(l, s) {
					continue lines
				}
			}
			return nil
		}
		return fmt.Errorf("no log line holds %q", want)
	})
}

// TestRLSScenario35XDSClients: tokengate's rate-limit service takes
// envoyproxy/ratelimit's configuration from an xDS management server
// (go-control-plane's), as ratelimit's own client does: AI Gateway's in
// plaintext for node envoy-ai-gateway-ratelimit, Envoy Gateway's over mTLS
// for node envoy-ratelimit. Until the first snapshot a call is an error,
// as ratelimit answers without configuration; each snapshot then decides
// the answers; one with an invalid unit is NACKed and the one before keeps
// answering; a reload of the file keeps the snapshot's domains; and when
// the server goes away and comes back, tokengate redials and follows it.
func TestRLSScenario35XDSClients(t *testing.T) {
	t.Run("AI Gateway, plaintext", func(t *testing.T) {
		const node = "envoy-ai-gateway-ratelimit"
		m := startXDSServer(t, "127.0.0.1:0", nil, nil)
		dir := t.TempDir()
		path := filepath.Join(dir, "tokengate.yaml")
		files := "domain: files\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3}\n"
		replace(t, filepath.Join(dir, "rl.yaml"), []byte(files))
		replace(t, path, []byte(fmt.Sprintf("store: {type: memory}\nratelimit:\n  files: [rl.yaml]\n  xds: {address: %q, node_id: %s, node_metadata: {zone: a}, insecure: true}\n", m.addr, node)))
		hup := make(chan os.Signal, 1)
		s, _ := serveReloading(t, path, hup)
		c := newRLSCaller(t, s.grpc)

		c.limitIs(t, "files", 3)

		m.publish(t, node, "1", perUser("ai", rlsconfv3.RateLimitUnit_MINUTE, 2))
		c.limitIs(t, "ai", 2)
		if got := c.codes(t, "ai", "ann", 3); got != "OK OK OVER_LIMIT" {
			t.Errorf("three hits of 2 per minute: %s", got)
		}
		m.mu.Lock()
		first := m.requests[0]
		m.mu.Unlock()
		if first.GetNode().GetId() != node || first.GetNode().GetMetadata().GetFields()["zone"].GetStringValue() != "a" || len(first.GetResourceNames()) != 0 {
			t.Errorf("first request %v: want node %s with its metadata, a wildcard", first, node)
		}

		m.publish(t, node, "2", perUser("ai", rlsconfv3.RateLimitUnit_MINUTE, 5))
		c.limitIs(t, "ai", 5)
		if got := c.codes(t, "ai", "ben", 6); got != "OK OK OK OK OK OVER_LIMIT" {
			t.Errorf("six hits of 5 per minute: %s", got)
		}

		m.publish(t, node, "3", perUser("ai", rlsconfv3.RateLimitUnit_UNKNOWN, 50))
		m.nack(t, "invalid rate limit unit 'UNKNOWN'")
		c.limitIs(t, "ai", 5)
		if got := c.codes(t, "ai", "ben", 1); got != "OVER_LIMIT" {
			t.Errorf("after the NACK, ben's next hit: %s, want OVER_LIMIT as before", got)
		}
		// A snapshot that loads but does not validate with the file (its
		// domain is the files') is refused by the swap, and NACKed too.
		m.publish(t, node, "3b", perUser("files", rlsconfv3.RateLimitUnit_MINUTE, 50))
		m.nack(t, "the configuration was refused")
		c.limitIs(t, "ai", 5)
		c.limitIs(t, "files", 3)

		// A reload of the file keeps the snapshot's domain beside the files'.
		replace(t, filepath.Join(dir, "rl.yaml"), []byte(strings.Replace(files, "requests_per_unit: 3", "requests_per_unit: 4", 1)))
		hup <- os.Interrupt
		c.limitIs(t, "files", 4)
		c.limitIs(t, "ai", 5)

		// The server goes away and comes back with a new snapshot.
		m.gs.Stop()
		m2 := startXDSServer(t, m.addr, nil, m.cache)
		m2.publish(t, node, "4", perUser("ai", rlsconfv3.RateLimitUnit_MINUTE, 7))
		c.limitIs(t, "ai", 7)
	})

	// A snapshot past gRPC's 4 MiB (a controller with many routes) needs
	// max_message_bytes, as ratelimit's XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES;
	// without it the log says which setting to raise.
	t.Run("a snapshot past 4 MiB", func(t *testing.T) {
		const node = "envoy-ratelimit"
		big := perUser("big", rlsconfv3.RateLimitUnit_MINUTE, 2)
		pad := strings.Repeat("p", 10<<10)
		for i := range 450 {
			big.Descriptors = append(big.Descriptors, &rlsconfv3.RateLimitDescriptor{Key: "route", Value: fmt.Sprintf("%s%d", pad, i),
				RateLimit: &rlsconfv3.RateLimitPolicy{Unit: rlsconfv3.RateLimitUnit_MINUTE, RequestsPerUnit: 9}})
		}
		if n := proto.Size(big); n <= 4<<20 {
			t.Fatalf("the snapshot is %d bytes, want one past gRPC's 4 MiB", n)
		}
		for _, max := range []int{0, 8 << 20} {
			m := startXDSServer(t, "127.0.0.1:0", nil, nil)
			m.publish(t, node, "1", big)
			path := filepath.Join(t.TempDir(), "tokengate.yaml")
			replace(t, path, []byte(fmt.Sprintf("store: {type: memory}\nratelimit:\n  xds: {address: %q, node_id: %s, insecure: true, max_message_bytes: %d}\n", m.addr, node, max)))
			s, w := serveReloading(t, path, make(chan os.Signal, 1))
			if max == 0 {
				w.has(t, "raise ratelimit.xds.max_message_bytes", "received message larger than max")
				continue
			}
			newRLSCaller(t, s.grpc).limitIs(t, "big", 2)
		}
	})

	t.Run("Envoy Gateway, mTLS", func(t *testing.T) {
		const node = "envoy-ratelimit"
		dir := t.TempDir()
		serverCA, clientCA := newTestCA(t, "envoy-gateway CA"), newTestCA(t, "rate-limit CA")
		scert, skey, _ := serverCA.issue(t, "envoy-gateway", true, "envoy-gateway")
		ccert, ckey, _ := clientCA.issue(t, "envoy-ratelimit", false)
		for name, data := range map[string][]byte{"ca.crt": serverCA.pem, "tls.crt": ccert, "tls.key": ckey} {
			replace(t, filepath.Join(dir, name), data)
		}
		sc, err := tls.X509KeyPair(scert, skey)
		if err != nil {
			t.Fatal(err)
		}
		creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{sc}, ClientCAs: clientCA.pool(), ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12})
		m := startXDSServer(t, "127.0.0.1:0", creds, nil)
		path := filepath.Join(dir, "tokengate.yaml")
		replace(t, path, []byte(fmt.Sprintf("store: {type: memory}\nratelimit:\n  xds: {address: %q, node_id: %s, server_name: envoy-gateway, ca_file: ca.crt, cert_file: tls.crt, key_file: tls.key}\n", m.addr, node)))
		// Without the client certificate the server refuses the handshake:
		// the stream ends, tokengate redials, and answers without
		// configuration. The client meets the refusal as TLS's "certificate
		// required" alert or, when its first write comes before it, as the
		// connection's close: the server, which never got a request, says
		// which.
		noCert := filepath.Join(dir, "nocert.yaml")
		replace(t, noCert, []byte(fmt.Sprintf("store: {type: memory}\nratelimit:\n  xds: {address: %q, node_id: %s, server_name: envoy-gateway, ca_file: ca.crt}\n", m.addr, node)))
		s0, logs := serveReloading(t, noCert, make(chan os.Signal, 1))
		logs.has(t, "xDS stream ended; redialling")
		m.mu.Lock()
		got := len(m.requests)
		m.mu.Unlock()
		if got != 0 {
			t.Fatalf("the xDS server took %d requests from a client without a certificate", got)
		}
		if _, err := newRLSCaller(t, s0.grpc).call("default/eg/http", "ann", 1); err == nil || !strings.Contains(err.Error(), "no rate limit configuration") {
			t.Errorf("without a client certificate: %v, want ratelimit's error without configuration", err)
		}
		s0.stop(t)

		s, _ := serveReloading(t, path, make(chan os.Signal, 1))
		c := newRLSCaller(t, s.grpc)
		if _, err := c.call("default/eg/http", "ann", 1); err == nil || !strings.Contains(err.Error(), "no rate limit configuration") {
			t.Errorf("a call before the first snapshot: %v, want ratelimit's error without configuration", err)
		}
		m.publish(t, node, "1", perUser("default/eg/http", rlsconfv3.RateLimitUnit_MINUTE, 2))
		c.limitIs(t, "default/eg/http", 2)
		if got := c.codes(t, "default/eg/http", "ann", 3); got != "OK OK OVER_LIMIT" {
			t.Errorf("three hits of 2 per minute: %s", got)
		}
		m.mu.Lock()
		id := m.requests[0].GetNode().GetId()
		m.mu.Unlock()
		if id != node {
			t.Errorf("node %q, want %s", id, node)
		}
	})
}

// The redial waits double from xdsRetryFirst and stop at xdsRetryMax.
func TestXDSRetryBacksOff(t *testing.T) {
	var got []time.Duration
	for d := xdsRetryFirst; len(got) < 9; d = nextRetry(d) {
		got = append(got, d)
	}
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second, time.Minute, time.Minute, time.Minute}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("waits %v, want %v", got, want)
	}
}
