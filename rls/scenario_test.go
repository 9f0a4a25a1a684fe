package rls_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
	"sigs.k8s.io/yaml"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/rls"
)

// The scenarios of docs/rls.md's table, played by Envoy's rate-limit
// filter (the stand-in, envoy/standin.RateLimitProxy) in front of the real
// service, on the memory store, Redis and the Redis Cluster.

// scenarioYAML maps Envoy Gateway's descriptors of a route (route, then
// the tenant from x-tenant-id) and Envoy AI Gateway's (user, then model)
// onto policy eg: a tenant bucket of 3 refilling 3 a minute (ratelimit's
// 3 per minute), a user bucket of 1,000 tokens refilling 1 a minute (a
// level that stays put while a test runs).
const scenarioYAML = `
store: {type: memory}
tokenizer: {fallback_encoding: o200k_base}
policies:
  - name: eg
    identities:
      - {name: tenant, header: x-tenant-id}
      - {name: user, header: x-user-id}
    buckets:
      - {name: tenant, per: tenant, tokens_per_minute: 3, burst: 3, max_debt: 3}
      - {name: user, per: user, tokens_per_minute: 1, burst: 1000, max_debt: 1000}
      - {name: quiet, per: tenant, tokens_per_minute: 1, burst: 1, max_debt: 1}
rls:
  domains:
    - domain: default/eg/http
      descriptors:
        - key: route
          value: route
          descriptors:
            - {key: rule-0-match-0, identity: tenant, policy: eg, rules: [tenant]}
        - key: quiet
          identity: tenant
          policy: eg
          rules: [quiet]
        - {key: shadow, identity: tenant, policy: eg, rules: [quiet], shadow_mode: true}
        - {key: qa, identity: tenant, policy: eg, rules: [tenant], quota_mode: true}
        - {key: qb, identity: tenant, policy: eg, rules: [quiet], quota_mode: true}
    - domain: ai-gateway
      descriptors:
        - {key: user, identity: user, policy: eg, rules: [user]}
`

// scene is one scenario's setup: the service on a store, served over
// gRPC, and the stand-in in front of an upstream or a Next handler.
type scene struct {
	svc   *rls.Service
	rig   *rig
	proxy *standin.RateLimitProxy
	front *httptest.Server
	conn  *grpc.ClientConn
}

// serveService serves svc on a loopback port and dials it as Envoy's
// cluster would.
func serveService(t *testing.T, svc *rls.Service) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(gs, svc)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// newScene starts the scene for the filter configuration (Envoy YAML) on
// store, forwarding to next (nil: an upstream answering 200).
func newScene(t *testing.T, store buckets.Store, filter string, next http.Handler, yamls ...string) *scene {
	t.Helper()
	y := scenarioYAML
	if len(yamls) > 0 {
		y = yamls[0]
	}
	r := newRig(t, store, y)
	s := &scene{svc: r.svc, rig: r, conn: serveService(t, r.svc)}
	cfg := standin.RateLimitConfig{RLS: s.conn, Filter: filterOf(t, filter), Next: next}
	if next == nil {
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "upstream says hi") }))
		t.Cleanup(up.Close)
		cfg.Upstream, _ = url.Parse(up.URL)
	}
	p, err := standin.NewRateLimitProxy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	s.proxy = p
	s.front = httptest.NewUnstartedServer(p)
	s.front.Config = p.Server()
	s.front.Start()
	t.Cleanup(s.front.Close)
	return s
}

// filterOf reads the filter's configuration from Envoy YAML, with the
// rate_limit_service and a timeout long enough for a loaded machine unless
// given.
func filterOf(t *testing.T, y string) *rlfilterv3.RateLimit {
	t.Helper()
	if !strings.Contains(y, "rate_limit_service:") {
		y += "\nrate_limit_service:\n  grpc_service: {envoy_grpc: {cluster_name: ratelimit}}\n  transport_api_version: V3\n"
	}
	if !strings.Contains(y, "timeout:") {
		y += "\ntimeout: 10s\n"
	}
	js, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	var f rlfilterv3.RateLimit
	if err := protojson.Unmarshal(js, &f); err != nil {
		t.Fatalf("%v\n%s", err, y)
	}
	return &f
}

type answer struct {
	status int
	header http.Header
	body   string
}

