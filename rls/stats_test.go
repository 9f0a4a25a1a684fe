package rls_test

import (
	"context"
	"strings"
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/rls"
)

// statsYAML maps onto buckets as the import makes ratelimit's limits: user
// 10 per minute, other 5 per minute, each with a window's worth of debt.
const statsYAML = `
store: {type: memory}
policies:
  - name: p
    identities:
      - {name: user, header: x-user}
    buckets:
      - {name: user, per: user, tokens_per_minute: 10, burst: 10, max_debt: 10}
      - {name: other, per: user, tokens_per_minute: 5, burst: 5, max_debt: 5}
rls:
  domains:
    - domain: d
      descriptors:
        - {key: user, identity: user, policy: p, rules: [user]}
        - {key: shadow, identity: user, policy: p, rules: [other], shadow_mode: true}
        - {key: detail, identity: user, policy: p, rules: [user], detailed_metric: true}
        - key: route
          value_to_metric: true
          descriptors:
            - {key: user, identity: user, policy: p, rules: [user]}
        - key: team
          value: "ops-*"
          descriptors:
            - {key: user, identity: user, policy: p, rules: [user]}
        - {key: health, value: probe, unlimited: true}
        - {key: banned, deny: true}
        - {key: named, identity: user, policy: p, rules: [user], name: base}
        - {key: better, identity: user, policy: p, rules: [other], replaces: [base]}
`

// byKey sums the stats handed out per key.
func (r *rig) byKey() map[string]rls.RatelimitStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]rls.RatelimitStats{}
	for _, s := range r.stats {
		t := out[s.Key]
		t.Key = s.Key
		t.TotalHits += s.TotalHits
		t.OverLimit += s.OverLimit
		t.NearLimit += s.NearLimit
		t.WithinLimit += s.WithinLimit
		t.ShadowMode += s.ShadowMode
		t.DomainNotFound += s.DomainNotFound
		out[s.Key] = t
	}
	return out
}

// TestRatelimitStats follows ratelimit's base limiter (docs/envoy-
// ratelimit.md §3.6): every hit of a limit is in total_hits; those of a
// call the limit lets through in within_limit; those past the near
// threshold (0.8 of the limit, rounded down) and not past the limit in
// near_limit; those past it in over_limit, and in shadow_mode too when the
// rule's shadow mode answered OK. A check (hits 0), an unlimited
// descriptor and a replaced limit add nothing; every descriptor of a call
// to an unknown domain, hits or not, adds 1 to that domain's
// domain_not_found, as ratelimit's GetLimit counts it. The keys
// are ratelimit's: the configured path, the request's values with
// detailed_metric and value_to_metric, a wildcard's pattern, the entries
// for a descriptor's own limit.
func TestRatelimitStats(t *testing.T) {
	onEveryStoreWith(t, statsYAML, func(t *testing.T, r *rig) {
		// A count of 10 by 7, 2, 3 and 1: 7 within; 9 is past 8, so 1 of
		// the 2 is near; 12 is 2 over, 1 near (9 to 10); then 1 over.
		for _, n := range []uint64{7, 0, 2, 3, 1} {
			r.call(t, hits(desc("user", "alice"), n))
		}
		// 7 on 5 under shadow mode: answered OK; 2 over, in shadow_mode
		// too, 1 near (4 to 5), none within: the call was over the limit.
		if got := r.call(t, hits(desc("shadow", "bob"), 7)); got.GetOverallCode() != ok {
			t.Errorf("shadow-mode rule over its limit answered %v, want OK", got.GetOverallCode())
		}
		r.call(t, hits(desc("banned", "x"), 3))
		r.call(t, hits(desc("health", "probe"), 4))
		r.call(t, hits(desc("detail", "dave"), 2))
		r.call(t, hits(desc("route", "/v1/chat", "user", "eve"), 1))
		r.call(t, hits(desc("team", "ops-eu", "user", "fay"), 1))
		r.call(t, hits(desc("named", "gus"), 1), hits(desc("better", "gus"), 1))
		own := hits(desc("user", "carol"), 3)
		own.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 4, Unit: typev3.RateLimitUnit_HOUR}
		r.call(t, own)
		if _, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "elsewhere", Descriptors: []*commonv3.RateLimitDescriptor{hits(desc("user", "x"), 5)}}); err != nil {
			t.Fatal(err)
		}
		if _, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "elsewhere", Descriptors: []*commonv3.RateLimitDescriptor{hits(desc("user", "y"), 0), desc("route", "/")}}); err != nil {
			t.Fatal(err)
		}
		want := map[string]rls.RatelimitStats{
			"d.user":                {TotalHits: 13, WithinLimit: 9, NearLimit: 2, OverLimit: 3},
			"d.shadow":              {TotalHits: 7, NearLimit: 1, OverLimit: 2, ShadowMode: 2},
			"d.banned":              {TotalHits: 3, OverLimit: 3},
			"d.detail_dave":         {TotalHits: 2, WithinLimit: 2},
			"d.route_/v1/chat.user": {TotalHits: 1, WithinLimit: 1},
			"d.team_ops-*.user":     {TotalHits: 1, WithinLimit: 1},
			"d.better":              {TotalHits: 1, WithinLimit: 1},
			"d.user_carol":          {TotalHits: 3, WithinLimit: 3, NearLimit: 0},
			"elsewhere":             {DomainNotFound: 3},
		}
		for k, v := range want {
			v.Key = k
			want[k] = v
		}
		if d := cmp.Diff(want, r.byKey()); d != "" {
			t.Errorf("stats (-want +got):\n%s", d)
		}
	})
}

