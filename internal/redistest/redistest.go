// Package redistest starts real Redis servers for tests: a standalone
// redis-server, and a three-master Redis Cluster built from redis-server
// processes. Each runs on free loopback ports in a t.TempDir and is stopped
// when the test ends.
//
// When redis-server is not installed the test is skipped with a clear
// message — except when the CI environment variable is set: CI must never
// skip Redis, so there the test fails.
package redistest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// startTimeout bounds how long a server may take to answer PING.
const startTimeout = 10 * time.Second

// Server is one redis-server process. Its methods are safe for use from the
// test goroutine and its cleanup; they are not meant for concurrent use.
type Server struct {
	// Addr is host:port of the server.
	Addr string

	t      testing.TB
	bin    string
	dir    string
	args   []string
	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	stderr *strings.Builder
}

// Binary returns the path of redis-server, or skips (fails under CI) the
// test when it is missing.
func Binary(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("redis-server is not installed, and CI must not skip Redis tests: %v (install Debian's redis-server)", err)
		}
		t.Skipf("redis-server is not installed (apt-get install redis-server); skipping Redis tests: %v", err)
	}
	return bin
}

// Start starts a standalone redis-server on a free loopback port. It is
// stopped at the end of the test.
func Start(t testing.TB) *Server {
	t.Helper()
	return start(t, "no")
}

// StartPersistent starts a standalone redis-server as Start does, that
// writes every command to its append-only file before it answers: killed
// and restarted (Kill, Restart), it comes back with its data, as a
// production Redis with persistence does after a crash.
func StartPersistent(t testing.TB) *Server {
	t.Helper()
	return start(t, "yes")
}

func start(t testing.TB, appendonly string) *Server {
	t.Helper()
	bin := Binary(t)
	s := &Server{t: t, bin: bin, dir: t.TempDir()}
	port := freePort(t, false)
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	s.args = []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", appendonly, "--appendfsync", "always",
		"--dir", s.dir, "--protected-mode", "no", "--enable-debug-command", "local"}
	t.Cleanup(s.Stop)
	if err := s.start(); err != nil {
		t.Fatal(err)
	}
	return s
}

func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	cmd := exec.Command(s.bin, s.args...)
	cmd.Dir = s.dir
	s.stderr = new(strings.Builder)
	cmd.Stdout, cmd.Stderr = s.stderr, s.stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("redistest: start redis-server: %w", err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	s.cmd, s.done = cmd, done
	deadline := time.Now().Add(startTimeout)
	for {
		if reply, err := Do(s.Addr, "PING"); err == nil && reply == "PONG" {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("redistest: redis-server on %s exited: %s", s.Addr, s.stderr)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redistest: redis-server on %s did not answer PING within %v", s.Addr, startTimeout)
		}
	}
}

// PID returns the process ID of the running server, or 0 when it is
// stopped; benchmarks read its CPU time from /proc.
func (s *Server) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return 0
	}
	return s.cmd.Process.Pid
}

// Kill stops the server abruptly (SIGKILL), as a crash would.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}

// Restart starts the server again on the same address after Kill or Stop.
// Its data is gone, unless it was started with StartPersistent.
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	if err := s.start(); err != nil {
		s.t.Fatal(err)
	}
}

// Stop stops the server. It is safe to call more than once.
func (s *Server) Stop() { s.Kill() }

// StartUnix starts a standalone redis-server that listens on a unix socket
// only, no TCP port: Addr is the socket's path. The socket lives in a
// short directory of its own, as a socket path must fit in 108 bytes.
func StartUnix(t testing.TB) *Server {
	t.Helper()
	bin := Binary(t)
	dir, err := os.MkdirTemp("", "redis")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &Server{t: t, bin: bin, dir: dir, Addr: filepath.Join(dir, "redis.sock")}
	s.args = []string{"--port", "0", "--unixsocket", s.Addr, "--unixsocketperm", "700",
		"--save", "", "--appendonly", "no", "--dir", dir, "--enable-debug-command", "local"}
	t.Cleanup(s.Stop)
	if err := s.start(); err != nil {
		t.Fatal(err)
	}
	return s
}

