package extproc

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// ErrUnknownPolicy is wrapped by Usage's error for a policy the
// configuration does not define.
var ErrUnknownPolicy = errors.New("unknown policy")

// ErrUnknownIdentity is wrapped by Usage's error for an identity name the
// policy does not define.
var ErrUnknownIdentity = errors.New("unknown identity")

// UsageQuery names whose usage Server.Usage reports: the requests of
// Policy that carry these identities, name Model and belong to Tier.
type UsageQuery struct {
	Policy string
	// Identities maps identity names to values in the form store keys use
	// (IdentityKey). Rules keyed by an identity not given are left out.
	Identities map[string]string
	// Model is the model name; without it per-model rules are left out.
	Model string
	// Tier is the tier the requests carry; "" for none.
	Tier string
}

// Usage is what the requests a UsageQuery names have used and have left
// of their policy's limits, rule by rule, as a usage page shows it. It is
// a plain value.
type Usage struct {
	Policy string
	// Currency is the currency of quotas of money (their amounts are
	// micro-units of it); empty without a price table.
	Currency string
	// Rules are the policy's buckets in chain order, then its quotas,
	// then its concurrency limits, each when it applies to the query.
	Rules []RuleUsage
	// At is when the store was read.
	At time.Time
}

// Kinds of rule (RuleUsage.Kind).
const (
	KindBucket      = "bucket"
	KindQuota       = "quota"
	KindConcurrency = "concurrency"
)

// RuleUsage is one rule with the limit in force and what is left of it.
// Exactly one of Bucket, Quota and Slot is set, as Kind says.
type RuleUsage struct {
	Name string
	Kind string
	// Per is the identity the rule is keyed by, "model", or "" (global).
	Per string
	// Source is where the limit in force comes from: "rule" (the policy's
	// own), "tier" or "override" (the identity's).
	Source string
	// Bucket is the bucket's limit in force, tokens remaining and time
	// until it is full again.
	Bucket *buckets.BucketState
	// Quota is the quota's budget in force, the current window and what
	// was spent in it, and the time until it ends.
	Quota *buckets.QuotaState
	// Slot is the concurrency limit in force and the requests holding a
	// slot now.
	Slot *SlotUsage
}

// SlotUsage is a concurrency limit's max in force and the slots held.
type SlotUsage struct {
	Max, InUse int
}

