package admission

import (
	"fmt"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
)

// FromConfig maps a validated configuration's policies onto the admission
// core's, as both fronts take them.
func FromConfig(cfg *config.Config) ([]Policy, error) {
	var out []Policy
	for i, cp := range cfg.Policies {
		p := Policy{
			Name:            cp.Name,
			Anonymous:       cp.Anonymous,
			MaxOutputTokens: cp.MaxOutputTokens,
			ClampOutput:     cp.ClampOutput != nil && *cp.ClampOutput,
			InjectUsage:     cp.InjectUsage == nil || *cp.InjectUsage,
			PriorityHeader:  cp.PriorityHeader,

			UnknownEndpoints:      cp.UnknownEndpoints,
			UnknownEndpointTokens: cp.UnknownEndpointTokens,
		}
		if cp.Wait != nil {
			p.MaxWait, p.MaxQueue = cp.Wait.MaxWait, cp.Wait.MaxQueue
		}
		var err error
		if p.Tier, p.Tiers, err = tiers(cp); err != nil {
			return nil, fmt.Errorf("policies[%d]: %w", i, err)
		}
		for _, id := range cp.Identities {
			p.Identities = append(p.Identities, Identity{
				Name: id.Name, Header: id.Header, Metadata: id.Metadata, Path: id.Path, Hash: id.Hash,
			})
		}
		for j, b := range cp.Buckets {
			limit, headroom, err := b.Limit()
			if err != nil {
				return nil, fmt.Errorf("policies[%d].buckets[%d]: %w", i, j, err)
			}
			p.Buckets = append(p.Buckets, BucketRule{
				Name: b.Name, Per: b.Per, Limit: limit, Headroom: headroom,
				Hard: b.Hard, MaxDebt: b.MaxDebt, Provider: b.ProviderLimit != nil, Lease: leaseOf(cfg, b.Lease),
			})
		}
		for _, c := range cp.Concurrency {
			p.Concurrency = append(p.Concurrency, ConcurrencyRule{Name: c.Name, Per: c.Per, Max: c.Max, Lease: c.Lease})
		}
		for j, q := range cp.Quotas {
			w, unit, limit, err := q.Budget()
			if err != nil {
				return nil, fmt.Errorf("policies[%d].quotas[%d]: %w", i, j, err)
			}
			p.Quotas = append(p.Quotas, QuotaRule{Name: q.Name, Per: q.Per, Window: w, Unit: unit, Limit: limit, Hard: q.Hard})
		}
		out = append(out, p)
	}
	return out, nil
}

// tiers maps a policy's tier source and tiers onto the server's terms.
func tiers(cp config.Policy) (*Identity, map[string]map[string]Override, error) {
	if cp.Tier == nil {
		return nil, nil, nil
	}
	src := &Identity{Name: "tier", Header: cp.Tier.Header, Metadata: cp.Tier.Metadata, Path: cp.Tier.Path}
	out := make(map[string]map[string]Override, len(cp.Tiers))
	for _, t := range cp.Tiers {
		rules := make(map[string]Override, len(t.Limits))
		for _, rl := range t.Limits {
			ov, err := OverrideOf(rl.Limits)
			if err != nil {
				return nil, nil, fmt.Errorf("tier %q, rule %q: %w", t.Name, rl.Rule, err)
			}
			rules[rl.Rule] = ov
		}
		out[t.Name] = rules
	}
	return src, out, nil
}

// leaseOf maps a bucket's lease onto the store's. Only Redis is leased
// from: the memory store is the bucket itself.
func leaseOf(cfg *config.Config, l *config.Lease) *buckets.Lease {
	if l == nil || cfg.Store.Type != "redis" {
		return nil
	}
	return &buckets.Lease{Size: l.Size, TTL: l.TTL}
}

// OverrideOf maps validated limits onto the admission core's terms: an
// override of the API or the file, or a tier's limits. The error says why
// a cost is not an amount, which validated limits never have.
func OverrideOf(l config.Limits) (Override, error) {
	tokens, money, err := l.Budgets()
	if err != nil {
		return Override{}, err
	}
	return Override{Limit: l.Limit(), Max: l.Max, Tokens: tokens, Money: money}, nil
}
