package extproc

import (
	"cmp"
	"fmt"
	"maps"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
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
// rule takes Limit, a concurrency rule Max (a rule name may be both, as
// "apikey" is in the default configuration). A zero field keeps the
// rule's own value. Plain data.
type Override struct {
	Limit buckets.Limit
	Max   int
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

// ChainQuery names the requests whose chain Server.Chain describes: those
// of Policy from the given identities, of Model and of Tier.
type ChainQuery struct {
	Policy string
	// Identities maps identity names to values in the form store keys use
	// (IdentityKey). Rules keyed by an identity not given are left out.
	Identities map[string]string
	// Model is the model name; without it per-model rules are left out.
	Model string
	Tier  string
}

// ChainRule is one rule of a chain with the limit in force for it.
type ChainRule struct {
	// Bucket is set for a bucket rule, Slot for a concurrency rule.
	Bucket *buckets.Bucket
	Slot   *buckets.Slot
	Per    string
	// Source is where the limit comes from: "rule", "tier" or "override".
	Source string
}

// Chain returns the buckets and concurrency limits a request described by
// q would reserve against now, each with the limit in force for it and its
// store key: what a usage report inspects. It is the request path's own
// code, so the two cannot disagree.
func (s *Server) Chain(q ChainQuery) ([]ChainRule, error) {
	set := s.live.Load()
	pol := set.byName[q.Policy]
	if pol == nil {
		return nil, fmt.Errorf("policy %q is not defined", q.Policy)
	}
	p := &processor{s: s, pol: pol, policy: pol.Name}
	p.req.ids = make(map[string]string, len(q.Identities))
	for name, v := range q.Identities {
		if !hasIdentity(pol, name) {
			return nil, fmt.Errorf("policy %q has no identity %q", pol.Name, name)
		}
		p.req.ids[name] = v
	}
	p.req.count.Model, p.req.count.ModelKey = q.Model, tokenizer.ModelKey(q.Model)
	p.req.tier = q.Tier
	known := func(per string) bool {
		if per == perModel {
			return q.Model != ""
		}
		return per == "" || p.req.ids[per] != ""
	}
	var out []ChainRule
	for _, r := range pol.Buckets {
		if !known(r.Per) {
			continue
		}
		b := p.bucket(r)
		src := sourceRule
		if !r.Provider {
			tier, id := p.layers(r.Name, r.Per)
			src = source(tier.Limit != buckets.Limit{}, id.Limit != buckets.Limit{})
		}
		out = append(out, ChainRule{Bucket: &b, Per: r.Per, Source: src})
	}
	for _, r := range pol.Concurrency {
		if !known(r.Per) {
			continue
		}
		sl := p.slot(r)
		tier, id := p.layers(r.Name, r.Per)
		out = append(out, ChainRule{Slot: &sl, Per: r.Per, Source: source(tier.Max != 0, id.Max != 0)})
	}
	return out, nil
}

// Where a limit in force comes from (ChainRule.Source).
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
