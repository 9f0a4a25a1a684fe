package rls_test

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/rls"
)

// mappingYAML is the configuration of these tests: policy p with a user
// bucket of 10 tokens refilling 10 a minute (ratelimit's 10 per minute,
// as the import makes it) and max_debt 10, a daily quota of 100 tokens,
// a second bucket, and a daily cost quota; domain d maps descriptors onto
// them.
const mappingYAML = `
store: {type: memory}
tokenizer: {fallback_encoding: o200k_base}
pricing:
  currency: USD
  defaults: none
  unknown_models: refuse
  models:
    - {model: gpt-4o, input: "2.50", output: "10.00"}
policies:
  - name: p
    identities:
      - {name: user, header: x-user}
    buckets:
      - {name: user, per: user, tokens_per_minute: 10, burst: 10, max_debt: 10}
      - {name: other, per: user, tokens_per_minute: 5, burst: 5, max_debt: 5}
    quotas:
      - {name: daily, per: user, window: day, timezone: UTC, tokens: 100}
      - {name: spend, per: user, window: day, timezone: UTC, cost: "0.0001"}
rls:
  domains:
    - domain: d
      descriptors:
        - {key: user, identity: user, policy: p, rules: [user]}
        - {key: both, identity: user, policy: p, rules: [user, other]}
        - {key: quser, identity: user, policy: p, rules: [daily]}
        - {key: shadow, identity: user, policy: p, rules: [other], shadow_mode: true}
        - {key: qm, identity: user, policy: p, rules: [user], quota_mode: true}
        - {key: qm2, identity: user, policy: p, rules: [other], quota_mode: true}
        - {key: health, value: probe, unlimited: true}
        - {key: banned, deny: true}
        - {key: named, identity: user, policy: p, rules: [user], name: base}
        - {key: better, identity: user, policy: p, rules: [other], replaces: [base]}
        - key: cuser
          identity: user
          descriptors:
            - {key: model, model: true, policy: p, rules: [spend]}
`

// rig is a service on one store with the test mapping loaded.
type rig struct {
	svc   *rls.Service
	store buckets.Store
	cfg   *config.Config
	mu    sync.Mutex
	seen  []rls.Result
	errs  []string
	stats []rls.RatelimitStats
	// shadowed counts the calls the service's shadow mode answered OK.
	shadowed int
}

func newRig(t *testing.T, store buckets.Store, yaml string) *rig {
	t.Helper()
	cfg, err := config.Parse("mapping.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{store: store, cfg: cfg}
	svc, err := rls.New(rls.Config{
		Store: store, Prices: cfg.Prices(),
		OnDescriptor:       func(res rls.Result) { r.mu.Lock(); r.seen = append(r.seen, res); r.mu.Unlock() },
		OnError:            func(reason string) { r.mu.Lock(); r.errs = append(r.errs, reason); r.mu.Unlock() },
		OnStats:            func(st rls.RatelimitStats) { r.mu.Lock(); r.stats = append(r.stats, st); r.mu.Unlock() },
		OnGlobalShadowMode: func() { r.mu.Lock(); r.shadowed++; r.mu.Unlock() },
	})
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
	r.svc = svc
	return r
}

// stores are the stores every test runs on: memory, Redis and the Redis
// Cluster, each on a fresh prefix per test.
func stores(t *testing.T) map[string]func(t *testing.T) buckets.Store {
	return map[string]func(t *testing.T) buckets.Store{
		"memory": func(t *testing.T) buckets.Store { return buckets.NewMemory(buckets.MemoryOptions{}) },
		"redis": func(t *testing.T) buckets.Store {
			srv := redisServer(t)
			c := redis.NewClient(&redis.Options{Addr: srv})
			t.Cleanup(func() { c.Close() })
			return redisstore.New(c, redisstore.Options{Prefix: t.Name() + ":" + admission.NewID()[:8] + ":"})
		},
		"cluster": func(t *testing.T) buckets.Store {
			addrs := redisCluster(t)
			c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
			t.Cleanup(func() { c.Close() })
			return redisstore.New(c, redisstore.Options{Prefix: t.Name() + ":" + admission.NewID()[:8] + ":", Cluster: true})
		},
	}
}

// eachStore runs f on every store.
func eachStore(t *testing.T, f func(t *testing.T, r *rig)) {
	for _, name := range []string{"memory", "redis", "cluster"} {
		open := stores(t)[name]
		t.Run(name, func(t *testing.T) { f(t, newRig(t, open(t), mappingYAML)) })
	}
}

func desc(kv ...string) *commonv3.RateLimitDescriptor {
	d := &commonv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func hits(d *commonv3.RateLimitDescriptor, n uint64) *commonv3.RateLimitDescriptor {
	d.HitsAddend = wrapperspb.UInt64(n)
	return d
}

func (r *rig) call(t *testing.T, ds ...*commonv3.RateLimitDescriptor) *rlsv3.RateLimitResponse {
	t.Helper()
	resp, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "d", Descriptors: ds})
	if err != nil {
		t.Fatalf("ShouldRateLimit: %v", err)
	}
	if len(resp.GetStatuses()) != len(ds) {
		t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(ds))
	}
	return resp
}