// StartReplica starts a standalone redis-server replicating master, and
// returns once the replica has synchronised.
func StartReplica(t testing.TB, master *Server) *Server {
	t.Helper()
	r := Start(t)
	host, port, _ := net.SplitHostPort(master.Addr)
	if _, err := Do(r.Addr, "REPLICAOF", host, port); err != nil {
		t.Fatalf("redistest: REPLICAOF %s: %v", master.Addr, err)
	}
	deadline := time.Now().Add(startTimeout)
	for {
		info, err := Do(r.Addr, "INFO", "replication")
		if err == nil && strings.Contains(info, "master_link_status:up") {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("redistest: replica %s did not synchronise with %s within %v: %s %v", r.Addr, master.Addr, startTimeout, info, err)
		}
		time.Sleep(10 * time.Millisecond) // polling the replica, with the deadline above
	}
}

// StartSentinel starts a Redis Sentinel on a free port that monitors
// master under name, with a quorum of one: on its own it can fail the
// master over (SENTINEL FAILOVER) to a replica.
func StartSentinel(t testing.TB, master *Server, name string) *Server {
	t.Helper()
	bin := Binary(t)
	s := &Server{t: t, bin: bin, dir: t.TempDir()}
	port := freePort(t, false)
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	host, mport, _ := net.SplitHostPort(master.Addr)
	conf := filepath.Join(s.dir, "sentinel.conf")
	// Sentinel rewrites its configuration file as it learns, so the file
	// is its own.
	body := fmt.Sprintf("port %d\nbind 127.0.0.1\nprotected-mode no\ndir %s\n"+
		"sentinel monitor %s %s %s 1\nsentinel down-after-milliseconds %s 1000\nsentinel failover-timeout %s 10000\n",
		port, s.dir, name, host, mport, name, name)
	if err := os.WriteFile(conf, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	s.args = []string{conf, "--sentinel"}
	t.Cleanup(s.Stop)
	if err := s.start(); err != nil {
		t.Fatal(err)
	}
	return s
}

// MasterOf asks the sentinel at addr for the address of the master it
// knows as name.
func MasterOf(addr, name string) (string, error) {
	reply, err := Do(addr, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", name)
	if err != nil {
		return "", err
	}
	host, port, ok := strings.Cut(reply, "\n")
	if !ok {
		return "", fmt.Errorf("redistest: sentinel %s knows no master %s: %q", addr, name, reply)
	}
	return net.JoinHostPort(host, port), nil
}

// Cluster is a Redis Cluster of three masters without replicas.
type Cluster struct {
	// Addrs holds host:port of each master.
	Addrs   []string
	Servers []*Server
}

// StartCluster starts three cluster-enabled redis-server processes, assigns
// the hash slots among them and waits until the cluster reports state ok.
// The servers are stopped at the end of the test.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	bin := Binary(t)
	c := &Cluster{}
	for range 3 {
		s := &Server{t: t, bin: bin, dir: t.TempDir()}
		port := freePort(t, true)
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		s.args = []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no", "--dir", s.dir, "--protected-mode", "no", "--enable-debug-command", "local",
			"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(s.dir, "nodes.conf"),
			"--cluster-node-timeout", "5000"}
		t.Cleanup(s.Stop)
		if err := s.start(); err != nil {
			t.Fatal(err)
		}
		c.Servers = append(c.Servers, s)
		c.Addrs = append(c.Addrs, s.Addr)
	}
	// Assign slots by hand and introduce the nodes: this needs only
	// redis-server, not redis-cli.
	const slots = 16384
	for i, s := range c.Servers {
		lo, hi := i*slots/3, (i+1)*slots/3-1
		if _, err := Do(s.Addr, "CLUSTER", "ADDSLOTSRANGE", strconv.Itoa(lo), strconv.Itoa(hi)); err != nil {
			t.Fatalf("redistest: assign slots %d-%d to %s: %v", lo, hi, s.Addr, err)
		}
		if _, err := Do(s.Addr, "CLUSTER", "SET-CONFIG-EPOCH", strconv.Itoa(i+1)); err != nil {
			t.Fatalf("redistest: config epoch on %s: %v", s.Addr, err)
		}
	}
	host0, port0, _ := net.SplitHostPort(c.Addrs[0])
	for _, s := range c.Servers[1:] {
		if _, err := Do(s.Addr, "CLUSTER", "MEET", host0, port0); err != nil {
			t.Fatalf("redistest: cluster meet from %s: %v", s.Addr, err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, s := range c.Servers {
		for {
			info, err := Do(s.Addr, "CLUSTER", "INFO")
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_known_nodes:3") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("redistest: cluster did not become ready on %s: %v %s", s.Addr, err, info)
			}
			<-time.After(20 * time.Millisecond) // poll the server, with the deadline above
		}
	}
	return c
}

// freePort returns a loopback port that is free now; for a cluster node the
// bus port (port + 10000) must be free too.
func freePort(t testing.TB, bus bool) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("redistest: find a free port: %v", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		if !bus {
			l.Close()
			return port
		}
		if port+10000 < 65536 {
			if lb, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000))); err == nil {
				lb.Close()
				l.Close()
				return port
			}
		}
		l.Close()
	}
	t.Fatal("redistest: no free port pair found")
	return 0
}