func (s *scene) do(t *testing.T, hdr ...string) answer {
	t.Helper()
	req, err := http.NewRequest("POST", s.front.URL+"/v1/chat/completions", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// entry waits for the stand-in's n-th log entry: the request and its
// stream-done call are done.
func (s *scene) entry(t *testing.T, n int) standin.RateLimitEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	es, err := s.proxy.WaitLog(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	return es[n-1]
}

// onEveryStore runs f on the memory store, Redis and the Redis Cluster.
func onEveryStore(t *testing.T, f func(t *testing.T, store buckets.Store)) {
	for _, name := range []string{"memory", "redis", "cluster"} {
		open := stores(t)[name]
		t.Run(name, func(t *testing.T) { f(t, open(t)) })
	}
}

// egFilter is Envoy Gateway's filter for a route limited per tenant.
const egFilter = `
domain: default/eg/http
enable_x_ratelimit_headers: DRAFT_VERSION_03
rate_limits:
  - actions:
      - generic_key: {descriptor_key: route, descriptor_value: route}
      - request_headers: {header_name: x-tenant-id, descriptor_key: rule-0-match-0}
`

// costFilter is Envoy AI Gateway's: a check on the request path, the
// response's token count charged at stream done.
const costFilter = `
domain: ai-gateway
enable_x_ratelimit_headers: DRAFT_VERSION_03
rate_limits:
  - actions:
      - request_headers: {header_name: x-user-id, descriptor_key: user}
    hits_addend: {number: 0}
  - actions:
      - request_headers: {header_name: x-user-id, descriptor_key: user}
    hits_addend: {format: "%DYNAMIC_METADATA(io.envoy.ai_gateway:llm_total_token)%"}
    apply_on_stream_done: true
`

// costs answers each request and sets its token count, as AI Gateway's
// ext_proc does; a nil cost sets none.
func costs(cs ...*structpb.Value) http.Handler {
	var mu sync.Mutex
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		var c *structpb.Value
		if len(cs) > 0 {
			c, cs = cs[0], cs[1:]
		}
		mu.Unlock()
		io.WriteString(w, "answer")
		if c != nil {
			standin.SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", &structpb.Struct{Fields: map[string]*structpb.Value{"llm_total_token": c}})
		}
	})
}

// Scenario 1: a request within the limit is forwarded, with the
// x-ratelimit-* headers of the tenant's rule (3 per minute).
func TestRLSScenario01BasicOK(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter, nil)
		res := s.do(t, "x-tenant-id", "acme")
		if res.status != 200 || res.body != "upstream says hi" {
			t.Fatalf("%d %q", res.status, res.body)
		}
		if res.header.Get("x-ratelimit-limit") != "3, 3;w=60" || res.header.Get("x-ratelimit-remaining") != "2" {
			t.Errorf("x-ratelimit headers %v", res.header)
		}
	})
}

// Scenario 2: past the limit, Envoy answers 429 with the service's
// retry-after.
func TestRLSScenario02OverLimit(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter, nil)
		for range 3 {
			s.do(t, "x-tenant-id", "acme")
		}
		res := s.do(t, "x-tenant-id", "acme")
		if res.status != 429 || res.header.Get("x-envoy-ratelimited") != "true" || res.header.Get("x-ratelimit-remaining") != "0" {
			t.Fatalf("4th request of 3 a minute: %d %v", res.status, res.header)
		}
		// One token of debt and one asked for: 2 tokens at 3 a minute.
		if res.header.Get("retry-after") != "40" {
			t.Errorf("retry-after %q, want 40", res.header.Get("retry-after"))
		}
		if res := s.do(t, "x-tenant-id", "other"); res.status != 200 {
			t.Errorf("another tenant: %d", res.status)
		}
	})
}

// Scenario 3: Envoy sends hits_addend 0 (absent) on the request path, which
// counts 1 per request.
func TestRLSScenario03RequestHitsDefaultToOne(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter, nil)
		for i, want := range []string{"2", "1", "0"} {
			if res := s.do(t, "x-tenant-id", "acme"); res.header.Get("x-ratelimit-remaining") != want {
				t.Errorf("request %d: remaining %q, want %s", i+1, res.header.Get("x-ratelimit-remaining"), want)
			}
		}
	})
}

// Scenarios 4 and 5: AI Gateway checks on the request path (number 0) and
// charges the response's tokens at stream done: at a level of exactly 0 a
// check is OK with remaining 0, in debt it is OVER_LIMIT.
func TestRLSScenario04CheckOnlyAtTheLimit(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, costFilter, costs(structpb.NewNumberValue(1000), structpb.NewNumberValue(5)))
		if res := s.do(t, "x-user-id", "ann"); res.status != 200 || res.header.Get("x-ratelimit-remaining") != "1000" {
			t.Fatalf("first request: %d remaining %q", res.status, res.header.Get("x-ratelimit-remaining"))
		}
		s.entry(t, 1) // its 1,000 tokens are charged
		if res := s.do(t, "x-user-id", "ann"); res.status != 200 || res.header.Get("x-ratelimit-remaining") != "0" {
			t.Fatalf("a check at exactly 0: %d remaining %q, want 200 and 0", res.status, res.header.Get("x-ratelimit-remaining"))
		}
		s.entry(t, 2) // 5 more: in debt
		if res := s.do(t, "x-user-id", "ann"); res.status != 429 {
			t.Errorf("a check in debt: %d, want 429", res.status)
		}
	})
}