// level is a bucket's level as the store holds it for identity value user
// (of whichever identity the rule is per), found by the key the admission
// core gives it: the ext_proc front meets the same bucket.
func (r *rig) level(t *testing.T, rule, user string) float64 {
	t.Helper()
	pols, err := admission.FromConfig(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	p := admission.Normalize(pols[0])
	ids := map[string]string{}
	for _, id := range p.Identities {
		ids[id.Name] = admission.IdentityKey(user, false)
	}
	c := admission.Chain{Policy: &p, PolicyName: p.Name, IDs: ids}
	for _, br := range p.Buckets {
		if br.Name == rule {
			bs, _, err := r.store.(buckets.Inspector).Inspect(context.Background(), []buckets.Bucket{c.Bucket(br)}, nil)
			if err != nil {
				t.Fatal(err)
			}
			return bs[0].Remaining
		}
	}
	t.Fatalf("no bucket %q", rule)
	return 0
}

func near(a, b float64) bool { return math.Abs(a-b) < 0.01 }

var (
	ok   = rlsv3.RateLimitResponse_OK
	over = rlsv3.RateLimitResponse_OVER_LIMIT
)

// TestHitsOntoTokens follows docs/rls.md "Hits onto tokens": a request's
// hits_addend 0 counts 1, a descriptor's own hits_addend wins, 0 checks
// (OK at exactly 0, with remaining 0), a charge over the limit is written
// down to max_debt and answered OVER_LIMIT, and a check in debt is over.
func TestHitsOntoTokens(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		if got := r.call(t, desc("user", "alice")); got.GetOverallCode() != ok || got.Statuses[0].GetLimitRemaining() != 9 {
			t.Fatalf("one default hit: %v", got)
		}
		if l := r.level(t, "user", "alice"); !near(l, 9) {
			t.Errorf("level after one hit %v, want 9", l)
		}
		if got := r.call(t, hits(desc("user", "alice"), 9)); got.GetOverallCode() != ok || got.Statuses[0].GetLimitRemaining() != 0 {
			t.Fatalf("9 hits at 9: %v", got)
		}
		if got := r.call(t, hits(desc("user", "alice"), 0)); got.GetOverallCode() != ok || got.Statuses[0].GetLimitRemaining() != 0 {
			t.Fatalf("a check at exactly 0: %v, want OK with remaining 0", got)
		}
		got := r.call(t, hits(desc("user", "alice"), 4))
		if got.GetOverallCode() != over || got.Statuses[0].GetCode() != over || got.Statuses[0].GetLimitRemaining() != 0 {
			t.Fatalf("4 hits at 0: %v, want OVER_LIMIT", got)
		}
		if l := r.level(t, "user", "alice"); l > -4+0.01 || l < -4-0.01 {
			t.Errorf("level after an over-limit charge %v, want -4: the hits are written", l)
		}
		if h := got.GetResponseHeadersToAdd(); len(h) != 1 || h[0].GetKey() != "retry-after" {
			t.Errorf("headers of an over-limit answer %v, want retry-after", h)
		} else if h[0].GetValue() != "48" {
			// 4 tokens of debt and 4 hits asked for: 8 tokens at 10 a
			// minute.
			t.Errorf("retry-after %q, want 48", h[0].GetValue())
		}
		r.call(t, hits(desc("user", "alice"), 100))
		if l := r.level(t, "user", "alice"); !near(l, -10) {
			t.Errorf("level after 100 hits %v, want the floor -10 (max_debt)", l)
		}
		if got := r.call(t, hits(desc("user", "alice"), 0)); got.GetOverallCode() != over {
			t.Errorf("a check in debt: %v, want OVER_LIMIT", got)
		}
		if got := r.call(t, desc("user", "bob")); got.GetOverallCode() != ok {
			t.Errorf("another identity: %v, want its own bucket", got)
		}
	})
}

