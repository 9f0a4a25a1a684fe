package rlxds

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	rlsconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// TestNackPause: the same refusal again is NACKed after 100 ms, doubling
// up to 5 s.
func TestNackPause(t *testing.T) {
	for repeat, want := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 6: 3200 * time.Millisecond, 7: 5 * time.Second, 1000: 5 * time.Second} {
		if got := nackPause(repeat); got != want {
			t.Errorf("nackPause(%d) = %v, want %v", repeat, got, want)
		}
	}
}

// managementServer is go-control-plane's xDS server with a snapshot cache,
// as Envoy Gateway runs it for its rate-limit deployment (§4.3): ADS off,
// snapshots by node id. It records every request it receives.
type managementServer struct {
	cache cachev3.SnapshotCache
	conn  *grpc.ClientConn

	mu       sync.Mutex
	requests []*discoveryv3.DiscoveryRequest
	changed  chan struct{}
}

func newManagementServer(t *testing.T) *managementServer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	m := &managementServer{cache: cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil), changed: make(chan struct{}, 64)}
	srv := serverv3.NewServer(ctx, m.cache, serverv3.CallbackFuncs{
		StreamRequestFunc: func(_ int64, req *discoveryv3.DiscoveryRequest) error {
			m.mu.Lock()
			m.requests = append(m.requests, req)
			m.mu.Unlock()
			// Never block the server: a NACKed snapshot is sent again
			// at once (the cache answers a version it does not have), so
			// requests can outrun a test that is not waiting yet; one
			// pending signal is enough, waitRequest scans them all.
			select {
			case m.changed <- struct{}{}:
			default:
			}
			return nil
		},
	})
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(gs, srv)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient("passthrough:///envoy-gateway",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	m.conn = cc
	return m
}

func (m *managementServer) publish(t *testing.T, node, version string, configs ...*rlsconfv3.RateLimitConfig) {
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

// waitRequest waits for a request that ok accepts and returns it.
func (m *managementServer) waitRequest(t *testing.T, what string, ok func(*discoveryv3.DiscoveryRequest) bool) *discoveryv3.DiscoveryRequest {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		m.mu.Lock()
		for _, r := range m.requests {
			if ok(r) {
				m.mu.Unlock()
				return r
			}
		}
		m.mu.Unlock()
		select {
		case <-m.changed:
		case <-deadline:
			t.Fatalf("the management server saw no %s", what)
		}
	}
}

func quota(domain string, unit rlsconfv3.RateLimitUnit, rpu uint32) *rlsconfv3.RateLimitConfig {
	return &rlsconfv3.RateLimitConfig{
		Name: domain, Domain: domain,
		Descriptors: []*rlsconfv3.RateLimitDescriptor{{
			Key: "backend_name", Value: "default/openai",
			Descriptors: []*rlsconfv3.RateLimitDescriptor{{
				Key: "model_name_override", QuotaMode: true,
				RateLimit: &rlsconfv3.RateLimitPolicy{Unit: unit, RequestsPerUnit: rpu},
			}},
		}},
	}
}

