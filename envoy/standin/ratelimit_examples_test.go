package standin

import (
	"os"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"

	"github.com/tokengate/tokengate/config"
)

// The shipped plain-Envoy example's rate-limit filter and routes, run by
// the stand-in, send the descriptor the shipped tokengate mapping
// (examples/rls/tokengate.yaml) puts on the ai-gateway policy, with the
// x-user-id header as its user identity, the identity its ext_proc front
// reads too.
func TestRateLimitShippedEnvoyExampleMeetsTheShippedMapping(t *testing.T) {
	data, err := os.ReadFile("../../examples/rls/envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	fromYAML(t, string(data), &b)
	var hcm hcmv3.HttpConnectionManager
	if err := b.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	var filter rlfilterv3.RateLimit
	if err := hcm.GetHttpFilters()[0].GetTypedConfig().UnmarshalTo(&filter); err != nil {
		t.Fatal(err)
	}
	h := newRLHarness(t, RateLimitConfig{Filter: &filter, Routes: hcm.GetRouteConfig()}, ok, nil)
	if res := h.do(t, "POST", "/v1/chat/completions", "{}", "x-user-id", "alice"); res.status != 200 {
		t.Fatalf("status %d", res.status)
	}
	req := h.rls.seen()[0].req

	cfg, err := config.Load("../../examples/rls/tokengate.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m, known, ok := cfg.MatchRLS(req.GetDomain(), req.GetDescriptors()[0])
	if !known || !ok || m.Descriptor().Policy != "ai-gateway" {
		t.Fatalf("domain %q, descriptor %v: known %v, matched %v", req.GetDomain(), req.GetDescriptors()[0], known, ok)
	}
	if user, ok := m.Identity("user"); !ok || user != "alice" {
		t.Errorf("identity user %q (%v), want alice", user, ok)
	}
}
