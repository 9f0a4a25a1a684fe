package config

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// `lease: auto` and a mapping both turn a lease on; no lease key leaves it
// off (S20).
func TestLeaseForms(t *testing.T) {
	c, err := Parse("x.yaml", []byte(`
store: {type: redis, redis: {addrs: ["127.0.0.1:6379"]}}
policies:
  - name: p
    buckets:
      - {name: off, tokens_per_minute: 600}
      - {name: auto, tokens_per_minute: 600, lease: auto}
      - {name: sized, tokens_per_minute: 600, lease: {size: 100, ttl: 3s}}
      - {name: ttl, tokens_per_minute: 600, lease: {ttl: 500ms}}
`))
	if err != nil {
		t.Fatal(err)
	}
	var got []*Lease
	for _, b := range c.Policies[0].Buckets {
		got = append(got, b.Lease)
	}
	want := []*Lease{nil, {}, {Size: 100, TTL: 3 * time.Second}, {TTL: 500 * time.Millisecond}}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("leases (-want +got):\n%s", d)
	}
}

// A provider bucket is one bucket whatever policy uses it: its lease must
// match too.
func TestProviderLeaseMustMatch(t *testing.T) {
	_, err := Parse("x.yaml", []byte(`
store: {type: redis, redis: {addrs: ["127.0.0.1:6379"]}}
default_policy: a
policies:
  - name: a
    buckets:
      - {name: openai, provider_limit: {tokens_per_minute: 60000}, lease: auto}
  - name: b
    buckets:
      - {name: openai, provider_limit: {tokens_per_minute: 60000}}
`))
	if err == nil || !strings.Contains(err.Error(), "policies[1].buckets[0]: provider bucket \"openai\" is shared by every policy") {
		t.Errorf("err = %v, want the provider mismatch", err)
	}
}