// TestStatusesReportTheRule: current_limit is the imported rule's (10 per
// minute), limit_remaining the bucket's level, duration_until_reset the
// time to refill; several rules of one descriptor report the tightest.
func TestStatusesReportTheRule(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		st := r.call(t, hits(desc("user", "carol"), 4)).Statuses[0]
		cl := st.GetCurrentLimit()
		if cl.GetRequestsPerUnit() != 10 || cl.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE || st.GetLimitRemaining() != 6 {
			t.Errorf("status %v, want 10 per minute, remaining 6", st)
		}
		if d := st.GetDurationUntilReset().AsDuration(); d < 23*time.Second || d > 24*time.Second {
			t.Errorf("duration_until_reset %v, want 24s (4 tokens at 10 a minute)", d)
		}
		st = r.call(t, hits(desc("both", "carol"), 3)).Statuses[0]
		if st.GetCurrentLimit().GetRequestsPerUnit() != 5 || st.GetLimitRemaining() != 2 {
			t.Errorf("two rules: %v, want the other bucket's 5 per minute, remaining 2", st)
		}
	})
}

// TestHugeHitsResetCappedAtAYear: the time until a bucket holds the hits
// is at most a year (docs/rls.md "The service"), also for hits whose
// refill takes longer than a time.Duration holds: 2e9 hits at 10 a minute
// take some 380 years. retry-after says the same year.
func TestHugeHitsResetCappedAtAYear(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		got := r.call(t, hits(desc("user", "huge"), 2_000_000_000))
		st := got.GetStatuses()[0]
		if st.GetCode() != over {
			t.Fatalf("2e9 hits on a bucket of 10: %v, want OVER_LIMIT", st)
		}
		const year = 365 * 24 * time.Hour
		if d := st.GetDurationUntilReset().AsDuration(); d != year {
			t.Errorf("duration_until_reset %v, want the cap of a year", d)
		}
		var retry []string
		for _, h := range got.GetResponseHeadersToAdd() {
			if h.GetKey() == "retry-after" {
				retry = append(retry, h.GetValue())
			}
		}
		if len(retry) != 1 || retry[0] != "31536000" {
			t.Errorf("retry-after %q, want one of 31536000 (a year)", retry)
		}
	})
}

// TestNegativeHitsRefund: is_negative_hits gives tokens back, never above
// the capacity.
func TestNegativeHitsRefund(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		r.call(t, hits(desc("user", "dan"), 8))
		d := hits(desc("user", "dan"), 5)
		d.IsNegativeHits = true
		if got := r.call(t, d); got.GetOverallCode() != ok {
			t.Fatalf("refund: %v", got)
		}
		if l := r.level(t, "user", "dan"); !near(l, 7) {
			t.Errorf("level after a refund of 5 at 2: %v, want 7", l)
		}
		d = hits(desc("user", "dan"), 50)
		d.IsNegativeHits = true
		r.call(t, d)
		if l := r.level(t, "user", "dan"); !near(l, 10) {
			t.Errorf("level after a refund of 50: %v, want the capacity 10", l)
		}
	})
}

