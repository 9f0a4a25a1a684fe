package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestServeAnswersRateLimitCalls runs the binary on examples/rls/tokengate.yaml
// and calls ShouldRateLimit on its gRPC listener, beside ext_proc: the
// health service names the rate-limit service, the hits of user alice are
// tokens of her bucket of 20,000, a charge past it is OVER_LIMIT with
// retry-after, the answers are counted in the metrics, and a reload
// of the file swaps the limits the calls meet.
func TestServeAnswersRateLimitCalls(t *testing.T) {
	p, conn, file, data := serveRLSExample(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "envoy.service.ratelimit.v3.RateLimitService"})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of the rate-limit service: %v, %v", h, err)
	}
	rl := rlsv3.NewRateLimitServiceClient(conn)
	call := func(user string, hits uint64) *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "ai-gateway", Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries:    []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: user}},
			HitsAddend: wrapperspb.UInt64(hits),
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		return resp
	}
	st := call("alice", 15000).GetStatuses()[0]
	if st.GetCode() != rlsv3.RateLimitResponse_OK || st.GetCurrentLimit().GetRequestsPerUnit() != 60000 ||
		st.GetCurrentLimit().GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE || st.GetLimitRemaining() < 5000 || st.GetLimitRemaining() > 5100 {
		t.Errorf("15,000 hits of a bucket of 20,000 refilling 60,000 a minute: %v", st)
	}
	over := call("alice", 8000)
	if over.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || len(over.GetResponseHeadersToAdd()) != 1 || over.GetResponseHeadersToAdd()[0].GetKey() != "retry-after" {
		t.Errorf("8,000 more hits: %v, want OVER_LIMIT with retry-after", over)
	}
	m, err := getBody(p.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`tokengate_rls_descriptors_total{code="ok",domain="ai-gateway",kind="limit",policy="ai-gateway"} 1`,
		`tokengate_rls_descriptors_total{code="over_limit",domain="ai-gateway",kind="limit",policy="ai-gateway"} 1`,
		`tokengate_rls_hits_total{direction="charge",domain="ai-gateway",policy="ai-gateway"} 23000`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s:\n%s", want, grepLines(m, "tokengate_rls_"))
		}
	}

	// A reload doubles the refill: the next call meets the new rule.
	changed := strings.Replace(string(data), "tokens_per_minute: 60000", "tokens_per_minute: 120000", 1)
	if changed == string(data) {
		t.Fatal("the example no longer holds tokens_per_minute: 60000")
	}
	if err := os.WriteFile(file, []byte(changed), 0o600); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if call("bob", 0).GetStatuses()[0].GetCurrentLimit().GetRequestsPerUnit() == 120000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reload did not reach the rate-limit service within 20s:\n%s", p.stderr.String())
		}
		time.Sleep(50 * time.Millisecond) // polling the reload, with the deadline above
	}
	p.stop(t)
}

// serveRLSExample runs the binary on examples/rls/tokengate.yaml with
// extra appended (lines of its rls section), and dials its gRPC listener;
// it returns the file it serves and the example's own bytes.
func serveRLSExample(t *testing.T, extra string) (*served, *grpc.ClientConn, string, []byte) {
	t.Helper()
	bin := tokengateBinary(t)
	data, err := os.ReadFile(filepath.Join(repoRoot, "examples/rls/tokengate.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	if err := os.WriteFile(file, append(slices.Clip(data), extra...), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, nil, "--config", file)
	conn, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return p, conn, file, data
}

// TestServeDefersStreamDoneCharges: with the example's domain in
// rls.deferred_charges, the binary answers a call of hits (Envoy's
// stream-done call) OK at once, past the limit, and charges it in the
// background: a check then finds the bucket in debt, and the call is
// counted as deferred (docs/rls.md, "Charges Envoy does not wait for").
func TestServeDefersStreamDoneCharges(t *testing.T) {
	p, conn, _, _ := serveRLSExample(t, "  deferred_charges: [ai-gateway]\n")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rl := rlsv3.NewRateLimitServiceClient(conn)
	call := func(hits uint64) *rlsv3.RateLimitResponse {
		t.Helper()
		resp, err := rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "ai-gateway", Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries:    []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: "dana"}},
			HitsAddend: wrapperspb.UInt64(hits),
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		return resp
	}
	if got := call(30000); got.GetOverallCode() != rlsv3.RateLimitResponse_OK || got.GetStatuses()[0].GetCurrentLimit().GetRequestsPerUnit() != 60000 {
		t.Errorf("a stream-done charge of 30,000 from a bucket of 20,000: %v, want OK at once, naming the limit", got)
	}
	deadline := time.Now().Add(20 * time.Second)
	for call(0).GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
		if time.Now().After(deadline) {
			t.Fatalf("the deferred charge did not reach the bucket within 20s:\n%s", p.stderr.String())
		}
		time.Sleep(10 * time.Millisecond) // polling the charge, with the deadline above
	}
	m, err := getBody(p.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`tokengate_rls_descriptors_total{code="deferred",domain="ai-gateway",kind="limit",policy="ai-gateway"} 1`,
		`tokengate_rls_hits_total{direction="charge",domain="ai-gateway",policy="ai-gateway"} 30000`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s:\n%s", want, grepLines(m, "tokengate_rls_"))
		}
	}
	p.stop(t)
}