// Scenario 5: the stream-done call charges the cost from dynamic metadata;
// its answer is ignored.
func TestRLSScenario05CheckThenCharge(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, costFilter, costs(structpb.NewNumberValue(300), structpb.NewNumberValue(2000)))
		s.do(t, "x-user-id", "bea")
		if e := s.entry(t, 1); len(e.Calls) != 2 {
			t.Fatalf("calls %d, want the check and the stream-done charge", len(e.Calls))
		}
		if l := s.rig.level(t, "user", "bea"); l < 699 || l > 701 {
			t.Errorf("level %v after a charge of 300, want 700", l)
		}
		if res := s.do(t, "x-user-id", "bea"); res.status != 200 {
			t.Fatalf("second request: %d", res.status)
		}
		s.entry(t, 2) // 2,000 tokens: charged down to max_debt, its answer ignored
		if l := s.rig.level(t, "user", "bea"); l < -1000.01 || l > -999 {
			t.Errorf("level %v after a charge of 2,000 at 700, want the floor -1000", l)
		}
	})
}

// Scenario 6: a stream-done descriptor without a cost is dropped, and no
// call is made for it: nothing is charged.
func TestRLSScenario06NoChargeWithoutCost(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, costFilter, costs(nil, structpb.NewStringValue("many")))
		s.do(t, "x-user-id", "cy")
		s.do(t, "x-user-id", "cy")
		s.entry(t, 2)
		if l := s.rig.level(t, "user", "cy"); l < 999.9 {
			t.Errorf("level %v, want 1000: nothing charged", l)
		}
	})
}

// Scenario 12: the errors ratelimit answers reach Envoy as errors, which
// its failure mode decides (here fail open: forwarded, counted as error).
func TestRLSScenario12ErrorsAsRatelimit(t *testing.T) {
	s := newScene(t, buckets.NewMemory(buckets.MemoryOptions{}), egFilter, nil)
	if err := s.svc.Load(rls.Mapping{}); err != nil {
		t.Fatal(err)
	}
	res := s.do(t, "x-tenant-id", "acme")
	if res.status != 200 || s.proxy.Stats().Error != 1 || s.proxy.Stats().FailureModeAllowed != 1 {
		t.Errorf("no configuration loaded: %d, stats %+v; want forwarded, one error", res.status, s.proxy.Stats())
	}
	ctx := context.Background()
	client := rlsv3.NewRateLimitServiceClient(s.conn)
	if _, err := client.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d"}); err == nil || !strings.Contains(err.Error(), "descriptor list must not be empty") {
		t.Errorf("empty descriptors over gRPC: %v", err)
	}
	if _, err := client.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{}); err == nil || !strings.Contains(err.Error(), "domain must not be empty") {
		t.Errorf("empty domain over gRPC: %v", err)
	}
}

// Scenario 16: of several descriptors the headers come from the status
// with the least remaining.
func TestRLSScenario16MostRestrictiveStatus(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		f := egFilter + "  - actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: quiet}}]\n"
		s := newScene(t, store, f, nil)
		res := s.do(t, "x-tenant-id", "dee")
		if res.status != 200 || res.header.Get("x-ratelimit-limit") != "1, 3;w=60, 1;w=60" || res.header.Get("x-ratelimit-remaining") != "0" {
			t.Errorf("two descriptors: %d %v; want the quiet rule's 1 a minute, remaining 0", res.status, res.header)
		}
	})
}

// Scenario 22: two filters, two domains, each its own rules.
func TestRLSScenario22DomainsApart(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		inner := newScene(t, store, "domain: ai-gateway\nrate_limits: [{actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}], hits_addend: {number: 10}}]\n", nil)
		outer := newScene(t, store, egFilter, inner.proxy)
		if res := outer.do(t, "x-tenant-id", "eve", "x-user-id", "eve"); res.status != 200 {
			t.Fatalf("status %d", res.status)
		}
		if l := outer.rig.level(t, "tenant", "eve"); l < 1.99 || l > 2.1 {
			t.Errorf("tenant level %v, want 2", l)
		}
		if l := outer.rig.level(t, "user", "eve"); l < 989.9 || l > 990.1 {
			t.Errorf("user level %v, want 990", l)
		}
	})
}

