package extproc

import (
	"context"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
)

func (p *processor) duplex() bool {
	return p.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// responseHeaders adds the limit headers (S17), passes provider back-pressure
// on (S18) and prepares the live count (S13).
func (p *processor) responseHeaders(h *extprocv3.HttpHeaders, send sendFunc) error {
	hdr := headerMap(h.GetHeaders())
	p.status, _ = strconv.Atoi(hdr[":status"])
	if p.status == 0 {
		p.status = 200
	}
	ce := strings.ToLower(hdr["content-encoding"])
	p.encoded = ce != "" && ce != "identity"
	p.sse = p.status == 200 && p.res != nil && !p.encoded &&
		strings.HasPrefix(strings.ToLower(hdr["content-type"]), "text/event-stream")
	if p.sse {
		p.stream = provider.NewStream(p.count.API, p.count.IncludeUsage, p.injected)
		p.framer = *framerPool.Get().(*provider.Framer) // emptied by Flush before it was pooled
		p.live = p.s.cfg.counter.NewLive(p.count.Encoding)
	}
	var set []*corev3.HeaderValueOption
	if st, ok := mostLimiting(p.states); ok {
		for _, kv := range limitHeaders(st) {
			set = append(set, headerOption(kv[0], kv[1]))
		}
	}
	if p.status == 429 && p.res != nil {
		if ra := p.providerPause(hdr[headerRetryAfter]); ra != "" {
			set = append(set, headerOption(headerRetryAfter, ra))
		}
	}
	resp := &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}},
		}},
	}
	if h.GetEndOfStream() {
		p.eosSeen = true
	}
	if p.res != nil {
		resp.DynamicMetadata = p.metadata(false)
	}
	if err := send(resp); err != nil {
		return err
	}
	if p.eosSeen {
		p.settle()
	}
	return nil
}

// providerPause pauses the provider buckets after an upstream 429 with
// Retry-After (S18) and returns the Retry-After to send: the longer of the
// provider's wait and a pause already known here.
func (p *processor) providerPause(retryAfterHeader string) string {
	secs, err := strconv.ParseFloat(strings.TrimSpace(retryAfterHeader), 64)
	if err != nil || secs <= 0 {
		if t, err := http.ParseTime(retryAfterHeader); err == nil {
			secs = t.Sub(p.s.cfg.Now()).Seconds()
		}
	}
	now := p.s.cfg.Now()
	var keys []string
	for _, b := range p.res.Buckets {
		for _, r := range p.pol.Buckets {
			if r.Name == b.Name && r.Provider {
				keys = append(keys, b.Key)
			}
		}
	}
	if len(keys) == 0 {
		return ""
	}
	until := p.s.pausedUntil(keys, now)
	if secs > 0 {
		mine := now.Add(time.Duration(secs * float64(time.Second)))
		if mine.After(until) {
			until = mine
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(p.ctx), p.s.cfg.SettleTimeout)
		defer cancel()
		for _, b := range p.res.Buckets {
			for _, k := range keys {
				if b.Key != k {
					continue
				}
				if mine.After(p.s.pausedUntil([]string{k}, now)) {
					p.s.pauses.Store(k, mine)
				}
				if err := p.s.cfg.Store.Pause(ctx, b, mine); err != nil {
					p.logAt(slog.LevelWarn, "cannot pause provider bucket", "bucket", b.Name, "err", err)
				}
			}
		}
	}
	if until.IsZero() {
		return ""
	}
	return retryAfter(until.Sub(now))
}

func (p *processor) responseBody(b *extprocv3.HttpBody, send sendFunc) error {
	chunk, eos := b.GetBody(), b.GetEndOfStream()
	p.answers++
	p.renewSlots()
	if !p.sse {
		if p.res != nil && !p.eosSeen && len(p.respBody)+len(chunk) <= p.s.cfg.MaxBodyBytes {
			p.respBody = append(p.respBody, chunk...)
		}
		if eos {
			p.eosSeen = true
			p.readUsage()
		}
		var err error
		if p.duplex() {
			err = p.sendStreamed(chunk, eos)
		} else {
			err = send(p.bodyAnswer(nil, false, eos))
		}
		if err == nil && eos {
			p.settle()
		}
		return err
	}
	if p.cut { // STREAMED mode after a cut-off: the client already has its end
		p.framer.Feed(chunk)
		for ev, ok := p.framer.Next(); ok; ev, ok = p.framer.Next() {
			p.observeAfterCut(ev)
		}
		if eos {
			if tail := p.framer.Flush(); len(tail) > 0 {
				p.observeAfterCut(tail)
			}
			p.eosSeen = true
		}
		err := send(p.bodyAnswer(nil, true, eos))
		if err == nil && eos {
			p.settle()
		}
		return err
	}
	p.growOut(len(chunk) + len(p.framer.Pending()))
	p.framer.Feed(chunk)
	for ev, ok := p.framer.Next(); ok; ev, ok = p.framer.Next() {
		if p.observe(ev) {
			return p.cutOff(send)
		}
	}
	if eos {
		if tail := p.framer.Flush(); len(tail) > 0 && p.observe(tail) {
			return p.cutOff(send)
		}
		p.eosSeen = true
	}
	var err error
	if p.duplex() {
		err = p.sendStreamed(p.out, eos)
	} else {
		err = send(p.bodyAnswer(p.out, true, eos))
	}
	if err == nil && eos {
		p.settle()
	}
	return err
}

