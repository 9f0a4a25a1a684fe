package extproc

import (
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/tokenizer"
)

// How a request body reaches the decision, per request body mode (§2.2, §3):
//
//   - BUFFERED: one message holds the whole body; its answer carries the
//     decision and, when the body is rewritten, the new body and its
//     content-length.
//   - STREAMED: each chunk is answered in turn and goes upstream as it is;
//     the answer to the last chunk (or to the trailers) waits for the
//     decision, so the upstream never sees the end of a refused request,
//     which Envoy resets. Chunks already forwarded cannot be taken back, so
//     the body is never rewritten.
//   - FULL_DUPLEX_STREAMED: nothing is answered, not even the headers, until
//     the body is complete, so the upstream is not contacted before the
//     decision; then the headers answer and the body (rewritten or not) in
//     streamed_response chunks of at most duplexChunk bytes.
//
// In every mode the body is gathered in one buffer bounded by MaxBodyBytes
// and counted when it is complete. A body that comes in several chunks
// (STREAMED, FULL_DUPLEX_STREAMED) is also read as it arrives, and its long
// strings counted then (tokenizer.Precount): the count at the end takes
// them as they are, and is the same as the count of the whole body.

// duplexChunk is the largest body chunk sent back in FULL_DUPLEX_STREAMED
// mode, as Envoy recommends (§2.2).
const duplexChunk = 64 << 10

func (p *processor) duplexRequest() bool {
	return p.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// keepChunk adds a chunk of the request body. A body that comes in one
// message is kept as it came. Otherwise the chunks are gathered in one
// buffer of the size the request's content-length announced, or, without
// one, a buffer that doubles as it fills, never beyond MaxBodyBytes: each
// byte is copied at most twice, and the buffer outgrows the body at most
// twofold. (A content-length is a claim: requestHeaders refuses one above
// MaxBodyBytes, and a body longer than its claim still grows the buffer.)
func (p *processor) keepChunk(chunk []byte, last bool) {
	p.req.size += len(chunk)
	switch {
	case len(chunk) == 0:
		return
	case p.req.body == nil && last:
		p.req.body = chunk // no copy
		return
	case cap(p.req.body)-len(p.req.body) < len(chunk):
		n := len(p.req.body) + len(chunk)
		size := max(n, min(2*cap(p.req.body), p.s.cfg.MaxBodyBytes))
		if p.req.body == nil && p.req.sizeHint >= n {
			size = p.req.sizeHint
		}
		grown := make([]byte, len(p.req.body), size)
		copy(grown, p.req.body)
		p.req.body = grown
	}
	p.req.body = append(p.req.body, chunk...)
}

// precounter is a tokenCounter that counts a body's long strings while
// the body arrives: *tokenizer.Counter's, through tokenizerCounter.
type precounter interface {
	NewPrecount(path string) *tokenizer.Precount
	CountPrecounted(req tokenizer.Request, pre *tokenizer.Precount) (tokenizer.Count, error)
}

// precount reads a chunk of a STREAMED or FULL_DUPLEX_STREAMED body as it
// arrives, counting the long strings in it, on this goroutine: the work is
// the body's count done earlier, bounded by the chunk, and Envoy does not
// send faster than the stream takes chunks. A body in one message is
// counted whole, at the decision.
func (p *processor) precount(chunk []byte, last bool) {
	if p.req.pre == nil {
		pc, ok := p.s.cfg.counter.(precounter)
		if !ok || last && p.req.size == len(chunk) {
			return
		}
		p.req.pre = pc.NewPrecount(p.req.path)
	}
	p.req.pre.Write(chunk)
}

// count counts the complete request body, with what was counted as it
// arrived. The Precount is let go: its memory goes with the decision.
func (p *processor) count() (tokenizer.Count, error) {
	req := tokenizer.Request{Path: p.req.path, Policy: p.policy, Body: p.req.body}
	pre := p.req.pre
	p.req.pre = nil
	if pc, ok := p.s.cfg.counter.(precounter); ok && pre != nil {
		return pc.CountPrecounted(req, pre)
	}
	return p.s.cfg.counter.Count(req)
}

// decideBody decides the request now that its body is complete. A body
// that ended empty (an HTTP/2 request's one empty DATA frame with
// END_STREAM, §2.4) is a request without body, as one whose headers
// ended it: nothing to count, it goes on unmetered.
func (p *processor) decideBody(send sendFunc) error {
	p.req.decided = true
	if p.req.size == 0 {
		p.req.decision = "unmetered"
		return p.forward(nil, nil, send)
	}
	return p.decide(p.reqMode != filterv3.ProcessingMode_STREAMED, send)
}

// requestTrailers answers the request's trailers. Trailers end a STREAMED
// or FULL_DUPLEX_STREAMED body that has no end_of_stream message: the
// decision comes first, and in duplex mode the trailers answer follows the
// last body answer (§2.3).
func (p *processor) requestTrailers(send sendFunc) error {
	answer := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	if !p.req.decided && (p.reqMode == filterv3.ProcessingMode_STREAMED || p.duplexRequest()) {
		p.req.trailers = true
		if err := p.decideBody(send); err != nil || p.done {
			return err
		}
		if !p.duplexRequest() {
			if p.st.res != nil {
				answer.DynamicMetadata = p.metadata(false) // the decision's, as forward would send it
			}
			return p.letOn(func() error { return send(answer) })
		}
	}
	return send(answer)
}

// decideUnended decides, at the response headers, a STREAMED body that
// never ended: one that ends with trailers while request_trailer_mode is
// SKIP has no end_of_stream message (§2.3), so it reaches the upstream
// undecided. An upstream that accepted it (200) read all of it, and the
// response headers are still held: a refusal replaces the upstream's answer
// (§4), an admission meters the response as usual. An upstream that
// answered otherwise before the body ended is not metered.
func (p *processor) decideUnended(send sendFunc) error {
	if p.req.decided || p.reqMode != filterv3.ProcessingMode_STREAMED || p.req.size == 0 || p.st.seen.status != 200 {
		return nil
	}
	p.req.trailers = true // no body message awaits its answer
	return p.decideBody(send)
}

// requestHeadersAnswer is the answer to the request headers: the upstream
// answers in identity encoding (§9.9), which a cut-off can append to. In
// duplex mode the body that follows may be rewritten, so the
// content-length goes too (Envoy removes it anyway in that mode).
func (p *processor) requestHeadersAnswer(md *structpb.Struct) *extprocv3.ProcessingResponse {
	mut := &extprocv3.HeaderMutation{RemoveHeaders: []string{"accept-encoding"}}
	if p.duplexRequest() {
		mut.RemoveHeaders = append(mut.RemoveHeaders, "content-length")
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: mut},
		}},
		DynamicMetadata: md,
	}
}