// Scenario 24: negative hits refund tokens.
func TestRLSScenario24NegativeHitsRefund(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		charge := newScene(t, store, "domain: ai-gateway\nrate_limits: [{actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}], hits_addend: {number: 400}}]\n", nil)
		charge.do(t, "x-user-id", "fin")
		refund := newScene(t, store, "domain: ai-gateway\nrate_limits: [{actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}], hits_addend: {number: 150, is_negative_hits: true}}]\n", nil)
		refund.do(t, "x-user-id", "fin")
		if l := charge.rig.level(t, "user", "fin"); l < 749.9 || l > 750.1 {
			t.Errorf("level %v after 400 charged and 150 refunded, want 750", l)
		}
	})
}

// Scenario 31: an unknown domain is OK with no current_limit, so Envoy
// adds no x-ratelimit-* headers.
func TestRLSScenario31UnknownDomain(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, strings.Replace(egFilter, "default/eg/http", "unknown/domain", 1), nil)
		for range 5 {
			if res := s.do(t, "x-tenant-id", "acme"); res.status != 200 || res.header.Get("x-ratelimit-limit") != "" {
				t.Errorf("unknown domain: %d %v", res.status, res.header)
			}
		}
	})
}

// Scenario 32: two quota-mode descriptors, one over: OK; both over:
// OVER_LIMIT.
func TestRLSScenario32QuotaMode(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		f := "domain: default/eg/http\nrate_limits:\n  - actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: qa}}]\n  - actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: qb}}]\n"
		s := newScene(t, store, f, nil)
		for i, want := range []int{200, 200, 200, 429} {
			// qb (1 a minute) is over from the second request, qa (3 a
			// minute) from the fourth.
			if res := s.do(t, "x-tenant-id", "gus"); res.status != want {
				t.Errorf("request %d: %d, want %d", i+1, res.status, want)
			}
		}
	})
}

// Scenario 33: a shadow-mode rule over its limit answers OK with remaining
// 0, and is charged.
func TestRLSScenario33ShadowMode(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		f := "domain: default/eg/http\nenable_x_ratelimit_headers: DRAFT_VERSION_03\nrate_limits: [{actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: shadow}}]}]\n"
		s := newScene(t, store, f, nil)
		for range 3 {
			if res := s.do(t, "x-tenant-id", "hal"); res.status != 200 {
				t.Errorf("shadow mode: %d", res.status)
			}
		}
		if l := s.rig.level(t, "quiet", "hal"); l > -0.99 {
			t.Errorf("level %v, want the floor -1: counted as usual", l)
		}
	})
}

// Scenario 34: parallel requests on one connection, calls on one gRPC
// connection: exactly the limit passes.
func TestRLSScenario34ExactUnderConcurrentHits(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter, nil)
		var wg sync.WaitGroup
		var mu sync.Mutex
		passed := 0
		for range 12 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if res := s.do(t, "x-tenant-id", "ivy"); res.status == 200 {
					mu.Lock()
					passed++
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		if passed != 3 {
			t.Errorf("%d of 12 parallel requests passed a limit of 3", passed)
		}
	})
}

// Scenarios 10 and 11: a store slower than the filter's timeout: Envoy
// fails open (forwarded) or closed (500) as configured; the charge the
// store was running still applies, once.
func TestRLSScenario10SlowStoreFailsOpen(t *testing.T) {
	slowStore(t, "", 200)
}

func TestRLSScenario11SlowStoreFailsClosed(t *testing.T) {
	slowStore(t, "failure_mode_deny: true\n", 500)
}

