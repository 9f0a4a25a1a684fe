package extproc

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// extendBatch is how many tokens a hard bucket is debited at once beyond
// the reservation (S14): small enough that a stream overshoots little, large
// enough that a stream costs a store round trip only every few events.
const extendBatch = 32

// metadataEvery is how often (in response body answers) the running token
// counts are written to Envoy's dynamic metadata, besides the answers that
// begin and end a request (S24).
const metadataEvery = 16

type sendFunc func(*extprocv3.ProcessingResponse) error

// processor is the state of one HTTP request, split by phase: what the
// request phase decided (request), what the response phase follows
// (response), and the reservation's settlement (settlement), which alone is
// shared with other goroutines. The processor is owned by its stream's
// goroutine; only Shutdown (abandon) and the slot renewal timer reach the
// settlement from elsewhere, through its mutex and atomic counters.
type processor struct {
	s      *Server
	ctx    context.Context
	pol    *Policy
	policy string
	queue  *waitQueue // the policy's requests waiting for tokens (S12)

	reqMode, respMode filterv3.ProcessingMode_BodySendMode
	send              sendFunc
	// receiveAhead starts the stream's next receive while the processor
	// waits for tokens (see waitForTokens); nil without a stream loop.
	receiveAhead func() *received
	// done: nothing more is answered (after an immediate response or a
	// FULL_DUPLEX_STREAMED cut-off, Envoy may still send what was in flight).
	done bool

	req  request
	resp response
	st   settlement
	// sentCounts is what the last dynamic metadata sent said (see
	// metadata).
	sentCounts metadataCounts

	started time.Time // the request's headers arrived (Config.Now)
}

// request is what the request phase read and decided. Written by the
// request phase, read by the later ones.
type request struct {
	id        string // x-request-id, bounded, for logs
	path      string
	priority  bool
	ids       map[string]string // identity name → its part of store keys (admission/keys.go)
	tier      string            // the request's tier (Policy.Tier), "" for none
	body      []byte            // the request body gathered so far (keepChunk)
	size      int               // bytes of the body received
	sizeHint  int               // the body's content-length, 0 when unknown
	trailers  bool              // the body ended with trailers
	decided   bool
	pre       *tokenizer.Precount // the body's long strings, counted as they arrive (precount) until the decision
	count     tokenizer.Count
	allowance int // output tokens reserved
	injected  bool
	capAdded  bool // clamp_output wrote a cap into a body that had none
	hard      bool
	states    []buckets.BucketState
	quotas    []buckets.QuotaState
	price     pricing.Price // the model's, when the policy has a quota of money
	budget    string        // the quota that refused the request
	decision  string        // admitted, unmetered, refused_tokens, refused_requests, refused_budget, never_admissible, bad_request, unauthorized, store_error
	reply     int           // status of tokengate's own answer (400, 413, 429, …), 0 when none
	waited    time.Duration
}

// response is what the response phase follows: the upstream's body, the
// live count (S13) and the cut-off (S14). What settlement reads of it (the
// status, the end, the usage reported) is in settlement.seen.
type response struct {
	encoded     bool
	body        []byte // a non-streamed body, kept to read its usage
	bodyDropped bool   // the body passed MaxBodyBytes: its usage is not read
	framer      provider.Framer
	stream      *provider.Stream
	live        liveCounter
	out         []byte
	outBuf      *[]byte // the pooled buffer out came from
	delivered   int     // output tokens forwarded to the client
	answers     int
	model       string    // the model a non-streamed answer names
	firstOutput time.Time // the first output text of a stream arrived
	streamResp  *extprocv3.ProcessingResponse
	streamBody  *extprocv3.StreamedBodyResponse
}

// metadataCounts are the values of the dynamic metadata (S24); sent tells
// them from the zero value, before any was sent.
type metadataCounts struct {
	input, reserved, settled int
	output                   int64
	decision                 string
	final, sent              bool
}

