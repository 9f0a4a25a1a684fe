package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
)

// serve over mTLS end to end: Envoy's stand-in dials the ext_proc listener with
// a client certificate and a request is admitted, one is refused with 429 and a
// stream is cut off; clients without a certificate from the configured CA are
// refused; the admin listener serves HTTPS; a rotated server certificate is
// presented to the next connection without a restart.
func TestServeMTLS(t *testing.T) {
	dir := t.TempDir()
	serverCA, envoyCA, rogueCA := newTestCA(t, "server CA"), newTestCA(t, "envoy CA"), newTestCA(t, "rogue CA")
	cert1, key1, serial1 := serverCA.issue(t, "tokengate", true)
	certFile, keyFile, caFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "envoy-ca.crt")
	replace(t, certFile, cert1)
	replace(t, keyFile, key1)
	replace(t, caFile, envoyCA.pem)

	cfg, err := config.Parse("mtls.yaml", []byte(fmt.Sprintf(`
listeners:
  grpc: 0.0.0.0:50051 # not loopback: accepted because clients are verified
  grpc_tls: {cert_file: %[1]q, key_file: %[2]q, client_ca_file: %[3]q}
  admin_tls: {cert_file: %[1]q, key_file: %[2]q}
policies:
  - name: default
    identities: [{name: user, header: x-user-id}]
    anonymous: reject
    buckets:
      - {name: user, per: user, tokens_per_minute: 60, burst: 300}
  - name: capped
    identities: [{name: user, header: x-user-id}]
    anonymous: reject
    buckets:
      - {name: user, per: user, tokens_per_minute: 6000, burst: 6000}
    max_output_tokens: 20
default_policy: default
`, certFile, keyFile, caFile)))
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
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()

	// The admin listener speaks HTTPS only.
	https := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: serverCA.pool()}}}
	defer https.CloseIdleConnections()
	admin := "https://" + al.Addr().String()
	poll(t, func() error {
		resp, err := https.Get(admin + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("readyz: %d", resp.StatusCode)
		}
		return nil
	})
	if resp, err := http.Get("http://" + al.Addr().String() + "/readyz"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Error("the admin listener answered plain HTTP")
		}
	}

	// Who may talk to ext_proc: only holders of a certificate from envoy-ca.crt.
	var presented atomic.Int64 // serial of the server certificate of the last handshake
	envoyTLS := func(cert *tls.Certificate) *tls.Config {
		c := &tls.Config{RootCAs: serverCA.pool(), ServerName: "tokengate",
			VerifyConnection: func(cs tls.ConnectionState) error {
				presented.Store(cs.PeerCertificates[0].SerialNumber.Int64())
				return nil
			}}
		if cert != nil {
			c.Certificates = []tls.Certificate{*cert}
		}
		return c
	}
	health := func(conn *grpc.ClientConn) error {
		hctx, hcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer hcancel()
		_, err := healthpb.NewHealthClient(conn).Check(hctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(false))
		return err
	}
	rogue := rogueCA.clientCert(t, "envoy")
	for name, c := range map[string]*tls.Config{"no client certificate": envoyTLS(nil), "certificate of another CA": envoyTLS(&rogue)} {
		conn, err := standin.Dial(gl.Addr().String(), c)
		if err != nil {
			t.Fatal(err)
		}
		if err := health(conn); err == nil {
			t.Errorf("%s: ext_proc accepted the connection", name)
		}
		conn.Close()
	}
	envoyCert := envoyCA.clientCert(t, "envoy")
	conn, err := standin.Dial(gl.Addr().String(), envoyTLS(&envoyCert))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := health(conn); err != nil || presented.Load() != serial1 {
		t.Fatalf("health over mTLS: %v (server certificate %d, want %d)", err, presented.Load(), serial1)
	}

	llm := mockllm.New(mockllm.Config{TokenDelay: time.Millisecond})
	u, _ := url.Parse(httptestServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.URL.Path = strings.TrimPrefix(r.URL.Path, "/capped") // both routes reach the one mock
		llm.ServeHTTP(w, r)
	})))
	proxy, err := standin.New(standin.Config{ExtProc: conn, Upstream: u, MessageTimeout: 10 * time.Second,
		Routes: []standin.Route{
			{Prefix: "/capped/", InitialMetadata: map[string]string{"x-tokengate-policy": "capped"}},
			{Prefix: "/"},
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	front := httptestServer(t, proxy.Handler())
	client := func(base string) *openai.Client {
		c := openai.NewClient(option.WithBaseURL(base), option.WithAPIKey("k"), option.WithHeader("x-user-id", "u1"), option.WithMaxRetries(0))
		return &c
	}
	ask := func(max int64) openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{Model: "gpt-4o-mini", MaxTokens: openai.Int(max),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")}}
	}

	// Admitted: 250 output tokens of the 300-token burst are used.
	if _, err := client(front+"/v1/").Chat.Completions.New(context.Background(), ask(250)); err != nil {
		t.Fatalf("admitted request: %v", err)
	}
	// Refused: the bucket no longer holds another 100 (S8, S16).
	_, err = client(front+"/v1/").Chat.Completions.New(context.Background(), ask(100))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusTooManyRequests {
		t.Errorf("request over the remaining budget: %v, want 429", err)
	}
	// Cut off: the capped policy ends the stream at 20 output tokens (S14).
	stream := client(front+"/capped/v1/").Chat.Completions.NewStreaming(context.Background(), ask(100))
	var finish string
	chunks := 0
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			if c.Delta.Content != "" {
				chunks++
			}
			if c.FinishReason != "" {
				finish = c.FinishReason
			}
		}
	}
	if err := stream.Err(); err != nil || finish != "length" || chunks == 0 || chunks > 21 {
		t.Errorf("capped stream: %d content chunks, finish %q, err %v; want a cut at 20 with finish_reason length", chunks, finish, err)
	}
	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer rcancel()
	recs, err := llm.WaitRequests(rctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if last := recs[len(recs)-1]; !last.Cancelled || last.TokensSent >= last.TokensPlanned {
		t.Errorf("upstream of the cut stream: %+v, want it cancelled before its end", last)
	}

	// Rotation: the next connection sees the new certificate, no restart.
	cert2, key2, serial2 := serverCA.issue(t, "tokengate", true)
	replace(t, keyFile, key2)
	replace(t, certFile, cert2)
	conn2, err := standin.Dial(gl.Addr().String(), envoyTLS(&envoyCert))
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close()
	if err := health(conn2); err != nil || presented.Load() != serial2 {
		t.Errorf("after rotation: %v, server certificate %d, want %d", err, presented.Load(), serial2)
	}
	if err := health(conn); err != nil {
		t.Errorf("the connection opened before the rotation: %v", err)
	}
}

// validate and serve apply one rule (in package config): an ext_proc listener
// on a non-loopback address without client certificates is refused by both,
// in the same words, and serve refuses before it listens.
func TestNonLoopbackPlaintextRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "open.yaml")
	yaml := "listeners: {grpc: \"0.0.0.0:0\", admin: \"127.0.0.1:0\"}\npolicies: [{name: p, buckets: [{name: g, tokens_per_minute: 60}]}]\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	const want = `listeners.grpc: "0.0.0.0:0" is not a loopback address and has no TLS`
	var out, errOut bytes.Buffer
	if err := run(context.Background(), []string{"validate", path}, nil, &out, &errOut); exitCode(err) != 1 || !strings.Contains(errOut.String(), want) {
		t.Errorf("validate: exit %d, output:\n%s\nwant %q", exitCode(err), errOut.String(), want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := run(ctx, []string{"serve", "--config", path}, nil, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("serve: %v, want %q", err, want)
	}
}
