package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// go-redis's own messages come out as slog JSON lines, at warn, marked as
// go-redis's.
func TestRedisLogsAreJSON(t *testing.T) {
	var buf bytes.Buffer
	redisLogger{slog.New(slog.NewJSONHandler(&buf, nil))}.Printf(context.Background(), "redis: connection pool: %s", "dial tcp 127.0.0.1:1: connection refused")
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
		t.Fatalf("not one JSON line: %q: %v", buf.String(), err)
	}
	for k, want := range map[string]string{"level": "WARN", "component": "go-redis", "msg": "connection pool: dial tcp 127.0.0.1:1: connection refused"} {
		if line[k] != want {
			t.Errorf("%s = %v, want %q", k, line[k], want)
		}
	}
}

// syncBuffer is a bytes.Buffer that a command may write while the test
// reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// demo --serve logs JSON lines to stderr and serves /metrics like serve.
func TestDemoServeLogsAndMetrics(t *testing.T) {
	var out, errOut syncBuffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"demo", "--serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"}, nil, &out, &errOut)
	}()
	var started struct {
		Standin string `json:"envoy_standin"`
		Admin   string `json:"admin"`
	}
	poll(t, func() error {
		for _, line := range strings.Split(errOut.String(), "\n") {
			if strings.Contains(line, "demo stack listening") {
				return json.Unmarshal([]byte(line), &started)
			}
		}
		return fmt.Errorf("not started: %s", errOut.String())
	})
	req, err := http.NewRequest(http.MethodPost, started.Standin+"/v1/chat/completions",
		strings.NewReader(`{"model":"gpt-4o-mini","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-user-id", "me")
	req.Header.Set("content-type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("request through the demo stack: %s", resp.Status)
	}
	poll(t, func() error {
		m, err := getBody(started.Admin + "/metrics")
		if err != nil {
			return err
		}
		if want := `tokengate_requests_total{decision="admitted",policy="demo"} 1`; !strings.Contains(m, want) {
			return fmt.Errorf("metrics lack %s", want)
		}
		return nil
	})
	if err := getOK(started.Admin + "/readyz"); err != nil {
		t.Error(err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("demo --serve did not stop within 10s")
	}
	for _, line := range strings.Split(strings.TrimSpace(errOut.String()), "\n") {
		if !json.Valid([]byte(line)) {
			t.Errorf("stderr line is not JSON: %q", line)
		}
	}
	if !strings.Contains(out.String(), "/metrics") {
		t.Errorf("stdout does not say where the metrics are:\n%s", out.String())
	}
}
