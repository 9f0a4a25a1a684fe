package extproc

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/tokenizer"
)

// charge is what settling a request charges, and why.
type charge struct {
	actual  int
	outcome string // complete, aborted, cut_off, upstream_error, no_response, not_forwarded
	// reported is the provider's usage when it was beyond what the request
	// makes plausible and bound was charged instead.
	reported, bound provider.Usage
	clamped         bool
	// usage is actual split as billed, which prices it; standing says the
	// reservation stands as well, so it costs at least what it reserved.
	usage    provider.Usage
	standing bool
}

// output is the output tokens of the charge: what was settled beyond the
// prompt.
func (c charge) output() int { return c.actual - c.usage.InputTokens }

// progress is how far a request got, as settlement reads it (S8): whether
// it went upstream, what the upstream answered, the usage it reported. The
// stream's goroutine alone writes it, under settlement.mu (see seeing), and
// reads it without; Shutdown reads it under the mutex, so an open request
// is settled by the one rule whoever settles it.
type progress struct {
	forwarded bool // the request was let on to the upstream (forward)
	status    int  // the upstream's HTTP status; 0 until its response headers
	sse       bool // a stream of events, counted live
	eos       bool // the response ended
	cut       bool // cut off at a hard budget (S14)
	unread    bool // an event passed MaxEventBytes: the rest went on unread
	usage     provider.Usage
	usageOK   bool
	// usageFinal says the usage is the provider's count of the whole
	// answer; outputReported that it counts the output generated so far,
	// hidden reasoning included (provider.Stream.UsageFinal, OutputReported).
	usageFinal, outputReported bool
}

// seeing updates the progress that settlement reads, from the stream's
// goroutine.
func (p *processor) seeing(update func(*progress)) {
	p.st.mu.Lock()
	update(&p.st.seen)
	p.st.mu.Unlock()
}

// settlement is what the request costs, and why (S8); docs/budgets.md has
// the table of every exit. st.mu is held.
//
//   - not forwarded (refused after its reservation, or the client gone
//     while it was counted, reserved or waited): nothing; the provider
//     never had it.
//   - forwarded, no answer (the client hung up before the response
//     headers, or Envoy answered itself: connect failure, upstream
//     timeout, which Envoy does not show tokengate): the provider has the
//     prompt. A non-streamed answer goes on without the client and is
//     billed whole: the reservation stands. A stream ends when Envoy resets
//     it: the prompt.
//   - cut off: the prompt as reported (its cache split) or counted, and the
//     output counted (delivered plus the event in flight); in STREAMED mode
//     the upstream runs to its end, so its final usage when it reports one.
//   - upstream error status: the provider's usage if it reported any, else
//     nothing.
//   - the provider's final usage: that.
//   - a stream without its provider's final count (aborted, ended by an
//     error event, or a running figure): the prompt as reported or counted,
//     and the larger of the output reported and counted.
//   - a stream without usage: the prompt and the output counted; a stream
//     forwarded unread past an unbounded event: the reservation, or what was
//     counted before the event when that is more.
//   - a non-streamed answer without usage (none reported, unread past the
//     body limit, or compressed): the reservation stands.
//
// A model that bills reasoning the answer does not show
// (tokenizer.Count.HiddenReasoning) is charged at least its reservation
// wherever the provider has not reported its output. Reported usage is
// bounded by what the model can do (see Config.UsageMargin).
func (p *processor) settlement() charge {
	in, live := p.req.count.InputTokens, int(p.st.output.Load())
	s := &p.st.seen
	var c charge
	switch {
	case !s.forwarded && s.status == 0:
		return charge{outcome: "not_forwarded"}
	case s.cut:
		if s.usageFinal && !p.duplex() {
			return p.usageCharge(s.usage, "cut_off")
		}
		c = p.usageCharge(p.soFar(), "cut_off")
	case s.status == 0:
		c = charge{actual: in, outcome: "no_response", usage: usageOf(in, 0)}
		if !p.streamed() {
			return p.standing(c)
		}
	case s.status >= 400:
		if s.usageOK {
			return p.usageCharge(s.usage, "upstream_error")
		}
		return charge{outcome: "upstream_error"}
	default:
		outcome := "complete"
		if !s.eos {
			outcome = "aborted"
		}
		switch {
		case s.unread:
			// Nothing after the unbounded event was read: the reservation
			// stands, or what was counted before it when that is more.
			return p.standing(charge{actual: in + live, outcome: outcome, usage: usageOf(in, live)})
		case s.usageFinal:
			return p.usageCharge(s.usage, outcome)
		case s.usageOK:
			c = p.usageCharge(p.soFar(), outcome)
		case s.sse:
			c = charge{actual: in + live, outcome: outcome, usage: usageOf(in, live)}
		default:
			return p.standing(charge{actual: in, outcome: outcome, usage: usageOf(in, 0)})
		}
	}
	if p.req.count.HiddenReasoning && !s.outputReported {
		return p.standing(c)
	}
	return c
}

