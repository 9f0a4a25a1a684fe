package admission

import (
	"fmt"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/billing"
	"github.com/tokengate/tokengate/pricing"
)

// PriceOf is the price a request for model is reserved at: the model's,
// at the dearest service tier the request can be billed at
// (pricing.Table.TierFor of the tier it asks for). The error wraps
// pricing.ErrUnpriced when the model has no price, or none at that tier.
func PriceOf(prices *pricing.Table, model string, serviceTier billing.Tier) (pricing.Price, error) {
	price, err := prices.Resolve(model)
	if err != nil {
		return pricing.Price{}, err
	}
	tier := prices.TierFor(serviceTier)
	tp, ok := price.AtTier(tier)
	switch {
	case !ok && serviceTier == billing.Auto:
		// The request asks for no tier, and its project's is one the
		// table has no price of this model at: the provider serves a
		// model at a tier it supports, and standard is the one every
		// model has.
		return price, nil
	case !ok:
		return pricing.Price{}, fmt.Errorf("%w %q at service tier %s", pricing.ErrUnpriced, model, tier)
	}
	return tp, nil
}

// MaxMoney is the most a request of in prompt tokens and an output
// allowance of out tokens can cost at price, in micro-units (its prompt at
// the dearest input rate, its whole output at the dearest output rate),
// and what each output token beyond the allowance costs at most.
func MaxMoney(price pricing.Price, in, out int) (money, perToken float64) {
	return float64(price.MaxCost(in, out)), float64(price.MaxOutputRate(in)) / 1e6
}

// QuotaCost is a request's cost in a quota's unit: tokens, or money.
func QuotaCost(u buckets.Unit, tokens, money float64) float64 {
	if u == buckets.Money {
		return money
	}
	return tokens
}
