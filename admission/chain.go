package admission

import (
	"cmp"

	"github.com/tokengate/tokengate/buckets"
)

// Limits as data: a rule's limits may differ per identity (an override) and
// per tier (Policy.Tiers), and the policies themselves may be replaced
// while a server runs. A request's limits are decided when it reserves,
// from what is in force then, field by field: the identity's override,
// else its tier's limits, else the rule's own. A reservation carries the
// limits it was taken under, so a stream in flight settles against them
// whatever changes meanwhile; bucket levels live in the store under keys
// that no limit is part of, so they carry over.

// Chain is one request as both fronts see it once its identities are read:
// the policy it falls under, its identities, model and tier, and the
// overrides and currency in force. Its methods give the request's store
// keys (keys.go) and its buckets, slots and quotas with the limits in
// force. A plain value; the maps are read, never written.
type Chain struct {
	// Policy is the request's policy; PolicyName its name (in keys).
	Policy     *Policy
	PolicyName string
	// IDs are the key parts of the request's identities by name
	// (IdentityPart of the value as read, or AnonymousPart).
	IDs map[string]string
	// ModelKey is the model that per-model rules are keyed by
	// (tokenizer.ModelKey's form, unescaped); empty when none is named.
	ModelKey string
	// Tier is the request's tier; empty when none.
	Tier string
	// Overrides are the per-identity overrides in force; nil when none.
	Overrides Overrides
	// Currency is the currency quotas of money count in ("" without a
	// price table).
	Currency string
}

// KeyPart is the identity part of the store keys of rules keyed by per.
func (c *Chain) KeyPart(per string) string {
	switch per {
	case "":
		return globalPart
	case PerModel:
		if c.ModelKey != "" {
			return identityPart(c.ModelKey)
		}
		return noModelPart
	}
	if v := c.IDs[per]; v != "" {
		return v
	}
	return anonymousPart // the identity was not given
}

// Key is the store key of a bucket or a slot of rule keyed by per; a
// provider rule's is every policy's.
func (c *Chain) Key(rule, per string, provider bool) string {
	scope := c.PolicyName
	if provider {
		scope = sharedScope
	}
	return bucketKey(scope, rule, c.KeyPart(per))
}

// Layers returns the tier's and the identity's overrides of a rule for
// this request, each zero when there is none.
func (c *Chain) Layers(rule, per string) (tier, identity Override) {
	if per == "" {
		return
	}
	if c.Tier != "" && per != PerModel {
		tier = c.Policy.Tiers[c.Tier][rule]
	}
	if len(c.Overrides) > 0 {
		identity = c.Overrides[OverrideKey{Policy: c.PolicyName, Rule: rule, Identity: c.KeyPart(per)}]
	}
	return tier, identity
}

// Bucket is rule r's bucket for this request, with the limit in force.
func (c *Chain) Bucket(r BucketRule) buckets.Bucket {
	limit := r.Limit
	if !r.Provider {
		tier, id := c.Layers(r.Name, r.Per)
		limit = cmp.Or(id.Limit, tier.Limit, limit)
	}
	return buckets.Bucket{
		Name: r.Name, Key: c.Key(r.Name, r.Per, r.Provider), Limit: limit,
		Hard: r.Hard, MaxDebt: r.MaxDebt, Headroom: r.Headroom, Lease: r.Lease,
	}
}

// Slot is concurrency rule r's slot for this request, with the max in
// force.
func (c *Chain) Slot(r ConcurrencyRule) buckets.Slot {
	tier, id := c.Layers(r.Name, r.Per)
	return buckets.Slot{Name: r.Name, Key: c.Key(r.Name, r.Per, false), Max: cmp.Or(id.Max, tier.Max, r.Max), Lease: r.Lease}
}

// Quota is quota rule r's quota for this request, with the budget in
// force.
func (c *Chain) Quota(r QuotaRule) buckets.Quota {
	tier, id := c.Layers(r.Name, r.Per)
	limit := r.Limit
	if r.Unit == buckets.Money {
		limit = cmp.Or(id.Money, tier.Money, limit)
	} else {
		limit = cmp.Or(id.Tokens, tier.Tokens, limit)
	}
	q := buckets.Quota{Name: r.Name, Key: c.Key(r.Name, r.Per, false), Window: r.Window, Unit: r.Unit, Limit: limit, Hard: r.Hard}
	if r.Unit == buckets.Money {
		q.Currency = c.Currency
	}
	return q
}

// Limits are the buckets and quotas of the policy's chain for this
// request's identities and model, keyed as keys.go describes and with the
// limits in force: what a request reserves.
func (c *Chain) Limits() ([]buckets.Bucket, []buckets.Quota) {
	bs := make([]buckets.Bucket, 0, len(c.Policy.Buckets))
	for _, r := range c.Policy.Buckets {
		bs = append(bs, c.Bucket(r))
	}
	var qs []buckets.Quota
	for _, r := range c.Policy.Quotas {
		qs = append(qs, c.Quota(r))
	}
	return bs, qs
}

// The key forms that tests and tools outside the package build.

// BucketKey is the store key of rule of policy for an identity key part
// (keys.go).
func BucketKey(policy, rule, part string) string { return bucketKey(policy, rule, part) }

// QuotaPrefix is the prefix every store key of a quota rule starts with,
// whatever its identity (what a spend listing scans); a quota's key is
// its rule's bucket key, whatever its unit (keys.go).
func QuotaPrefix(policy, rule string) string { return bucketKey(policy, rule, "") }

// IdentityPart is the key part of an identity value as read (hashed
// already when its identity hashes): escaped, or hashed when long.
func IdentityPart(v string) string { return identityPart(v) }

// HashIdentity is the form a hashed identity's value takes (S9a).
func HashIdentity(v string) string { return hashIdentity(v) }

// Reserved key parts (keys.go).
const (
	// GlobalPart is the key part of a global rule.
	GlobalPart = globalPart
	// AnonymousPart is the key part of a missing identity.
	AnonymousPart = anonymousPart
	// NoModelPart is the key part of a per-model rule for a request that
	// names no model.
	NoModelPart = noModelPart
)