// outPool recycles the buffers that forwarded events are gathered in, so a
// stream allocates none per chunk and few per request.
var outPool = sync.Pool{New: func() any { return new([]byte) }}

// framerPool recycles the buffers of the framers of streamed responses.
var framerPool = sync.Pool{New: func() any { return new(provider.Framer) }}

// releaseFramer returns the framer's buffer to the pool, unless it grew
// large; nothing may refer to what the framer returned afterwards.
func (p *processor) releaseFramer() {
	if !p.sse {
		return
	}
	f := p.framer
	p.framer = provider.Framer{}
	if f.Flush(); cap(f.Pending()) <= 1<<20 {
		framerPool.Put(&f)
	}
}

// growOut empties the forward buffer and makes room for n bytes.
func (p *processor) growOut(n int) {
	if p.outBuf == nil {
		p.outBuf = outPool.Get().(*[]byte)
		p.out = (*p.outBuf)[:0]
	}
	p.out = p.out[:0]
	if cap(p.out) < n {
		p.out = make([]byte, 0, n+n/4)
	}
}

// releaseOut returns the forward buffer to the pool; nothing may refer to
// it afterwards.
func (p *processor) releaseOut() {
	if p.outBuf == nil {
		return
	}
	if cap(p.out) <= 1<<20 {
		*p.outBuf = p.out[:0]
		outPool.Put(p.outBuf)
	}
	p.outBuf, p.out = nil, nil
}

// observe reads one complete event, counts its output and meters it against
// the hard budgets. It returns true when the event must not be delivered
// because a hard budget ran out (S14); the event is then counted (the
// upstream generated it) but not forwarded.
func (p *processor) observe(ev []byte) bool {
	e, err := p.stream.Observe(ev)
	if err != nil {
		p.logAt(slog.LevelDebug, "unreadable stream event forwarded as is", "err", err)
		p.out = append(p.out, ev...)
		return false
	}
	if e.Usage {
		p.usage, p.usageOK = p.stream.Usage()
	}
	if e.Text != "" {
		before := int(p.output.Load()) // the count after the previous event
		p.live.Write(e.Text)
		n := p.live.Tokens()
		p.output.Store(int64(n))
		if p.overBudget(n) {
			p.delivered = before
			p.stream.Withhold() // the client never gets this event
			return true
		}
	}
	p.out = append(p.out, e.Forward...)
	return false
}

func (p *processor) observeAfterCut(ev []byte) {
	e, err := p.stream.Observe(ev)
	if err != nil {
		return
	}
	if e.Usage {
		p.usage, p.usageOK = p.stream.Usage()
	}
}

// overBudget reports whether n output tokens exceed a hard budget: the
// policy's per-request cap (no store call) or a hard bucket, debited with
// Extend in batches only beyond what was reserved.
func (p *processor) overBudget(n int) bool {
	if m := p.pol.MaxOutputTokens; m > 0 && n > m {
		return true
	}
	if !p.hard || n <= p.allowance+p.extended {
		return false
	}
	need := n - p.allowance - p.extended
	batch := max(need, extendBatch)
	ok, err := p.s.cfg.Store.Extend(p.ctx, p.res, float64(batch))
	if err != nil {
		// The store is unreachable: a stream is not cut for the store's
		// sake; settlement charges what was counted.
		p.logAt(slog.LevelWarn, "cannot extend hard budget", "err", err)
		return false
	}
	if !ok && batch > need {
		// Retry with just what this event needs, so a nearly empty bucket
		// still delivers its last tokens.
		batch = need
		ok, err = p.s.cfg.Store.Extend(p.ctx, p.res, float64(batch))
		if err != nil {
			p.logAt(slog.LevelWarn, "cannot extend hard budget", "err", err)
			return false
		}
	}
	if !ok {
		return true
	}
	p.extended += batch
	return false
}