// soFar is the usage of a stream that did not reach the provider's final
// count: the prompt as reported (Anthropic's message_start, Gemini's
// running usageMetadata: with its cache split), else as counted, and the
// larger of the output reported and counted. What was counted was
// generated; message_start's output_tokens is a placeholder, and Gemini's
// usage lags behind what it sent.
func (p *processor) soFar() provider.Usage {
	s := &p.st.seen
	u := usageOf(p.req.count.InputTokens, int(p.st.output.Load()))
	if !s.usageOK {
		return u
	}
	r := s.usage
	if r.InputTokens > 0 {
		u.InputTokens, u.CachedInputTokens, u.CacheCreationInputTokens = r.InputTokens, r.CachedInputTokens, r.CacheCreationInputTokens
		u.CacheCreationExtendedInputTokens, u.AudioInputTokens = r.CacheCreationExtendedInputTokens, r.AudioInputTokens
	}
	u.OutputTokens, u.ReasoningTokens, u.AudioOutputTokens = max(u.OutputTokens, r.OutputTokens), r.ReasoningTokens, r.AudioOutputTokens
	u.ServiceTier = r.ServiceTier
	return u
}

// standing is c with the reservation standing: it charges at least what
// was reserved, tokens and money.
func (p *processor) standing(c charge) charge {
	c.actual, c.standing = max(c.actual, p.reservedTokens()), true
	return c
}

// streamed reports whether the request asked for a streamed answer, which
// the provider stops generating when Envoy resets it: a non-streamed answer
// is finished, and billed, whatever the client does.
func (p *processor) streamed() bool {
	c := p.req.count
	return c.Stream || c.API == tokenizer.Gemini && strings.Contains(p.req.path, ":streamGenerateContent")
}

// usageCharge charges reported usage, bounded by what the model can do
// (usageBound): the provider knows best what it billed, but not more than
// the request could have cost, or one broken or hostile answer would drive
// the shared buckets to their floor.
func (p *processor) usageCharge(u provider.Usage, outcome string) charge {
	bound := p.usageBound()
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

// settle settles the reservation exactly once, under a context that is not
// the stream's, with a short timeout (S8).
func (p *processor) settle() {
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	p.settleAs("")
}

// abandon settles an open reservation from Shutdown, by the rule its own
// end would follow at this point (settlement), with outcome shutdown.
func (p *processor) abandon() {
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	p.settleAs("shutdown")
}

// settleAs settles the reservation, unless it is settled already, and
// records outcome instead of the charge's when it is not empty; st.mu is
// held.
func (p *processor) settleAs(outcome string) {
	if p.st.settled || p.st.res == nil {
		return
	}
	p.st.settled = true
	p.stopRenewal()
	c := p.settlement()
	if outcome != "" {
		c.outcome = outcome
	}
	p.st.actual, p.st.outcome, p.st.clamped, p.st.settledOutput = c.actual, c.outcome, c.clamped, c.output()
	if p.pol.Charges() {
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
	s := &p.st.seen
	if p.st.outcome != "complete" || s.status != 200 || p.req.count.Model == "" {
		return
	}
	out := int(p.st.output.Load())
	switch {
	case p.st.clamped:
		return // an answer beyond the plausible teaches nothing
	case s.usageFinal:
		out = s.usage.OutputTokens
	case !s.sse:
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

// finish runs once when the stream ends, on every path: it settles what is
// still open (an aborted request, or a non-streamed answer whose end Envoy
// did not show: readUnended) and records the request's outcome. It is the
// one place per request where outcomes are reported.
func (p *processor) finish() {
	p.releaseOut()
	p.releaseFramer()
	p.readUnended()
	p.settle()
	p.awaitSettlement()
	p.st.mu.Lock()
	actual, outcome, settled, inDebt, forgiven, clamped, quotas := p.st.actual, p.st.outcome, p.st.settled, p.st.inDebt, p.st.forgiven, p.st.clamped, p.st.quotas
	settledOutput := p.st.settledOutput
	p.st.mu.Unlock()
	s := &p.st.seen // this goroutine alone writes it
	level := slog.LevelInfo
	if p.req.decision == "admitted" && outcome == "complete" || p.req.decision == "unmetered" {
		level = slog.LevelDebug // the common case: keep Info for what an operator acts on
	}
	if p.s.cfg.Logger.Enabled(context.Background(), level) {
		// The status the client got: tokengate's own answer, or the
		// upstream's. The output: what was settled beyond the prompt, else
		// (nothing reserved) the live count.
		status, output := s.status, int(p.st.output.Load())
		if p.req.reply != 0 {
			status = p.req.reply
		}
		if settled {
			output = settledOutput
		}
		attrs := []any{
			"decision", p.req.decision,
			"api", string(p.req.count.API), "model", p.req.count.Model,
			"input_tokens", p.req.count.InputTokens, "allowance", p.req.allowance,
			"reserved", p.reservedTokens(), "output_tokens", output,
			"status", status, "cut_off", s.cut,
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
			CutOff: s.cut, Status: s.status, Usage: s.usageOK,
			AllowanceSource: string(p.req.count.AllowanceSource), FallbackEncoding: p.req.count.Fallback,
			Waited: p.req.waited, InDebt: inDebt, Forgiven: forgiven, UsageClamped: clamped, StreamUnread: s.unread,
			Quotas: quotas, Budget: p.req.budget,
			API: string(p.req.count.API), Embedding: p.req.count.Embedding,
			ResponseModel: p.responseModel(), ProviderUsage: s.providerUsage(), Streamed: s.sse,
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