// TestQuotaAndShadowMode follows §3.4, §3.5: a shadow-mode rule answers OK
// with remaining 0 while its bucket is charged; one quota-mode descriptor
// over is OK, all of them over is OVER_LIMIT; the service's shadow mode
// answers OK overall with the statuses over.
func TestQuotaAndShadowMode(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		got := r.call(t, hits(desc("shadow", "erin"), 7))
		if got.GetOverallCode() != ok || got.Statuses[0].GetCode() != ok || got.Statuses[0].GetLimitRemaining() != 0 {
			t.Errorf("shadow-mode rule over: %v, want OK with remaining 0", got)
		}
		if l := r.level(t, "other", "erin"); !near(l, -2) {
			t.Errorf("shadow-mode rule's level %v, want -2: counted as usual", l)
		}
		got = r.call(t, hits(desc("qm", "finn"), 11), hits(desc("qm2", "finn"), 1))
		if got.GetOverallCode() != ok || got.Statuses[0].GetCode() != over {
			t.Errorf("one quota-mode descriptor over: %v, want overall OK, its status over", got)
		}
		got = r.call(t, hits(desc("qm", "finn"), 1), hits(desc("qm2", "finn"), 5))
		if got.GetOverallCode() != over {
			t.Errorf("every quota-mode descriptor over: %v, want OVER_LIMIT", got)
		}
	})
	t.Run("global", func(t *testing.T) {
		r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), mappingYAML+"  shadow_mode: true\n")
		got := r.call(t, hits(desc("user", "fay"), 11))
		if got.GetOverallCode() != ok || got.Statuses[0].GetCode() != over {
			t.Errorf("global shadow mode: %v, want overall OK, the status over", got)
		}
		if len(got.GetResponseHeadersToAdd()) != 0 {
			t.Errorf("global shadow mode added %v", got.GetResponseHeadersToAdd())
		}
	})
	// ratelimit's QUOTA_MODE (§3.4): every descriptor but the unlimited is
	// a quota one, those that meet no limit too; over only when all are.
	t.Run("global quota", func(t *testing.T) {
		r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), mappingYAML+"  quota_mode: true\n")
		got := r.call(t, hits(desc("user", "gus"), 11), desc("nothing", "x"))
		if got.GetOverallCode() != ok || got.Statuses[0].GetCode() != over {
			t.Errorf("one descriptor over beside one without a limit: %v, want overall OK, its status over", got)
		}
		got = r.call(t, hits(desc("user", "hal"), 11), desc("health", "probe"))
		if got.GetOverallCode() != over {
			t.Errorf("one descriptor over beside an unlimited one: %v, want OVER_LIMIT (the unlimited is no quota descriptor)", got)
		}
		got = r.call(t, hits(desc("user", "ivy"), 11), hits(desc("user", "jo"), 11))
		if got.GetOverallCode() != over {
			t.Errorf("every descriptor over: %v, want OVER_LIMIT", got)
		}
	})
}

// TestLimitsWithoutBuckets: unlimited, deny, replaces, unknown domains and
// descriptors that land on no limit, each counted.
func TestLimitsWithoutBuckets(t *testing.T) {
	r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), mappingYAML)
	got := r.call(t, desc("health", "probe"), desc("nothing", "x"), hits(desc("banned", "u"), 0))
	if got.GetOverallCode() != ok || got.Statuses[0].GetLimitRemaining() != math.MaxUint32 || got.Statuses[1].GetCurrentLimit() != nil {
		t.Errorf("unlimited, unmatched and a check of deny: %v", got)
	}
	if got := r.call(t, desc("banned", "u")); got.GetOverallCode() != over {
		t.Errorf("deny: %v, want OVER_LIMIT", got)
	}
	got = r.call(t, hits(desc("named", "gil"), 20), hits(desc("better", "gil"), 1))
	if got.GetOverallCode() != ok || got.Statuses[0].GetCurrentLimit() != nil {
		t.Errorf("a replaced limit: %v, want OK with no limit", got)
	}
	if l := r.level(t, "user", "gil"); !near(l, 10) {
		t.Errorf("a replaced limit charged: level %v, want 10", l)
	}
	resp, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "elsewhere", Descriptors: []*commonv3.RateLimitDescriptor{desc("user", "x")}})
	if err != nil || resp.GetOverallCode() != ok || resp.Statuses[0].GetCurrentLimit() != nil {
		t.Errorf("unknown domain: %v, %v; want OK with no limit", resp, err)
	}
	kinds := map[string]int{}
	for _, s := range r.seen {
		kinds[s.Kind]++
		if s.Kind == rls.KindUnknownDomain && s.Domain != "" {
			t.Errorf("an unknown domain is labelled %q", s.Domain)
		}
	}
	for _, k := range []string{rls.KindUnlimited, rls.KindNoLimit, rls.KindDeny, rls.KindReplaced, rls.KindUnknownDomain} {
		if kinds[k] == 0 {
			t.Errorf("no descriptor counted as %s: %v", k, kinds)
		}
	}
}

