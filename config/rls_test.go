package config

import (
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
)

func descriptor(kv ...string) *commonv3.RateLimitDescriptor {
	d := &commonv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

const rlsFile = `
policies:
  - name: bench
    identities:
      - {name: user, header: x-user-id}
      - {name: tenant}
    buckets:
      - {name: user, per: user, tokens_per_minute: 60000}
      - {name: tenant, per: tenant, tokens_per_minute: 600000}
      - {name: model, per: model, tokens_per_minute: 6000000}
    quotas:
      - {name: spend, per: tenant, window: month, timezone: UTC, cost: "100"}
    concurrency:
      - {name: user, per: user, max: 4}
rls:
  domains:
    - domain: ai-gateway
      descriptors:
        - {key: user, identity: user, policy: bench, rules: [user]}
        - key: tenant
          identity: tenant
          descriptors:
            - {key: user, identity: user, policy: bench, rules: [tenant, user]}
            - key: model
              model: true
              policy: bench
              rules: [model, spend, tenant]
        - {key: user, value: vip-*, identity: user, unlimited: true}
        - {key: user, value: vip-banned, deny: true}
        - key: org
          identity: tenant
          descriptors:
            - {key: team, identity: tenant, policy: bench, rules: [tenant]}
`

// The rls section maps a descriptor onto a policy's rules as ratelimit
// matches (exact value, then wildcard, then the bare key), with its
// identities and model read from the entries that carry them.
func TestRLSMappingMatchesLikeRatelimit(t *testing.T) {
	c, err := Parse("rls.yaml", []byte(rlsFile))
	if err != nil {
		t.Fatal(err)
	}
	if _, known, _ := c.MatchRLS("other-domain", descriptor("user", "alice")); known {
		t.Error("other-domain is known")
	}
	for _, tt := range []struct {
		kv         []string
		ok         bool
		policy     string
		unlimited  bool
		deny       bool
		identities map[string]string
		model      string
	}{
		{kv: []string{"user", "alice"}, ok: true, policy: "bench", identities: map[string]string{"user": "alice"}},
		{kv: []string{"user", "vip-carol"}, ok: true, unlimited: true, identities: map[string]string{"user": "vip-carol"}},
		{kv: []string{"user", "vip-banned"}, ok: true, deny: true},
		{kv: []string{"tenant", "acme", "user", "bob"}, ok: true, policy: "bench", identities: map[string]string{"tenant": "acme", "user": "bob"}},
		{kv: []string{"tenant", "acme", "model", "gpt-4o"}, ok: true, policy: "bench", identities: map[string]string{"tenant": "acme"}, model: "gpt-4o"},
		// Two entries give one identity: their values together, escaped.
		{kv: []string{"org", "a&b", "team", "c d"}, ok: true, policy: "bench", identities: map[string]string{"tenant": "a%26b&c+d"}},
		{kv: []string{"tenant", "acme"}},
		{kv: []string{"user", "alice", "extra", "x"}},
		{kv: []string{"nobody", "x"}},
	} {
		m, known, ok := c.MatchRLS("ai-gateway", descriptor(tt.kv...))
		if !known || ok != tt.ok {
			t.Errorf("%q: known %v ok %v, want ok %v", tt.kv, known, ok, tt.ok)
			continue
		}
		if !ok {
			continue
		}
		d := m.Descriptor()
		if d.Policy != tt.policy || d.Unlimited != tt.unlimited || d.Deny != tt.deny {
			t.Errorf("%q: met %+v", tt.kv, d)
		}
		for _, id := range []string{"user", "tenant"} {
			v, ok := m.Identity(id)
			if want, has := tt.identities[id]; ok != has || v != want {
				t.Errorf("%q: identity %s = %q (%v), want %q (%v)", tt.kv, id, v, ok, want, has)
			}
		}
		if mdl, ok := m.Model(); mdl != tt.model || ok != (tt.model != "") {
			t.Errorf("%q: model %q (%v), want %q", tt.kv, mdl, ok, tt.model)
		}
	}
}

// A descriptor meets the rules its node names, a bucket and a concurrency
// limit of one name both; with none named, every bucket and quota and no
// concurrency limit.
func TestRLSDescriptorMeetsItsRules(t *testing.T) {
	c, err := Parse("rls.yaml", []byte(rlsFile))
	if err != nil {
		t.Fatal(err)
	}
	p, _ := c.Policy("bench")
	names := func(d *RLSDescriptor) (out []string) {
		bs, qs, cs := d.Meets(p)
		for _, b := range bs {
			out = append(out, "bucket "+b.Name)
		}
		for _, q := range qs {
			out = append(out, "quota "+q.Name)
		}
		for _, cl := range cs {
			out = append(out, "concurrency "+cl.Name)
		}
		return out
	}
	m, _, _ := c.MatchRLS("ai-gateway", descriptor("user", "alice"))
	if got, want := names(m.Descriptor()), []string{"bucket user", "concurrency user"}; !equal(got, want) {
		t.Errorf("rules [user]: %q, want %q", got, want)
	}
	if got, want := names(&RLSDescriptor{Policy: "bench"}), []string{"bucket user", "bucket tenant", "bucket model", "quota spend"}; !equal(got, want) {
		t.Errorf("no rules: %q, want %q", got, want)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A descriptor's metadata is read as ratelimit reads its own (numbers as
// numbers, a timestamp as its text, every key as its text, aliases
// followed) into the Struct the service merges into its answers.
func TestRLSMetadataIsReadAsRatelimitReadsIt(t *testing.T) {
	c, err := Parse("rls.yaml", []byte(`
policies:
  - name: p
    identities: [{name: user, header: x-user-id}]
    buckets: [{name: user, per: user, tokens_per_minute: 60}]
rls:
  response_dynamic_metadata: true
  domains:
    - domain: d
      descriptors:
        - key: user
          identity: user
          policy: p
          metadata:
            name: service_1
            tier: &t {level: 2, ratio: 0.5, paid: true, note: null}
            copy: *t
            since: 2001-12-14
            1: one
            list: [a, 7, {x: "y"}]
            empty: {}
        - {key: banned, deny: true, metadata: {}}
`))
	if err != nil {
		t.Fatal(err)
	}
	if !c.RLS.ResponseDynamicMetadata {
		t.Error("response_dynamic_metadata is not set")
	}
	m, _, ok := c.MatchRLS("d", descriptor("user", "ann"))
	if !ok {
		t.Fatal("no match")
	}
	tier := map[string]any{"level": 2, "ratio": 0.5, "paid": true, "note": nil}
	want, err := structpb.NewStruct(map[string]any{
		"name": "service_1", "tier": tier, "copy": tier, "since": "2001-12-14", "1": "one",
		"list": []any{"a", 7, map[string]any{"x": "y"}}, "empty": map[string]any{},
	})
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, m.Descriptor().Metadata.Struct(), protocmp.Transform()); d != "" {
		t.Errorf("metadata (-want +got):\n%s", d)
	}
	if m, _, _ := c.MatchRLS("d", descriptor("banned", "x")); m.Descriptor().Metadata.Struct() != nil {
		t.Errorf("empty metadata %v, want none", m.Descriptor().Metadata.Struct())
	}
}

// The RateLimit-* header names: ratelimit's defaults for those left out,
// any HTTP token otherwise.
func TestRLSLimitHeaderNames(t *testing.T) {
	for _, tt := range []struct {
		h                       RLSLimitHeaders
		limit, remaining, reset string
	}{
		{RLSLimitHeaders{Enabled: true}, "RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"},
		{RLSLimitHeaders{LimitHeader: "X-Quota", ResetHeader: "x-reset_in~s"}, "X-Quota", "RateLimit-Remaining", "x-reset_in~s"},
	} {
		l, rm, rs := tt.h.Names()
		if l != tt.limit || rm != tt.remaining || rs != tt.reset {
			t.Errorf("%+v: %q %q %q, want %q %q %q", tt.h, l, rm, rs, tt.limit, tt.remaining, tt.reset)
		}
		if ps := tt.h.problems(func(f string) string { return f }); len(ps) > 0 {
			t.Errorf("%+v: %v", tt.h, ps)
		}
	}
}
