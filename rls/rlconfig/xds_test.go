package rlconfig

import (
	"strings"
	"testing"

	rlsconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
)

// egConfig is a RateLimitConfig as Envoy Gateway pushes it (§4.2): the
// route name at the root, a Distinct header rule below it (key only), the
// limit on the leaf, shadow_mode on every node of the chain.
func egConfig(unit rlsconfv3.RateLimitUnit) *rlsconfv3.RateLimitConfig {
	return &rlsconfv3.RateLimitConfig{
		Name: "default/eg/http", Domain: "default/eg/http",
		Descriptors: []*rlsconfv3.RateLimitDescriptor{{
			Key: "httproute/default/backend/rule/0/match/0/*", Value: "httproute/default/backend/rule/0/match/0/*",
			Descriptors: []*rlsconfv3.RateLimitDescriptor{{
				Key:       "rule-0-match-0",
				RateLimit: &rlsconfv3.RateLimitPolicy{Unit: unit, RequestsPerUnit: 3, Name: "tenant"},
				Metadata:  &structpb.Struct{Fields: map[string]*structpb.Value{"tier": structpb.NewStringValue("gold")}},
			}, {
				Key:       "rule-1-match-0",
				RateLimit: &rlsconfv3.RateLimitPolicy{Unlimited: true, Replaces: []*rlsconfv3.RateLimitReplace{{Name: "tenant"}}},
			}},
		}},
	}
}

// A RateLimitConfig pushed over xDS reads into the form of a file and
// loads with the same checks: the limit, the unit by its enum name, the
// metadata; an unlimited rule without unit.
func TestRatelimitXDSConfigLoadsLikeAFile(t *testing.T) {
	a, err := anypb.New(egConfig(rlsconfv3.RateLimitUnit_HOUR))
	if err != nil {
		t.Fatal(err)
	}
	files, err := DecodeXDS([]*anypb.Any{a})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Load(files, Options{})
	if err != nil {
		t.Fatal(err)
	}
	route := "httproute/default/backend/rule/0/match/0/*"
	r, _ := c.Limit("default/eg/http", desc(route, route, "rule-0-match-0", "tenant-a"))
	if r == nil || r.RequestsPerUnit != 3 || r.Unit != hour || r.Name != "tenant" || r.Metadata.GetFields()["tier"].GetStringValue() != "gold" {
		t.Errorf("tenant-a met %+v, want 3/HOUR named tenant with its metadata", r)
	}
	if r, _ := c.Limit("default/eg/http", desc(route, route, "rule-1-match-0", "x")); r == nil || !r.Unlimited || len(r.Replaces) != 1 {
		t.Errorf("rule-1 met %+v, want the unlimited rule replacing tenant", r)
	}
	if got := c.StatsKey("default/eg/http", desc(route, route, "rule-0-match-0", "tenant-a")); got != "default/eg/http."+route+"_"+route+".rule-0-match-0" {
		t.Errorf("stats key %q", got)
	}
}

// A snapshot whose unit is UNKNOWN on a limited rule is refused, as
// ratelimit NACKs it, naming the resource; so is a resource of another
// type.
func TestRatelimitXDSBadSnapshotRefused(t *testing.T) {
	_, err := Load([]*File{FromXDS(egConfig(rlsconfv3.RateLimitUnit_UNKNOWN))}, Options{})
	want := "default/eg/http: descriptors[0].descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'"
	if err == nil || err.Error() != want {
		t.Errorf("got %v, want %s", err, want)
	}
	other, err := anypb.New(&structpb.Struct{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := DecodeXDS([]*anypb.Any{other}); err == nil || !strings.Contains(err.Error(), ConfigTypeURL) {
		t.Errorf("a Struct resource: %v, want a type error", err)
	}
}
