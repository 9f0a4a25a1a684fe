package extproc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
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

// processor is the state of one HTTP request. It is owned by its stream's
// goroutine; only abandon (Shutdown) reaches it from elsewhere, through
// settleMu and the atomic counters.
type processor struct {
	s      *Server
	ctx    context.Context
	pol    *Policy
	policy string

	reqMode, respMode filterv3.ProcessingMode_BodySendMode
	send              sendFunc

	// request
	id        string
	path      string
	priority  bool
	ids       map[string]string
	reqBody   []byte
	decided   bool
	count     tokenizer.Count
	allowance int // output tokens reserved
	injected  bool
	hard      bool
	states    []buckets.BucketState
	decision  string // admitted, refused_tokens, refused_requests, never_admissible, bad_request, unauthorized, store_error
	waited    time.Duration
	inDebt    []string      // buckets settlement left below zero; written under settleMu
	renewAt   time.Time     // when the concurrency slots are renewed next
	renewIn   time.Duration // half the shortest slot lease; 0 without slots

	// response
	status     int
	sse        bool
	encoded    bool
	respBody   []byte
	framer     provider.Framer
	stream     *provider.Stream
	live       liveCounter
	out        []byte
	outBuf     *[]byte // the pooled buffer out came from
	delivered  int     // output tokens forwarded to the client
	extended   int
	answers    int
	eosSeen    bool
	cut        bool
	done       bool
	usage      provider.Usage
	usageOK    bool
	streamResp *extprocv3.ProcessingResponse
	streamBody *extprocv3.StreamedBodyResponse

	// settlement, shared with abandon
	settleMu sync.Mutex
	res      *buckets.Reservation
	settled  bool
	actual   int
	outcome  string
	input    atomic.Int64
	output   atomic.Int64
}

func newProcessor(ctx context.Context, s *Server, policy string) *processor {
	p := &processor{s: s, ctx: ctx, policy: policy, pol: s.policies[policy]}
	return p
}

func (p *processor) handle(req *extprocv3.ProcessingRequest, send sendFunc) error {
	p.send = send
	if pc := req.GetProtocolConfig(); pc != nil {
		p.reqMode, p.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	if p.pol == nil {
		p.decision = "bad_request"
		p.logAt(slog.LevelWarn, "route names an unknown policy")
		return p.immediate(reply{status: 500, detail: errorDetail{
			Code: "unknown_policy", Message: "the gateway route names an unknown rate-limit policy", Type: "server_error",
		}, details: "tokengate_unknown_policy"}, send)
	}
	switch r := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return p.requestHeaders(req, r.RequestHeaders, send)
	case *extprocv3.ProcessingRequest_RequestBody:
		return p.requestBody(r.RequestBody, send)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}})
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
	p.path = hdr[":path"]
	p.id = hdr["x-request-id"]
	if p.id == "" {
		p.id = randomID()
	}
	if p.pol.PriorityHeader != "" {
		v := hdr[p.pol.PriorityHeader]
		p.priority = v == "true" || v == "1"
	}
	md := req.GetMetadataContext().GetFilterMetadata()
	p.ids = make(map[string]string, len(p.pol.Identities))
	for _, id := range p.pol.Identities {
		v, ok := lookupIdentity(id, hdr, md)
		if !ok {
			if p.pol.Anonymous == anonymousReject {
				p.decision = "unauthorized"
				return p.immediate(unauthorized(id.Name), send)
			}
			v = anonymousIdentity
		}
		p.ids[id.Name] = v
	}
	mut := &extprocv3.HeaderMutation{RemoveHeaders: []string{"accept-encoding"}}
	if h.GetEndOfStream() {
		p.decision = "unmetered" // no body, nothing to count
	}
	return send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: mut}},
	}})
}

