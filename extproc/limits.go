package extproc

import (
	"maps"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/admission"
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
		p = admission.Normalize(p)
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

// chain is this request as the admission core sees it: its policy,
// identities, model, tier, and the overrides and currency in force.
func (p *processor) chain() admission.Chain {
	return admission.Chain{
		Policy: p.pol, PolicyName: p.policy, IDs: p.req.ids, ModelKey: p.modelKey(), Tier: p.req.tier,
		Overrides: *p.s.overrides.Load(), Currency: p.currency(),
	}
}

// layers returns the tier's and the identity's overrides of a rule for
// this request, each zero when there is none.
func (p *processor) layers(rule, per string) (tier, identity Override) {
	c := p.chain()
	return c.Layers(rule, per)
}

// bucket is rule r's bucket for this request, with the limit in force.
func (p *processor) bucket(r BucketRule) buckets.Bucket {
	c := p.chain()
	return c.Bucket(r)
}

// slot is concurrency rule r's slot for this request, with the max in
// force.
func (p *processor) slot(r ConcurrencyRule) buckets.Slot {
	c := p.chain()
	return c.Slot(r)
}

// quota is quota rule r's quota for this request, with the budget in
// force.
func (p *processor) quota(r QuotaRule) buckets.Quota {
	c := p.chain()
	return c.Quota(r)
}

// limits are the buckets and quotas of the policy's chain for this
// request (admission.Chain.Limits): what a request reserves.
func (p *processor) limits() ([]buckets.Bucket, []buckets.Quota) {
	c := p.chain()
	return c.Limits()
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
