package extproc

import (
	"cmp"
	"maps"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/buckets"
)

// Limits as data: a rule's limits may differ per identity (an override,
// Server.SetOverrides) and per tier (Policy.Tiers), and the policies
// themselves may be replaced while the server runs (Server.Reload). A
// request's limits are decided when it reserves, from what is in force
// then, field by field: the identity's override, else its tier's limits,
// else the rule's own. The reservation carries the limits it was taken
// under, so a stream in flight settles against them whatever changes
// meanwhile; bucket levels live in the store under keys that no limit is
// part of, so they carry over.

// Override replaces a rule's limits for one identity or one tier: a bucket
// rule takes Limit, a concurrency rule Max, a quota of tokens Tokens and a
// quota of money Money (a rule name may be a bucket's or a quota's and a
// concurrency limit's, as "apikey" is in the default configuration). A zero
// field keeps the rule's own value. Plain data.
type Override struct {
	Limit buckets.Limit
	Max   int
	// Tokens is a quota of tokens' budget per window.
	Tokens float64
	// Money is a quota of money's budget per window, in micro-units of
	// Config.Prices' currency.
	Money float64
}

// OverrideKey names an override: a rule of a policy, for one identity
// value in the form store keys use (IdentityKey, or ModelKey for a
// per-model rule).
type OverrideKey struct{ Policy, Rule, Identity string }

// Overrides are the per-identity overrides in force. A map given to
// SetOverrides belongs to the server from then on; do not modify it.
type Overrides map[OverrideKey]Override

// policySet is what Reload replaces: the policies, their wait queues and
// the default policy. It is immutable once stored, except each queue's
// max, which is atomic.
type policySet struct {
	byName        map[string]*Policy
	queues        map[string]*waitQueue
	defaultPolicy string
}

// newPolicySet copies policies, fills their defaults and keeps the wait
// queues of old (if any) for policies of the same name, so that requests
// already waiting count against the new bound.
func newPolicySet(policies []Policy, defaultPolicy string, old *policySet) *policySet {
	set := &policySet{
		byName:        make(map[string]*Policy, len(policies)),
		queues:        make(map[string]*waitQueue, len(policies)),
		defaultPolicy: defaultPolicy,
	}
	for _, p := range policies {
		p.Identities = append([]Identity(nil), p.Identities...)
		p.Buckets = append([]BucketRule(nil), p.Buckets...)
		p.Concurrency = append([]ConcurrencyRule(nil), p.Concurrency...)
		p.Quotas = append([]QuotaRule(nil), p.Quotas...)
		p.Tiers = maps.Clone(p.Tiers)
		for t, rules := range p.Tiers {
			p.Tiers[t] = maps.Clone(rules)
		}
		if p.Tier != nil {
			t := *p.Tier
			p.Tier = &t
		}
		normalizePolicy(&p)
		set.byName[p.Name] = &p
		q := &waitQueue{}
		if old != nil && old.queues[p.Name] != nil {
			q = old.queues[p.Name]
		}
		q.max.Store(int64(p.MaxQueue))
		set.queues[p.Name] = q
	}
	return set
}

// normalizePolicy fills a policy's defaults.
func normalizePolicy(p *Policy) {
	if p.Anonymous == "" {
		p.Anonymous = anonymousShared
	}
	for j := range p.Concurrency {
		if p.Concurrency[j].Lease == 0 {
			p.Concurrency[j].Lease = 10 * time.Minute
		}
	}
}

// Reload makes policies and defaultPolicy those of every request that
// starts from now on; streams already open keep the policy they started
// with, and settle their reservations as they were taken. The policies
// come from a validated configuration (package config), as NewServer's
// do; Reload copies them.
func (s *Server) Reload(policies []Policy, defaultPolicy string) {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	s.live.Store(newPolicySet(policies, defaultPolicy, s.live.Load()))
}

