package extproc

import (
	"context"
	"log/slog"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
)

// charge is what settling a request charges, and why.
type charge struct {
	actual  int
	outcome string // complete, aborted, cut_off, upstream_error, no_response
	// reported is the provider's usage when it was beyond what the request
	// makes plausible and bound was charged instead.
	reported, bound provider.Usage
	clamped         bool
	// usage is actual split as billed, which prices it; standing says the
	// reservation stands as well, so it costs at least what it reserved.
	usage    provider.Usage
	standing bool
}

// settlement is what the request costs, and why (S8):
//   - cut off: the prompt and every output token counted (what was
//     delivered plus the event in flight the upstream generated); in
//     STREAMED mode the upstream runs to its end, so its usage if reported;
//   - no response seen (upstream connect failure, client gone before the
//     answer): nothing; the provider bills no request it never answered;
//   - upstream error status: the provider's usage if it reported any, else
//     nothing;
//   - provider usage reported: that, authoritative at the end of the stream;
//     a stream that ended without its end charges the larger of the usage
//     reported so far and the live count;
//   - streamed: the prompt and the live output count, ended or aborted;
//     a stream forwarded unread past an unbounded event: the reservation,
//     or the count before the event when that is more;
//   - not streamed and no usage reported: the reservation stands.
//
// Reported usage is bounded by what the request makes plausible (see
// Config.UsageMargin).
func (p *processor) settlement() charge {
	in, live := p.req.count.InputTokens, int(p.st.output.Load())
	switch {
	case p.resp.cut:
		if p.resp.usageOK && p.resp.usage.Total() > 0 && !p.duplex() {
			return p.usageCharge(p.resp.usage, "cut_off")
		}
		return charge{actual: in + live, outcome: "cut_off", usage: usageOf(in, live)}
	case p.resp.status == 0:
		return charge{outcome: "no_response"}
	case p.resp.status >= 400:
		if p.resp.usageOK {
			return p.usageCharge(p.resp.usage, "upstream_error")
		}
		return charge{outcome: "upstream_error"}
	}
	outcome := "complete"
	if !p.resp.eosSeen {
		outcome = "aborted"
	}
	switch {
	case p.resp.unread:
		// Nothing after the unbounded event was read: the reservation
		// stands, or what was counted before it when that is more.
		return charge{actual: max(p.reservedTokens(), in+live), outcome: outcome, usage: usageOf(in, live), standing: true}
	case p.resp.usageOK:
		u := p.resp.usage
		if !p.resp.eosSeen {
			// Usage seen before the end is a running figure: Anthropic's
			// message_start reports output_tokens 1, Gemini's
			// usageMetadata lags. What was counted was generated.
			u.OutputTokens = max(u.OutputTokens, live)
			if u.InputTokens == 0 {
				u.InputTokens = in
			}
		}
		return p.usageCharge(u, outcome)
	case p.resp.sse:
		return charge{actual: in + live, outcome: outcome, usage: usageOf(in, live)}
	}
	return charge{actual: p.reservedTokens(), outcome: outcome, standing: true}
}

// usageCharge charges reported usage, bounded by what the request makes
// plausible: the provider knows best what it billed, but not more than the
// request could have cost, or one broken or hostile answer would drive the
// shared buckets to their floor.
func (p *processor) usageCharge(u provider.Usage, outcome string) charge {
	cfg := &p.s.cfg
	c := p.req.count
	bound := provider.Usage{InputTokens: scaled(c.InputTokens, cfg.UsageMargin, cfg.UsageSlack)}
	spent := p.req.allowance + p.st.extended
	if c.OutputCap > 0 {
		bound.OutputTokens = max(c.OutputCap*max(1, c.Choices), spent) + cfg.UsageSlack
	} else {
		bound.OutputTokens = scaled(max(spent, int(p.st.output.Load())), cfg.UsageMargin, cfg.UsageSlack)
	}
	ch := charge{outcome: outcome, reported: u, bound: bound}
	if u.InputTokens > bound.InputTokens {
		u.InputTokens, ch.clamped = bound.InputTokens, true
	}
	if u.OutputTokens > bound.OutputTokens {
		u.OutputTokens, ch.clamped = bound.OutputTokens, true
	}
	ch.actual, ch.usage = u.Total(), u
	return ch
}

// scaled is n × margin + slack, saturating at a count no request reaches.
func scaled(n int, margin float64, slack int) int {
	const most = 1 << 40
	return int(min(float64(n)*margin+float64(slack), most))
}