// TestServeReadsRatelimitFiles: the binary reads envoyproxy/ratelimit's
// own file through ratelimit.files and answers as ratelimit would: 2 per
// minute per user, the third hit over the limit.
func TestServeReadsRatelimitFiles(t *testing.T) {
	bin := tokengateBinary(t)
	dir := t.TempDir()
	for name, content := range map[string]string{
		"tokengate.yaml": "store: {type: memory}\nratelimit:\n  files: [ratelimit.yaml]\n",
		"ratelimit.yaml": "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	p := startServe(t, bin, nil, "--config", filepath.Join(dir, "tokengate.yaml"))
	conn, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rl := rlsv3.NewRateLimitServiceClient(conn)
	var codes []string
	for range 3 {
		resp, err := rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: "ann"}},
		}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		codes = append(codes, resp.GetOverallCode().String())
		if cl := resp.GetStatuses()[0].GetCurrentLimit(); cl.GetRequestsPerUnit() != 2 || cl.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE {
			t.Errorf("current_limit %v, want 2 per minute", cl)
		}
	}
	if got := strings.Join(codes, " "); got != "OK OK OVER_LIMIT" {
		t.Errorf("three hits of 2 per minute: %s", got)
	}
	p.stop(t)
}

// TestServeAnswersWithMetadataAndLimitHeaders: the binary serving a file
// with rls.response_dynamic_metadata and rls.limit_response_headers (one
// name its own) answers a real call with ratelimit's dynamic metadata,
// the descriptor's metadata included, and the RateLimit-* headers.
func TestServeAnswersWithMetadataAndLimitHeaders(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "tokengate.yaml")
	writeFile(t, file, `
store: {type: memory}
policies:
  - name: p
    identities: [{name: user, header: x-user-id}]
    buckets: [{name: user, per: user, tokens_per_minute: 600, burst: 100, max_debt: 100}]
rls:
  response_dynamic_metadata: true
  limit_response_headers: {enabled: true, remaining_header: X-Tokens-Left}
  domains:
    - domain: ai-gateway
      descriptors:
        - {key: user, identity: user, policy: p, metadata: {tier: standard, route: {cluster: llm}}}
`)
	p := startServe(t, tokengateBinary(t), nil, "--config", file)
	c := newRLSCaller(t, p.grpc)
	resp, err := c.call("ai-gateway", "ann", 40)
	if err != nil {
		t.Fatalf("ShouldRateLimit: %v", err)
	}
	want, err := structpb.NewStruct(map[string]any{
		"domain":      "ai-gateway",
		"descriptors": []any{map[string]any{"entries": []any{"user=ann"}, "hitsAddend": 40}},
		"metadata":    map[string]any{"tier": "standard", "route": map[string]any{"cluster": "llm"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, resp.GetDynamicMetadata(), protocmp.Transform()); d != "" {
		t.Errorf("dynamic metadata (-want +got):\n%s", d)
	}
	var headers []string
	for _, h := range resp.GetResponseHeadersToAdd() {
		headers = append(headers, h.GetKey()+": "+h.GetValue())
	}
	// 40 of a bucket of 100 refilling 600 a minute (10 a second): 60
	// left, full in 4s; the limit is the refill per the unit nearest to a
	// whole refill (10s: 600 per MINUTE).
	if d := cmp.Diff([]string{"RateLimit-Limit: 600", "X-Tokens-Left: 60", "RateLimit-Reset: 4"}, headers); d != "" {
		t.Errorf("headers (-want +got):\n%s\nstatus %v", d, resp.GetStatuses()[0])
	}
	p.stop(t)
}

// TestServeReplaysAChargeLostInARedisStall runs the gateway as the command
// wires it (the Redis store behind the failover store) and sends a
// rate-limit call while Redis is busy for longer than the store's every
// attempt: the call fails as ratelimit without its store does, its
// charge is kept, Redis wakes and runs the copies that waited in its
// connections, and the replay, once Redis answers, applies nothing more.
// The 100 hits count once.
func TestServeReplaysAChargeLostInARedisStall(t *testing.T) {
	srv := redistest.Start(t)
	cfg, err := config.Parse("stall.yaml", []byte(`
store:
  type: redis
  redis: {addrs: [`+srv.Addr+`], timeout: 250ms}
policies:
  - name: p
    identities: [{name: user, header: x-user-id}]
    buckets: [{name: user, per: user, tokens_per_minute: 1, burst: 1000, max_debt: 1000}]
rls:
  domains:
    - domain: d
      descriptors:
        - {key: user, identity: user, policy: p}
`))
	if err != nil {
		t.Fatal(err)
	}
	p := serveInProcess(t, cfg, slog.New(slog.DiscardHandler))
	conn, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	rl := rlsv3.NewRateLimitServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	call := func(user string, hits uint64) (*rlsv3.RateLimitResponse, error) {
		return rl.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries:    []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: user}},
			HitsAddend: wrapperspb.UInt64(hits),
		}}})
	}
	if _, err := call("warm", 1); err != nil { // connected, the scripts loaded
		t.Fatal(err)
	}
	redistest.Sleep(t, srv.Addr, 1500*time.Millisecond)
	if resp, err := call("lee", 100); err == nil {
		t.Fatalf("a charge while Redis is busy past the store's timeout: %v; want the store's error", resp)
	}
	poll(t, func() error {
		m, err := getBody(p.admin + "/metrics")
		if err != nil {
			return err
		}
		if !strings.Contains(m, "\ntokengate_store_replay_pending 0\n") || !strings.Contains(m, `tokengate_store_seconds_count{op="replay"}`) {
			return fmt.Errorf("the charge not replayed yet:\n%s", grepLines(m, "tokengate_store_replay_pending|op=\"replay\""))
		}
		return nil
	})
	resp, err := call("lee", 0)
	if err != nil {
		t.Fatal(err)
	}
	if left := resp.GetStatuses()[0].GetLimitRemaining(); left != 900 {
		t.Errorf("after 100 hits lost in a stall and replayed: %d remaining, want 900 (charged once)", left)
	}
}