// cutOff ends the stream now (S14): the tail is dropped, the closing events
// are sent. In FULL_DUPLEX_STREAMED they go in one streamed_response with
// end_of_stream, which makes Envoy end the response and reset the upstream.
// In STREAMED they replace this chunk and later chunks are cleared (the
// upstream runs on; see README).
func (p *processor) cutOff(send sendFunc) error {
	p.cut = true
	delivered := provider.Usage{InputTokens: p.count.InputTokens, OutputTokens: p.delivered}
	p.out = append(p.out, p.stream.Close(delivered)...)
	p.logAt(slog.LevelInfo, "stream cut off at hard budget", "delivered_tokens", p.delivered, "counted_tokens", p.output.Load())
	if !p.duplex() {
		// The upstream runs on: keep reading what it sends for its usage,
		// which is what the provider bills.
		for ev, ok := p.framer.Next(); ok; ev, ok = p.framer.Next() {
			p.observeAfterCut(ev)
		}
		return send(p.bodyAnswer(p.out, true, false))
	}
	p.done = true
	err := p.sendStreamed(p.out, true)
	p.settle()
	return err
}

func (p *processor) responseTrailers(send sendFunc) error {
	if p.duplex() && !p.cut {
		p.growOut(len(p.framer.Pending()))
		if p.sse {
			if tail := p.framer.Flush(); len(tail) > 0 && p.observe(tail) {
				return p.cutOff(send)
			}
		}
		if len(p.out) > 0 {
			if err := p.sendStreamed(p.out, false); err != nil {
				return err
			}
		}
	}
	p.eosSeen = true
	if !p.sse {
		p.readUsage()
	}
	err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{},
	}, DynamicMetadata: p.finalMetadata()})
	p.settle()
	return err
}

// sendStreamed sends one FULL_DUPLEX_STREAMED answer, reusing one message.
func (p *processor) sendStreamed(body []byte, eos bool) error {
	if p.streamResp == nil {
		p.streamBody = &extprocv3.StreamedBodyResponse{}
		p.streamResp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: p.streamBody}},
			}},
		}}
	}
	p.streamBody.Body, p.streamBody.EndOfStream = body, eos
	p.streamResp.DynamicMetadata = nil
	if eos {
		p.streamResp.DynamicMetadata = p.finalMetadata()
	} else if p.res != nil && p.answers%metadataEvery == 0 {
		p.streamResp.DynamicMetadata = p.metadata(false)
	}
	return p.send(p.streamResp)
}

// bodyAnswer is a response body answer in STREAMED or BUFFERED mode (1:1):
// with replace, the chunk is replaced by body (cleared when empty).
func (p *processor) bodyAnswer(body []byte, replace, eos bool) *extprocv3.ProcessingResponse {
	cr := &extprocv3.CommonResponse{}
	if replace {
		if len(body) == 0 {
			cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}}
		} else {
			cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
		}
	}
	resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: cr},
	}}
	if eos {
		resp.DynamicMetadata = p.finalMetadata()
	} else if p.res != nil && p.answers%metadataEvery == 0 {
		resp.DynamicMetadata = p.metadata(false)
	}
	return resp
}

func (p *processor) finalMetadata() *structpb.Struct {
	if p.res == nil {
		return nil
	}
	return p.metadata(true)
}

func (p *processor) readUsage() {
	if p.res == nil || len(p.respBody) == 0 || p.encoded {
		return
	}
	u, ok, err := provider.ParseUsage(p.count.API, p.respBody)
	if err != nil {
		p.logAt(slog.LevelDebug, "response usage unreadable", "err", err)
		return
	}
	p.usage, p.usageOK = u, ok
	p.respBody = nil
}

// settlement is what the request costs, and why (S8):
//   - cut off: the prompt and every output token counted (what was
//     delivered plus the event in flight the upstream generated);
//   - no response seen (upstream connect failure, client gone before the
//     answer): nothing; the provider bills no request it never answered;
//   - upstream error status: the provider's usage if it reported any, else
//     nothing;
//   - provider usage reported: that, authoritative;
//   - streamed: the prompt and the live output count, ended or aborted;
//   - not streamed and no usage reported: the reservation stands.
func (p *processor) settlement() (int, string) {
	in := p.count.InputTokens
	switch {
	case p.cut:
		if p.usageOK && p.usage.Total() > 0 && !p.duplex() {
			return p.usage.Total(), "cut_off"
		}
		return in + int(p.output.Load()), "cut_off"
	case p.status == 0:
		return 0, "no_response"
	case p.status >= 400:
		if p.usageOK {
			return p.usage.Total(), "upstream_error"
		}
		return 0, "upstream_error"
	}
	outcome := "complete"
	if !p.eosSeen {
		outcome = "aborted"
	}
	switch {
	case p.usageOK:
		return p.usage.Total(), outcome
	case p.sse:
		return in + int(p.output.Load()), outcome
	}
	return p.reservedTokens(), outcome
}

