package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/internal/redistest"
)

// inProcess is one serve running in the test's process on free ports.
type inProcess struct {
	grpc, admin string // admin as a URL
	cancel      context.CancelFunc
	done        chan error
}

// serveInProcess runs serve on cfg until stop is called (or the test ends).
func serveInProcess(t *testing.T, cfg *config.Config, logger *slog.Logger) *inProcess {
	t.Helper()
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
	go func() { s.done <- serve(ctx, cfg, logger, &listeners{grpc: gl, admin: al}) }()
	t.Cleanup(func() { s.stop(t) })
	poll(t, func() error { return getOK(s.admin + "/readyz") })
	return s
}

// stop ends serve and checks that it returned no error; it may be called
// more than once.
func (s *inProcess) stop(t *testing.T) {
	t.Helper()
	s.cancel()
	select {
	case err, ok := <-s.done:
		if ok && err != nil {
			t.Errorf("serve returned %v", err)
		}
		if ok {
			close(s.done)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop within 20s")
	}
}

// metricValue polls the admin listener until the metric reads want (to
// within a millionth).
func metricValue(t *testing.T, admin, metric string, want float64) {
	t.Helper()
	poll(t, func() error {
		body, err := getBody(admin + "/metrics")
		if err != nil {
			return err
		}
		for _, line := range strings.Split(body, "\n") {
			if v, ok := strings.CutPrefix(line, metric+" "); ok {
				got, err := strconv.ParseFloat(v, 64)
				if err == nil && math.Abs(got-want) <= want*1e-6 {
					return nil
				}
				return fmt.Errorf("%s = %s, want %v", metric, v, want)
			}
		}
		return fmt.Errorf("no %s in /metrics", metric)
	})
}

// S20, S21: gateways configured with store.fleet announce themselves in the
// Redis they share; each counts the gateways alive and takes its share of
// the fleet's fallback. A gateway that stops leaves at once, and the others'
// shares grow.
func TestFleetGatewaysCounted(t *testing.T) {
	srv := redistest.Start(t)
	cfg, err := config.Parse("fleet.yaml", []byte(`
store:
  type: redis
  redis: {addrs: [`+srv.Addr+`]}
  on_failure: open
  fallback: {tokens_per_minute: 6000}
  fleet:
    heartbeat: 100ms
    floor: {tokens_per_minute: 1000}
policies:
  - name: default
    buckets: [{name: global, tokens_per_minute: 60000}]
`))
	if err != nil {
		t.Fatal(err)
	}
	var gws []*inProcess
	for range 3 {
		gws = append(gws, serveInProcess(t, cfg, slog.New(slog.DiscardHandler)))
	}
	for _, g := range gws {
		metricValue(t, g.admin, "tokengate_fleet_gateways", 3)
		metricValue(t, g.admin, "tokengate_fallback_tokens_per_minute", 2000)
	}
	gws[2].stop(t)
	for _, g := range gws[:2] {
		metricValue(t, g.admin, "tokengate_fleet_gateways", 2)
		metricValue(t, g.admin, "tokengate_fallback_tokens_per_minute", 3000)
	}
	n, err := redistest.Do(srv.Addr, "ZCARD", cfg.Store.Redis.KeyPrefix+"gateways")
	if err != nil {
		t.Fatal(err)
	}
	if n != "2" {
		t.Errorf("%s gateways in Redis after one stopped, want 2", n)
	}
}

// S8: a stream still open when serve's shutdown grace ends is settled with
// what it used, and that settlement is in Redis when serve has returned:
// the bucket holds its capacity less the prompt and the output delivered.
func TestServeShutdownSettlesIntoRedis(t *testing.T) {
	srv := redistest.Start(t)
	cfg, err := config.Parse("shutdown.yaml", []byte(`
store:
  type: redis
  redis: {addrs: [`+srv.Addr+`]}
shutdown_grace: 100ms
policies:
  - name: default
    buckets: [{name: global, tokens_per_minute: 1, burst: 100000}]
`))
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	s := serveInProcess(t, cfg, slog.New(slog.NewJSONHandler(logs, nil)))

	// The stream stops after five tokens until the client goes away.
	const delivered = 5
	llm := mockllm.New(mockllm.Config{Pace: func(ctx context.Context, i int) error {
		if i == delivered {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}})
	up, err := url.Parse(httptestServer(t, llm))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(s.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	proxy, err := standin.New(standin.Config{ExtProc: conn, Upstream: up, MessageTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	front := httptestServer(t, proxy.Handler())
	resp, err := http.Post(front+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"gpt-4o-mini","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"hello"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	// Read until the five tokens are through.
	var got strings.Builder
	buf := make([]byte, 4096)
	for strings.Count(got.String(), `"content"`) < delivered {
		n, err := resp.Body.Read(buf)
		if err != nil {
			t.Fatalf("reading the stream: %v\n%s", err, got.String())
		}
		got.Write(buf[:n])
	}

	s.stop(t)
	var settled float64 = -1
	for _, line := range strings.Split(logs.String(), "\n") {
		var l struct {
			Msg     string
			Outcome string
			Settled float64
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "request finished" && l.Outcome == "shutdown" {
			settled = l.Settled
		}
	}
	if settled < delivered {
		t.Fatalf("no request settled at shutdown with at least %d tokens:\n%s", delivered, logs.String())
	}
	b, _, err := cfg.Policies[0].Buckets[0].Limit()
	if err != nil {
		t.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	store := redisstore.New(client, redisstore.Options{Prefix: cfg.Store.Redis.KeyPrefix})
	d, err := store.Reserve(context.Background(), buckets.Request{Buckets: []buckets.Bucket{{Name: "global", Key: "tg:default:global:%2A", Limit: b}}})
	if err != nil {
		t.Fatal(err)
	}
	// Refill over the test's few seconds is under a token.
	if got, want := d.Buckets[0].Remaining, b.Capacity-settled; got < want-1 || got > want+1 {
		t.Errorf("bucket at %v after serve returned, want %v (capacity less the %v tokens settled at shutdown)", got, want, settled)
	}
}
