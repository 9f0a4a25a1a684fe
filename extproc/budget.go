package extproc

import (
	"fmt"
	"log/slog"
	"math"
	"strconv"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// Budgets: quotas over calendar windows, in tokens or money (see
// buckets.Quota). A request is reserved against them with its buckets, all
// or none; settlement charges what it used, priced by Config.Prices for
// quotas of money.

// Response header names of the quota that limits a request most.
const (
	headerLimitBudget     = "x-ratelimit-limit-budget"
	headerRemainingBudget = "x-ratelimit-remaining-budget"
	headerResetBudget     = "x-ratelimit-reset-budget"
	headerUnitBudget      = "x-ratelimit-unit-budget"
)

// maxMoney is the most the request can cost, in micro-units, and what each
// token beyond its allowance costs at most (admission.MaxMoney).
func (p *processor) maxMoney() (money, perToken float64) {
	return admission.MaxMoney(p.req.price, p.req.count.InputTokens, p.req.allowance)
}

// priceOf is the price request c is reserved at (admission.PriceOf), the
// price of its priceModel.
func (p *processor) priceOf(c tokenizer.Count) (pricing.Price, error) {
	return admission.PriceOf(p.s.cfg.Prices, p.priceModel(c), c.ServiceTier)
}

// priceModel is the model request c is priced by: an Azure deployment the
// price table names (an alias of its model), as Azure bills the
// deployment whatever the body's model says; else the model the request
// names.
func (p *processor) priceModel(c tokenizer.Count) string {
	if c.Deployment != "" && p.s.cfg.Prices != nil {
		if _, ok := p.s.cfg.Prices.Price(c.Deployment); ok {
			return c.Deployment
		}
	}
	return c.Model
}

// billed is the usage u as the provider billed it: at the tier its answer
// names, and with the cache-write retention the request asked for when the
// answer does not say. The price is the reservation's when the answer
// names a tier the table has no price for.
func (p *processor) billed(u provider.Usage) (pricing.Price, provider.Usage) {
	if p.req.count.ExtendedCacheRetention && u.CacheCreationExtendedInputTokens == 0 {
		u.CacheCreationExtendedInputTokens = u.CacheCreationInputTokens
	}
	price := p.req.price
	if u.ServiceTier != "" && u.ServiceTier != price.Tier {
		if tp, ok := price.AtTier(u.ServiceTier); ok {
			price = tp
		} else {
			p.logAt(slog.LevelWarn, "the provider billed a service tier the price table has no price for; the reserved tier's price is charged",
				"billed_tier", string(u.ServiceTier), "reserved_tier", string(price.Tier))
		}
	}
	return price, u
}

// quotaCost is the request's cost in a quota's unit: tokens, or the money
// reserved.
func (p *processor) quotaCost(u buckets.Unit, tokens int) float64 {
	var money float64
	if u == buckets.Money {
		money, _ = p.maxMoney()
	}
	return admission.QuotaCost(u, float64(tokens), money)
}

// currency is the currency that quotas of money count in.
func (p *processor) currency() string {
	if p.s.cfg.Prices == nil {
		return ""
	}
	return p.s.cfg.Prices.Currency()
}

// spent is what the request cost in micro-units, its charge priced by the
// model's price at the tier it was billed at: the usage settled, or, where
// the reservation stands, what it reserved when that is more.
func (p *processor) spent(c charge) float64 {
	price, u := p.billed(c.usage)
	cost := float64(price.Cost(u))
	if c.standing {
		r := p.st.res
		cost = max(cost, r.Money+r.Extended*r.MoneyPerToken)
	}
	return cost
}

// quotaCharges is what settling r charged each of its quotas.
func quotaCharges(r *buckets.Reservation, actual float64) []QuotaCharge {
	if len(r.Quotas) == 0 {
		return nil
	}
	out := make([]QuotaCharge, len(r.Quotas))
	for i, q := range r.Quotas {
		out[i] = QuotaCharge{Name: q.Name, Money: q.Unit == buckets.Money, Amount: r.UsedQuota(q, actual)}
	}
	return out
}

// refuseUnpriced answers 400 for a request that a quota of money applies to
// but whose model has no price, and the price table no fallback.
func (p *processor) refuseUnpriced(send sendFunc) error {
	p.req.decision = "bad_request"
	msg := "a cost budget applies to this request, but its model has no price; ask the operator to price it"
	if _, err := p.s.cfg.Prices.Resolve(p.req.count.Model); err == nil {
		msg = fmt.Sprintf("a cost budget applies to this request, but its model has no price at the %s service tier it asks for; ask the operator to price it",
			p.s.cfg.Prices.TierFor(p.req.count.ServiceTier))
	}
	p.logAt(slog.LevelInfo, "request refused: its model has no price", "code", "unpriced_model")
	return p.immediate(reply{status: 400, detail: errorDetail{
		Code:    "unpriced_model",
		Message: msg,
		Type:    "invalid_request_error",
	}, details: "tokengate_unpriced_model"}, send)
}

// limitingQuota returns the state of the quota that refused the decision,
// if a quota did.
func limitingQuota(d buckets.Decision) (buckets.QuotaState, bool) {
	if d.Reason != buckets.OverQuota && d.Reason != buckets.NeverAdmissible {
		return buckets.QuotaState{}, false
	}
	for _, q := range d.Quotas {
		if q.Name == d.Limiting {
			return q, true
		}
	}
	return buckets.QuotaState{}, false
}

// budgetRefusal answers a request that quota st refused: 429 until the
// window ends when the window has too little left, 413 when the request
// could cost more than the whole budget (S4, S16). amount is what the
// request needed, in the quota's unit.
func budgetRefusal(d buckets.Decision, st buckets.QuotaState, amount float64, currency string) reply {
	need := formatBudget(st.Unit, math.Ceil(amount), currency)
	if d.Reason == buckets.NeverAdmissible {
		return reply{
			status: 413,
			detail: errorDetail{
				Code: "request_too_large",
				Message: fmt.Sprintf("request may cost up to %s but budget %q allows %s per window: it can never be admitted",
					need, st.Name, formatBudget(st.Unit, st.Limit, currency)),
				Type: "budget", Quota: st.Name,
			},
			headers: budgetHeaders(st, currency),
			details: "tokengate_never_admissible",
		}
	}
	return reply{
		status: 429,
		detail: errorDetail{
			Code: "budget_exceeded",
			Message: fmt.Sprintf("budget %q has %s left in this window but the request may cost up to %s; it resets in %s",
				st.Name, formatBudget(st.Unit, max(0, math.Floor(st.Remaining)), currency), need, formatReset(d.Wait)),
			Type: "budget", Quota: st.Name,
		},
		wait:    waitOf(d),
		headers: budgetHeaders(st, currency),
		details: "tokengate_budget_exceeded",
	}
}

// formatBudget renders an amount of a quota's unit for a message: "1200
// tokens", "2.50 USD".
func formatBudget(u buckets.Unit, v float64, currency string) string {
	if u == buckets.Money {
		return budgetValue(u, v) + " " + currency
	}
	return budgetValue(u, v) + " tokens"
}

// budgetValue renders an amount of a quota's unit for a header: whole
// tokens, or money in units of the currency with up to six decimals
// ("500.00", "12.345678"). Amounts are rounded down to a whole token or
// micro-unit.
func budgetValue(u buckets.Unit, v float64) string {
	v = math.Floor(v)
	if u == buckets.Money {
		return pricing.Micros(v).String()
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

// budgetHeaders are the x-ratelimit-*-budget headers of quota state st.
func budgetHeaders(st buckets.QuotaState, currency string) [][2]string {
	unit := "tokens"
	if st.Unit == buckets.Money {
		unit = currency
	}
	return [][2]string{
		{headerLimitBudget, budgetValue(st.Unit, st.Limit)},
		{headerRemainingBudget, budgetValue(st.Unit, max(0, st.Remaining))},
		{headerResetBudget, formatReset(st.Reset)},
		{headerUnitBudget, unit},
	}
}

// tightestQuota is the quota with the least of its budget left, for the
// headers of an admitted request.
func tightestQuota(states []buckets.QuotaState) (buckets.QuotaState, bool) {
	if len(states) == 0 {
		return buckets.QuotaState{}, false
	}
	m := states[0]
	for _, s := range states[1:] {
		if s.Remaining/s.Limit < m.Remaining/m.Limit {
			m = s
		}
	}
	return m, true
}

// usageOf is the usage of in prompt and out output tokens counted here,
// without the provider's split: priced at the plain input and output rates.
func usageOf(in, out int) provider.Usage { return provider.Usage{InputTokens: in, OutputTokens: out} }