// unlimitedNamedYAML is mappingYAML with the unlimited node named base,
// the name that node better replaces.
func unlimitedNamedYAML(t *testing.T) string {
	return replaceOnce(t, mappingYAML, "{key: health, value: probe, unlimited: true}", "{key: health, value: probe, unlimited: true, name: base}")
}

// TestReplacedUnlimitedStaysUnlimited: an unlimited limit is never
// replaced, as ratelimit sets unlimited limits aside before it drops the
// replaced names (§3.2): beside a descriptor replacing its name it is
// still {OK, limit_remaining MaxUint32}, while a limit of that name is
// dropped; and under the service's quota mode it is no quota-mode
// descriptor (§3.5), so a call whose limited descriptors are all over is
// OVER_LIMIT beside it. What an unlimited limit replaces goes, as any
// limit's.
func TestReplacedUnlimitedStaysUnlimited(t *testing.T) {
	onEveryStoreWith(t, unlimitedNamedYAML(t), func(t *testing.T, r *rig) {
		got := r.call(t, desc("health", "probe"), hits(desc("named", "amy"), 20), desc("better", "amy"))
		if st := got.GetStatuses()[0]; st.GetCode() != ok || st.GetLimitRemaining() != math.MaxUint32 || st.GetCurrentLimit() != nil {
			t.Errorf("an unlimited descriptor beside one replacing its name: %v, want OK with limit_remaining %d and no limit", st, uint32(math.MaxUint32))
		}
		if st := got.GetStatuses()[1]; st.GetCode() != ok || st.GetCurrentLimit() != nil {
			t.Errorf("a limit of the replaced name: %v, want OK with no limit (replaced)", st)
		}
		if l := r.level(t, "user", "amy"); !near(l, 10) {
			t.Errorf("the replaced limit's level %v, want 10: not charged", l)
		}
		r.mu.Lock()
		if k := r.seen[0].Kind; k != rls.KindUnlimited {
			t.Errorf("the unlimited descriptor counted as %s, want %s", k, rls.KindUnlimited)
		}
		r.mu.Unlock()
	})
	t.Run("what it replaces", func(t *testing.T) {
		y := replaceOnce(t, mappingYAML, "{key: health, value: probe, unlimited: true}", "{key: health, value: probe, unlimited: true, replaces: [base]}")
		r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), y)
		got := r.call(t, desc("health", "probe"), hits(desc("named", "bo"), 20))
		if st := got.GetStatuses()[1]; got.GetOverallCode() != ok || st.GetCurrentLimit() != nil {
			t.Errorf("a limit an unlimited one replaces: %v, want OK with no limit (replaced)", got)
		}
	})
	t.Run("service's quota mode", func(t *testing.T) {
		onEveryStoreWith(t, unlimitedNamedYAML(t)+"  quota_mode: true\n", func(t *testing.T, r *rig) {
			got := r.call(t, hits(desc("user", "bea"), 11), desc("health", "probe"), hits(desc("better", "bea"), 6))
			if got.GetStatuses()[0].GetCode() != over || got.GetStatuses()[2].GetCode() != over {
				t.Fatalf("11 hits on 10 and 6 on 5: %v, want both limited descriptors over", got)
			}
			if got.GetOverallCode() != over {
				t.Errorf("quota mode, every limited descriptor over, an unlimited one beside: %v, want OVER_LIMIT (the unlimited is no quota-mode descriptor)", got.GetOverallCode())
			}
		})
	})
}

