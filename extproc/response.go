package extproc

import (
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

	"github.com/tokengate/tokengate/extproc/provider"
)

func (p *processor) duplex() bool {
	return p.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// responseHeaders adds the limit headers (S17), passes provider back-pressure
// on (S18) and prepares the live count (S13).
func (p *processor) responseHeaders(h *extprocv3.HttpHeaders, send sendFunc) error {
	hdr := headerMap(h.GetHeaders())
	status, _ := strconv.Atoi(hdr[":status"])
	if status == 0 {
		status = 200
	}
	p.seeing(func(s *progress) { s.status = status })
	if err := p.decideUnended(send); err != nil || p.done {
		return err
	}
	ce := strings.ToLower(hdr["content-encoding"])
	p.resp.encoded = ce != "" && ce != "identity"
	// A stream of events: server-sent events, or the JSON array Gemini's
	// streamGenerateContent sends without alt=sse.
	fr := provider.FramingOf(p.req.count.API, p.req.path, hdr["content-type"])
	sse := status == 200 && p.st.res != nil && !p.resp.encoded && fr != provider.Unframed
	p.seeing(func(s *progress) { s.sse = sse })
	if sse {
		p.resp.stream = provider.NewFramedStream(p.req.count.API, fr, p.req.count.IncludeUsage, p.req.injected)
		p.resp.framer = *framerPool.Get().(*provider.Framer) // emptied by Flush before it was pooled
		p.resp.framer.Reset(fr)
		p.resp.live = p.s.cfg.counter.NewLive(p.req.count.Encoding)
	}
	var set []*corev3.HeaderValueOption
	if st, ok := mostLimiting(p.req.states); ok {
		for _, kv := range limitHeaders(st, p.req.count.API, p.s.cfg.Now()) {
			set = append(set, headerOption(kv[0], kv[1]))
		}
	}
	if st, ok := tightestQuota(p.req.quotas); ok {
		for _, kv := range budgetHeaders(st, p.currency()) {
			set = append(set, headerOption(kv[0], kv[1]))
		}
	}
	if status == 429 && p.st.res != nil {
		if wait := p.providerPause(hdr[headerRetryAfter]); wait > 0 {
			for _, kv := range retryHints(wait, sdkWaits(wait)) {
				set = append(set, headerOption(kv[0], kv[1]))
			}
		}
	}
	resp := &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}},
		}},
	}
	if h.GetEndOfStream() {
		// A response without body (§2.4): this is its last answer, which
		// carries what the settlement charges.
		p.ended()
		resp.DynamicMetadata = p.finalMetadata()
	} else if p.st.res != nil {
		resp.DynamicMetadata = p.metadata(false)
	}
	if err := send(resp); err != nil {
		return err
	}
	if p.st.seen.eos {
		p.settle()
	}
	return nil
}

