package standin

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/rls"
)

// aigwQuotaYAML maps AI Gateway's QuotaPolicy domain as docs/rls.md
// recommends for it (TOKENGATE_DEFERRED_CHARGES / rls.deferred_charges:
// "AI Gateway's ai-gateway-quota (its QuotaPolicy checks, then charges at
// stream end)"): a model quota of 100 tokens, every leaf in quota mode as
// AI Gateway's translator makes it (docs/envoy-ratelimit.md §5.2).
const aigwQuotaYAML = `
store: {type: memory}
tokenizer: {fallback_encoding: o200k_base}
policies:
  - name: quota
    buckets:
      - {name: model, per: model, tokens_per_minute: 1, burst: 100, max_debt: 1000}
rls:
  deferred_charges: [ai-gateway-quota]
  domains:
    - domain: ai-gateway-quota
      descriptors:
        - key: backend_name
          value: default/openai
          descriptors:
            - {key: model_name_override, model: true, policy: quota, quota_mode: true}
`

// TestAIGatewayQuotaDeferredStillRefuses: AI Gateway's QuotaPolicy
// sends its request-time entries WITHOUT hits_addend and its stream-done
// entries with hits_addend format %DYNAMIC_METADATA(io.envoy.ai_gateway:
// quota_cost)% (docs/envoy-ratelimit.md §5.2, "These entries carry no
// hits_addend, so stock ratelimit counts 1 per request"; aigw
// internal/extensionserver/quota_ratelimit.go enableQuotaRateLimitOnRoute:
// "Uses the same descriptor actions but without HitsAddend"). Envoy sends
// them with request-level hits_addend 0 (§2.5, §2.7), i.e. 1 hit each
// (§3.3). With ai-gateway-quota in rls.deferred_charges, as docs/rls.md
// advises, only a call whose hits were sent is a stream-done charge
// answered at once; the request-time call is answered by the quota: after
// the first stream charged 150 tokens of a 100-token quota, the next
// request gets 429 (§6 scenario 5, §3.5 quota mode).
func TestAIGatewayQuotaDeferredStillRefuses(t *testing.T) {
	cfg, err := config.Parse("mapping.yaml", []byte(aigwQuotaYAML))
	if err != nil {
		t.Fatal(err)
	}
	store := buckets.NewMemory(buckets.MemoryOptions{})
	svc, err := rls.New(rls.Config{Store: store, Prices: cfg.Prices()})
	if err != nil {
		t.Fatal(err)
	}
	pols, err := admission.FromConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Load(rls.Mapping{Config: cfg, Policies: pols}); err != nil {
		t.Fatal(err)
	}
	conn := serveRLS(t, svc)

	// The filter and per-route config AI Gateway's extension server writes
	// (quota_ratelimit.go: domain ai-gateway-quota, base entries from the
	// io.envoy.ai_gateway metadata its ext_proc sets, the request-time entry
	// without hits_addend, the stream-done one with the cost format).
	filter := filterConfig(t, `
domain: ai-gateway-quota
failure_mode_deny: false
disable_x_envoy_ratelimited_header: true
enable_x_ratelimit_headers: DRAFT_VERSION_03
`)
	routes := routeConfig(t, `
virtual_hosts:
- name: llm
  domains: ["*"]
  routes:
  - match: {prefix: /}
    route: {cluster: upstream}
    typed_per_filter_config:
      envoy.filters.http.ratelimit:
        "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
        domain: ai-gateway-quota
        rate_limits:
        - actions:
          - metadata: {descriptor_key: backend_name, metadata_key: {key: io.envoy.ai_gateway, path: [{key: ai_service_backend_name}]}}
          - metadata: {descriptor_key: model_name_override, metadata_key: {key: io.envoy.ai_gateway, path: [{key: model_name_override}]}}
        - actions:
          - metadata: {descriptor_key: backend_name, metadata_key: {key: io.envoy.ai_gateway, path: [{key: ai_service_backend_name}]}}
          - metadata: {descriptor_key: model_name_override, metadata_key: {key: io.envoy.ai_gateway, path: [{key: model_name_override}]}}
          hits_addend: {format: "%DYNAMIC_METADATA(io.envoy.ai_gateway:quota_cost)%"}
          apply_on_stream_done: true
`)
	aigw := func(*http.Request) map[string]*structpb.Struct {
		s, _ := structpb.NewStruct(map[string]any{"ai_service_backend_name": "default/openai", "model_name_override": "gpt-4o-mini"})
		return map[string]*structpb.Struct{"io.envoy.ai_gateway": s}
	}
	// AI Gateway's ext_proc writes the cost when the response ends.
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cost, _ := structpb.NewStruct(map[string]any{"quota_cost": 150})
		SetDynamicMetadata(r.Context(), "io.envoy.ai_gateway", cost)
		w.WriteHeader(http.StatusOK)
	})
	p, err := NewRateLimitProxy(RateLimitConfig{RLS: conn, Filter: filter, Routes: routes, Next: next, Metadata: aigw})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	h := &rlHarness{proxy: p}
	h.front = httptest.NewUnstartedServer(p)
	h.front.Config = p.Server()
	h.front.Start()
	t.Cleanup(h.front.Close)

	if got := h.do(t, "POST", "/v1/chat/completions", "{}"); got.status != http.StatusOK {
		t.Fatalf("first request: %d, want 200 (quota full)", got.status)
	}
	first := h.entry(t, 1)
	if n := len(first.Calls); n != 2 {
		t.Fatalf("first request made %d calls, want the check and the stream-done charge", n)
	}
	if hd := first.Calls[0].Request.GetDescriptors()[0].GetHitsAddend(); hd != nil {
		t.Fatalf("request-time descriptor carries hits_addend %v; AI Gateway sends none", hd)
	}
	// Let the deferred charge land (the memory store applies it at once, but be sure).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := svc.Drain(ctx); err != nil {
		t.Fatal(err)
	}

	got := h.do(t, "POST", "/v1/chat/completions", "{}")
	second := h.entry(t, 2)
	if got.status != http.StatusTooManyRequests {
		t.Errorf("after a 150-token stream on a 100-token quota, the next request got %d, want 429: "+
			"with ai-gateway-quota in rls.deferred_charges (docs/rls.md) the request-time call of AI Gateway, "+
			"whose descriptors carry no hits_addend and so count 1 hit each (docs/envoy-ratelimit.md §5.2, §3.3), "+
			"is taken for a stream-done charge and answered OK at once; request-time answer: %v",
			got.status, second.Calls[0].Response)
	}
}

// TestRequestHeadersActionTakesFirstValue: Envoy's request_headers
// action produces "(descriptor_key, first header value)"
// (docs/envoy-ratelimit.md §2.3, router_ratelimit.cc:111-126). A request
// carrying x-user-id twice is sent to the rate-limit service as the first
// value only; the stand-in joins every value with ",".
func TestRequestHeadersActionTakesFirstValue(t *testing.T) {
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, `
domain: ai-gateway
rate_limits:
- actions:
  - request_headers: {header_name: x-user-id, descriptor_key: user}
`)}, ok, nil)
	if got := h.do(t, "GET", "/v1/models", "", "x-user-id", "alice", "x-user-id", "mallory"); got.status != http.StatusOK {
		t.Fatalf("status %d", got.status)
	}
	calls := h.rls.seen()
	if len(calls) != 1 {
		t.Fatalf("%d calls", len(calls))
	}
	if got := entries(calls[0].req); len(got) != 1 || len(got[0]) != 1 || got[0][0] != "user=alice" {
		t.Errorf("descriptors sent %v, want [[user=alice]] (Envoy takes the header's first value)", got)
	}
}