// SetOverrides makes o the per-identity overrides of every request that
// reserves from now on, replacing the previous set whole. Overrides of a
// provider rule are ignored: the provider's bucket is every identity's.
func (s *Server) SetOverrides(o Overrides) {
	if o == nil {
		o = Overrides{}
	}
	s.overrides.Store(&o)
}

// readTier reads the request's tier, when its policy has tiers. A tier
// header sent twice is an error, as for identities: another filter may read
// the other value.
func (p *processor) readTier(hm *corev3.HeaderMap, headers map[string]string, md map[string]*structpb.Struct) error {
	t := p.pol.Tier
	if t == nil {
		return nil
	}
	v, _, err := lookupIdentity(*t, hm, headers, md)
	p.req.tier = v
	return err
}

// layers returns the tier's and the identity's overrides of a rule for
// this request, each zero when there is none.
func (p *processor) layers(rule, per string) (tier, identity Override) {
	if per == "" {
		return
	}
	if p.req.tier != "" && per != perModel {
		tier = p.pol.Tiers[p.req.tier][rule]
	}
	if m := *p.s.overrides.Load(); len(m) > 0 {
		identity = m[OverrideKey{Policy: p.policy, Rule: rule, Identity: p.keyPart(per)}]
	}
	return tier, identity
}

// bucket is rule r's bucket for this request, with the limit in force.
func (p *processor) bucket(r BucketRule) buckets.Bucket {
	limit := r.Limit
	if !r.Provider {
		tier, id := p.layers(r.Name, r.Per)
		limit = cmp.Or(id.Limit, tier.Limit, limit)
	}
	return buckets.Bucket{
		Name: r.Name, Key: p.key(r.Name, r.Per, r.Provider), Limit: limit,
		Hard: r.Hard, MaxDebt: r.MaxDebt, Headroom: r.Headroom, Lease: r.Lease,
	}
}

// slot is concurrency rule r's slot for this request, with the max in
// force.
func (p *processor) slot(r ConcurrencyRule) buckets.Slot {
	tier, id := p.layers(r.Name, r.Per)
	return buckets.Slot{Name: r.Name, Key: p.key(r.Name, r.Per, false), Max: cmp.Or(id.Max, tier.Max, r.Max), Lease: r.Lease}
}

// quota is quota rule r's quota for this request, with the budget in
// force.
func (p *processor) quota(r QuotaRule) buckets.Quota {
	tier, id := p.layers(r.Name, r.Per)
	limit := r.Limit
	if r.Unit == buckets.Money {
		limit = cmp.Or(id.Money, tier.Money, limit)
	} else {
		limit = cmp.Or(id.Tokens, tier.Tokens, limit)
	}
	q := buckets.Quota{Name: r.Name, Key: p.key(r.Name, r.Per, false), Window: r.Window, Unit: r.Unit, Limit: limit, Hard: r.Hard}
	if r.Unit == buckets.Money {
		q.Currency = p.currency()
	}
	return q
}

// limits are the buckets and quotas of the policy's chain for this
// request's identities and model, keyed as keys.go describes and with the
// limits in force: what a request reserves.
func (p *processor) limits() ([]buckets.Bucket, []buckets.Quota) {
	bs := make([]buckets.Bucket, 0, len(p.pol.Buckets))
	for _, r := range p.pol.Buckets {
		bs = append(bs, p.bucket(r))
	}
	var qs []buckets.Quota
	for _, r := range p.pol.Quotas {
		qs = append(qs, p.quota(r))
	}
	return bs, qs
}

// Where a limit in force comes from (RuleUsage.Source).
const (
	sourceRule     = "rule"
	sourceTier     = "tier"
	sourceOverride = "override"
)

func source(tier, identity bool) string {
	switch {
	case identity:
		return sourceOverride
	case tier:
		return sourceTier
	}
	return sourceRule
}

func hasIdentity(p *Policy, name string) bool {
	for _, id := range p.Identities {
		if id.Name == name {
			return true
		}
	}
	return false
}