// forward lets an admitted or unmetered request on, with body instead of
// the one received when the body was rewritten (non-nil): in BUFFERED and
// STREAMED mode by answering the body message (or, when trailers ended the
// body, by leaving the trailers answer to do so); in FULL_DUPLEX_STREAMED mode
// by the withheld headers answer followed by the body, in chunks of at most
// duplexChunk bytes, end_of_stream on the last unless trailers follow. The
// request body is not kept afterwards.
func (p *processor) forward(body []byte, md *structpb.Struct, send sendFunc) error {
	defer func() { p.req.body = nil }()
	switch {
	case !p.duplexRequest() && p.req.trailers:
		// Every body message is answered: the trailers answer lets the
		// request on, and carries md instead.
		p.sentCounts = metadataCounts{}
		return nil
	case !p.duplexRequest():
		return p.letOn(func() error { return send(requestBodyResponse(body, md)) })
	}
	if body == nil {
		body = p.req.body
	}
	return p.letOn(func() error { return p.sendDuplexBody(body, md, send) })
}

// letOn sends answer, which lets the request on to the upstream, and notes
// that it was forwarded (S8): from then on the provider has it, and bills
// it. The note comes first, so that a Shutdown settling meanwhile charges
// what the provider is about to get, and is taken back when the answer
// cannot be sent: Envoy never got it. A reservation Shutdown has settled
// already (while the request waited for its tokens) backs nothing: the
// request is not let on.
func (p *processor) letOn(answer func() error) error {
	p.st.mu.Lock()
	abandoned := p.st.settled
	p.st.seen.forwarded = !abandoned
	p.st.mu.Unlock()
	if abandoned {
		return status.Error(codes.Unavailable, "tokengate is shutting down")
	}
	err := answer()
	if err != nil {
		p.seeing(func(s *progress) { s.forwarded = false })
	}
	return err
}

// sendDuplexBody sends, in FULL_DUPLEX_STREAMED mode, the withheld headers
// answer and the body after it.
func (p *processor) sendDuplexBody(body []byte, md *structpb.Struct, send sendFunc) error {
	if err := send(p.requestHeadersAnswer(md)); err != nil {
		return err
	}
	sr := &extprocv3.StreamedBodyResponse{}
	msg := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
		Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
			Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: sr},
		}},
	}}}
	for first := true; first || len(body) > 0; first = false {
		n := min(len(body), duplexChunk)
		sr.Body, sr.EndOfStream = body[:n], n == len(body) && !p.req.trailers
		body = body[n:]
		if n == 0 && !sr.EndOfStream {
			break // an empty body ended by trailers: nothing to send
		}
		if err := send(msg); err != nil {
			return err
		}
	}
	return nil
}