// settlement is the reservation and what settling it charged (S8). mu
// guards every field but the atomic counters, which the stream goroutine
// writes as it counts, and states and settleErr, which the store's answer
// writes once before it closes written. The stream goroutine reads res,
// extended and seen, which only it writes (under mu), without it.
// Extensions, renewals and settlement exclude each other: none follows
// settlement, which Shutdown (abandon) may do from another goroutine.
type settlement struct {
	mu       sync.Mutex
	res      *buckets.Reservation
	extended int      // tokens debited by Extend beyond the reservation
	seen     progress // how far the request got, as settlement reads it
	settled  bool
	actual   int
	outcome  string
	// settledOutput is the output tokens settled: actual beyond the prompt.
	settledOutput int
	inDebt        []string      // buckets settlement left below zero
	forgiven      []string      // buckets whose floor forgave part of the usage
	quotas        []QuotaCharge // what settlement charged each quota
	clamped       bool          // reported usage beyond the plausible was bounded
	renewIn       time.Duration // a third of the shortest lifetime, see startRenewal
	renewal       stopper       // the next renewal, nil when none
	// written is closed when the store has answered the settlement, after
	// it set states and settleErr (see settleStore); nil before settlement.
	written   chan struct{}
	states    []buckets.BucketState
	settleErr error
	input     atomic.Int64
	output    atomic.Int64
}

func newProcessor(ctx context.Context, s *Server, set *policySet, policy string) *processor {
	return &processor{s: s, ctx: ctx, policy: policy, pol: set.byName[policy], queue: set.queues[policy]}
}

func (p *processor) handle(req *extprocv3.ProcessingRequest, send sendFunc) error {
	p.send = send
	if pc := req.GetProtocolConfig(); pc != nil {
		p.reqMode, p.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	if p.pol == nil {
		p.req.decision = "bad_request"
		p.req.path = headerMap(req.GetRequestHeaders().GetHeaders())[":path"] // the API whose shape answers
		p.logAt(slog.LevelWarn, "route names an unknown policy")
		return p.immediate(noSuchPolicy(), send)
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return p.requestHeaders(req, r.RequestHeaders, send)
	case *extprocv3.ProcessingRequest_RequestBody:
		return p.requestBody(r.RequestBody, send)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return p.requestTrailers(send)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return p.responseHeaders(r.ResponseHeaders, send)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return p.responseBody(r.ResponseBody, send)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return p.responseTrailers(send)
	}
	return nil
}

// headerMap reads a HeaderMap into a map, from raw_value, falling back to
// value for old Envoy.
func headerMap(hm *corev3.HeaderMap) map[string]string {
	m := make(map[string]string, len(hm.GetHeaders()))
	for _, h := range hm.GetHeaders() {
		v := string(h.GetRawValue())
		if v == "" {
			v = h.GetValue()
		}
		m[strings.ToLower(h.GetKey())] = v
	}
	return m
}

func (p *processor) requestHeaders(req *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders, send sendFunc) error {
	hdr := headerMap(h.GetHeaders())
	p.req.path = hdr[":path"]
	p.req.id = logID(hdr["x-request-id"])
	if p.pol.PriorityHeader != "" {
		v := hdr[p.pol.PriorityHeader]
		p.req.priority = v == "true" || v == "1"
	}
	md := req.GetMetadataContext().GetFilterMetadata()
	p.req.ids = make(map[string]string, len(p.pol.Identities))
	for _, id := range p.pol.Identities {
		v, ok, err := lookupIdentity(id, h.GetHeaders(), hdr, md)
		switch {
		case err != nil:
			p.req.decision = "bad_request"
			return p.immediate(duplicateIdentity(id.Name), send)
		case ok:
			p.req.ids[id.Name] = admission.IdentityPart(v)
		case p.pol.Anonymous == anonymousReject:
			p.req.decision = "unauthorized"
			return p.immediate(unauthorized(id.Name), send)
		default:
			p.req.ids[id.Name] = admission.AnonymousPart
		}
	}
	if err := p.readTier(h.GetHeaders(), hdr, md); err != nil {
		p.req.decision = "bad_request"
		return p.immediate(duplicateIdentity("tier"), send)
	}
	if n, err := strconv.ParseInt(hdr["content-length"], 10, 64); err == nil && n > int64(p.s.cfg.MaxBodyBytes) {
		// Refused before a byte of the body is read, in every mode.
		p.req.decision = "bad_request"
		return p.immediate(tooLarge(p.s.cfg.MaxBodyBytes), send)
	} else if err == nil && n > 0 {
		p.req.sizeHint = int(n)
	}
	if h.GetEndOfStream() {
		p.req.decision = "unmetered" // no body, nothing to count
	} else if p.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return nil // answered once the body is decided (forward)
	}
	return send(p.requestHeadersAnswer(nil))
}

