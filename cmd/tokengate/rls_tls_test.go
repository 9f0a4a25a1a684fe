package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"testing"
	"time"

	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
)

// TestRLSScenario35Transports: Envoy's rate-limit filter (the stand-in)
// reaches tokengate's rate-limit service over the listener's mTLS with a
// client certificate, and fails (failing closed: 500) without one; over
// plaintext HTTP/2 on loopback with Envoy Gateway's 5 s timeout it is
// answered too.
func TestRLSScenario35Transports(t *testing.T) {
	dir := t.TempDir()
	serverCA, envoyCA := newTestCA(t, "server CA"), newTestCA(t, "envoy CA")
	cert, key, _ := serverCA.issue(t, "tokengate", true)
	certFile, keyFile, caFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "envoy-ca.crt")
	replace(t, certFile, cert)
	replace(t, keyFile, key)
	replace(t, caFile, envoyCA.pem)
	const mapping = `
policies:
  - name: p
    identities: [{name: user, header: x-user-id}]
    buckets:
      - {name: user, per: user, tokens_per_minute: 2, burst: 2, max_debt: 2}
rls:
  domains:
    - domain: d
      descriptors:
        - {key: user, identity: user, policy: p}
`
	filter := func(timeout string) *rlfilterv3.RateLimit {
		y := "domain: d\nfailure_mode_deny: true\ntimeout: " + timeout + "\nrate_limits: [{actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}]}]\nrate_limit_service: {grpc_service: {envoy_grpc: {cluster_name: ratelimit}}, transport_api_version: V3}\n"
		js, err := yaml.YAMLToJSON([]byte(y))
		if err != nil {
			t.Fatal(err)
		}
		var f rlfilterv3.RateLimit
		if err := protojson.Unmarshal(js, &f); err != nil {
			t.Fatal(err)
		}
		return &f
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(up.Close)
	upURL, _ := url.Parse(up.URL)
	// statuses sends three requests of one user through a stand-in on conn.
	statuses := func(t *testing.T, grpcAddr string, tc *tls.Config, timeout string) []int {
		t.Helper()
		conn, err := standin.Dial(grpcAddr, tc)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		p, err := standin.NewRateLimitProxy(standin.RateLimitConfig{RLS: conn, Filter: filter(timeout), Upstream: upURL})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		front := httptest.NewServer(p)
		defer front.Close()
		var out []int
		for range 3 {
			req, err := http.NewRequest("GET", front.URL+"/", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("x-user-id", "ann")
			resp, err := http.DefaultTransport.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			out = append(out, resp.StatusCode)
		}
		return out
	}
	start := func(t *testing.T, listenerYAML string) string {
		t.Helper()
		cfg, err := config.Parse("rls.yaml", []byte(listenerYAML+mapping))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ShutdownGrace = 5 * time.Second
		gl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		al, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- serve(ctx, cfg, slog.New(slog.DiscardHandler), &listeners{grpc: gl, admin: al}) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
		})
		return gl.Addr().String()
	}

	t.Run("mTLS", func(t *testing.T) {
		addr := start(t, fmt.Sprintf("listeners:\n  grpc_tls: {cert_file: %q, key_file: %q, client_ca_file: %q}\n", certFile, keyFile, caFile))
		envoyCert := envoyCA.clientCert(t, "envoy")
		tc := &tls.Config{RootCAs: serverCA.pool(), ServerName: "tokengate", Certificates: []tls.Certificate{envoyCert}}
		if got := statuses(t, addr, tc, "5s"); fmt.Sprint(got) != "[200 200 429]" {
			t.Errorf("with a client certificate: %v, want [200 200 429]", got)
		}
		tc = &tls.Config{RootCAs: serverCA.pool(), ServerName: "tokengate"}
		if got := statuses(t, addr, tc, "5s"); fmt.Sprint(got) != "[500 500 500]" {
			t.Errorf("without a client certificate: %v, want the failure mode's [500 500 500]", got)
		}
	})
	t.Run("plaintext", func(t *testing.T) {
		addr := start(t, "")
		if got := statuses(t, addr, nil, "5s"); fmt.Sprint(got) != "[200 200 429]" {
			t.Errorf("plaintext h2c: %v, want [200 200 429]", got)
		}
	})
}
