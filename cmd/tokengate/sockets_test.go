package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// socketDir is a short directory for unix sockets, whose paths must fit in
// 108 bytes (t.TempDir's may not).
func socketDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "tg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// spent is what a run charged team acme so far: tokens, and money at $1 per
// million input and $2 per million output tokens (exitsConfig).
type spent struct {
	tokens int
	money  float64
}

// chargeOne sends one chat request of team acme with the OpenAI SDK through
// the stand-in in front of the served tokengate, the n-th request of the
// run, and checks that it settled the usage the answer reports and that
// the day's quotas hold exactly before plus that usage.
func chargeOne(t *testing.T, bin string, p *served, cfg *config.Config, n int, before spent) spent {
	t.Helper()
	front := standInFor(t, p.grpc, cfg)
	client := openai.NewClient(option.WithBaseURL(front+"/v1/"), option.WithAPIKey("sk-acme"),
		option.WithHeader("x-team", "acme"), option.WithHeader("x-test-policy", "default"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	answer, err := client.Chat.Completions.New(ctx, exitParams())
	if err != nil {
		t.Fatalf("request %d: %v", n, err)
	}
	u := answer.Usage
	if f := awaitFinished(t, p, "complete", n); f.Settled != int(u.TotalTokens) || u.TotalTokens == 0 {
		t.Errorf("request %d settled %d tokens, want the %d its answer reports", n, f.Settled, u.TotalTokens)
	}
	now := spent{before.tokens + int(u.TotalTokens), before.money + float64(u.PromptTokens)*1e-6 + float64(u.CompletionTokens)*2e-6}
	checkCharged(t, bin, p.admin, now.tokens, now.money)
	return now
}

// ratelimit's GRPC_UDS and REDIS_SOCKET_TYPE=unix: tokengate serves
// ext_proc on a unix socket (listeners.grpc: unix:PATH) and reaches Redis
// on its unix socket (store.redis.addrs: [unix:PATH]). The Redis here
// listens on no TCP port, so the charge can only have gone through the
// socket.
func TestServeOverUnixSockets(t *testing.T) {
	bin := tokengateBinary(t)
	rs := redistest.StartUnix(t)
	grpcSock := filepath.Join(socketDir(t), "grpc.sock")
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, exitsConfig(fmt.Sprintf("store: {type: redis, redis: {addrs: [%q]}}", "unix:"+rs.Addr)))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}, "--config", file, "--grpc", "unix:"+grpcSock, "--log-level", "debug")
	if p.grpc != grpcSock {
		t.Fatalf("listening on %q, want the socket %q", p.grpc, grpcSock)
	}
	p.grpc = "unix:" + grpcSock
	chargeOne(t, bin, p, cfg, 1, spent{})
	if keys, err := redistest.Do(rs.Addr, "DBSIZE"); err != nil || keys == "0" {
		t.Errorf("Redis on the socket holds %q keys (%v), want the charge's", keys, err)
	}
	p.stop(t)
	if _, err := os.Lstat(grpcSock); !os.IsNotExist(err) {
		t.Errorf("the socket file is still there after a clean stop: %v", err)
	}
}