// Against go-control-plane's own xDS server: the client subscribes as its
// node, applies a snapshot that loads and ACKs its version, NACKs one with
// an invalid unit (naming the problem) keeping the version it had, and
// applies the next good one.
func TestWatchAppliesACKsAndNACKs(t *testing.T) {
	m := newManagementServer(t)
	const node = "envoy-ai-gateway-ratelimit"
	m.publish(t, node, "1", quota("ai-gateway-quota", rlsconfv3.RateLimitUnit_HOUR, 1000))

	applied := make(chan []*rlconfig.File, 4)
	// The pause before a refusal is NACKed again, held until released.
	waits, release := make(chan int, 4), make(chan struct{})
	wait := func(ctx context.Context, repeat int) error {
		waits <- repeat
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, m.conn, Options{NodeID: node, NodeMetadata: map[string]string{"zone": "a"}, wait: wait}, func(fs []*rlconfig.File) error {
			applied <- fs
			return nil
		})
	}()
	check := func(want uint32) {
		t.Helper()
		select {
		case fs := <-applied:
			c, err := rlconfig.Load(fs, rlconfig.Options{})
			if err != nil {
				t.Fatal(err)
			}
			d := descriptor("backend_name", "default/openai", "model_name_override", "gpt-4o")
			if r, _ := c.Limit("ai-gateway-quota", d); r == nil || r.RequestsPerUnit != want || !r.QuotaMode {
				t.Errorf("applied %+v, want %d per hour in quota mode", r, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no configuration applied")
		}
	}
	check(1000)
	first := m.waitRequest(t, "first request", func(r *discoveryv3.DiscoveryRequest) bool { return true })
	if first.GetNode().GetId() != node || first.GetTypeUrl() != rlconfig.ConfigTypeURL || len(first.GetResourceNames()) != 0 ||
		first.GetNode().GetMetadata().GetFields()["zone"].GetStringValue() != "a" {
		t.Errorf("first request %v: want node %s, the RateLimitConfig type, a wildcard", first, node)
	}
	m.waitRequest(t, "ACK of version 1", func(r *discoveryv3.DiscoveryRequest) bool {
		return r.GetVersionInfo() == "1" && r.GetErrorDetail() == nil
	})

	m.publish(t, node, "2", quota("ai-gateway-quota", rlsconfv3.RateLimitUnit_UNKNOWN, 5))
	nack := m.waitRequest(t, "NACK", func(r *discoveryv3.DiscoveryRequest) bool { return r.GetErrorDetail() != nil })
	if nack.GetVersionInfo() != "1" || !strings.Contains(nack.GetErrorDetail().GetMessage(), "invalid rate limit unit 'UNKNOWN'") {
		t.Errorf("NACK %v: want version 1 kept and the invalid unit named", nack)
	}

	// The cache sends the refused snapshot again at once; the client
	// pauses before its second NACK instead of spinning with it.
	select {
	case n := <-waits:
		if n != 1 {
			t.Errorf("paused before NACK %d of the refusal, want the first repeat", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the refused snapshot sent again was NACKed without a pause")
	}
	m.mu.Lock()
	nacks := 0
	for _, r := range m.requests {
		if r.GetErrorDetail() != nil {
			nacks++
		}
	}
	m.mu.Unlock()
	if nacks != 1 {
		t.Errorf("%d NACKs before the pause ended, want 1", nacks)
	}
	// A configuration fixed during the pause is what the NACK fetches.
	m.publish(t, node, "3", quota("ai-gateway-quota", rlsconfv3.RateLimitUnit_HOUR, 2000))
	close(release)
	check(2000)
	m.waitRequest(t, "ACK of version 3", func(r *discoveryv3.DiscoveryRequest) bool {
		return r.GetVersionInfo() == "3" && r.GetErrorDetail() == nil
	})
	select {
	case fs := <-applied:
		t.Errorf("the NACKed snapshot was applied too: %v", fs)
	default:
	}
	cancel()
	if err := <-done; err != context.Canceled {
		t.Errorf("Watch returned %v, want context.Canceled", err)
	}
}

// A configuration the caller refuses is NACKed with the caller's reason.
func TestWatchNACKsWhatApplyRefuses(t *testing.T) {
	m := newManagementServer(t)
	m.publish(t, "envoy-ratelimit", "7", quota("default/eg/http", rlsconfv3.RateLimitUnit_MINUTE, 1))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = Watch(ctx, m.conn, Options{NodeID: "envoy-ratelimit"}, func([]*rlconfig.File) error {
			return errRefused
		})
	}()
	nack := m.waitRequest(t, "NACK", func(r *discoveryv3.DiscoveryRequest) bool { return r.GetErrorDetail() != nil })
	if !strings.Contains(nack.GetErrorDetail().GetMessage(), errRefused.Error()) {
		t.Errorf("NACK message %q", nack.GetErrorDetail().GetMessage())
	}
}