// TestLimitOverride: a descriptor's own limit is the rule's limit for that
// call, without the node's shadow or quota mode (§3.2); where the tree has
// no policy, a bucket of the domain's own.
func TestLimitOverride(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		d := hits(desc("user", "hal"), 30)
		d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 100, Unit: typev3.RateLimitUnit_HOUR}
		st := r.call(t, d).Statuses[0]
		if st.GetCode() != ok || st.GetCurrentLimit().GetRequestsPerUnit() != 100 || st.GetCurrentLimit().GetUnit() != rlsv3.RateLimitResponse_RateLimit_HOUR {
			t.Errorf("own limit of 100 an hour: %v", st)
		}
		d = hits(desc("adhoc", "x"), 3)
		d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 2, Unit: typev3.RateLimitUnit_DAY}
		if got := r.call(t, d); got.GetOverallCode() != over {
			t.Errorf("3 hits of an own limit of 2 a day where the tree has none: %v, want OVER_LIMIT", got)
		}
		// As ratelimit's own limit it has no shadow mode, and it skips
		// a deny node.
		d = hits(desc("shadow", "hal"), 3)
		d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 2, Unit: typev3.RateLimitUnit_DAY}
		if got := r.call(t, d); got.GetOverallCode() != over || got.Statuses[0].GetCode() != over {
			t.Errorf("own limit on a shadow-mode rule, over: %v, want OVER_LIMIT", got)
		}
		d = hits(desc("banned", "x"), 1)
		d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 2, Unit: typev3.RateLimitUnit_DAY}
		if got := r.call(t, d); got.GetOverallCode() != ok || got.Statuses[0].GetLimitRemaining() != 1 {
			t.Errorf("own limit on a deny node: %v, want OK with 1 left", got)
		}
		d.Limit.Unit = typev3.RateLimitUnit_UNKNOWN
		_, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{d}})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("an own limit without unit: %v, want InvalidArgument", err)
		}
	})
}

// TestOwnLimitOfZero: a descriptor's own limit of requests_per_unit 0 is
// a limit of 0 (ratelimit's GetLimit takes it as is, §3.2; §3.4: after >
// limit is OVER_LIMIT): a hit is OVER_LIMIT and a check OK, each with
// current_limit {0, its unit}, and the call's other descriptors are
// answered as ever. As any own limit it skips the tree: a node's buckets
// are not charged; its hits are counted in ratelimit's stats of the own
// limit (§3.6).
func TestOwnLimitOfZero(t *testing.T) {
	zero := func(d *commonv3.RateLimitDescriptor) *commonv3.RateLimitDescriptor {
		d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 0, Unit: typev3.RateLimitUnit_MINUTE}
		return d
	}
	want := &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: 0, Unit: rlsv3.RateLimitResponse_RateLimit_MINUTE}
	eachStore(t, func(t *testing.T, r *rig) {
		got := r.call(t, desc("user", "zed"), zero(hits(desc("adhoc", "x"), 1)))
		if got.GetOverallCode() != over || got.Statuses[0].GetCode() != ok || got.Statuses[1].GetCode() != over {
			t.Errorf("a hit on an own limit of 0 per minute beside a descriptor under its limit: %v, want OVER_LIMIT for it, OK for the other", got)
		}
		if d := cmp.Diff(want, got.Statuses[1].GetCurrentLimit(), protocmp.Transform()); d != "" {
			t.Errorf("current_limit of an own limit of 0 (-want +got):\n%s", d)
		}
		got = r.call(t, zero(hits(desc("adhoc", "y"), 0)))
		if got.GetOverallCode() != ok || got.Statuses[0].GetLimitRemaining() != 0 {
			t.Errorf("a check on an own limit of 0: %v, want OK with remaining 0", got)
		}
		if d := cmp.Diff(want, got.Statuses[0].GetCurrentLimit(), protocmp.Transform()); d != "" {
			t.Errorf("current_limit of a check on an own limit of 0 (-want +got):\n%s", d)
		}
		if got := r.call(t, zero(hits(desc("user", "zed"), 3))); got.GetOverallCode() != over {
			t.Errorf("3 hits on an own limit of 0 on a node with a policy: %v, want OVER_LIMIT", got)
		}
		if l := r.level(t, "user", "zed"); !near(l, 9) {
			t.Errorf("the node's bucket at %v after its own limit of 0 was hit, want 9 (the one hit of the first call only)", l)
		}
		// ratelimit's stats of the own limit: its hit over the limit of 0.
		if st, want := r.byKey()["d.adhoc_x"], (rls.RatelimitStats{Key: "d.adhoc_x", TotalHits: 1, OverLimit: 1}); st != want {
			t.Errorf("stats of a hit on an own limit of 0: %+v, want %+v", st, want)
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if k := r.seen[1].Kind; k != rls.KindOverride {
			t.Errorf("an own limit of 0 counted as %s, want %s", k, rls.KindOverride)
		}
	})
}