func slowStore(t *testing.T, extra string, want int) {
	addr := redisServer(t)
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	store := redisstore.New(c, redisstore.Options{Prefix: t.Name() + ":" + admission.NewID()[:8] + ":"})
	s := newScene(t, store, egFilter+"timeout: 0.1s\n"+extra, nil)
	s.do(t, "x-tenant-id", "warm") // the scripts loaded, the connection open
	redistest.Sleep(t, addr, 400*time.Millisecond)
	res := s.do(t, "x-tenant-id", "slow")
	if res.status != want || res.header.Get("x-ratelimit-limit") != "" {
		t.Fatalf("a store slower than the timeout: %d %v, want %d without x-ratelimit headers", res.status, res.header, want)
	}
	if st := s.proxy.Stats(); st.Error != 1 {
		t.Errorf("stats %+v, want one error", st)
	}
	// The store finishes the charge Envoy gave up on, once.
	deadline := time.Now().Add(10 * time.Second)
	for {
		l := s.rig.level(t, "tenant", "slow")
		if l < 2.1 {
			if l < 1.99 {
				t.Errorf("level %v, want 2: the hit charged once", l)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("level %v: the slow charge never applied", l)
		}
		time.Sleep(10 * time.Millisecond) // polling the store, with the deadline above
	}
}

// Scenario 13: a service that cannot be reached fails at once with
// UNAVAILABLE, and the filter's failure mode decides.
func TestRLSScenario13Unreachable(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	for deny, want := range map[bool]int{false: 200, true: 500} {
		f := egFilter
		if deny {
			f += "failure_mode_deny: true\n"
		}
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
		t.Cleanup(up.Close)
		u, _ := url.Parse(up.URL)
		p, err := standin.NewRateLimitProxy(standin.RateLimitConfig{RLS: cc, Filter: filterOf(t, f), Upstream: u})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		front := httptest.NewServer(p)
		t.Cleanup(front.Close)
		req, err := http.NewRequest("GET", front.URL+"/", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("x-tenant-id", "a")
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("deny %v: %d, want %d", deny, resp.StatusCode, want)
		}
	}
}

// Scenario 17: the status of a rule imported from ratelimit's week, month
// and year units says that unit, and Envoy's x-ratelimit-limit its window.
func TestRLSScenario17StatusUnits(t *testing.T) {
	y := `
store: {type: memory}
tokenizer: {fallback_encoding: o200k_base}
policies:
  - name: p
    identities: [{name: t, header: x-tenant-id}]
    buckets:
      - {name: week, per: t, tokens_per_minute: 0.0009920634920634920, burst: 10, max_debt: 10}
      - {name: hour, per: t, tokens_per_minute: 0.5, burst: 30, max_debt: 30}
rls:
  domains:
    - domain: default/eg/http
      descriptors:
        - {key: week, identity: t, policy: p, rules: [week]}
        - {key: hour, identity: t, policy: p, rules: [hour]}
`
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		for _, tt := range []struct{ key, limit string }{{"week", "10, 10;w=604800"}, {"hour", "30, 30;w=3600"}} {
			f := "domain: default/eg/http\nenable_x_ratelimit_headers: DRAFT_VERSION_03\nrate_limits: [{actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: " + tt.key + "}}]}]\n"
			s := newScene(t, store, f, nil, y)
			if res := s.do(t, "x-tenant-id", "a"); res.status != 200 || res.header.Get("x-ratelimit-limit") != tt.limit {
				t.Errorf("%s: %d x-ratelimit-limit %q, want %q", tt.key, res.status, res.header.Get("x-ratelimit-limit"), tt.limit)
			}
		}
	})
}

// Scenario 21: a descriptor whose entries were all skipped (none left)
// meets no limit: OK.
func TestRLSScenario21EmptyDescriptorIsOK(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		f := "domain: default/eg/http\nrate_limits: [{actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: quiet, skip_if_absent: true}}]}]\n"
		s := newScene(t, store, f, nil)
		for range 3 {
			if res := s.do(t); res.status != 200 {
				t.Errorf("no entries: %d", res.status)
			}
		}
		if res := s.do(t, "x-tenant-id", "a"); res.status != 200 {
			t.Errorf("with the entry: %d", res.status)
		}
		if res := s.do(t, "x-tenant-id", "a"); res.status != 429 {
			t.Errorf("with the entry, second hit of 1 a minute: %d", res.status)
		}
	})
}

// Scenario 23: a limit sent with the descriptor is the rule's for that
// call: the bucket of 1 holds up to 7.
func TestRLSScenario23LimitOverride(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		f := `
domain: default/eg/http
enable_x_ratelimit_headers: DRAFT_VERSION_03
rate_limits:
  - actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: quiet}}]
    limit: {rate_limit: {requests_per_unit: 7, unit: HOUR}}
`
		s := newScene(t, store, f, nil)
		res := s.do(t, "x-tenant-id", "a")
		if res.status != 200 || res.header.Get("x-ratelimit-limit") != "7, 7;w=3600" || res.header.Get("x-ratelimit-remaining") != "6" {
			t.Errorf("own limit 7 an hour in place of the bucket's 1: %d %v, want remaining 6", res.status, res.header)
		}
	})
}

