package main

import (
	"context"
	bin "encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestServeShutdownSavesWhatRedisMissed: a gateway failing open spends
// while Redis is down and stops before Redis is back; what it could not
// replay within its grace goes to store.replay_file, and the next gateway
// started on it replays it as soon as Redis answers, without a request:
// the quota's window in Redis ends with every token that was used.
func TestServeShutdownSavesWhatRedisMissed(t *testing.T) {
	srv := redistest.StartPersistent(t)
	file := filepath.Join(t.TempDir(), "replay.json")
	cfg, err := config.Parse("replay.yaml", []byte(`
store:
  type: redis
  redis: {addrs: [`+srv.Addr+`], dial_timeout: 200ms}
  on_failure: open
  fallback: {tokens_per_minute: 1000000, burst: 100000}
  replay_file: `+file+`
shutdown_grace: 200ms
policies:
  - name: default
    buckets: [{name: global, tokens_per_minute: 1000000, burst: 100000}]
    quotas: [{name: daily, window: day, timezone: UTC, tokens: 1000000}]
`))
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	s := serveInProcess(t, cfg, slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	ask := func(grpcAddr string) {
		t.Helper()
		conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		up, err := url.Parse(httptestServer(t, mockllm.New(mockllm.Config{})))
		if err != nil {
			t.Fatal(err)
		}
		proxy, err := standin.New(standin.Config{ExtProc: conn, Upstream: up, MessageTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer proxy.Close()
		resp, err := http.Post(httptestServer(t, proxy.Handler())+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"hello"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil || resp.StatusCode != 200 {
			t.Fatalf("status %d, %v", resp.StatusCode, err)
		}
	}
	ask(s.grpc) // while Redis answers: the gateway learns the window
	// The settlement goes to Redis after the answer, within its settle
	// window: Redis is killed once it landed, not with it in flight (a
	// settlement whose reply is lost is the ambiguous case, tested in
	// buckets/failover).
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	poll(t, func() error { return windowHolds(client, cfg.Store.Redis.KeyPrefix, settledIn(logs.String())) })
	srv.Kill()
	ask(s.grpc) // admitted by the fallback
	// The outage's spend waits (and the cancellation of the reserve the
	// failed call may have made).
	poll(t, func() error {
		if n := metricNow(t, s.admin, "tokengate_store_replay_pending"); n < 1 {
			return fmt.Errorf("tokengate_store_replay_pending = %v, want writes waiting", n)
		}
		return nil
	})
	metricValue(t, s.admin, "tokengate_store_up", 0)
	s.stop(t)
	if _, err := os.Stat(file); err != nil {
		t.Fatalf("store.replay_file after a shutdown with Redis down: %v\n%s", err, logs.String())
	}

	used := settledIn(logs.String())
	if used == 0 {
		t.Fatalf("no request settled:\n%s", logs.String())
	}
	srv.Restart()
	next := serveInProcess(t, cfg, slog.New(slog.NewJSONHandler(&syncBuffer{}, nil)))
	poll(t, func() error { return windowHolds(client, cfg.Store.Redis.KeyPrefix, used) })
	metricValue(t, next.admin, "tokengate_store_replay_pending", 0)
	if _, err := os.Stat(file); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("store.replay_file still there after it was loaded: %v", err)
	}
}

// settledIn is the sum of the tokens the "request finished" lines of a
// JSON log settled.
func settledIn(logs string) float64 {
	used := 0.0
	for _, line := range strings.Split(logs, "\n") {
		var l struct {
			Msg     string
			Settled float64
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "request finished" {
			used += l.Settled
		}
	}
	return used
}

// windowHolds reports whether the one quota window in Redis holds want
// tokens.
func windowHolds(client *redis.Client, prefix string, want float64) error {
	keys, err := client.Keys(context.Background(), prefix+"q:*").Result()
	if err != nil || len(keys) != 1 {
		return fmt.Errorf("quota keys %q, %v", keys, err)
	}
	v, err := client.Get(context.Background(), keys[0]).Bytes()
	// A packed double and the unit's tag ("t": tokens).
	if err != nil || len(v) != 9 || v[8] != 't' {
		return fmt.Errorf("quota value %q, %v", v, err)
	}
	if got := math.Float64frombits(bin.LittleEndian.Uint64(v)); got != want {
		return fmt.Errorf("the window in Redis holds %v tokens, want the %v used", got, want)
	}
	return nil
}

// metricNow reads a metric without labels from the admin listener.
func metricNow(t *testing.T, admin, metric string) float64 {
	t.Helper()
	body, err := getBody(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, metric+" "); ok {
			got, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return got
		}
	}
	t.Fatalf("no %s in /metrics", metric)
	return 0
}