// settle settles the reservation exactly once, under a context that is not
// the stream's, with a short timeout (S8).
func (p *processor) settle() {
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	if p.st.settled || p.st.res == nil {
		return
	}
	p.st.settled = true
	p.stopRenewal()
	c := p.settlement()
	p.st.actual, p.st.outcome, p.st.clamped = c.actual, c.outcome, c.clamped
	if p.pol.charges() {
		p.st.res.Spent = p.spent(c)
	}
	p.st.quotas = quotaCharges(p.st.res, float64(c.actual))
	if c.clamped {
		p.logAt(slog.LevelWarn, "implausible usage reported: the bound is settled instead",
			"reported_input", c.reported.InputTokens, "reported_output", c.reported.OutputTokens,
			"bound_input", c.bound.InputTokens, "bound_output", c.bound.OutputTokens)
	}
	p.settleStore(p.st.actual)
	p.learn()
}

// learn feeds the output of a complete answer back to the learned estimate
// (S7); the estimator divides it among the request's choices.
func (p *processor) learn() {
	if p.st.outcome != "complete" || p.resp.status != 200 || p.req.count.Model == "" {
		return
	}
	out := int(p.st.output.Load())
	switch {
	case p.st.clamped:
		return // an answer beyond the plausible teaches nothing
	case p.resp.usageOK:
		out = p.resp.usage.OutputTokens
	case !p.resp.sse:
		return // no usage, nothing counted: nothing learned
	}
	if p.req.capAdded && out >= p.req.allowance {
		return // stopped by the cap clamp_output added, not by the model
	}
	p.s.cfg.counter.Observe(p.policy, p.req.count, out)
}

// settleStore hands the settlement to the store; st.mu is held. A store
// that settles asynchronously (buckets.AsyncSettler: the Redis store sends
// it with its next call, a round trip less per request) answers later, from
// another goroutine; finish waits for the answer before it reports, and
// Shutdown flushes what is still queued. The store gets a copy of the
// reservation, so p.st.res stays the stream's to read.
func (p *processor) settleStore(actual int) {
	written := make(chan struct{})
	p.st.written = written
	r := *p.st.res
	done := func(states []buckets.BucketState, err error) {
		p.st.states, p.st.settleErr = states, err
		close(written)
	}
	if as, ok := p.s.cfg.Store.(buckets.AsyncSettler); ok {
		as.SettleAsync(&r, float64(actual), done)
		return
	}
	ctx, cancel := p.storeCtx(p.s.cfg.SettleTimeout)
	defer cancel()
	done(p.s.cfg.Store.Settle(ctx, &r, float64(actual)))
}

// awaitSettlement waits, up to SettleTimeout, for the store to answer the
// settlement, and reads its answer: the buckets it left in debt and those
// whose floor forgave part of the usage. A settlement still unanswered then
// is left to the store (Shutdown flushes it); the outcome then names no
// bucket. It runs on the stream's goroutine, without st.mu.
func (p *processor) awaitSettlement() {
	p.st.mu.Lock()
	written, reserved, actual := p.st.written, p.reservedTokens(), p.st.actual
	p.st.mu.Unlock()
	if written == nil {
		return
	}
	t := time.NewTimer(p.s.cfg.SettleTimeout)
	defer t.Stop()
	select {
	case <-written:
	case <-t.C:
		p.logAt(slog.LevelWarn, "settlement not answered in time; the store still holds it", "timeout", p.s.cfg.SettleTimeout)
		return
	}
	// written is closed after states and settleErr are set, and nothing
	// writes them again.
	if err := p.st.settleErr; err != nil {
		p.logAt(slog.LevelError, "settlement failed", "reserved", reserved, "actual", actual, "err", err)
		return
	}
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	for _, st := range p.st.states {
		if st.Remaining < 0 {
			p.st.inDebt = append(p.st.inDebt, st.Name)
		}
		if st.Forgiven > 0 {
			p.st.forgiven = append(p.st.forgiven, st.Name)
		}
	}
}

// abandon settles an open reservation from Shutdown, as an aborted request.
func (p *processor) abandon() {
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	if p.st.settled || p.st.res == nil {
		return
	}
	p.st.settled = true
	p.stopRenewal()
	in, out := int(p.st.input.Load()), int(p.st.output.Load())
	p.st.actual = in + out
	p.st.outcome = "shutdown"
	if p.pol.charges() {
		p.st.res.Spent = p.spent(charge{usage: usageOf(in, out)})
	}
	p.st.quotas = quotaCharges(p.st.res, float64(p.st.actual))
	p.settleStore(p.st.actual)
}