func (p *processor) requestBody(b *extprocv3.HttpBody, send sendFunc) error {
	if p.req.decided {
		return send(requestBodyResponse(nil, nil))
	}
	chunk, eos := b.GetBody(), b.GetEndOfStream()
	if p.req.size+len(chunk) > p.s.cfg.MaxBodyBytes {
		p.req.decision = "bad_request"
		p.req.pre = nil
		return p.immediate(tooLarge(p.s.cfg.MaxBodyBytes), send)
	}
	streaming := p.reqMode == filterv3.ProcessingMode_STREAMED || p.duplexRequest()
	p.keepChunk(chunk, eos || !streaming) // a BUFFERED body is one message, trailers or not
	if streaming {
		p.precount(chunk, eos)
	}
	switch p.reqMode {
	case filterv3.ProcessingMode_STREAMED:
		if !eos {
			// Earlier chunks pass as they are; the decision waits for the
			// last chunk (or the trailers), which Envoy releases upstream
			// only after its answer (§3.2).
			return send(requestBodyResponse(nil, nil))
		}
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if !eos {
			// Nothing is answered, not even the headers, until the body
			// is complete: the upstream is not contacted before the
			// decision (§3.2).
			return nil
		}
	}
	// BUFFERED: one message holds the whole body (without end_of_stream
	// when trailers follow).
	return p.decideBody(send)
}

// decide counts the request, reserves its chain and answers the request body
// (S3–S7, S12, S15, S16).
func (p *processor) decide(canRewrite bool, send sendFunc) error {
	c, err := p.count()
	if err != nil {
		p.req.count.API = c.API // whose error shape answers (see api)
		flat, pass := p.uncounted(err)
		switch {
		case pass:
			p.req.decision = "unmetered"
			return p.forward(nil, nil, send)
		case flat == 0:
			return p.refuseUncountable(err, send)
		}
		c = tokenizer.Count{InputTokens: flat}
	}
	p.req.count = c
	p.req.allowance = p.pol.Allowance(c)
	if p.pol.Charges() {
		price, err := p.priceOf(c)
		if err != nil {
			return p.refuseUnpriced(send)
		}
		p.req.price = price
	}
	if p.ctx.Err() != nil {
		p.done = true
		return nil // the client left while its request was counted: nothing to reserve
	}
	cost := c.InputTokens + p.req.allowance
	d, leaveQueue, err := p.reserve(cost)
	defer leaveQueue()
	if err != nil {
		p.req.decision = "store_error"
		p.logAt(slog.LevelError, "bucket store unavailable", "err", err)
		return p.immediate(unavailable(), send)
	}
	p.req.states, p.req.quotas = d.Buckets, d.Quotas
	p.st.input.Store(int64(c.InputTokens))
	if !d.OK {
		switch d.Reason {
		case buckets.NeverAdmissible:
			p.req.decision = "never_admissible"
		case buckets.ConcurrencyFull:
			p.req.decision = "refused_requests"
		case buckets.OverQuota:
			p.req.decision = "refused_budget"
		default:
			p.req.decision = "refused_tokens"
		}
		if st, ok := limitingQuota(d); ok {
			p.req.budget = st.Name
			return p.immediate(budgetRefusal(d, st, p.quotaCost(st.Unit, cost), p.currency()), send)
		}
		return p.immediate(refusal(d, cost, p.pol.LeaseOf), send)
	}
	p.st.mu.Lock()
	p.st.res = d.Reservation
	p.startRenewal()
	p.st.mu.Unlock()
	p.req.decision = "admitted"
	if d.Wait > 0 {
		p.req.waited = d.Wait
		// Envoy's per-message timer (200 ms by default) would answer 504
		// while the request waits: extend it, in a message of its own. It
		// takes effect only up to Envoy's max_message_timeout.
		ext := &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(d.Wait + time.Second)}
		if err := send(ext); err != nil {
			return err
		}
		if !p.waitForTokens(d.Wait) {
			p.done = true
			return nil // the client left while waiting; finish refunds the reservation
		}
	}
	if p.ctx.Err() != nil {
		p.done = true
		return nil // the client left while its tokens were reserved; finish refunds them
	}
	return p.forward(p.rewrite(canRewrite), p.metadata(false), send)
}

// waitForTokens waits d, until the tokens reserved come due (S12), and
// reports whether the client is still there. Envoy cancels the stream when
// the client goes (ctx), or, with its graceful close (§2.5, §7.2),
// half-closes it and resets it only a second later: that shows only to a
// receive, and the stream's loop is not in one while it waits here. So the
// wait has the loop's next receive started (receiveAhead): its end of the
// stream, or error, ends the wait as the client's going; a message it gets
// is the loop's to handle after the wait.
func (p *processor) waitForTokens(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	var next *received
	var arrived <-chan struct{}
	if p.receiveAhead != nil {
		next = p.receiveAhead()
		arrived = next.done
	}
	for {
		select {
		case <-t.C:
			select {
			case <-arrived: // the stream may have ended as the wait did
				return next.err == nil
			default:
				return true
			}
		case <-p.ctx.Done():
			return false
		case <-arrived:
			if next.err != nil {
				return false
			}
			arrived = nil // a message: handled once the wait is over
		}
	}
}