// Scenario 29: a gRPC client over the limit gets HTTP 200 with grpc-status
// 14.
func TestRLSScenario29GRPCClient(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, "domain: default/eg/http\nrate_limits: [{actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: quiet}}], hits_addend: {number: 2}}]\n", nil)
		req, err := http.NewRequest("POST", s.front.URL+"/pkg.Service/Method", strings.NewReader("\x00\x00\x00\x00\x00"))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("content-type", "application/grpc")
		req.Header.Set("x-tenant-id", "a")
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("grpc-status") != "14" {
			t.Errorf("status %d, headers %v", resp.StatusCode, resp.Header)
		}
	})
}

// Scenario 7: after a 429 Envoy still makes the stream-done call, and its
// hits are charged.
func TestRLSScenario07ChargeAfterRefusal(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, costFilter, costs(structpb.NewNumberValue(1200)))
		s.do(t, "x-user-id", "kai")
		s.entry(t, 1) // -200: in debt
		r := newRig(t, store, scenarioYAML)
		cost := func(*http.Request) map[string]*structpb.Struct {
			return map[string]*structpb.Struct{"io.envoy.ai_gateway": {Fields: map[string]*structpb.Value{"llm_total_token": structpb.NewNumberValue(300)}}}
		}
		p, err := standin.NewRateLimitProxy(standin.RateLimitConfig{RLS: serveService(t, r.svc), Filter: filterOf(t, costFilter), Metadata: cost, Next: costs()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		front := httptest.NewUnstartedServer(p)
		front.Config = p.Server()
		front.Start()
		t.Cleanup(front.Close)
		refused := &scene{proxy: p, front: front, rig: r}
		if res := refused.do(t, "x-user-id", "kai"); res.status != 429 {
			t.Fatalf("a check in debt: %d", res.status)
		}
		if e := refused.entry(t, 1); len(e.Calls) != 2 || !e.Calls[1].StreamDone {
			t.Fatalf("calls %+v, want the stream-done charge", e.Calls)
		}
		if l := r.level(t, "user", "kai"); l < -500.1 || l > -499.9 {
			t.Errorf("level %v, want -500: the refused request's 300 charged too", l)
		}
	})
}

// Scenario 14: timeout 0s sends no deadline; the service answers.
func TestRLSScenario14NoDeadline(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter+"timeout: 0s\n", nil)
		if res := s.do(t, "x-tenant-id", "a"); res.status != 200 || res.header.Get("x-ratelimit-remaining") != "2" {
			t.Errorf("no deadline: %d %v", res.status, res.header)
		}
	})
}

// Scenario 15: with the service's shadow mode the overall code is OK while
// a status is over: Envoy forwards.
func TestRLSScenario15OverallCode(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter, nil, scenarioYAML+"  shadow_mode: true\n")
		for range 3 {
			s.do(t, "x-tenant-id", "a")
		}
		res := s.do(t, "x-tenant-id", "a")
		if res.status != 200 || res.header.Get("x-ratelimit-remaining") != "0" {
			t.Errorf("over, in global shadow mode: %d %v; want forwarded with remaining 0", res.status, res.header)
		}
	})
}

// Scenario 19: a route's own domain (RateLimitPerRoute) is the one the
// service matches.
func TestRLSScenario19DomainPerRoute(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		r := newRig(t, store, scenarioYAML)
		routes := `
virtual_hosts:
  - name: vh
    domains: ["*"]
    routes:
      - match: {prefix: /}
        route: {cluster: upstream}
        typed_per_filter_config:
          envoy.filters.http.ratelimit:
            "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
            domain: ai-gateway
            rate_limits:
              - actions: [{request_headers: {header_name: x-user-id, descriptor_key: user}}]
                hits_addend: {number: 10}
`
		js, err := yaml.YAMLToJSON([]byte(routes))
		if err != nil {
			t.Fatal(err)
		}
		var rc routev3.RouteConfiguration
		if err := protojson.Unmarshal(js, &rc); err != nil {
			t.Fatal(err)
		}
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
		t.Cleanup(up.Close)
		u, _ := url.Parse(up.URL)
		p, err := standin.NewRateLimitProxy(standin.RateLimitConfig{RLS: serveService(t, r.svc), Filter: filterOf(t, egFilter), Routes: &rc, Upstream: u})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		front := httptest.NewServer(p)
		t.Cleanup(front.Close)
		s := &scene{proxy: p, front: front, rig: r}
		if res := s.do(t, "x-user-id", "lou", "x-tenant-id", "lou"); res.status != 200 {
			t.Fatalf("status %d", res.status)
		}
		if l := r.level(t, "user", "lou"); l < 989.9 || l > 990.1 {
			t.Errorf("user level %v, want 990: the route's domain and hits", l)
		}
		if l := r.level(t, "tenant", "lou"); l < 2.99 {
			t.Errorf("tenant level %v, want 3: the filter's domain not called", l)
		}
	})
}

