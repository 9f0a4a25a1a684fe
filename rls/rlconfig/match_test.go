package rlconfig

import (
	"slices"
	"strings"
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
)

const (
	second = rlsv3.RateLimitResponse_RateLimit_SECOND
	minute = rlsv3.RateLimitResponse_RateLimit_MINUTE
	hour   = rlsv3.RateLimitResponse_RateLimit_HOUR
	day    = rlsv3.RateLimitResponse_RateLimit_DAY
)

// match is one GetLimit case: the descriptor's key/value pairs and what
// it meets; rpu < 0 means no limit applies.
type match struct {
	kv        []string
	rpu       int64
	unit      Unit
	stats     string
	name      string
	unlimited bool
}

func checkMatches(t *testing.T, c *Config, domain string, cases []match) {
	t.Helper()
	for _, m := range cases {
		d := desc(m.kv...)
		r, known := c.Limit(domain, d)
		if !known {
			t.Fatalf("%s: domain not known", domain)
		}
		what := strings.Join(m.kv, ",")
		if m.rpu < 0 {
			if r != nil {
				t.Errorf("%s: met %+v, want no limit", what, r)
			}
			if s := c.StatsKey(domain, d); s != "" {
				t.Errorf("%s: stats key %q for no limit", what, s)
			}
			continue
		}
		if r == nil {
			t.Errorf("%s: no limit, want %d/%v", what, m.rpu, m.unit)
			continue
		}
		if int64(r.RequestsPerUnit) != m.rpu || r.Unit != m.unit || r.Name != m.name || r.Unlimited != m.unlimited {
			t.Errorf("%s: met %d/%v name %q unlimited %v, want %d/%v name %q unlimited %v",
				what, r.RequestsPerUnit, r.Unit, r.Name, r.Unlimited, m.rpu, m.unit, m.name, m.unlimited)
		}
		if m.stats != "" {
			if s := c.StatsKey(domain, d); s != m.stats {
				t.Errorf("%s: stats key %q, want %q", what, s, m.stats)
			}
		}
	}
}

// GetLimit on ratelimit's basic_config.yaml answers as ratelimit's own
// TestBasicConfig expects (§3.2): a limit only at the request's last
// entry, the bare key as the default of any value, a value without
// rate_limit applying none, a request deeper than the tree meeting none.
func TestRatelimitGetLimitBasicConfig(t *testing.T) {
	c := mustLoad(t, Options{}, "ratelimit/basic_config.yaml")
	if _, known := c.Limit("foo_domain", desc("key1", "value1")); known {
		t.Error("foo_domain is known")
	}
	checkMatches(t, c, "test-domain", []match{
		{kv: nil, rpu: -1},
		{kv: []string{"key1", "something"}, rpu: -1},
		{kv: []string{"key1", "value1"}, rpu: -1},
		{kv: []string{"key2", "value2", "subkey", "subvalue"}, rpu: -1},
		{kv: []string{"key5", "value5", "subkey5", "subvalue"}, rpu: -1},
		{kv: []string{"key1", "value1", "subkey1", "something"}, rpu: 5, unit: second, stats: "test-domain.key1_value1.subkey1"},
		{kv: []string{"key1", "value1", "subkey1", "subvalue1"}, rpu: 10, unit: second, stats: "test-domain.key1_value1.subkey1_subvalue1"},
		{kv: []string{"key2", "something"}, rpu: 20, unit: minute, stats: "test-domain.key2"},
		{kv: []string{"key2", "value2"}, rpu: 30, unit: minute, stats: "test-domain.key2_value2"},
		{kv: []string{"key2", "value3"}, rpu: -1},
		{kv: []string{"key3", "foo"}, rpu: 1, unit: hour, stats: "test-domain.key3"},
		{kv: []string{"key4", "foo"}, rpu: 1, unit: day, name: "key4_rate_limit", stats: "test-domain.key4"},
		{kv: []string{"key5", "value5", "subkey5", "subvalue5"}, rpu: 25, unit: day},
		{kv: []string{"key6", "foo"}, rpu: 0, unlimited: true, stats: "test-domain.key6"},
		{kv: []string{"key7", "unspecified_value"}, rpu: 70, unit: minute, stats: "test-domain.key7_unspecified_value"},
		{kv: []string{"key7", "another_value"}, rpu: 70, unit: minute, stats: "test-domain.key7_another_value"},
	})
}

// An exact value wins over a wildcard, a wildcard over the bare key, and
// among wildcards the first in the file wins, not the most specific
// (§3.2). A limit above the last entry does not apply.
func TestRatelimitGetLimitPrecedence(t *testing.T) {
	c := mustLoad(t, Options{}, "precedence.yaml")
	checkMatches(t, c, "precedence", []match{
		{kv: []string{"k", "abc"}, rpu: 4, unit: minute, stats: "precedence.k_abc"},
		{kv: []string{"k", "abd"}, rpu: 2, unit: minute, stats: "precedence.k_a*"},
		{kv: []string{"k", "a"}, rpu: 2, unit: minute},
		{kv: []string{"k", "xyz"}, rpu: 1, unit: minute, stats: "precedence.k"},
		{kv: []string{"k", ""}, rpu: 1, unit: minute},
		{kv: []string{"tenant", "t1"}, rpu: 100, unit: hour},
		{kv: []string{"tenant", "t1", "user", "u1"}, rpu: 10, unit: minute, stats: "precedence.tenant.user"},
		{kv: []string{"tenant", "t1", "user", "u1", "extra", "x"}, rpu: -1},
		{kv: []string{"user", "u1"}, rpu: -1},
	})
}