// TestOwnLimitInUnknownDomainIsNoLimit: a domain no mapping names has no
// limit, looked up before a descriptor's own limit is (§3.2, scenario
// 31): OK with no current_limit, whatever the own limit says — also one
// without unit, which a known domain refuses (TestLimitOverride).
func TestOwnLimitInUnknownDomainIsNoLimit(t *testing.T) {
	r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), mappingYAML)
	for name, l := range map[string]*commonv3.RateLimitDescriptor_RateLimitOverride{
		"no unit":             {RequestsPerUnit: 5},
		"requests_per_unit 0": {Unit: typev3.RateLimitUnit_MINUTE},
		"5 per minute":        {RequestsPerUnit: 5, Unit: typev3.RateLimitUnit_MINUTE},
	} {
		t.Run(name, func(t *testing.T) {
			d := desc("user", "x")
			d.Limit = l
			resp, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "elsewhere", Descriptors: []*commonv3.RateLimitDescriptor{d}})
			if err != nil {
				t.Fatalf("own limit (%s) in an unknown domain: %v, want OK with no limit", name, err)
			}
			if resp.GetOverallCode() != ok || len(resp.GetStatuses()) != 1 || resp.GetStatuses()[0].GetCurrentLimit() != nil {
				t.Errorf("own limit (%s) in an unknown domain: %v, want OK with no limit", name, resp)
			}
		})
	}
}

// TestCostQuotaPricedByModel: hits of a descriptor meeting a quota of money
// are priced by its model entry (at gpt-4o's dearest rate, $10 a million:
// the budget of $0.0001 holds 10 hits); a model without price is refused,
// nothing written.
func TestCostQuotaPricedByModel(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		st := r.call(t, hits(desc("cuser", "ida", "model", "gpt-4o"), 4)).Statuses[0]
		if st.GetCode() != ok || st.GetLimitRemaining() != 6 || st.GetCurrentLimit().GetRequestsPerUnit() != 10 || st.GetCurrentLimit().GetUnit() != rlsv3.RateLimitResponse_RateLimit_DAY {
			t.Errorf("4 hits of a $0.0001 daily quota at $10 a million: %v, want remaining 6 of 10 a day", st)
		}
		if got := r.call(t, hits(desc("cuser", "ida", "model", "gpt-4o"), 7)); got.GetOverallCode() != over {
			t.Errorf("7 more hits: %v, want OVER_LIMIT", got)
		}
		if got := r.call(t, desc("cuser", "ida", "model", "unpriced-model")); got.GetOverallCode() != over {
			t.Errorf("an unpriced model: %v, want OVER_LIMIT", got)
		}
	})
}

// TestErrorsAsRatelimit: an empty domain, no descriptors and no mapping
// loaded are errors, as ratelimit answers them, and counted.
func TestErrorsAsRatelimit(t *testing.T) {
	r := newRig(t, buckets.NewMemory(buckets.MemoryOptions{}), mappingYAML)
	ctx := context.Background()
	if _, err := r.svc.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Descriptors: []*commonv3.RateLimitDescriptor{desc("user", "x")}}); status.Code(err) != codes.Unknown || status.Convert(err).Message() != "rate limit domain must not be empty" {
		t.Errorf("empty domain: %v", err)
	}
	if _, err := r.svc.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d"}); status.Code(err) != codes.Unknown || status.Convert(err).Message() != "rate limit descriptor list must not be empty" {
		t.Errorf("no descriptors: %v", err)
	}
	many := make([]*commonv3.RateLimitDescriptor, rls.MaxDescriptors+1)
	for i := range many {
		many[i] = desc("user", "x")
	}
	if _, err := r.svc.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: many}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("%d descriptors: %v, want InvalidArgument", len(many), err)
	}
	if err := r.svc.Load(rls.Mapping{}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.svc.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{desc("user", "x")}}); status.Code(err) != codes.Unknown || status.Convert(err).Message() != "no rate limit configuration loaded" {
		t.Errorf("no configuration: %v", err)
	}
	if len(r.errs) != 4 || r.errs[3] != rls.ErrorNoConfig {
		t.Errorf("errors counted %v", r.errs)
	}
	if _, err := rls.New(rls.Config{Store: plainStore{}}); err == nil {
		t.Error("New accepted a store that cannot charge")
	}
}