// Sleep makes the server at addr busy for d (DEBUG SLEEP, sent from a
// connection of its own), as a slow command or a fork would: it answers
// nothing meanwhile, while commands sent to it wait in their sockets and
// run when it wakes — also those of clients that gave up waiting and
// closed their connection. Sleep returns once the command is written, so
// that the caller's next command reaches the server after it; the
// server's reply is read at the end of the test.
func Sleep(t testing.TB, addr string, d time.Duration) {
	t.Helper()
	conn, err := net.DialTimeout(network(addr), addr, 2*time.Second)
	if err != nil {
		t.Fatalf("redistest: sleep %s: %v", addr, err)
	}
	// A PING answered first: the server has accepted the connection, so
	// it reads the DEBUG SLEEP before commands written after it.
	rd := bufio.NewReader(conn)
	conn.SetDeadline(time.Now().Add(startTimeout))
	if _, err := conn.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		conn.Close()
		t.Fatalf("redistest: sleep %s: %v", addr, err)
	}
	if reply, err := readReply(rd); err != nil || reply != "PONG" {
		conn.Close()
		t.Fatalf("redistest: sleep %s: PING = %q, %v", addr, reply, err)
	}
	sec := strconv.FormatFloat(d.Seconds(), 'f', 3, 64)
	if _, err := fmt.Fprintf(conn, "*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$%d\r\n%s\r\n", len(sec), sec); err != nil {
		conn.Close()
		t.Fatalf("redistest: sleep %s: %v", addr, err)
	}
	t.Cleanup(func() {
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(d + startTimeout))
		if reply, err := readReply(rd); err != nil || reply != "OK" {
			t.Errorf("redistest: DEBUG SLEEP on %s = %q, %v", addr, reply, err)
		}
	})
}

// Do sends one command to the server at addr over a fresh connection and
// returns its reply as text (simple strings, errors and bulk strings; the
// elements of an array are joined by newlines).
func Do(addr string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, network(addr), addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	conn.SetDeadline(deadline)
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := conn.Write([]byte(b.String())); err != nil {
		return "", err
	}
	return readReply(bufio.NewReader(conn))
}

// network is the network of an address: a path starting with / is a unix
// socket's, as go-redis reads it.
func network(addr string) string {
	if strings.HasPrefix(addr, "/") {
		return "unix"
	}
	return "tcp"
}

func readReply(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return "", fmt.Errorf("redistest: empty reply")
	}
	switch line[0] {
	case '+', ':':
		return line[1:], nil
	case '-':
		return "", fmt.Errorf("redis: %s", line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", err
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(line[1:])
		if err != nil {
			return "", err
		}
		parts := make([]string, 0, max(n, 0))
		for range n {
			p, err := readReply(r)
			if err != nil {
				return "", err
			}
			parts = append(parts, p)
		}
		return strings.Join(parts, "\n"), nil
	}
	return "", fmt.Errorf("redistest: unexpected reply %q", line)
}