// reserve asks the store for cost tokens from every bucket of the policy's
// chain and a slot from each concurrency limit (S3, S10, S11). A request
// that may wait takes a place in the policy's queue before it asks (S12);
// it keeps it, until it calls leaveQueue, only if it is to wait.
func (p *processor) reserve(cost int) (d buckets.Decision, leaveQueue func(), err error) {
	req := buckets.Request{ID: randomID(), Cost: float64(cost), Priority: p.req.priority, Lifetime: p.s.cfg.reservationLifetime()}
	req.Buckets, req.Quotas = p.limits()
	for _, b := range req.Buckets {
		p.req.hard = p.req.hard || b.Hard
	}
	for _, q := range req.Quotas {
		p.req.hard = p.req.hard || q.Hard
	}
	for _, r := range p.pol.Concurrency {
		req.Slots = append(req.Slots, p.slot(r))
	}
	if p.pol.Charges() {
		req.Money, req.MoneyPerToken = p.maxMoney()
	}
	queue := p.queue
	if p.pol.MaxWait > 0 && queue.enter() {
		req.MaxWait = p.pol.MaxWait
	}
	ctx, cancel := p.storeCtx(p.s.cfg.StoreTimeout)
	d, err = p.s.cfg.Store.Reserve(ctx, req)
	cancel()
	leaveQueue = func() {}
	if req.MaxWait > 0 {
		if err == nil && d.OK && d.Wait > 0 {
			leaveQueue = queue.leave
		} else {
			queue.leave()
		}
	}
	return d, leaveQueue, err
}

// rewrite returns the request body with include_usage asked for (S15) and
// the output cap clamped to the reservation, when the policy says so and
// the body can still be replaced; nil when it stays as it is.
func (p *processor) rewrite(canRewrite bool) []byte {
	c := p.req.count
	inject := p.pol.InjectUsage && c.Stream && !c.IncludeUsage &&
		(c.API == tokenizer.ChatCompletions || c.API == tokenizer.Completions)
	clamp := 0
	if p.pol.ClampOutput && !c.Embedding {
		clamp = p.req.allowance
	}
	if !canRewrite || !inject && clamp == 0 {
		return nil
	}
	body, err := rewriteBody(c, p.req.body, inject, clamp)
	if err != nil {
		p.logAt(slog.LevelWarn, "request body not rewritten: forwarded unchanged")
		p.logAt(slog.LevelDebug, "request body not rewritten", "err", err)
		return nil
	}
	p.req.injected = inject
	// A cap written into a request that carried none stops the model at
	// tokengate's own allowance: such an answer says nothing about how long
	// uncapped answers are (see learn).
	p.req.capAdded = clamp > 0 && len(c.CapFields) == 0
	return body
}

// uncounted decides what becomes of a request the tokenizer cannot count:
// pass it unmetered, or charge it flat (flat > 0); neither means refuse it.
// An endpoint that generates nothing (count_tokens, moderations, stored
// completions: tokenizer.Classify's Free) passes unmetered; one no API
// matches follows the policy's UnknownEndpoints (S22); everything else that
// cannot be counted is refused (S23).
func (p *processor) uncounted(err error) (flat int, pass bool) {
	if errors.Is(err, tokenizer.ErrFreeEndpoint) {
		return 0, true
	}
	if !errors.Is(err, tokenizer.ErrUnknownAPI) {
		return 0, false
	}
	switch p.pol.UnknownEndpoints {
	case unknownPass:
		return 0, true
	case unknownCharge:
		return p.pol.UnknownEndpointTokens, false
	}
	return 0, false
}

// refuseUncountable answers 400 for a body that cannot be counted. The
// tokenizer's message may quote the body: it reaches debug logs only, and
// the client only when it quotes nothing (see clientDetail).
func (p *processor) refuseUncountable(err error, send sendFunc) error {
	p.req.decision = "bad_request"
	code, msg := "invalid_request", "the request body cannot be counted"
	switch {
	case errors.Is(err, tokenizer.ErrMalformed):
		code, msg = "malformed_json", "malformed request body"
	case errors.Is(err, tokenizer.ErrUnknownAPI):
		code, msg = "unknown_api", "the path and body match no API that tokengate meters"
	case errors.Is(err, tokenizer.ErrUnknownModel):
		code, msg = "unknown_model", "the request names a model tokengate cannot count, and no fallback encoding is configured"
	case errors.Is(err, tokenizer.ErrInvalidCap):
		code, msg = "invalid_max_tokens", "an output token cap is not a number, or is larger than tokengate admits"
	}
	p.logAt(slog.LevelInfo, "request refused: cannot count it", "code", code)
	p.logAt(slog.LevelDebug, "request refused: cannot count it", "code", code, "err", err)
	return p.immediate(badRequest(code, clientDetail(err.Error(), msg)), send)
}