// plainStore is a store without Charge.
type plainStore struct{ buckets.Store }

// TestCancelledCallChargesNothing: a call whose caller is gone before the
// store is reached writes nothing.
func TestCancelledCallChargesNothing(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := r.svc.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{hits(desc("user", "jo"), 5)}})
		if status.Code(err) != codes.Canceled {
			t.Errorf("cancelled call: %v, want Canceled", err)
		}
		if l := r.level(t, "user", "jo"); !near(l, 10) {
			t.Errorf("level %v after a cancelled call, want 10", l)
		}
	})
}

// TestExactUnderConcurrentHits: 40 calls of 1 hit at once on a bucket of
// 10 admit exactly 10, and the bucket holds the rest as debt down to its
// floor.
func TestExactUnderConcurrentHits(t *testing.T) {
	eachStore(t, func(t *testing.T, r *rig) {
		var wg sync.WaitGroup
		var mu sync.Mutex
		admitted := 0
		errs := make(chan error, 40)
		for range 40 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := r.svc.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{desc("user", "kim")}})
				if err != nil {
					errs <- err
					return
				}
				if resp.GetOverallCode() == ok {
					mu.Lock()
					admitted++
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		// The refill of 10 a minute adds a token every 6 s: none within
		// this test.
		if admitted != 10 {
			t.Errorf("%d of 40 concurrent hits admitted on a bucket of 10, want 10", admitted)
		}
		if l := r.level(t, "user", "kim"); !near(l, -10) {
			t.Errorf("level %v, want the floor -10", l)
		}
	})
}

// TestChargeAppliesOnceAfterTimeout: Redis busy for longer than the
// client's read timeout loses the reply of a charge that Redis still runs;
// the store sends it again, and both copies run: the hits count once —
// also for a deferred charge, queued and sent after its call was answered
// (rls.deferred_charges).
func TestChargeAppliesOnceAfterTimeout(t *testing.T) {
	const timeout, pause = 250 * time.Millisecond, 400 * time.Millisecond
	for name, mapping := range map[string]string{"waited": mappingYAML, "deferred": deferredYAML} {
		t.Run(name, func(t *testing.T) {
			addr := redisServer(t)
			c := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: timeout, WriteTimeout: timeout})
			t.Cleanup(func() { c.Close() })
			st := redisstore.New(c, redisstore.Options{Prefix: t.Name() + ":" + admission.NewID()[:8] + ":"})
			r := newRig(t, st, mapping)
			// Warm up: the scripts loaded, the connection open.
			r.call(t, hits(desc("user", "warm"), 0))
			redistest.Sleep(t, addr, pause)
			got := r.call(t, hits(desc("user", "lee"), 3), hits(desc("quser", "lee"), 30))
			if got.GetOverallCode() != ok {
				t.Fatalf("charge during a %v stall: %v", pause, got)
			}
			if err := r.svc.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			if l := r.level(t, "user", "lee"); !near(l, 7) {
				t.Errorf("level %v after 3 hits sent twice, want 7: the charge applied once", l)
			}
			_, qs, err := st.Inspect(context.Background(), nil, []buckets.Quota{r.quota(t, "daily", "lee")})
			if err != nil {
				t.Fatal(err)
			}
			if !near(qs[0].Spent, 30) {
				t.Errorf("quota spent %v after 30 hits sent twice, want 30", qs[0].Spent)
			}
			r.mu.Lock()
			defer r.mu.Unlock()
			if len(r.errs) != 0 {
				t.Errorf("errors counted: %v", r.errs)
			}
		})
	}
}

func (r *rig) quota(t *testing.T, rule, user string) buckets.Quota {
	t.Helper()
	pols, err := admission.FromConfig(r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	p := admission.Normalize(pols[0])
	c := admission.Chain{Policy: &p, PolicyName: p.Name, IDs: map[string]string{"user": admission.IdentityKey(user, false)}, Currency: "USD"}
	for _, q := range p.Quotas {
		if q.Name == rule {
			return c.Quota(q)
		}
	}
	t.Fatalf("no quota %q", rule)
	return buckets.Quota{}
}