// A unix socket that an ended process left behind is removed and listened
// on again; a socket someone listens on, or a file that is not a socket,
// is refused with an error naming it, and left alone.
func TestUnixListenerLeftBehind(t *testing.T) {
	bin := tokengateBinary(t)
	dir := socketDir(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, "store: {type: memory}\npolicies: [{name: default, buckets: [{name: all, tokens_per_minute: 60000}]}]\n")

	stale := filepath.Join(dir, "stale.sock")
	l, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close() // the file stays, nothing answers on it: a crash's leftover
	p := startServe(t, bin, nil, "--config", file, "--grpc", "unix:"+stale)
	if p.grpc != stale {
		t.Fatalf("listening on %q, want %q", p.grpc, stale)
	}

	// The socket just opened is in use: a second gateway must not take it.
	out, err := cli(t, bin, "serve", "--config", file, "--grpc", "unix:"+stale, "--admin", "127.0.0.1:0")
	if err == nil || !strings.Contains(out, "another process listens on this socket") {
		t.Errorf("second serve on a socket in use: %v\n%s", err, out)
	}
	p.stop(t)

	plain := filepath.Join(dir, "plain")
	writeFile(t, plain, "not a socket")
	out, err = cli(t, bin, "serve", "--config", file, "--grpc", "unix:"+plain, "--admin", "127.0.0.1:0")
	if err == nil || !strings.Contains(out, "exists and is not a unix socket") {
		t.Errorf("serve on a regular file: %v\n%s", err, out)
	}
	if b, err := os.ReadFile(plain); err != nil || string(b) != "not a socket" {
		t.Errorf("the file was touched: %q, %v", b, err)
	}

	out, err = cli(t, bin, "serve", "--config", file, "--grpc", "unix:relative.sock", "--admin", "127.0.0.1:0")
	if err == nil || !strings.Contains(out, "a unix socket needs an absolute path") {
		t.Errorf("serve on a relative socket path: %v\n%s", err, out)
	}
}

// ratelimit's REDIS_TYPE=sentinel: tokengate asks the sentinels for the
// master (store.redis.sentinel) and follows it when they fail over. A
// charge before the failover is on the replica that takes over, and one
// after it lands on the new master, each once.
func TestServeFollowsSentinelFailover(t *testing.T) {
	bin := tokengateBinary(t)
	master := redistest.Start(t)
	replica := redistest.StartReplica(t, master)
	sentinel := redistest.StartSentinel(t, master, "llm")
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, exitsConfig(fmt.Sprintf("store: {type: redis, redis: {sentinel: {master: llm, addrs: [%s]}}}", sentinel.Addr)))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}, "--config", file, "--log-level", "debug")
	first := chargeOne(t, bin, p, cfg, 1, spent{})

	// The replica has the first charge before it takes over.
	deadline := time.Now().Add(10 * time.Second)
	for {
		a, errA := redistest.Do(master.Addr, "DBSIZE")
		b, errB := redistest.Do(replica.Addr, "DBSIZE")
		if errA == nil && errB == nil && a == b && a != "0" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replica did not catch up: master %q %v, replica %q %v", a, errA, b, errB)
		}
		time.Sleep(10 * time.Millisecond) // polling the replica, with the deadline above
	}
	if _, err := redistest.Do(sentinel.Addr, "SENTINEL", "FAILOVER", "llm"); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		// Done when the sentinel names the replica and has made the old
		// master its replica: until then both take writes, and what the
		// old one takes is lost when it follows the new one (Redis
		// replicates asynchronously; docs/operations.md says so).
		addr, err := redistest.MasterOf(sentinel.Addr, "llm")
		role, _ := redistest.Do(replica.Addr, "ROLE")
		old, _ := redistest.Do(master.Addr, "ROLE")
		if err == nil && addr == replica.Addr && strings.HasPrefix(role, "master") && strings.HasPrefix(old, "slave") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no failover within 30s: the sentinel names %q (%v), the replica's role is %q, the old master's %q", addr, err, role, old)
		}
		time.Sleep(20 * time.Millisecond) // polling the sentinel, with the deadline above
	}
	// The gateway follows: the next request is charged on the new master,
	// on top of the first, which it holds.
	deadline = time.Now().Add(30 * time.Second)
	for {
		st, _ := chatHeaders(t, standInFor(t, p.grpc, cfg), map[string]string{"x-team": "probe"})
		if st == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("requests still fail 30s after the failover (%d):\n%s", st, lastLines(p.stderr.String(), 20))
		}
		time.Sleep(50 * time.Millisecond) // polling the gateway, with the deadline above
	}
	chargeOne(t, bin, p, cfg, 3, first) // the probe was the second
	if n, err := redistest.Do(replica.Addr, "DBSIZE"); err != nil || n == "0" {
		t.Errorf("the new master holds %q keys (%v)", n, err)
	}
	p.stop(t)
}
