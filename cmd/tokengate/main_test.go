package main

import (
	"bytes"
	"context"
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
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
)

// The demo is the README's first command: it must exit 0 and show a 429 with
// Retry-After, a 413 and a stream cut with finish_reason "length", and the
// README's excerpt of it must be what it prints.
func TestDemo(t *testing.T) {
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, []string{"demo", "--token-delay", "2ms"}, nil, &out, &errOut); err != nil {
		t.Fatalf("demo: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errOut.String())
	}
	for _, want := range []string{"HTTP 429", "Retry-After: ", "HTTP 413", "allowed 2 retries: 1\n", `finish_reason "length"`, "the upstream was cancelled: true", "admitted again"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out.String())
		}
	}
	checkReadmeDemoExcerpt(t, out.String())
}

// Every YAML file the project ships validates: tokengate configs and Envoy
// configs alike.
func TestValidateShipped(t *testing.T) {
	var files []string
	for _, pattern := range []string{"../../envoy/*.yaml", "../../examples/configs/*.yaml", "../../examples/compose/*.yaml", "../../examples/plain-envoy/*.yaml", "../../config/default.yaml", "demo.yaml"} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) < 6 {
		t.Fatalf("found only %d files: %v", len(files), files)
	}
	var out, errOut bytes.Buffer
	if err := run(context.Background(), append([]string{"validate"}, files...), nil, &out, &errOut); err != nil {
		t.Fatalf("validate: %v\n%s", err, errOut.String())
	}
	if n := strings.Count(out.String(), ": valid "); n != len(files) {
		t.Errorf("%d files reported valid, want %d:\n%s", n, len(files), out.String())
	}
}

// Broken files fail, each naming the field.
func TestValidateBroken(t *testing.T) {
	huge := filepath.Join(t.TempDir(), "huge.yaml")
	if err := os.WriteFile(huge, bytes.Repeat([]byte("# "), config.MaxFileBytes), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct{ file, want string }{
		{huge, "the file is larger than 8 MiB"},
		{"../../config/testdata/invalid/unknown-key.yaml", `store.typo: unknown key "typo"`},
		{"../../config/testdata/invalid/safety-factor.yaml", "policies[0].buckets[0].provider_limit.safety_factor: must be in (0, 1]"},
		{"../../envoy/testdata/invalid/grpc-cluster-missing.yaml", `cluster "tokengat" does not exist`},
		{"../../envoy/testdata/invalid/router-not-last.yaml", "(router-last)"},
		{"does-not-exist.yaml", "no such file"},
	} {
		var out, errOut bytes.Buffer
		err := run(context.Background(), []string{"validate", tt.file}, nil, &out, &errOut)
		if err == nil || exitCode(err) != 1 {
			t.Errorf("validate %s: err %v, want failure", tt.file, err)
		}
		if !strings.Contains(errOut.String(), tt.want) {
			t.Errorf("validate %s: output lacks %q:\n%s", tt.file, tt.want, errOut.String())
		}
	}
}

// serve runs the real wiring: gRPC health, admin endpoints, a request through
// the Envoy stand-in, and a graceful shutdown that flips health first.
func TestServe(t *testing.T) {
	cfg, err := config.Parse("test.yaml", []byte(`
policies:
  - name: default
    identities: [{name: user, header: x-user-id}]
    buckets:
      - {name: user, per: user, tokens_per_minute: 6000, burst: 500}
`))
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
	defer func() { cancel(); <-done }()

	admin := "http://" + al.Addr().String()
	poll(t, func() error { return getOK(admin + "/readyz") })
	conn, err := grpc.NewClient(gl.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	hr, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "envoy.service.ext_proc.v3.ExternalProcessor"})
	if err != nil || hr.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v %v", hr, err)
	}

	// One request through the stand-in to the served tokengate.
	llm := mockllm.New(mockllm.Config{})
	up := httptestServer(t, llm)
	u, err := url.Parse(up)
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := standin.New(standin.Config{ExtProc: conn, Upstream: u, MessageTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	front := httptestServer(t, proxy.Handler())
	client := openai.NewClient(option.WithBaseURL(front+"/v1/"), option.WithAPIKey("k"), option.WithHeader("x-user-id", "u1"), option.WithMaxRetries(0))
	_, err = client.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model:     "gpt-4o-mini",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
		MaxTokens: openai.Int(600),
	})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("a request above the 500-token burst: err %v, want 413", err)
	}
	if _, err := client.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model:     "gpt-4o-mini",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
		MaxTokens: openai.Int(20),
	}); err != nil {
		t.Errorf("admitted request: %v", err)
	}
	// A request's outcome is recorded when its side stream ends, just after
	// the client has its answer.
	poll(t, func() error {
		metrics, err := getBody(admin + "/metrics")
		if err != nil {
			return err
		}
		for _, want := range []string{`tokengate_requests_total{decision="never_admissible",policy="default"} 1`, `tokengate_requests_total{decision="admitted",policy="default"} 1`} {
			if !strings.Contains(metrics, want) {
				return fmt.Errorf("metrics lack %s", want)
			}
		}
		return nil
	})

	// Shutdown: health flips to NOT_SERVING first, then serve returns.
	watch, err := hc.Watch(context.Background(), &healthpb.HealthCheckRequest{Service: ""})
	if err != nil {
		t.Fatal(err)
	}
	if first, err := watch.Recv(); err != nil || first.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("watch: %v %v", first, err)
	}
	cancel()
	if next, err := watch.Recv(); err == nil && next.Status != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health after stop = %v, want NOT_SERVING", next.Status)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve returned %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop within 10s")
	}
	done <- nil // for the deferred cancel-and-wait
}

// Without --config serve runs on the embedded defaults, starts, and says so
// in its first log line; --grpc and --admin move its listeners.
func TestServeEmbeddedDefaultsLogFirst(t *testing.T) {
	var errOut bytes.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // stops right after start-up
	if err := run(ctx, []string{"serve", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"}, nil, io.Discard, &errOut); err != nil {
		t.Fatalf("serve on the embedded defaults: %v\n%s", err, errOut.String())
	}
	first, _, _ := strings.Cut(errOut.String(), "\n")
	if !strings.Contains(first, "embedded defaults") {
		t.Errorf("first log line = %q, want it to say embedded defaults are used", first)
	}
	if !strings.Contains(errOut.String(), `"msg":"listening"`) {
		t.Errorf("serve never listened:\n%s", errOut.String())
	}
}

func poll(t *testing.T, f func() error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready within 10s: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
}

func getBody(u string) (string, error) {
	resp, err := http.Get(u)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("%s: %d %s", u, resp.StatusCode, b)
	}
	return string(b), err
}

func getOK(u string) error { _, err := getBody(u); return err }

func httptestServer(t *testing.T, h http.Handler) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Error(err)
		}
	})
	return "http://" + l.Addr().String()
}