// Scenario 18: the service answers one status per descriptor, matched or
// not, so Envoy's headers come from the statuses with a limit.
func TestRLSScenario18OneStatusPerDescriptor(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		f := egFilter + "  - actions: [{generic_key: {descriptor_key: nowhere, descriptor_value: x}}]\n  - actions: [{request_headers: {header_name: x-tenant-id, descriptor_key: quiet}}]\n"
		s := newScene(t, store, f, nil)
		res := s.do(t, "x-tenant-id", "mo")
		e := s.entry(t, 1)
		if n := len(e.Calls[0].Response.GetStatuses()); n != 3 {
			t.Fatalf("%d statuses for 3 descriptors", n)
		}
		if res.status != 200 || res.header.Get("x-ratelimit-limit") != "1, 3;w=60, 1;w=60" {
			t.Errorf("%d %v", res.status, res.header)
		}
	})
}

// Scenario 8: a client reset while the check is in the store cancels the
// call and no stream-done call follows: nothing beyond the check is
// written (a check writes nothing).
func TestRLSScenario08CancelledCheck(t *testing.T) {
	addr := redisServer(t)
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	store := redisstore.New(c, redisstore.Options{Prefix: t.Name() + ":" + admission.NewID()[:8] + ":"})
	s := newScene(t, store, costFilter, costs(structpb.NewNumberValue(100)))
	s.do(t, "x-user-id", "warm") // the scripts loaded, the connection open
	s.entry(t, 1)
	redistest.Sleep(t, addr, 300*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, "GET", s.front.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("x-user-id", "nia")
	done := make(chan error, 1)
	go func() {
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	time.AfterFunc(50*time.Millisecond, cancel) // while Redis sleeps
	if err := <-done; err == nil {
		t.Fatal("the cancelled request succeeded")
	}
	e := s.entry(t, 2)
	if len(e.Calls) != 1 || !e.Calls[0].Cancelled || e.UpstreamRequested {
		t.Errorf("entry %+v, want one cancelled call, no upstream, no stream-done call", e)
	}
	if l := s.rig.level(t, "user", "nia"); l < 999.9 {
		t.Errorf("level %v, want 1000: nothing charged", l)
	}
}

// Scenario 9: a client reset while the answer streams still makes the
// stream-done call, and its tokens are charged.
func TestRLSScenario09ChargeAfterReset(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			standin.SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", &structpb.Struct{Fields: map[string]*structpb.Value{"llm_total_token": structpb.NewNumberValue(17)}})
			for {
				if _, err := io.WriteString(w, "data: token\n\n"); err != nil {
					return
				}
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					return
				case <-time.After(5 * time.Millisecond): // a slow stream
				}
			}
		})
		s := newScene(t, store, costFilter, next)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, "POST", s.front.URL+"/v1/chat/completions", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("x-user-id", "ola")
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(resp.Body, make([]byte, 5)); err != nil {
			t.Fatal(err)
		}
		cancel()
		resp.Body.Close()
		if e := s.entry(t, 1); !e.ClientCancelled || len(e.Calls) != 2 {
			t.Fatalf("entry %+v, want the stream-done charge after the reset", e)
		}
		if l := s.rig.level(t, "user", "ola"); l < 982.9 || l > 983.1 {
			t.Errorf("level %v, want 983: the 17 tokens charged", l)
		}
	})
}

