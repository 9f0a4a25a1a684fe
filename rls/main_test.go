package rls_test

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/tokengate/tokengate/internal/redistest"
)

// The package's tests share one Redis server and one Redis Cluster,
// started on first use and stopped when the tests end; each test keys its
// buckets under a prefix of its own.

// keeper is the testing.TB that the shared servers are started with: it
// keeps their cleanups for TestMain, and turns a failure to start into a
// panic that fails the test which asked for them.
type keeper struct {
	testing.TB // nil: only the methods below are called
	mu         sync.Mutex
	cleanups   []func()
	skip       string
}

func (k *keeper) Helper()                           {}
func (k *keeper) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }
func (k *keeper) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (k *keeper) Errorf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "redis: "+format+"\n", args...)
}
func (k *keeper) Skipf(format string, args ...any) {
	k.skip = fmt.Sprintf(format, args...)
	panic(k.skip)
}
func (k *keeper) Cleanup(f func()) { k.mu.Lock(); k.cleanups = append(k.cleanups, f); k.mu.Unlock() }
func (k *keeper) TempDir() string {
	d, err := os.MkdirTemp("", "tokengate-rls-redis-")
	if err != nil {
		panic(err)
	}
	k.Cleanup(func() { os.RemoveAll(d) })
	return d
}

var (
	servers      = &keeper{}
	redisOnce    sync.Once
	redisAddr    string
	redisErr     string
	clusterOnce  sync.Once
	clusterAddrs []string
	clusterErr   string
)

func TestMain(m *testing.M) {
	code := m.Run()
	for i := len(servers.cleanups) - 1; i >= 0; i-- {
		servers.cleanups[i]()
	}
	os.Exit(code)
}

// start runs f, returning what it panicked with.
func start(f func()) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			msg = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}

// redisServer is the shared Redis server's address.
func redisServer(t *testing.T) string {
	t.Helper()
	redisOnce.Do(func() { redisErr = start(func() { redisAddr = redistest.Start(servers).Addr }) })
	if redisErr != "" {
		if servers.skip != "" {
			t.Skip(servers.skip)
		}
		t.Fatal(redisErr)
	}
	return redisAddr
}

// redisCluster is the shared Redis Cluster's masters.
func redisCluster(t *testing.T) []string {
	t.Helper()
	clusterOnce.Do(func() { clusterErr = start(func() { clusterAddrs = redistest.StartCluster(servers).Addrs }) })
	if clusterErr != "" {
		if servers.skip != "" {
			t.Skip(servers.skip)
		}
		t.Fatal(clusterErr)
	}
	return clusterAddrs
}