// Usage reads, without changing them, the buckets, quotas and concurrency
// limits that a request described by q would reserve against now, each
// with the limit in force for it (the rule's, its tier's or the identity's
// override) and its store key: the request path's own code builds them, so
// a usage report and admission cannot disagree. Shared rules (global,
// provider) are included: they limit these requests too. The store must
// implement buckets.Inspector (otherwise the error wraps
// errors.ErrUnsupported); an unknown policy or identity name is an error
// wrapping ErrUnknownPolicy or ErrUnknownIdentity.
func (s *Server) Usage(ctx context.Context, q UsageQuery) (Usage, error) {
	set := s.live.Load()
	pol := set.byName[q.Policy]
	if pol == nil {
		return Usage{}, fmt.Errorf("%w %q", ErrUnknownPolicy, q.Policy)
	}
	in, ok := s.cfg.Store.(buckets.Inspector)
	if !ok {
		return Usage{}, fmt.Errorf("usage: the bucket store cannot be inspected: %w", errors.ErrUnsupported)
	}
	p := &processor{s: s, pol: pol, policy: pol.Name}
	p.req.ids = make(map[string]string, len(q.Identities))
	for name, v := range q.Identities {
		if !pol.HasIdentity(name) {
			return Usage{}, fmt.Errorf("%w: policy %q has no identity %q", ErrUnknownIdentity, pol.Name, name)
		}
		p.req.ids[name] = v
	}
	p.req.count.Model, p.req.count.ModelKey = q.Model, tokenizer.ModelKey(q.Model)
	p.req.tier = q.Tier
	applies := func(per string) bool {
		if per == perModel {
			return q.Model != ""
		}
		return per == "" || p.req.ids[per] != ""
	}

	var (
		rules []RuleUsage
		bs    []buckets.Bucket
		qs    []buckets.Quota
		ss    []buckets.Slot
	)
	for _, r := range pol.Buckets {
		if !applies(r.Per) {
			continue
		}
		src := sourceRule
		if !r.Provider {
			tier, id := p.layers(r.Name, r.Per)
			src = source(tier.Limit != buckets.Limit{}, id.Limit != buckets.Limit{})
		}
		bs = append(bs, p.bucket(r))
		rules = append(rules, RuleUsage{Name: r.Name, Kind: KindBucket, Per: r.Per, Source: src})
	}
	for _, r := range pol.Quotas {
		if !applies(r.Per) {
			continue
		}
		tier, id := p.layers(r.Name, r.Per)
		src := source(tier.Tokens != 0, id.Tokens != 0)
		if r.Unit == buckets.Money {
			src = source(tier.Money != 0, id.Money != 0)
		}
		qs = append(qs, p.quota(r))
		rules = append(rules, RuleUsage{Name: r.Name, Kind: KindQuota, Per: r.Per, Source: src})
	}
	for _, r := range pol.Concurrency {
		if !applies(r.Per) {
			continue
		}
		tier, id := p.layers(r.Name, r.Per)
		ss = append(ss, p.slot(r))
		rules = append(rules, RuleUsage{Name: r.Name, Kind: KindConcurrency, Per: r.Per, Source: source(tier.Max != 0, id.Max != 0)})
	}

	at := s.cfg.Now()
	states, quotas, err := in.Inspect(ctx, bs, qs)
	if err != nil {
		return Usage{}, fmt.Errorf("usage: %w", err)
	}
	held, err := in.InUse(ctx, ss)
	if err != nil {
		return Usage{}, fmt.Errorf("usage: %w", err)
	}
	if len(states) != len(bs) || len(quotas) != len(qs) || len(held) != len(ss) {
		return Usage{}, fmt.Errorf("usage: the store answered %d, %d and %d states for %d buckets, %d quotas and %d slots: %w",
			len(states), len(quotas), len(held), len(bs), len(qs), len(ss), buckets.ErrStore)
	}
	for i := range rules {
		switch rules[i].Kind {
		case KindBucket:
			rules[i].Bucket, states = &states[0], states[1:]
		case KindQuota:
			rules[i].Quota, quotas = &quotas[0], quotas[1:]
		default:
			rules[i].Slot = &SlotUsage{Max: ss[0].Max, InUse: held[0]}
			ss, held = ss[1:], held[1:]
		}
	}
	return Usage{Policy: pol.Name, Currency: p.currency(), Rules: rules, At: at}, nil
}

// ErrUnknownQuota is wrapped by Spenders' error for a quota the policy
// does not define.
var ErrUnknownQuota = errors.New("unknown quota")

// Spenders lists, writing nothing, the identities with the most spend in
// the current window of the policy's quota rule quota: at most top of
// them, largest first, each in the form store keys use (IdentityKey: a
// hashed identity hashed, never raw; the model's key for a per-model
// quota; "%2A" for a global one), with what the store says of how much it
// read (buckets.SpendList). The store must implement buckets.SpendLister
// (otherwise the error wraps errors.ErrUnsupported); an unknown policy or
// quota is an error wrapping ErrUnknownPolicy or ErrUnknownQuota.
func (s *Server) Spenders(ctx context.Context, policy, quota string, top int) (buckets.SpendList, error) {
	pol := s.live.Load().byName[policy]
	if pol == nil {
		return buckets.SpendList{}, fmt.Errorf("%w %q", ErrUnknownPolicy, policy)
	}
	i := slices.IndexFunc(pol.Quotas, func(r QuotaRule) bool { return r.Name == quota })
	if i < 0 {
		return buckets.SpendList{}, fmt.Errorf("%w: policy %q has no quota %q", ErrUnknownQuota, policy, quota)
	}
	l, ok := s.cfg.Store.(buckets.SpendLister)
	if !ok {
		return buckets.SpendList{}, fmt.Errorf("spenders: the bucket store cannot list spend: %w", errors.ErrUnsupported)
	}
	r := pol.Quotas[i]
	p := &processor{s: s, pol: pol, policy: pol.Name}
	q := buckets.SpendQuery{Prefix: admission.QuotaPrefix(pol.Name, r.Name), Window: r.Window, Unit: r.Unit, Top: top}
	if r.Unit == buckets.Money {
		q.Currency = p.currency()
	}
	list, err := l.ListSpend(ctx, q)
	if err != nil {
		return buckets.SpendList{}, fmt.Errorf("spenders: %w", err)
	}
	return list, nil
}
