package rls_test

import (
	"context"
	"math"
	"strconv"
	"strings"
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
)

// answersYAML maps domain d onto policy p (a user bucket of 10 refilling
// 10 a minute, another of 5 refilling 5 a minute), with metadata on its
// limits, and turns on ratelimit's optional answers: dynamic metadata and
// the RateLimit-* headers.
const answersYAML = `
store: {type: memory}
tokenizer: {fallback_encoding: o200k_base}
policies:
  - name: p
    identities:
      - {name: user, header: x-user}
    buckets:
      - {name: user, per: user, tokens_per_minute: 10, burst: 10, max_debt: 10}
      - {name: other, per: user, tokens_per_minute: 5, burst: 5, max_debt: 5}
rls:
  response_dynamic_metadata: true
  limit_response_headers: {enabled: true}
  domains:
    - domain: d
      descriptors:
        - key: user
          identity: user
          policy: p
          rules: [user]
          metadata: {service: {name: user, team: a}, tier: gold}
        - key: other
          identity: user
          policy: p
          rules: [other]
          metadata: {service: {name: other, region: eu}, tier: silver, extra: [1, two]}
        - {key: shadow, identity: user, policy: p, rules: [other], shadow_mode: true, metadata: {shadowed: true}}
        - {key: qa, identity: user, policy: p, rules: [other], quota_mode: true, metadata: {qa: true}}
        - {key: qb, identity: user, policy: p, rules: [user], quota_mode: true, metadata: {qb: true}}
        - {key: free, unlimited: true}
        - {key: named, identity: user, policy: p, rules: [user], name: base, metadata: {replaced: true}}
        - {key: better, identity: user, policy: p, rules: [other], replaces: [base], metadata: {better: true}}
        - {key: banned, deny: true, metadata: {banned: true}}
`

// onEveryStoreWith runs f on a rig of yaml on every store.
func onEveryStoreWith(t *testing.T, yaml string, f func(t *testing.T, r *rig)) {
	for _, name := range []string{"memory", "redis", "cluster"} {
		open := stores(t)[name]
		t.Run(name, func(t *testing.T) { f(t, newRig(t, open(t), yaml)) })
	}
}

// callWith is r.call with the request's own hits_addend.
func (r *rig) callWith(t *testing.T, requestHits uint32, ds ...*commonv3.RateLimitDescriptor) *rlsv3.RateLimitResponse {
	t.Helper()
	resp, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "d", Descriptors: ds, HitsAddend: requestHits})
	if err != nil {
		t.Fatalf("ShouldRateLimit: %v", err)
	}
	if len(resp.GetStatuses()) != len(ds) {
		t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(ds))
	}
	return resp
}