// providerPause pauses the provider buckets after an upstream 429 with
// Retry-After (S18) and returns the wait to pass on: the longer of the
// provider's wait and a pause already known here; 0 for none.
func (p *processor) providerPause(retryAfterHeader string) time.Duration {
	secs, err := strconv.ParseFloat(strings.TrimSpace(retryAfterHeader), 64)
	if err != nil || secs <= 0 {
		if t, err := http.ParseTime(retryAfterHeader); err == nil {
			secs = t.Sub(p.s.cfg.Now()).Seconds()
		}
	}
	now := p.s.cfg.Now()
	var keys []string
	for _, b := range p.st.res.Buckets {
		for _, r := range p.pol.Buckets {
			if r.Name == b.Name && r.Provider {
				keys = append(keys, b.Key)
			}
		}
	}
	if len(keys) == 0 {
		return 0
	}
	until := p.s.pausedUntil(keys, now)
	if secs > 0 {
		mine := now.Add(time.Duration(secs * float64(time.Second)))
		if mine.After(until) {
			until = mine
		}
		ctx, cancel := p.storeCtx(p.s.cfg.SettleTimeout)
		defer cancel()
		for _, b := range p.st.res.Buckets {
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
		return 0
	}
	return max(until.Sub(now), time.Millisecond)
}

func (p *processor) responseBody(b *extprocv3.HttpBody, send sendFunc) error {
	chunk, eos := b.GetBody(), b.GetEndOfStream()
	p.resp.answers++
	switch seen := &p.st.seen; {
	case !seen.sse:
		p.keepBody(chunk)
		if eos {
			p.readUsage()
			p.ended()
		}
		return p.passOn(chunk, eos)
	case seen.unread:
		if eos {
			p.ended()
		}
		return p.passOn(chunk, eos)
	case seen.cut: // STREAMED mode after a cut-off: the client already has its end
		p.resp.framer.Feed(chunk)
		p.readAfterCut(eos)
		err := send(p.bodyAnswer(nil, true, eos))
		if err == nil && eos {
			p.settle()
		}
		return err
	}
	p.growOut(len(chunk) + len(p.resp.framer.Pending()))
	p.resp.framer.Feed(chunk)
	if p.observeChunk(eos) {
		return p.cutOff(eos, send)
	}
	if eos {
		p.ended()
	} else if len(p.resp.framer.Pending()) > p.s.cfg.MaxEventBytes {
		// One event without end past the bound: holding more would let an
		// upstream grow this buffer without limit. What is held goes on
		// now, the rest of the stream as it comes, unread.
		p.seeing(func(s *progress) { s.unread = true })
		p.resp.out = append(p.resp.out, p.resp.framer.Flush()...)
		p.logAt(slog.LevelWarn, "server-sent event beyond the bound: stream forwarded unread, settled at its reservation",
			"limit", p.s.cfg.MaxEventBytes)
	}
	var err error
	if p.duplex() {
		err = p.sendStreamed(p.resp.out, eos)
	} else {
		err = send(p.bodyAnswer(p.resp.out, true, eos))
	}
	if err == nil && eos {
		p.settle()
	}
	return err
}

// keepBody keeps a chunk of a non-streamed body to read its usage at the
// end, up to MaxBodyBytes. Once a chunk would pass the bound nothing more is
// kept, not even later chunks that would fit: usage read from a body with a
// hole in it could be anything.
func (p *processor) keepBody(chunk []byte) {
	if p.st.res == nil || p.st.seen.eos || p.resp.bodyDropped {
		return
	}
	if len(p.resp.body)+len(chunk) > p.s.cfg.MaxBodyBytes {
		p.resp.body, p.resp.bodyDropped = nil, true
		return
	}
	p.resp.body = append(p.resp.body, chunk...)
}

// passOn forwards a chunk unchanged.
func (p *processor) passOn(chunk []byte, eos bool) error {
	var err error
	if p.duplex() {
		err = p.sendStreamed(chunk, eos)
	} else {
		err = p.send(p.bodyAnswer(nil, false, eos))
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
	if !p.st.seen.sse {
		return
	}
	f := p.resp.framer
	p.resp.framer = provider.Framer{}
	if f.Flush(); cap(f.Pending()) <= 1<<20 {
		framerPool.Put(&f)
	}
}

// growOut empties the forward buffer and makes room for n bytes.
func (p *processor) growOut(n int) {
	if p.resp.outBuf == nil {
		p.resp.outBuf = outPool.Get().(*[]byte)
		p.resp.out = (*p.resp.outBuf)[:0]
	}
	p.resp.out = p.resp.out[:0]
	if cap(p.resp.out) < n {
		p.resp.out = make([]byte, 0, n+n/4)
	}
}

// releaseOut returns the forward buffer to the pool; nothing may refer to
// it afterwards.
func (p *processor) releaseOut() {
	if p.resp.outBuf == nil {
		return
	}
	if cap(p.resp.out) <= 1<<20 {
		*p.resp.outBuf = p.resp.out[:0]
		outPool.Put(p.resp.outBuf)
	}
	p.resp.outBuf, p.resp.out = nil, nil
}

// observeChunk observes the events of a chunk, and at the end of the
// stream what is left unframed, until one is over the budget: true when
// the stream must be cut there. The events share the live counter's scratch
// space, given back before anything is sent.
func (p *processor) observeChunk(eos bool) bool {
	p.resp.live.Hold()
	defer p.resp.live.Release()
	for ev, ok := p.resp.framer.Next(); ok; ev, ok = p.resp.framer.Next() {
		if p.observe(ev) {
			return true
		}
	}
	if eos {
		if tail := p.resp.framer.Flush(); len(tail) > 0 && p.observe(tail) {
			return true
		}
	}
	return false
}

// observe reads one complete event, counts its output and meters it against
// the hard budgets. It returns true when the event must not be delivered
// because a hard budget ran out (S14); the event is then counted (the
// upstream generated it) but not forwarded.
func (p *processor) observe(ev []byte) bool {
	e, err := p.resp.stream.Observe(ev)
	if err != nil {
		p.logAt(slog.LevelDebug, "unreadable stream event forwarded as is", "err", err)
		p.resp.out = append(p.resp.out, ev...)
		return false
	}
	if e.Usage {
		p.seeUsage()
	}
	if e.Text != "" {
		if p.resp.firstOutput.IsZero() {
			p.resp.firstOutput = p.s.cfg.Now()
		}
		before := int(p.st.output.Load()) // the count after the previous event
		p.resp.live.Write(e.Text)
		n := p.resp.live.Tokens()
		p.st.output.Store(int64(n))
		if p.overBudget(n) {
			p.resp.delivered = before
			p.resp.stream.Withhold() // the client never gets this event
			return true
		}
	}
	p.resp.out = append(p.resp.out, e.Forward...)
	return false
}

// readAfterCut reads, in STREAMED mode after a cut-off, the events the
// upstream still sends (it runs on to its end) for the usage they report,
// which is what the provider bills; at the end of the stream its tail too.
func (p *processor) readAfterCut(eos bool) {
	for ev, ok := p.resp.framer.Next(); ok; ev, ok = p.resp.framer.Next() {
		p.observeAfterCut(ev)
	}
	if len(p.resp.framer.Pending()) > p.s.cfg.MaxEventBytes {
		p.resp.framer.Flush() // unbounded: its usage is lost
	}
	if eos {
		if tail := p.resp.framer.Flush(); len(tail) > 0 {
			p.observeAfterCut(tail)
		}
		p.ended()
	}
}

func (p *processor) observeAfterCut(ev []byte) {
	e, err := p.resp.stream.Observe(ev)
	if err != nil {
		return
	}
	if e.Usage {
		p.seeUsage()
	}
}

// seeUsage notes the usage the stream reported so far.
func (p *processor) seeUsage() {
	st := p.resp.stream
	u, ok := st.Usage()
	final, outputs := st.UsageFinal(), st.OutputReported()
	p.seeing(func(s *progress) { s.usage, s.usageOK, s.usageFinal, s.outputReported = u, ok, final, outputs })
}

// ended notes that the response ended.
func (p *processor) ended() { p.seeing(func(s *progress) { s.eos = true }) }

// overBudget reports whether n output tokens exceed a hard budget: the
// policy's per-request cap (no store call) or a hard bucket, debited with
// Extend in batches only beyond what was reserved (S14).
//
// Extensions and settlement exclude each other: once the reservation is
// settled (Shutdown settles open streams) nothing backs more output, and an
// extension then would debit tokens that no settlement gives back, so the
// stream is cut instead. A store error cuts too: failing closed, a hard
// budget the store cannot confirm is spent (S21); failing open, the
// failover store answers for the store itself.
func (p *processor) overBudget(n int) bool {
	if m := p.pol.MaxOutputTokens; m > 0 && n > m {
		return true
	}
	if !p.req.hard || n <= p.req.allowance+p.st.extended {
		return false
	}
	p.st.mu.Lock()
	defer p.st.mu.Unlock()
	if p.st.settled {
		return true
	}
	// A store call can wait up to StoreTimeout: the live counter's scratch
	// space goes back meanwhile, or every stream waiting on a slow store
	// would keep one from the others.
	if p.resp.live.Release() {
		defer p.resp.live.Hold()
	}
	ctx, cancel := p.storeCtx(p.s.cfg.StoreTimeout)
	defer cancel()
	need := n - p.req.allowance - p.st.extended
	batch := max(need, extendBatch)
	ok, err := p.s.cfg.Store.Extend(ctx, p.st.res, float64(batch))
	if err == nil && !ok && batch > need {
		// Retry with just what this event needs, so a nearly empty bucket
		// still delivers its last tokens.
		batch = need
		ok, err = p.s.cfg.Store.Extend(ctx, p.st.res, float64(batch))
	}
	if err != nil {
		p.logAt(slog.LevelWarn, "cannot extend hard budget: stream cut off", "err", err)
		return true
	}
	if ok {
		p.st.extended += batch
	}
	return !ok
}

// deliveredUsage is the usage of what the client got, which the closing
// events of a cut-off report: the prompt as the provider reported it (with
// its cache split and, for Gemini, the reasoning so far), else as counted,
// and the output delivered.
func (p *processor) deliveredUsage() provider.Usage {
	u := usageOf(p.req.count.InputTokens, p.resp.delivered)
	if s := &p.st.seen; s.usageOK && s.usage.InputTokens > 0 {
		r := s.usage
		u.InputTokens, u.CachedInputTokens, u.CacheCreationInputTokens = r.InputTokens, r.CachedInputTokens, r.CacheCreationInputTokens
		u.OutputTokens += r.ReasoningTokens
		u.ReasoningTokens = r.ReasoningTokens
	}
	return u
}

// cut marks the stream cut off at a hard budget (S14): the event in
// flight is dropped and the closing events follow what is forwarded.
func (p *processor) cut() {
	p.seeing(func(s *progress) { s.cut = true })
	p.resp.out = append(p.resp.out, p.resp.stream.Close(p.deliveredUsage())...)
	p.logAt(slog.LevelInfo, "stream cut off at hard budget", "delivered_tokens", p.resp.delivered, "counted_tokens", p.st.output.Load())
}

// cutOff ends the stream now (S14), in the chunk that ends the upstream's
// stream when eos. In FULL_DUPLEX_STREAMED the closing events go in one
// streamed_response with end_of_stream, which makes Envoy end the response
// and reset the upstream. In STREAMED they replace this chunk and later
// chunks are cleared (the upstream runs on; see docs/envoy.md); in the
// last chunk, its answer is the request's last and carries the settlement.
func (p *processor) cutOff(eos bool, send sendFunc) error {
	p.cut()
	if !p.duplex() {
		p.readAfterCut(eos)
		err := send(p.bodyAnswer(p.resp.out, true, eos))
		if err == nil && eos {
			p.settle()
		}
		return err
	}
	p.done = true
	err := p.sendStreamed(p.resp.out, true)
	p.settle()
	return err
}

// responseTrailers answers the response's trailers, which end it (§2.3).
// In FULL_DUPLEX_STREAMED mode the tail held back goes first, read as the
// stream's last event: a cut-off there sends the closing events instead,
// without end_of_stream, since the trailers answer is what follows the
// last body answer (§5.2).
func (p *processor) responseTrailers(send sendFunc) error {
	if p.duplex() && !p.st.seen.cut {
		p.growOut(len(p.resp.framer.Pending()))
		if p.st.seen.sse {
			if tail := p.resp.framer.Flush(); len(tail) > 0 && p.observe(tail) {
				p.cut()
			}
		}
		if len(p.resp.out) > 0 {
			if err := p.sendStreamed(p.resp.out, false); err != nil {
				return err
			}
		}
	}
	if !p.st.seen.sse {
		p.readUsage()
	}
	p.ended()
	err := send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{},
	}, DynamicMetadata: p.finalMetadata()})
	p.settle()
	return err
}

