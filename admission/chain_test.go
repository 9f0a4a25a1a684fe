package admission_test

import (
	"strings"
	"testing"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
)

func TestChainKeysAndLimitsInForce(t *testing.T) {
	rule := buckets.Limit{Capacity: 100, Rate: 1}
	tierLimit := buckets.Limit{Capacity: 200, Rate: 2}
	own := buckets.Limit{Capacity: 300, Rate: 3}
	pol := admission.Normalize(admission.Policy{
		Name:       "p",
		Identities: []admission.Identity{{Name: "user", Header: "x-user"}},
		Buckets: []admission.BucketRule{
			{Name: "user", Per: "user", Limit: rule},
			{Name: "model", Per: admission.PerModel, Limit: rule},
			{Name: "provider", Limit: rule, Provider: true},
		},
		Quotas: []admission.QuotaRule{{Name: "spend", Per: "user", Unit: buckets.Money, Limit: 5}},
		Tiers:  map[string]map[string]admission.Override{"gold": {"user": {Limit: tierLimit}}},
	})
	if pol.Anonymous != admission.AnonymousShared {
		t.Fatalf("Anonymous = %q, want the default %q", pol.Anonymous, admission.AnonymousShared)
	}
	alice := admission.IdentityKey("alice", false)
	c := admission.Chain{Policy: &pol, PolicyName: pol.Name, IDs: map[string]string{"user": alice}, ModelKey: "gpt-4o", Currency: "USD"}
	bs, qs := c.Limits()
	want := []string{"tg:p:user:alice", "tg:p:model:gpt-4o", "tg:%2A:provider:%2A"}
	for i, b := range bs {
		if b.Key != want[i] || b.Limit != rule {
			t.Errorf("bucket %d = %q %+v, want %q %+v", i, b.Key, b.Limit, want[i], rule)
		}
	}
	if len(qs) != 1 || qs[0].Key != admission.BucketKey("p", "spend", alice) || qs[0].Currency != "USD" || qs[0].Limit != 5 {
		t.Errorf("quotas = %+v", qs)
	}

	c.Tier = "gold"
	if got := c.Bucket(pol.Buckets[0]).Limit; got != tierLimit {
		t.Errorf("with tier gold, limit %+v, want the tier's %+v", got, tierLimit)
	}
	c.Overrides = admission.Overrides{{Policy: "p", Rule: "user", Identity: alice}: {Limit: own}, {Policy: "p", Rule: "spend", Identity: alice}: {Money: 9}}
	if got := c.Bucket(pol.Buckets[0]).Limit; got != own {
		t.Errorf("with an override, limit %+v, want the override's %+v", got, own)
	}
	if got := c.Quota(pol.Quotas[0]).Limit; got != 9 {
		t.Errorf("with an override, quota %v, want 9", got)
	}

	c.IDs, c.ModelKey = nil, ""
	if got := c.KeyPart("user"); got != admission.AnonymousPart {
		t.Errorf("missing identity part %q, want %q", got, admission.AnonymousPart)
	}
	if got := c.KeyPart(admission.PerModel); got != admission.NoModelPart {
		t.Errorf("no model part %q, want %q", got, admission.NoModelPart)
	}
}

func TestDescriptorKey(t *testing.T) {
	if got := admission.DescriptorKey("d/x", []string{"a=b", "c=d&e"}); got != "tg:!rls:d%2Fx:a%3Db&c%3Dd%26e" {
		t.Errorf("DescriptorKey = %q", got)
	}
	long := admission.DescriptorKey("d", []string{strings.Repeat("k=v", 100)})
	if len(long) > 64 || !strings.HasPrefix(long, "tg:!rls:d:!h.") {
		t.Errorf("a long list of entries: %q, want it hashed", long)
	}
	if admission.DescriptorKey("d", []string{"a=b&c=d"}) == admission.DescriptorKey("d", []string{"a=b", "c=d"}) {
		t.Error("one entry and two entries of the same text share a key")
	}
}