// settle settles the reservation exactly once, under a context that is not
// the stream's, with a short timeout (S8).
func (p *processor) settle() {
	p.settleMu.Lock()
	defer p.settleMu.Unlock()
	if p.settled || p.res == nil {
		return
	}
	p.settled = true
	p.actual, p.outcome = p.settlement()
	p.settleStore(p.actual)
	if p.outcome == "complete" && p.status == 200 && p.count.Model != "" {
		out := int(p.output.Load())
		if p.usageOK {
			out = p.usage.OutputTokens
		}
		if p.usageOK || p.sse {
			p.s.cfg.counter.Observe(p.policy, p.count, out)
		}
	}
}

// settleStore calls the store; settleMu is held.
func (p *processor) settleStore(actual int) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(p.ctx), p.s.cfg.SettleTimeout)
	defer cancel()
	states, err := p.s.cfg.Store.Settle(ctx, p.res, float64(actual))
	if err != nil {
		p.logAt(slog.LevelError, "settlement failed", "reserved", p.reservedTokens(), "actual", actual, "err", err)
		return
	}
	for _, st := range states {
		if st.Remaining < 0 {
			p.inDebt = append(p.inDebt, st.Name)
		}
	}
}

// abandon settles an open reservation from Shutdown, as an aborted request.
func (p *processor) abandon() {
	p.settleMu.Lock()
	defer p.settleMu.Unlock()
	if p.settled || p.res == nil {
		return
	}
	p.settled = true
	p.actual = int(p.input.Load() + p.output.Load())
	p.outcome = "shutdown"
	p.settleStore(p.actual)
}

// finish runs once when the stream ends, on every path: it settles what is
// still open (an aborted request) and records the request's outcome. It is
// the one place per request where outcomes are reported.
func (p *processor) finish() {
	p.releaseOut()
	p.releaseFramer()
	p.settle()
	p.settleMu.Lock()
	actual, outcome, settled, inDebt := p.actual, p.outcome, p.settled, p.inDebt
	p.settleMu.Unlock()
	level := slog.LevelInfo
	if p.decision == "admitted" && outcome == "complete" || p.decision == "unmetered" {
		level = slog.LevelDebug // the common case: keep Info for what an operator acts on
	}
	if p.s.cfg.Logger.Enabled(context.Background(), level) {
		attrs := []any{
			"decision", p.decision,
			"api", string(p.count.API), "model", p.count.Model,
			"input_tokens", p.count.InputTokens, "allowance", p.allowance,
			"reserved", p.reservedTokens(), "output_tokens", p.output.Load(),
			"status", p.status, "cut_off", p.cut,
		}
		if settled {
			attrs = append(attrs, "settled", actual, "outcome", outcome)
		}
		if p.waited > 0 {
			attrs = append(attrs, "waited", p.waited)
		}
		p.logAt(level, "request finished", attrs...)
	}
	if p.s.cfg.OnFinish != nil {
		policy := p.policy
		if p.pol == nil {
			policy = unknownPolicy // a name from the route, not from the configuration
		}
		p.s.cfg.OnFinish(Outcome{
			Policy: policy, Decision: p.decision, Model: p.count.Model,
			InputTokens: p.count.InputTokens, Reserved: p.reservedTokens(),
			Output: int(p.output.Load()), Settled: actual, SettleOutcome: outcome,
			CutOff: p.cut, Status: p.status, Usage: p.usageOK,
			AllowanceSource: string(p.count.AllowanceSource), FallbackEncoding: p.count.Fallback,
			Waited: p.waited, InDebt: inDebt,
		})
	}
}

// scheduleRenewal plans the renewal of the request's concurrency slots: a
// response that runs longer than a slot's lease must keep its slot, or the
// limit would admit more requests than it allows (S11).
func (p *processor) scheduleRenewal() {
	for _, sl := range p.res.Slots {
		if half := sl.LeaseOrDefault() / 2; p.renewIn == 0 || half < p.renewIn {
			p.renewIn = half
		}
	}
	p.renewAt = p.s.cfg.Now().Add(p.renewIn)
}

// renewSlots renews the slots once half a lease has passed since admission
// or the last renewal; between renewals it costs a clock read per chunk.
func (p *processor) renewSlots() {
	if p.renewIn == 0 || p.res == nil {
		return
	}
	now := p.s.cfg.Now()
	if now.Before(p.renewAt) {
		return
	}
	p.renewAt = now.Add(p.renewIn)
	r, ok := p.s.cfg.Store.(buckets.Renewer)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(p.ctx), p.s.cfg.SettleTimeout)
	defer cancel()
	if err := r.Renew(ctx, p.res); err != nil {
		p.logAt(slog.LevelWarn, "concurrency slots not renewed; they expire with their lease", "err", err)
	}
}
