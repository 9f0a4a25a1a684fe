package admission

import (
	"maps"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// Policy is one named set of limits: how identities are found, the chain of
// buckets every request passes, concurrency limits, waiting and output caps.
// It is plain data, copied by the servers (Normalize); a zero Policy is invalid (it needs a
// Name and at least one bucket). Package config validates policies; the
// header names here are lower case, as Envoy sends them.
type Policy struct {
	Name string
	// Identities says how a request's identities are found (S9a).
	Identities []Identity
	// Anonymous is what happens when an identity is missing: "shared" (one
	// anonymous bucket per rule, the default) or "reject" (401).
	Anonymous string
	// Buckets is the chain (S10), in order.
	Buckets []BucketRule
	// Concurrency caps requests in flight (S11).
	Concurrency []ConcurrencyRule
	// MaxWait lets a request short of tokens wait up to this long (S12);
	// zero refuses at once.
	MaxWait time.Duration
	// MaxQueue bounds how many requests of this policy wait at once on
	// this gateway (S12); zero lets none wait, whatever MaxWait says.
	MaxQueue int
	// MaxOutputTokens is a hard per-request output cap (S14); 0 = none.
	MaxOutputTokens int
	// ClampOutput writes the reserved output allowance into the request
	// body's output cap, so the model itself stops there on every Envoy
	// version (the fallback for Envoy without FULL_DUPLEX_STREAMED).
	ClampOutput bool
	// InjectUsage asks OpenAI-style streams for
	// stream_options.include_usage (S15) and hides it from the client.
	InjectUsage bool
	// PriorityHeader names a request header that marks priority traffic
	// (S19) with the value "true" or "1".
	PriorityHeader string
	// UnknownEndpoints says what happens to a request whose path and body
	// match no API tokengate meters (S22): "refuse" (400 unknown_api; the
	// default when empty), "pass" (forwarded unmetered) or "charge"
	// (forwarded, charged UnknownEndpointTokens through the policy's
	// buckets and concurrency limits, nothing when the upstream fails).
	UnknownEndpoints string
	// UnknownEndpointTokens is the flat cost of a request under
	// UnknownEndpoints "charge".
	UnknownEndpointTokens int
	// Quotas are budgets over calendar windows, reserved and settled with
	// the buckets, all or none.
	Quotas []QuotaRule
	// Tier says where a request's tier is found (its Name is unused);
	// nil means requests have none. Tiers maps a tier value to the limits
	// it gives rules, by rule name: a request of that tier gets them
	// unless its identity has an override (Overrides). Package
	// config allows tier limits only for rules keyed by an identity.
	Tier  *Identity
	Tiers map[string]map[string]Override
}

// QuotaRule is one quota of a policy (see buckets.Quota): a budget per
// calendar window, keyed like a bucket. Plain data; the zero value is
// invalid (Name, Window and Limit are required).
type QuotaRule struct {
	Name string
	// Per is an identity name, "model", or "" for one global quota.
	Per    string
	Window buckets.Window
	// Unit is tokens, or money (micro-units of the price table's currency).
	Unit  buckets.Unit
	Limit float64
	// Hard meters streams live against the budget and cuts them off when
	// it runs out (S14).
	Hard bool
}

// LeaseOf returns the lease of the policy's bucket rule named bucket, or
// nil when that bucket is not leased.
func (p *Policy) LeaseOf(bucket string) *buckets.Lease {
	for i := range p.Buckets {
		if p.Buckets[i].Name == bucket {
			return p.Buckets[i].Lease
		}
	}
	return nil
}

// Charges reports whether the policy has a quota of money, so that its
// requests are priced.
func (p *Policy) Charges() bool {
	for _, q := range p.Quotas {
		if q.Unit == buckets.Money {
			return true
		}
	}
	return false
}

// Identity says where one identity of a request is found (S9a): a request
// header set by an auth filter, or a dotted key in a namespace of Envoy's
// forwarded dynamic metadata (JWT claims). Exactly one of Header and
// Metadata is set; the zero value is invalid. Plain data.
type Identity struct {
	Name     string
	Header   string
	Metadata string // dynamic metadata namespace
	Path     string // dotted key in that namespace
	// Hash stores only a hash of the value (API keys never become store keys).
	Hash bool
}

// BucketRule is one bucket of a policy's chain; its store key is described
// in keys.go and docs/design.md. Plain data; the zero value is invalid (Name and
// Limit are required).
type BucketRule struct {
	Name string
	// Per is an identity name, "model", or "" for one global bucket.
	Per      string
	Limit    buckets.Limit
	Hard     bool    // may never go below zero; a stream is cut when it runs out (S14)
	MaxDebt  float64 // see buckets.Bucket.MaxDebt
	Headroom float64 // see buckets.Bucket.Headroom (S19)
	// Provider marks the bucket that stands for the provider account: it
	// receives the provider's Retry-After pauses (S18).
	Provider bool
	// Lease, when set, lets this gateway admit against a local slice of
	// the bucket (see buckets.Lease): the store must be a lease store.
	Lease *buckets.Lease
}

// ConcurrencyRule caps requests in flight (S11). Plain data; the zero value
// is invalid (Name and Max are required).
type ConcurrencyRule struct {
	Name  string
	Per   string // as BucketRule.Per
	Max   int
	Lease time.Duration // how long a slot lives if never released; default 10m
}

// What Policy.Anonymous may say, and the Per of a per-model rule.
const (
	AnonymousShared = "shared"
	AnonymousReject = "reject"
	PerModel        = "model"
)

// Allowance is the output allowance a request of this policy reserves: the
// allowance the counter found (the request's cap, history or the default,
// S7), lowered to the policy's MaxOutputTokens (S14). The reservation is
// c.InputTokens plus it.
func (p *Policy) Allowance(c tokenizer.Count) int {
	if m := p.MaxOutputTokens; m > 0 && c.OutputAllowance > m {
		return m
	}
	return c.OutputAllowance
}

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
	// the price table's currency.
	Money float64
}

// OverrideKey names an override: a rule of a policy, for one identity
// value in the form store keys use (IdentityKey, or ModelKey for a
// per-model rule).
type OverrideKey struct{ Policy, Rule, Identity string }

// Overrides are the per-identity overrides in force. A map given to
// SetOverrides belongs to the server from then on; do not modify it.
type Overrides map[OverrideKey]Override

// Policies are policies by name, each a copy with its defaults filled
// (Normalize). Immutable once built: both fronts share one.
type Policies map[string]*Policy

// NewPolicies copies policies (Normalize) into a Policies.
func NewPolicies(policies []Policy) Policies {
	out := make(Policies, len(policies))
	for _, p := range policies {
		n := Normalize(p)
		out[n.Name] = &n
	}
	return out
}

// Normalize returns a deep copy of p with its defaults filled: Anonymous
// "shared", and a concurrency lease of 10 minutes. The policies are not
// checked again: they come from a validated configuration (package config).
func Normalize(p Policy) Policy {
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
	if p.Anonymous == "" {
		p.Anonymous = AnonymousShared
	}
	for j := range p.Concurrency {
		if p.Concurrency[j].Lease == 0 {
			p.Concurrency[j].Lease = 10 * time.Minute
		}
	}
	return p
}

// HasIdentity reports whether the policy has an identity of that name.
func (p *Policy) HasIdentity(name string) bool {
	for _, id := range p.Identities {
		if id.Name == name {
			return true
		}
	}
	return false
}