// Wildcards as ratelimit's TestWildcardConfig has them: trailing, middle
// and repeated '*', each matching any run of characters (none included),
// the whole key_value anchored at both ends.
func TestRatelimitGetLimitWildcards(t *testing.T) {
	c := mustLoad(t, Options{}, "ratelimit/wildcard.yaml")
	checkMatches(t, c, "test-domain", []match{
		{kv: []string{"noVal", "foo1"}, rpu: 20, unit: minute, stats: "test-domain.noVal"},
		{kv: []string{"wild", "foo1"}, rpu: 20, unit: minute, stats: "test-domain.wild_foo*"},
		{kv: []string{"wild", "foo"}, rpu: 20, unit: minute},
		{kv: []string{"nestedWild", "val1", "wild", "goo2"}, rpu: 20, unit: minute, stats: "test-domain.nestedWild_val1.wild_goo*"},
		{kv: []string{"wild", "bar"}, rpu: -1},
		{kv: []string{"noWild", "foo1"}, rpu: -1},
		{kv: []string{"midWild", "barab"}, rpu: 20, unit: minute, stats: "test-domain.midWild_bar*b"},
		{kv: []string{"midWild", "bar123b"}, rpu: 20, unit: minute},
		{kv: []string{"midWild", "barb"}, rpu: 20, unit: minute},
		{kv: []string{"midWild", "bara"}, rpu: -1},
		{kv: []string{"midWild", "xbarb"}, rpu: -1},
		{kv: []string{"multiWild", "foo123bar456baz"}, rpu: 10, unit: minute, stats: "test-domain.multiWild_foo*bar*baz"},
		{kv: []string{"multiWild", "foobarbaz"}, rpu: 10, unit: minute},
		{kv: []string{"multiWild", "foo123baz"}, rpu: -1},
		{kv: []string{"multiWild", "bar456baz"}, rpu: -1},
	})
}

// share_threshold: every value matching the wildcard shares one limit
// and names it by its pattern; an exact value still wins; the stats key
// takes the pattern over value_to_metric and detailed_metric (ratelimit's
// TestShareThreshold).
func TestRatelimitGetLimitShareThreshold(t *testing.T) {
	c := mustLoad(t, Options{}, "ratelimit/share_threshold.yaml")
	checkMatches(t, c, "test-domain", []match{
		{kv: []string{"files", "files/a.txt"}, rpu: 100, unit: minute, stats: "test-domain.files_files/*"},
		{kv: []string{"route", "api/v1", "method", "GET"}, rpu: 60, unit: minute, stats: "test-domain.route_api/*.method"},
		{kv: []string{"service", "svc/x", "endpoint", "get"}, rpu: 80, unit: minute, stats: "test-domain.service_svc/*.endpoint_get"},
		{kv: []string{"nested", "parent", "files", "nested/x"}, rpu: 200, unit: minute, stats: "test-domain.nested_parent.files_nested/*"},
		{kv: []string{"files", "top/a", "files", "nested/b"}, rpu: 300, unit: minute, stats: "test-domain.files_top/*.files_nested/*"},
		{kv: []string{"path", "path/a", "file", "file/b", "type", "t"}, rpu: 120, unit: minute, stats: "test-domain.path_path/*.file_file/*.type"},
		{kv: []string{"user", "user/1", "resource", "res/2", "action", "a"}, rpu: 150, unit: minute, stats: "test-domain.user_user/*.resource_res/*.action"},
		{kv: []string{"file", "test1"}, rpu: 50, unit: minute, stats: "test-domain.file_test1"},
		{kv: []string{"file", "test2"}, rpu: 100, unit: minute, stats: "test-domain.file_test*"},
		{kv: []string{"midpath", "/api/foo/v1"}, rpu: 100, unit: minute, stats: "test-domain.midpath_/api*v1"},
		{kv: []string{"multiroute", "svcXepYrpc"}, rpu: 50, unit: minute, stats: "test-domain.multiroute_svc*ep*rpc"},
		{kv: []string{"midroute", "/api/x/v2"}, rpu: 80, unit: minute, stats: "test-domain.midroute_/api*v2"},
		{kv: []string{"tenant", "t1prod", "resource", "resXv2"}, rpu: 60, unit: minute, stats: "test-domain.tenant_t*prod.resource_res*v2"},
	})
	tree := c.Tree("test-domain")
	for _, kv := range [][]string{{"files", "files/a"}, {"files", "files/b"}} {
		if n := tree.Match(desc(kv...).Entries); n == nil || !n.Shared() || n.Value != "files/*" {
			t.Errorf("%q: matched %+v, want the shared files/* node", kv, n)
		}
	}
	if n := tree.Match(desc("file", "test1").Entries); n == nil || n.Shared() {
		t.Errorf("file=test1 matched %+v, want its own, unshared node", n)
	}
}