// structOf builds the Struct v describes, as structpb reads a JSON value.
func structOf(t *testing.T, v map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(v)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestResponseDynamicMetadata follows ratelimit's ratelimitToMetadata
// (§3.5): the domain, every descriptor's entries as "key=value" with its
// own limit as ratelimit prints it and its hits_addend when set (0
// included, a number), the call's hits_addend when not 0, and the metadata
// of the limits met whose status is not OVER_LIMIT, merged in descriptor
// order: the first value of a key wins, mappings merge. A replaced limit,
// an unlimited descriptor, one without a limit and a descriptor's own
// limit give none; a shadow-mode rule over the limit (answered OK) gives
// its own, a quota-mode one over does not, and neither does a status that
// the service's shadow mode leaves OVER_LIMIT.
func TestResponseDynamicMetadata(t *testing.T) {
	onEveryStoreWith(t, answersYAML, func(t *testing.T, r *rig) {
		own := desc("user", "ann")
		own.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 7, Unit: typev3.RateLimitUnit_MINUTE}
		got := r.callWith(t, 2,
			hits(desc("user", "ann"), 0), desc("other", "ann"), desc("named", "ann"), desc("better", "ann"),
			desc("free", "x"), desc("nothing", "x"), hits(own, 1), hits(desc("banned", "x"), 0))
		if got.GetOverallCode() != ok {
			t.Fatalf("answer %v, want OK", got)
		}
		want := structOf(t, map[string]any{
			"domain": "d",
			"descriptors": []any{
				map[string]any{"entries": []any{"user=ann"}, "hitsAddend": 0},
				map[string]any{"entries": []any{"other=ann"}},
				map[string]any{"entries": []any{"named=ann"}},
				map[string]any{"entries": []any{"better=ann"}},
				map[string]any{"entries": []any{"free=x"}},
				map[string]any{"entries": []any{"nothing=x"}},
				map[string]any{"entries": []any{"user=ann"}, "limit": "requests_per_unit:7 unit:MINUTE", "hitsAddend": 1},
				map[string]any{"entries": []any{"banned=x"}, "hitsAddend": 0},
			},
			"hitsAddend": 2,
			"metadata": map[string]any{
				"service": map[string]any{"name": "user", "team": "a", "region": "eu"},
				"tier":    "gold", "extra": []any{1, "two"}, "better": true, "banned": true,
			},
		})
		if d := cmp.Diff(want, got.GetDynamicMetadata(), protocmp.Transform()); d != "" {
			t.Errorf("dynamic metadata (-want +got):\n%s", d)
		}

		// Over the limit: a shadow-mode rule's status is OK, a quota-mode
		// one's over (overall OK: qb passes); a deny over the limit gives
		// none, and without hits_addend on the call there is none.
		got = r.call(t, hits(desc("shadow", "cat"), 9), hits(desc("qa", "cat"), 1), hits(desc("qb", "cat"), 1))
		if got.GetOverallCode() != ok || got.Statuses[1].GetCode() != over {
			t.Fatalf("answer %v, want OK overall, qa over", got)
		}
		md := got.GetDynamicMetadata().GetFields()
		if d := cmp.Diff(structOf(t, map[string]any{"shadowed": true, "qb": true}), md["metadata"].GetStructValue(), protocmp.Transform()); d != "" {
			t.Errorf("metadata of a shadow-mode rule over, a quota-mode one over and one OK (-want +got):\n%s", d)
		}
		if _, has := md["hitsAddend"]; has {
			t.Errorf("hitsAddend %v of a call without one, want none", md["hitsAddend"])
		}
		got = r.call(t, desc("banned", "x"))
		if d := cmp.Diff(structOf(t, map[string]any{"domain": "d", "descriptors": []any{map[string]any{"entries": []any{"banned=x"}}}}), got.GetDynamicMetadata(), protocmp.Transform()); got.GetOverallCode() != over || d != "" {
			t.Errorf("a deny over the limit: %v, metadata (-want +got):\n%s", got.GetOverallCode(), d)
		}
		// The configuration's metadata is not changed by a merge.
		got = r.call(t, desc("other", "bo"))
		if d := cmp.Diff(structOf(t, map[string]any{"service": map[string]any{"name": "other", "region": "eu"}, "tier": "silver", "extra": []any{1, "two"}}),
			got.GetDynamicMetadata().GetFields()["metadata"].GetStructValue(), protocmp.Transform()); d != "" {
			t.Errorf("metadata of other alone, after a merge (-want +got):\n%s", d)
		}
	})
	t.Run("service shadow mode", func(t *testing.T) {
		r := newRig(t, stores(t)["memory"](t), answersYAML+"  shadow_mode: true\n")
		got := r.call(t, hits(desc("user", "eve"), 11), desc("other", "eve"))
		if got.GetOverallCode() != ok || got.Statuses[0].GetCode() != over {
			t.Fatalf("answer %v, want OK overall, the first status over", got)
		}
		if d := cmp.Diff(structOf(t, map[string]any{"service": map[string]any{"name": "other", "region": "eu"}, "tier": "silver", "extra": []any{1, "two"}}),
			got.GetDynamicMetadata().GetFields()["metadata"].GetStructValue(), protocmp.Transform()); d != "" {
			t.Errorf("metadata (-want +got):\n%s", d)
		}
	})
	t.Run("off", func(t *testing.T) {
		r := newRig(t, stores(t)["memory"](t), mappingYAML)
		if got := r.call(t, desc("user", "ann")); got.GetDynamicMetadata() != nil {
			t.Errorf("dynamic metadata %v without rls.response_dynamic_metadata", got.GetDynamicMetadata())
		}
	})
}