// finish runs once when the stream ends, on every path: it settles what is
// still open (an aborted request) and records the request's outcome. It is
// the one place per request where outcomes are reported.
func (p *processor) finish() {
	p.releaseOut()
	p.releaseFramer()
	p.settle()
	p.awaitSettlement()
	p.st.mu.Lock()
	actual, outcome, settled, inDebt, forgiven, clamped, quotas := p.st.actual, p.st.outcome, p.st.settled, p.st.inDebt, p.st.forgiven, p.st.clamped, p.st.quotas
	p.st.mu.Unlock()
	level := slog.LevelInfo
	if p.req.decision == "admitted" && outcome == "complete" || p.req.decision == "unmetered" {
		level = slog.LevelDebug // the common case: keep Info for what an operator acts on
	}
	if p.s.cfg.Logger.Enabled(context.Background(), level) {
		// The status the client got: tokengate's own answer, or the
		// upstream's. The output: the provider's count when it reported
		// one (a non-streamed answer has no live count), else the live one.
		status, output := p.resp.status, int(p.st.output.Load())
		if p.req.reply != 0 {
			status = p.req.reply
		}
		if p.resp.usageOK {
			output = p.resp.usage.OutputTokens
		}
		attrs := []any{
			"decision", p.req.decision,
			"api", string(p.req.count.API), "model", p.req.count.Model,
			"input_tokens", p.req.count.InputTokens, "allowance", p.req.allowance,
			"reserved", p.reservedTokens(), "output_tokens", output,
			"status", status, "cut_off", p.resp.cut,
		}
		if settled {
			attrs = append(attrs, "settled", actual, "outcome", outcome)
		}
		if p.req.waited > 0 {
			attrs = append(attrs, "waited", p.req.waited)
		}
		if len(forgiven) > 0 {
			attrs = append(attrs, "forgiven", forgiven)
		}
		p.logAt(level, "request finished", attrs...)
	}
	if p.s.cfg.OnFinish != nil {
		policy := p.policy
		if p.pol == nil {
			policy = unknownPolicy // a name from the route, not from the configuration
		}
		p.s.cfg.OnFinish(Outcome{
			Policy: policy, Decision: p.req.decision, Model: p.req.count.Model,
			InputTokens: p.req.count.InputTokens, Reserved: p.reservedTokens(),
			Output: int(p.st.output.Load()), Settled: actual, SettleOutcome: outcome,
			CutOff: p.resp.cut, Status: p.resp.status, Usage: p.resp.usageOK,
			AllowanceSource: string(p.req.count.AllowanceSource), FallbackEncoding: p.req.count.Fallback,
			Waited: p.req.waited, InDebt: inDebt, Forgiven: forgiven, UsageClamped: clamped, StreamUnread: p.resp.unread,
			Quotas: quotas, Budget: p.req.budget,
			API: string(p.req.count.API), Embedding: p.req.count.Embedding,
			ResponseModel: p.responseModel(), ProviderUsage: p.providerUsage(), Streamed: p.resp.sse,
			Duration: p.s.cfg.Now().Sub(p.started), FirstOutput: p.sinceStart(p.resp.firstOutput),
		})
	}
}

// startRenewal starts renewing the reservation and its concurrency slots
// on a timer, every third of the shortest of their lifetimes (each slot's
// lease, the reservation's Lifetime), until settlement; st.mu is held.
// Every request renews, with or without slots: a request that stays open
// longer than its reservation's lifetime — a long stream, or a slow answer
// that sends nothing for minutes — must stay settleable (S8), and keep its
// slots, or the limit would admit more requests than it allows (S11). A
// renewal that fails is retried at the next, before anything expires.
func (p *processor) startRenewal() {
	if _, ok := p.s.cfg.Store.(buckets.Renewer); !ok {
		return
	}
	shortest := p.st.res.LifetimeOrDefault()
	for _, sl := range p.st.res.Slots {
		shortest = min(shortest, sl.LeaseOrDefault())
	}
	p.st.renewIn = shortest / renewalsPerLifetime
	if p.st.renewIn > 0 {
		p.st.renewal = p.s.cfg.afterFunc(p.st.renewIn, p.renew)
	}
}

// renewalsPerLifetime is how many renewals fall within the shortest
// lifetime of a reservation and its slots: with three, one renewal may fail
// and the next still lands in time.
const renewalsPerLifetime = 3

// renew renews the reservation and its slots from the renewal timer,
// unless the reservation is settled meanwhile, and sets the next timer.
func (p *processor) renew() {
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	if p.st.settled {
		return
	}
	ctx, cancel := p.storeCtx(p.s.cfg.SettleTimeout)
	defer cancel()
	if err := p.s.cfg.Store.(buckets.Renewer).Renew(ctx, p.st.res); err != nil {
		p.logAt(slog.LevelWarn, "reservation not renewed; it and its slots expire unless the next renewal succeeds", "err", err)
	}
	p.st.renewal = p.s.cfg.afterFunc(p.st.renewIn, p.renew)
}

// stopRenewal stops the renewal timer; st.mu is held and the reservation
// settled.
func (p *processor) stopRenewal() {
	if p.st.renewal != nil {
		p.st.renewal.Stop()
		p.st.renewal = nil
	}
}