func (p *processor) requestBody(b *extprocv3.HttpBody, send sendFunc) error {
	if p.decided {
		return send(requestBodyResponse(nil, nil))
	}
	if len(p.reqBody)+len(b.GetBody()) > p.s.cfg.MaxBodyBytes {
		p.decision = "bad_request"
		return p.immediate(tooLarge(p.s.cfg.MaxBodyBytes), send)
	}
	if p.reqBody == nil && b.GetEndOfStream() {
		p.reqBody = b.GetBody() // one message: no copy
	} else {
		p.reqBody = append(p.reqBody, b.GetBody()...)
	}
	streamed := p.reqMode == filterv3.ProcessingMode_STREAMED
	if streamed && !b.GetEndOfStream() {
		// Earlier chunks pass as they are; the decision waits for the last
		// chunk, which Envoy releases only after this answer.
		return send(requestBodyResponse(nil, nil))
	}
	p.decided = true
	return p.decide(!streamed, send)
}

// decide counts the request, reserves its chain and answers the request body
// (S3–S7, S12, S15, S16).
func (p *processor) decide(canRewrite bool, send sendFunc) error {
	c, err := p.s.cfg.counter.Count(tokenizer.Request{Path: p.path, Policy: p.policy, Body: p.reqBody})
	if err != nil {
		p.decision = "bad_request"
		p.logAt(slog.LevelInfo, "request refused: cannot count it", "err", err)
		code := "invalid_request"
		switch {
		case errors.Is(err, tokenizer.ErrMalformed):
			code = "malformed_json"
		case errors.Is(err, tokenizer.ErrUnknownAPI):
			code = "unknown_api"
		case errors.Is(err, tokenizer.ErrUnknownModel):
			code = "unknown_model"
		case errors.Is(err, tokenizer.ErrInvalidCap):
			code = "invalid_max_tokens"
		}
		return p.immediate(badRequest(code, err.Error()), send)
	}
	p.count = c
	p.allowance = c.OutputAllowance
	if m := p.pol.MaxOutputTokens; m > 0 && p.allowance > m {
		p.allowance = m
	}
	cost := c.InputTokens + p.allowance
	req := buckets.Request{ID: p.id + "-" + randomID()[:8], Cost: float64(cost), Priority: p.priority}
	for _, r := range p.pol.Buckets {
		req.Buckets = append(req.Buckets, buckets.Bucket{
			Name: r.Name, Key: p.key(r.Name, r.Per, r.Provider), Limit: r.Limit,
			Hard: r.Hard, MaxDebt: r.MaxDebt, Headroom: r.Headroom,
		})
		p.hard = p.hard || r.Hard
	}
	for _, r := range p.pol.Concurrency {
		req.Slots = append(req.Slots, buckets.Slot{Name: r.Name, Key: p.key(r.Name, r.Per, false), Max: r.Max, Lease: r.Lease})
	}
	// A request that may wait takes a place in the policy's queue before it
	// asks the store, so MaxQueue is exact however many decide at once; the
	// place is given back as soon as it is clear the request does not wait.
	queue := p.s.waiting[p.policy]
	holdsPlace := false
	if p.pol.MaxWait > 0 {
		switch {
		case p.pol.MaxQueue == 0:
			req.MaxWait = p.pol.MaxWait
		case queue.Add(1) <= int64(p.pol.MaxQueue):
			holdsPlace = true
			req.MaxWait = p.pol.MaxWait
		default:
			queue.Add(-1)
		}
	}
	leaveQueue := func() {
		if holdsPlace {
			holdsPlace = false
			queue.Add(-1)
		}
	}
	defer leaveQueue()
	d, err := p.s.cfg.Store.Reserve(p.ctx, req)
	if d.Wait == 0 || !d.OK {
		leaveQueue()
	}
	if err != nil {
		p.decision = "store_error"
		p.logAt(slog.LevelError, "bucket store unavailable", "err", err)
		return p.immediate(unavailable(), send)
	}
	p.states = d.Buckets
	p.input.Store(int64(c.InputTokens))
	if !d.OK {
		switch d.Reason {
		case buckets.NeverAdmissible:
			p.decision = "never_admissible"
		case buckets.ConcurrencyFull:
			p.decision = "refused_requests"
		default:
			p.decision = "refused_tokens"
		}
		return p.immediate(refusal(d, cost), send)
	}
	p.settleMu.Lock()
	p.res = d.Reservation
	p.settleMu.Unlock()
	p.decision = "admitted"
	p.scheduleRenewal()
	if d.Wait > 0 {
		p.waited = d.Wait
		// Envoy's per-message timer (200 ms by default) would answer 504
		// while the request waits: extend it, in a message of its own. It
		// takes effect only up to Envoy's max_message_timeout.
		ext := &extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(d.Wait + time.Second)}
		if err := send(ext); err != nil {
			return err
		}
		t := time.NewTimer(d.Wait)
		select {
		case <-t.C:
		case <-p.ctx.Done():
			t.Stop()
			return nil // the client left while waiting; finish refunds the reservation
		}
	}
	var body []byte
	inject := p.pol.InjectUsage && c.Stream && !c.IncludeUsage &&
		(c.API == tokenizer.ChatCompletions || c.API == tokenizer.Completions)
	clamp := 0
	if p.pol.ClampOutput && c.API != tokenizer.Embeddings {
		clamp = p.allowance
	}
	if canRewrite && (inject || clamp > 0) {
		nb, err := rewriteBody(c, p.reqBody, inject, clamp)
		if err != nil {
			p.logAt(slog.LevelWarn, "request forwarded unchanged", "err", err)
		} else {
			body, p.injected = nb, inject
		}
	}
	p.reqBody = nil
	return send(requestBodyResponse(body, p.metadata(false)))
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