// TestRatelimitStatsGlobalShadowMode: with the service's shadow mode
// (ratelimit's SHADOW_MODE) a call over the limit is answered OK and
// counted in global_shadow_mode, once per call however many descriptors
// were over; a call within the limit, and one a rule's own shadow mode
// answered OK, are not (§3.5).
func TestRatelimitStatsGlobalShadowMode(t *testing.T) {
	yaml := strings.Replace(statsYAML, "rls:\n", "rls:\n  shadow_mode: true\n", 1)
	onEveryStoreWith(t, yaml, func(t *testing.T, r *rig) {
		r.call(t, hits(desc("user", "ivy"), 4))
		r.call(t, hits(desc("shadow", "ivy"), 9))
		if n := r.shadowedCalls(); n != 0 {
			t.Fatalf("%d calls counted before any was over the limit", n)
		}
		got := r.call(t, hits(desc("user", "ivy"), 9), hits(desc("banned", "x"), 1))
		if got.GetOverallCode() != ok || got.GetStatuses()[0].GetCode() != over {
			t.Errorf("over the limit in global shadow mode: overall %v, first status %v; want OK, OVER_LIMIT", got.GetOverallCode(), got.GetStatuses()[0].GetCode())
		}
		if n := r.shadowedCalls(); n != 1 {
			t.Errorf("%d calls counted in global_shadow_mode, want 1", n)
		}
		if st := r.byKey()["d.user"]; st.OverLimit != 3 {
			t.Errorf("d.user %+v: shadow mode must count hits as usual (3 over)", st)
		}
	})
}

func (r *rig) shadowedCalls() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.shadowed
}

// TestRatelimitStatsNearLimitRatio: rls.near_limit_ratio moves the near
// threshold (ratelimit's NEAR_LIMIT_RATIO).
func TestRatelimitStatsNearLimitRatio(t *testing.T) {
	yaml := strings.Replace(statsYAML, "rls:\n", "rls:\n  near_limit_ratio: 0.5\n", 1)
	onEveryStoreWith(t, yaml, func(t *testing.T, r *rig) {
		r.call(t, hits(desc("user", "hal"), 6))
		want := rls.RatelimitStats{Key: "d.user", TotalHits: 6, WithinLimit: 6, NearLimit: 1}
		if got := r.byKey()["d.user"]; got != want {
			t.Errorf("6 hits on 10 at a ratio of 0.5: %+v, want %+v", got, want)
		}
	})
}

// TestRatelimitStatsOfDeferredCharges: a deferred domain's charge counts
// once it is written, from the levels the store answered.
func TestRatelimitStatsOfDeferredCharges(t *testing.T) {
	yaml := strings.Replace(statsYAML, "rls:\n", "rls:\n  deferred_charges: [d]\n", 1)
	onEveryStoreWith(t, yaml, func(t *testing.T, r *rig) {
		r.call(t, hits(desc("user", "ivy"), 9))
		if err := r.svc.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		r.call(t, hits(desc("user", "ivy"), 4))
		if err := r.svc.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		want := rls.RatelimitStats{Key: "d.user", TotalHits: 13, WithinLimit: 9, NearLimit: 2, OverLimit: 3}
		if got := r.byKey()["d.user"]; got != want {
			t.Errorf("deferred charges of 9 and 4 on 10: %+v, want %+v", got, want)
		}
	})
}
