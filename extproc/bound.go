package extproc

import (
	"cmp"

	"github.com/tokengate/tokengate/extproc/provider"
)

// usageBound is the most usage a provider may report for the request
// before the bound is charged instead (Config.UsageMargin): margin × what
// the model can do + slack, for its prompt (the context window) and for
// its output (the maximum output per choice, or the request's own cap when
// lower: the provider stops there). What the model can do comes from the
// model table kept with the prices, else the configured defaults; never
// from this request's prompt, which may be a small part of what the
// provider bills (previous_response_id, cached content, files, server-side
// tools), nor from other requests' answers. The margin covers server-side
// tool loops, several calls of the model in one request. The bound is
// never below what this request was counted and reserved at, whatever the
// table says.
func (p *processor) usageBound() provider.Usage {
	cfg := &p.s.cfg
	c := p.req.count
	window, output := cfg.UsageContextWindow, cfg.UsageMaxOutputTokens
	if cfg.Prices != nil {
		if price, ok := cfg.Prices.Price(p.priceModel(c)); ok {
			window = cmp.Or(price.ContextWindow, window)
			output = cmp.Or(price.MaxOutputTokens, output)
		}
	}
	if c.OutputCap > 0 {
		// The provider stops each choice at the request's cap.
		output = min(output, c.OutputCap)
	}
	counted := p.req.allowance + p.st.extended
	return provider.Usage{
		InputTokens:  max(scaled(window, cfg.UsageMargin, cfg.UsageSlack), c.InputTokens+cfg.UsageSlack),
		OutputTokens: max(scaled(satMul(output, max(1, c.Choices)), cfg.UsageMargin, cfg.UsageSlack), max(counted, int(p.st.output.Load()))+cfg.UsageSlack),
	}
}

// scaled is n × margin + slack, saturating at a count no request reaches.
func scaled(n int, margin float64, slack int) int {
	const most = 1 << 40
	return int(min(float64(n)*margin+float64(slack), most))
}

// satMul is a × b, saturating at a count no request reaches.
func satMul(a, b int) int {
	const most = 1 << 40
	if a > most/max(b, 1) {
		return most
	}
	return a * b
}
