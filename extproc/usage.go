package extproc

import (
	"context"
	"errors"
	"fmt"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// ErrUnknownPolicy is wrapped by Usage's error for a policy the
// configuration does not define.
var ErrUnknownPolicy = errors.New("unknown policy")

// Usage is what one identity has left of a policy's limits, as a usage
// page shows it: per bucket its capacity, remaining tokens and time to
// full; per quota its budget, spend and remaining in the current window,
// and time to the window's end. It is a plain value.
type Usage struct {
	Policy string
	// Currency is the currency of quotas of money (their amounts are
	// micro-units of it); empty without a price table.
	Currency string
	Buckets  []buckets.BucketState
	Quotas   []buckets.QuotaState
}

// Usage reads the state of policy's buckets and quotas for one identity
// without changing them, through a store that implements
// buckets.Inspector (otherwise the error wraps errors.ErrUnsupported).
// identities maps the policy's identity names to values as requests carry
// them (an API key as sent, "Bearer " or not: identities that are hashed
// for store keys are hashed here alike); an identity left out is the
// anonymous one. model selects the buckets and quotas kept per model; with
// an empty model they are left out. Shared buckets (global, provider) are
// included: they limit this identity too.
func (s *Server) Usage(ctx context.Context, policy string, identities map[string]string, model string) (Usage, error) {
	set := s.live.Load()
	pol := set.byName[policy]
	if pol == nil {
		return Usage{}, fmt.Errorf("%w %q", ErrUnknownPolicy, policy)
	}
	in, ok := s.cfg.Store.(buckets.Inspector)
	if !ok {
		return Usage{}, fmt.Errorf("usage: the bucket store cannot be inspected: %w", errors.ErrUnsupported)
	}
	p := newProcessor(ctx, s, set, policy)
	p.req.ids = make(map[string]string, len(pol.Identities))
	for _, id := range pol.Identities {
		// The value as a request would carry it in a header: the same
		// rules (trimmed, bearer prefix dropped, hashed) make the same key.
		const h = "value"
		v, ok, err := lookupIdentity(Identity{Name: id.Name, Header: h, Hash: id.Hash}, nil, map[string]string{h: identities[id.Name]}, nil)
		switch {
		case err != nil:
			return Usage{}, fmt.Errorf("usage: identity %s: %w", id.Name, err)
		case ok:
			p.req.ids[id.Name] = identityPart(v)
		default:
			p.req.ids[id.Name] = anonymousPart
		}
	}
	p.req.count.Model, p.req.count.ModelKey = model, tokenizer.ModelKey(model)
	bs, qs := p.limits(model == "")
	states, quotas, err := in.Inspect(ctx, bs, qs)
	if err != nil {
		return Usage{}, fmt.Errorf("usage: %w", err)
	}
	return Usage{Policy: policy, Currency: p.currency(), Buckets: states, Quotas: quotas}, nil
}