func requestBodyResponse(body []byte, md *structpb.Struct) *extprocv3.ProcessingResponse {
	cr := &extprocv3.CommonResponse{}
	if body != nil {
		cr.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			headerOption("content-length", strconv.Itoa(len(body))),
		}}
		cr.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
	}
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: cr}},
		DynamicMetadata: md,
	}
}

// key builds the store key of a rule for this request (see admission/keys.go). A
// provider rule stands for the organisation's account at the provider, which
// every policy shares, so its key names no policy.
func (p *processor) key(rule, per string, provider bool) string {
	c := p.chain()
	return c.Key(rule, per, provider)
}

// modelKey is the model that per-model buckets are keyed by.
func (p *processor) modelKey() string { return p.req.count.ModelKey }

func (p *processor) immediate(r reply, send sendFunc) error {
	p.done = true
	p.req.reply = r.status
	return send(r.proto(p.api(), p.s.cfg.Now(), p.metadata(false)))
}

// metadata is the dynamic metadata of the running counts (S24): the
// fields that changed since the stream's last answer with metadata, all
// of them in the first, or nil when none changed. Envoy merges the
// metadata of every answer into the namespace, later keys over earlier
// ones, so what it holds is always every count; a field sent again would
// change nothing there and cost decoding on both sides.
func (p *processor) metadata(final bool) *structpb.Struct {
	counts := metadataCounts{input: p.req.count.InputTokens, output: p.st.output.Load(), reserved: p.reservedTokens(),
		decision: p.req.decision, final: final, sent: true}
	if final {
		// The last answer: what the settlement charges, and the output
		// the provider reported when it is more than was counted live (a
		// non-streamed answer is counted only from its usage).
		c := p.settlement()
		counts.settled, counts.output = c.actual, max(counts.output, int64(c.usage.OutputTokens))
	}
	last := p.sentCounts
	if last == counts {
		return nil
	}
	p.sentCounts = counts
	fields := make(map[string]*structpb.Value, 5)
	if !last.sent || last.input != counts.input {
		fields["input_tokens"] = structpb.NewNumberValue(float64(counts.input))
	}
	if !last.sent || last.output != counts.output {
		fields["output_tokens"] = structpb.NewNumberValue(float64(counts.output))
	}
	if !last.sent || last.reserved != counts.reserved {
		fields["reserved_tokens"] = structpb.NewNumberValue(float64(counts.reserved))
	}
	if !last.sent || last.decision != counts.decision {
		fields["decision"] = structpb.NewStringValue(counts.decision)
	}
	if final && (!last.final || last.settled != counts.settled) {
		fields["settled_tokens"] = structpb.NewNumberValue(float64(counts.settled))
	}
	if len(fields) == 0 {
		return nil // only final changed, and settled was sent as it is
	}
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		p.s.cfg.Namespace: structpb.NewStructValue(&structpb.Struct{Fields: fields}),
	}}
}

func (p *processor) reservedTokens() int {
	if p.st.res == nil {
		return 0
	}
	return int(p.st.res.Cost) + p.st.extended
}

// storeCtx is the context of every store call that must finish whatever the
// client does: a reservation or extension the store may already have
// written is only known, and so settled, if its answer is read; and a
// client's cancellation must never look like a store failure (S21).
// Reserve and Extend are bounded by StoreTimeout, a safety net above the
// store's own timeouts (the failover store decides what a slow store
// means); settlement, renewals and pauses by SettleTimeout.
func (p *processor) storeCtx(timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(p.ctx), timeout)
}

// logAt logs with the request's policy and id, building nothing when the
// level is off.
func (p *processor) logAt(level slog.Level, msg string, args ...any) {
	ctx := context.Background()
	if !p.s.cfg.Logger.Enabled(ctx, level) {
		return
	}
	p.s.cfg.Logger.Log(ctx, level, msg, append([]any{"policy", p.policy, "request_id", p.req.id}, args...)...)
}