// Scenario 28: without rls.response_dynamic_metadata the service, as
// ratelimit without RESPONSE_DYNAMIC_METADATA, sends no dynamic metadata
// and Envoy stores none. With it, the request path's answer carries
// ratelimit's metadata (the domain, the descriptor's entries and
// hits_addend, the metadata of the limit met), which Envoy stores under
// its metadata_namespace, the default or its own, for the filters after
// it; the stream-done call's answer carries its own (its hits_addend, the
// cost), which Envoy ignores.
func TestRLSScenario28ResponseMetadata(t *testing.T) {
	const defaultNS = "envoy.filters.http.ratelimit"
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, costFilter, costs(structpb.NewNumberValue(1)))
		s.do(t, "x-user-id", "pia")
		e := s.entry(t, 1)
		if md := e.DynamicMetadata[defaultNS]; md != nil {
			t.Errorf("off: dynamic metadata %v, want none", md)
		}
		for _, c := range e.Calls {
			if c.Response.GetDynamicMetadata() != nil {
				t.Errorf("off: answer with dynamic metadata: %v", c.Response)
			}
		}

		on := replaceOnce(t, scenarioYAML, "- {key: user, identity: user, policy: eg, rules: [user]}",
			"- {key: user, identity: user, policy: eg, rules: [user], metadata: {route: {cluster: llm}, tier: standard}}") +
			"  response_dynamic_metadata: true\n"
		metadata := func(hits float64) *structpb.Struct {
			return structOf(t, map[string]any{
				"domain":      "ai-gateway",
				"descriptors": []any{map[string]any{"entries": []any{"user=ria"}, "hitsAddend": hits}},
				"metadata":    map[string]any{"route": map[string]any{"cluster": "llm"}, "tier": "standard"},
			})
		}
		for i, ns := range []string{"", "tokengate.rl"} {
			seen := make(chan *structpb.Struct, 1)
			next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				want := ns
				if want == "" {
					want = defaultNS
				}
				seen <- standin.DynamicMetadataOf(r.Context(), want)
				io.WriteString(w, "answer")
				standin.SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", &structpb.Struct{Fields: map[string]*structpb.Value{"llm_total_token": structpb.NewNumberValue(17)}})
			})
			filter := costFilter
			if ns != "" {
				filter += "metadata_namespace: " + ns + "\n"
			}
			s := newScene(t, store, filter, next, on)
			if res := s.do(t, "x-user-id", "ria"); res.status != 200 {
				t.Fatalf("%q: %d %s", ns, res.status, res.body)
			}
			e := s.entry(t, 1)
			if len(e.Calls) != 2 || e.Calls[1].Response == nil {
				t.Fatalf("%q: calls %+v, want the check and the stream-done charge", ns, e.Calls)
			}
			if d := cmp.Diff(metadata(17), e.Calls[1].Response.GetDynamicMetadata(), protocmp.Transform()); d != "" {
				t.Errorf("%q: the stream-done answer's metadata (-want +got):\n%s", ns, d)
			}
			want := ns
			if want == "" {
				want = defaultNS
			}
			if d := cmp.Diff(metadata(0), <-seen, protocmp.Transform()); d != "" {
				t.Errorf("%q: metadata the next filter sees (-want +got):\n%s", ns, d)
			}
			if d := cmp.Diff(metadata(0), e.DynamicMetadata[want], protocmp.Transform()); d != "" {
				t.Errorf("%q: metadata at the stream's end, the stream-done answer's ignored (-want +got):\n%s", ns, d)
			}
			if other := []string{defaultNS, "tokengate.rl"}[1-i]; e.DynamicMetadata[other] != nil {
				t.Errorf("%q: metadata under %s too: %v", ns, other, e.DynamicMetadata[other])
			}
		}
	})
}

// rls.limit_response_headers (ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED):
// Envoy appends the service's RateLimit-* headers to the upstream's
// answer beside its own x-ratelimit-*, and to its 429 with the service's
// retry-after, each once.
func TestRLSLimitResponseHeadersReachTheClient(t *testing.T) {
	onEveryStore(t, func(t *testing.T, store buckets.Store) {
		s := newScene(t, store, egFilter, nil, scenarioYAML+"  limit_response_headers: {enabled: true}\n")
		once := func(res answer, name string) string {
			t.Helper()
			vs := res.header.Values(name)
			if len(vs) != 1 {
				t.Errorf("%s: %q, want one value", name, vs)
				return ""
			}
			return vs[0]
		}
		res := s.do(t, "x-tenant-id", "acme")
		// One hit of 3 refilling 3 a minute: full again in 20s.
		if res.status != 200 || once(res, "RateLimit-Limit") != "3" || once(res, "RateLimit-Remaining") != "2" || once(res, "RateLimit-Reset") != "20" {
			t.Errorf("first request: %d %v", res.status, res.header)
		}
		if res.header.Get("x-ratelimit-limit") != "3, 3;w=60" || res.header.Get("retry-after") != "" {
			t.Errorf("first request: Envoy's own headers %v", res.header)
		}
		for range 2 {
			s.do(t, "x-tenant-id", "acme")
		}
		res = s.do(t, "x-tenant-id", "acme")
		// One token of debt and one asked for: 2 tokens at 3 a minute.
		if res.status != 429 || once(res, "RateLimit-Limit") != "3" || once(res, "RateLimit-Remaining") != "0" || once(res, "RateLimit-Reset") != "40" || once(res, "retry-after") != "40" {
			t.Errorf("4th request of 3 a minute: %d %v", res.status, res.header)
		}
	})
}