// key builds the store key of a rule for this request (see keys.go). A
// provider rule stands for the organisation's account at the provider, which
// every policy shares, so its key names no policy.
func (p *processor) key(rule, per string, provider bool) string {
	scope := p.policy
	if provider {
		scope = sharedScope
	}
	switch per {
	case "":
		return bucketKey(scope, rule, globalIdentity)
	case perModel:
		m := p.count.Model
		if m == "" {
			m = "unknown"
		}
		return bucketKey(scope, rule, m)
	}
	v := p.ids[per]
	if v == "" { // request headers were not sent to the server
		v = anonymousIdentity
	}
	return bucketKey(scope, rule, v)
}

func (p *processor) immediate(r reply, send sendFunc) error {
	p.done = true
	return send(r.proto(p.metadata(false)))
}

// metadata is the dynamic metadata of the running counts (S24).
func (p *processor) metadata(final bool) *structpb.Struct {
	fields := map[string]*structpb.Value{
		"input_tokens":    structpb.NewNumberValue(float64(p.count.InputTokens)),
		"output_tokens":   structpb.NewNumberValue(float64(p.output.Load())),
		"reserved_tokens": structpb.NewNumberValue(float64(p.reservedTokens())),
		"decision":        structpb.NewStringValue(p.decision),
	}
	if final {
		a, _ := p.settlement()
		fields["settled_tokens"] = structpb.NewNumberValue(float64(a))
	}
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		p.s.cfg.Namespace: structpb.NewStructValue(&structpb.Struct{Fields: fields}),
	}}
}

func (p *processor) reservedTokens() int {
	if p.res == nil {
		return 0
	}
	return int(p.res.Cost) + p.extended
}

// logAt logs with the request's policy and id, building nothing when the
// level is off.
func (p *processor) logAt(level slog.Level, msg string, args ...any) {
	ctx := context.Background()
	if !p.s.cfg.Logger.Enabled(ctx, level) {
		return
	}
	p.s.cfg.Logger.Log(ctx, level, msg, append([]any{"policy", p.policy, "request_id", p.id}, args...)...)
}

func randomID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}