// sendStreamed sends one FULL_DUPLEX_STREAMED answer, reusing one message.
func (p *processor) sendStreamed(body []byte, eos bool) error {
	if p.resp.streamResp == nil {
		p.resp.streamBody = &extprocv3.StreamedBodyResponse{}
		p.resp.streamResp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: p.resp.streamBody}},
			}},
		}}
	}
	p.resp.streamBody.Body, p.resp.streamBody.EndOfStream = body, eos
	p.resp.streamResp.DynamicMetadata = nil
	if eos {
		p.resp.streamResp.DynamicMetadata = p.finalMetadata()
	} else if p.st.res != nil && p.resp.answers%metadataEvery == 0 {
		p.resp.streamResp.DynamicMetadata = p.metadata(false)
	}
	return p.send(p.resp.streamResp)
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
	} else if p.st.res != nil && p.resp.answers%metadataEvery == 0 {
		resp.DynamicMetadata = p.metadata(false)
	}
	return resp
}

func (p *processor) finalMetadata() *structpb.Struct {
	if p.st.res == nil {
		return nil
	}
	return p.metadata(true)
}

// readUsage reads the usage of a non-streamed body kept whole (keepBody),
// and reports whether the body is one whole JSON answer.
func (p *processor) readUsage() bool {
	if p.st.res == nil || len(p.resp.body) == 0 || p.resp.encoded || p.resp.bodyDropped {
		return false
	}
	u, ok, err := provider.ParseUsage(p.req.count.API, p.resp.body)
	if err != nil {
		p.logAt(slog.LevelDebug, "response usage unreadable", "err", err)
		return false
	}
	p.seeing(func(s *progress) { s.usage, s.usageOK, s.usageFinal, s.outputReported = u, ok, ok, ok })
	p.resp.model = provider.ResponseModel(p.req.count.API, p.resp.body)
	p.resp.body = nil
	return true
}

// readUnended reads, when the side stream ends, a non-streamed answer that
// never showed its end. Trailers that Envoy does not send (trailer mode
// SKIP) end a body without an end_of_stream message (§2.3): a body that
// parses whole is the complete answer, and is settled as one, by the usage
// it reports. One that does not, cut short by the client's going, is not.
func (p *processor) readUnended() {
	if p.st.seen.sse || p.st.seen.eos || p.st.seen.status == 0 {
		return
	}
	if p.readUsage() {
		p.ended()
	}
}