// detailed_metric names the stats by the request's key_value at every
// level, value_to_metric by the request's value where it is set.
func TestRatelimitStatsKeyDetailedAndValueToMetric(t *testing.T) {
	c := mustLoad(t, Options{}, "metrics.yaml")
	checkMatches(t, c, "nested", []match{
		{kv: []string{"key-1", "value-1"}, rpu: 10, unit: minute, stats: "nested.key-1_value-1"},
		{kv: []string{"key-1", "value-1", "key-2", "value-2"}, rpu: 5, unit: minute, stats: "nested.key-1_value-1.key-2_value-2"},
		{kv: []string{"key-1", ""}, rpu: 10, unit: minute, stats: "nested.key-1_"},
		{kv: []string{"plain-1", "v"}, rpu: 10, unit: minute, stats: "nested.plain-1"},
		{kv: []string{"plain-1", "v", "plain-2", "w"}, rpu: 5, unit: minute, stats: "nested.plain-1.plain-2"},
		{kv: []string{"route", "/a", "method", "GET"}, rpu: 60, unit: minute, stats: "nested.route_/a.method"},
		{kv: []string{"wild", "api/x"}, rpu: 60, unit: minute, stats: "nested.wild_api/x"},
	})
}

// A descriptor's own limit (Envoy Gateway's limit.fromMetadata) replaces
// the tree, in a known domain only, with no shadow mode; its stats are
// named by the request's entries (§3.2).
func TestRatelimitGetLimitOverride(t *testing.T) {
	c := mustLoad(t, Options{}, "ratelimit/shadowmode_config.yaml")
	if r, _ := c.Limit("test-domain", desc("key2", "value9")); r == nil || !r.ShadowMode {
		t.Fatalf("key2 without its own limit met %+v, want the shadow-mode rule", r)
	}
	d := desc("key2", "value9", "other", "")
	d.Limit = &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 7, Unit: typev3.RateLimitUnit_MONTH}
	r, known := c.Limit("test-domain", d)
	if !known || r == nil {
		t.Fatalf("override met %+v (known %v)", r, known)
	}
	if r.RequestsPerUnit != 7 || r.Unit != rlsv3.RateLimitResponse_RateLimit_MONTH || r.ShadowMode || r.Name != "" {
		t.Errorf("override met %+v, want 7/MONTH, no shadow mode, no name", r)
	}
	if s := c.StatsKey("test-domain", d); s != "test-domain.key2_value9.other" {
		t.Errorf("override stats key %q", s)
	}
	if r, known := c.Limit("unknown", d); known || r != nil {
		t.Errorf("override in an unknown domain met %+v (known %v), want nothing", r, known)
	}
}

// replaces drops every met limit named by a met limit's replaces, an
// unlimited one's included, as ratelimit's example configuration uses it.
func TestRatelimitReplaces(t *testing.T) {
	c := mustLoad(t, Options{}, "ratelimit/examples/example.yaml")
	meet := func(descs ...*commonv3.RateLimitDescriptor) []bool {
		var rules []*Rule
		for _, d := range descs {
			r, _ := c.Limit("rl", d)
			rules = append(rules, r)
		}
		name := func(r *Rule) string {
			if r == nil {
				return ""
			}
			return r.Name
		}
		replaces := func(r *Rule) []string {
			if r == nil {
				return nil
			}
			return r.Replaces
		}
		return Replaced(rules, name, replaces)
	}
	for _, tt := range []struct {
		descs []*commonv3.RateLimitDescriptor
		want  []bool
	}{
		// foo/bar=bkthomps is named bkthomps; the destination_cluster
		// bkthomps limit replaces it.
		{[]*commonv3.RateLimitDescriptor{desc("foo", "x", "bar", "bkthomps"), desc("source_cluster", "proxy", "destination_cluster", "bkthomps")}, []bool{true, false}},
		{[]*commonv3.RateLimitDescriptor{desc("foo", "x", "bar", "bkthomps")}, []bool{false}},
		// category=account replaces bkthomps and fake_name.
		{[]*commonv3.RateLimitDescriptor{desc("category", "account"), desc("source_cluster", "proxy", "destination_cluster", "fake"), desc("foo", "x", "bar", "bkthomps")}, []bool{false, true, true}},
		// An unmatched descriptor takes part as nothing.
		{[]*commonv3.RateLimitDescriptor{desc("nothing", "here"), desc("source_cluster", "proxy", "destination_cluster", "override"), desc("foo", "x", "bar", "banned")}, []bool{false, false, true}},
	} {
		if got := meet(tt.descs...); !slices.Equal(got, tt.want) {
			t.Errorf("%v: replaced %v, want %v", tt.descs, got, tt.want)
		}
	}
}