// A deferred domain's stream-done call is answered at once, with the
// metadata of every limit it met: nothing is over before it is written.
func TestResponseDynamicMetadataOfDeferredCharges(t *testing.T) {
	onEveryStoreWith(t, answersYAML+"  deferred_charges: [d]\n", func(t *testing.T, r *rig) {
		got := r.call(t, hits(desc("user", "dee"), 30), hits(desc("banned", "x"), 3))
		want := structOf(t, map[string]any{
			"domain": "d",
			"descriptors": []any{
				map[string]any{"entries": []any{"user=dee"}, "hitsAddend": 30},
				map[string]any{"entries": []any{"banned=x"}, "hitsAddend": 3},
			},
			"metadata": map[string]any{"service": map[string]any{"name": "user", "team": "a"}, "tier": "gold", "banned": true},
		})
		if d := cmp.Diff(want, got.GetDynamicMetadata(), protocmp.Transform()); d != "" {
			t.Errorf("dynamic metadata (-want +got):\n%s", d)
		}
		if h := got.GetResponseHeadersToAdd(); len(h) != 0 {
			t.Errorf("headers %v of a deferred answer, which knows no remaining or reset", h)
		}
		if err := r.svc.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// headersOf are an answer's response_headers_to_add as name, value pairs.
func headersOf(resp *rlsv3.RateLimitResponse) [][2]string {
	var out [][2]string
	for _, h := range resp.GetResponseHeadersToAdd() {
		out = append(out, [2]string{h.GetKey(), h.GetValue()})
	}
	return out
}

// resetOf is what RateLimit-Reset says of a status: its
// duration_until_reset in whole seconds, rounded up.
func resetOf(st *rlsv3.RateLimitResponse_DescriptorStatus) string {
	return itoa(int64(math.Ceil(st.GetDurationUntilReset().AsDuration().Seconds())))
}

// TestLimitResponseHeaders follows ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED
// (§3.5): RateLimit-Limit (requests_per_unit), RateLimit-Remaining and
// RateLimit-Reset of the status with the least limit_remaining among those
// with a current_limit, the first on a tie; a status over the limit
// outside quota mode takes over, the last such one; the reset is the
// status's own duration_until_reset, rounded up. retry-after follows them
// on an OVER_LIMIT answer.
func TestLimitResponseHeaders(t *testing.T) {
	onEveryStoreWith(t, answersYAML, func(t *testing.T, r *rig) {
		headers := func(limit, remaining string, st *rlsv3.RateLimitResponse_DescriptorStatus, more ...[2]string) [][2]string {
			return append([][2]string{{"RateLimit-Limit", limit}, {"RateLimit-Remaining", remaining}, {"RateLimit-Reset", resetOf(st)}}, more...)
		}
		for _, tt := range []struct {
			name  string
			ds    []*commonv3.RateLimitDescriptor
			pick  int // the status the headers are of
			want  func(got *rlsv3.RateLimitResponse) [][2]string
			reset [2]int64 // the range the reset must be in, seconds
		}{
			{"one status", []*commonv3.RateLimitDescriptor{hits(desc("user", "ann"), 4)}, 0,
				func(got *rlsv3.RateLimitResponse) [][2]string { return headers("10", "6", got.Statuses[0]) }, [2]int64{23, 24}},
			// 1 left of 5, 4 asked for: until it holds 4 again, 3 tokens
			// at 5 a minute.
			{"the least remaining", []*commonv3.RateLimitDescriptor{hits(desc("user", "bob"), 3), hits(desc("other", "bob"), 4), desc("free", "x")}, 1,
				func(got *rlsv3.RateLimitResponse) [][2]string { return headers("5", "1", got.Statuses[1]) }, [2]int64{35, 36}},
			{"the first on a tie", []*commonv3.RateLimitDescriptor{desc("free", "x"), hits(desc("user", "cy"), 5), hits(desc("other", "cy"), 0)}, 1,
				func(got *rlsv3.RateLimitResponse) [][2]string { return headers("10", "5", got.Statuses[1]) }, [2]int64{29, 30}},
			// 11 of 10: 12 tokens at 10 a minute; 6 of 5: 7 tokens at 5 a
			// minute, the last over and the longer retry.
			{"the last over", []*commonv3.RateLimitDescriptor{hits(desc("user", "dee"), 11), hits(desc("other", "dee"), 6), hits(desc("user", "eli"), 1)}, 1,
				func(got *rlsv3.RateLimitResponse) [][2]string {
					return headers("5", "0", got.Statuses[1], [2]string{"retry-after", "84"})
				}, [2]int64{84, 84}},
			// The shadow-mode rule answers OK with remaining 0, first (7
			// of 5: 9 tokens at 5 a minute); the quota-mode descriptor
			// over does not take over.
			{"quota mode over does not take over", []*commonv3.RateLimitDescriptor{hits(desc("shadow", "fay"), 7), hits(desc("qb", "fay"), 11), hits(desc("qa", "gus"), 1)}, 0,
				func(got *rlsv3.RateLimitResponse) [][2]string { return headers("5", "0", got.Statuses[0]) }, [2]int64{108, 108}},
			{"unlimited, no limit and replaced skipped", []*commonv3.RateLimitDescriptor{desc("free", "x"), desc("nothing", "x"), desc("named", "x"), desc("better", "x")}, 3,
				func(got *rlsv3.RateLimitResponse) [][2]string { return headers("5", "4", got.Statuses[3]) }, [2]int64{11, 12}},
		} {
			t.Run(tt.name, func(t *testing.T) {
				got := r.call(t, tt.ds...)
				if d := cmp.Diff(tt.want(got), headersOf(got)); d != "" {
					t.Errorf("headers (-want +got):\n%s\nstatuses %v", d, got.GetStatuses())
				}
				reset := int64(math.Ceil(got.Statuses[tt.pick].GetDurationUntilReset().AsDuration().Seconds()))
				if reset < tt.reset[0] || reset > tt.reset[1] {
					t.Errorf("reset %ds, want %d to %d", reset, tt.reset[0], tt.reset[1])
				}
			})
		}
		if got := r.call(t, desc("free", "x"), desc("nothing", "x")); len(got.GetResponseHeadersToAdd()) != 0 {
			t.Errorf("headers %v of an answer without a limit, want none", headersOf(got))
		}
	})
	t.Run("names and shadow mode", func(t *testing.T) {
		y := answersYAML + "  shadow_mode: true\n"
		r := newRig(t, stores(t)["memory"](t), replaceOnce(t, y, "limit_response_headers: {enabled: true}", "limit_response_headers: {enabled: true, limit_header: X-Quota, reset_header: x-reset}"))
		got := r.call(t, hits(desc("user", "hal"), 11))
		want := [][2]string{{"X-Quota", "10"}, {"RateLimit-Remaining", "0"}, {"x-reset", resetOf(got.Statuses[0])}}
		if d := cmp.Diff(want, headersOf(got)); got.GetOverallCode() != ok || d != "" {
			t.Errorf("the service's shadow mode: %v, headers (-want +got):\n%s", got.GetOverallCode(), d)
		}
	})
	t.Run("off", func(t *testing.T) {
		r := newRig(t, stores(t)["memory"](t), mappingYAML)
		if got := r.call(t, desc("user", "ann")); len(got.GetResponseHeadersToAdd()) != 0 {
			t.Errorf("headers %v without rls.limit_response_headers", headersOf(got))
		}
	})
}

// A replaced limit is no limit: its quota mode goes with it, as
// ratelimit's (the replaced limit is nil when it counts quota
// descriptors), so a quota-mode descriptor over beside it is the only one,
// and the call is over.
func TestReplacedLimitIsNoQuotaDescriptor(t *testing.T) {
	y := replaceOnce(t, answersYAML, "{key: named, identity: user, policy: p, rules: [user], name: base, metadata: {replaced: true}}",
		"{key: named, identity: user, policy: p, rules: [user], name: base, quota_mode: true}")
	onEveryStoreWith(t, y, func(t *testing.T, r *rig) {
		got := r.call(t, desc("named", "ivy"), desc("better", "ivy"), hits(desc("qa", "ivy"), 6))
		if got.GetOverallCode() != over || got.Statuses[0].GetCurrentLimit() != nil {
			t.Errorf("a replaced quota-mode limit beside a quota-mode descriptor over: %v, want OVER_LIMIT", got)
		}
	})
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// replaceOnce is s with old, which it must hold, replaced by new.
func replaceOnce(t *testing.T, s, old, new string) string {
	t.Helper()
	if !strings.Contains(s, old) {
		t.Fatalf("no %q to replace", old)
	}
	return strings.Replace(s, old, new, 1)
}
