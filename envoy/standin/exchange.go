package standin

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

const (
	modeNone     = filterv3.ProcessingMode_NONE
	modeBuffered = filterv3.ProcessingMode_BUFFERED
	modeStreamed = filterv3.ProcessingMode_STREAMED
	modeDuplex   = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	send         = filterv3.ProcessingMode_SEND
	skip         = filterv3.ProcessingMode_SKIP
)

type chunk struct {
	data     []byte
	eos      bool
	err      error
	trailers []header // the body ended with these trailers (eos is set too)
}

type upResult struct {
	resp *http.Response
	err  error
}

type srvEvent struct {
	msg *extprocv3.ProcessingResponse
	err error
}

// dir is the state of one direction (request or response) of the filter (docs §9.1).
type dir struct {
	resp        bool
	hdrMode     filterv3.ProcessingMode_HeaderSendMode
	bodyMode    filterv3.ProcessingMode_BodySendMode
	trailerMode filterv3.ProcessingMode_HeaderSendMode
	trailers    []header // set when the source ended the message with trailers
	trlSent     bool     // trailers message sent to the server
	trlDone     bool     // trailers answered (or not to be sent)
	hdrs        []header
	noBody      bool     // the headers carried end_of_stream
	expect      []string // answers Envoy waits for, in order: "headers", "body"
	hdrAnswered bool     // headers answer received (or headers not sent)
	released    bool     // headers passed on to the destination
	held        []byte   // data received and not yet sent anywhere
	heldEOS     bool     // the source ended the body (in duplex mode too, where nothing is held)
	queue       []chunk  // STREAMED chunks awaiting their answers
	chunksSent  int      // body messages sent to the server
	deadline    time.Time
	overridden  bool // override_message_timeout used in the current state
	ended       bool // the destination saw the end of the body
}

func (d *dir) name() string {
	if d.resp {
		return "response"
	}
	return "request"
}

// exchange drives one downstream request. All its state is owned by the handler goroutine.
type exchange struct {
	p     *Proxy
	w     http.ResponseWriter
	r     *http.Request
	route Route
	mode  *filterv3.ProcessingMode
	md    *extprocv3.ProcessingRequest // template carrying metadata_context

	req, res dir

	stream       *sender // nil until the side stream opens, and again once it is closed
	streamCancel context.CancelFunc
	sentAny      bool
	complete     bool // processing_complete: the server is no longer consulted
	srvCh        chan srvEvent
	recvDone     chan struct{}

	reqCh       chan chunk
	trailerKeys []string      // the request trailers the client announced
	reqRead     chan struct{} // closed when the goroutine reading the downstream body returned
	readMu      sync.Mutex    // guards reading and readStop
	reading     bool          // that goroutine is inside Body.Read
	readStop    bool          // that goroutine must not call Body.Read again
	reqPipe     *pipe

	upCancel   context.CancelFunc
	upCh       chan upResult
	upResp     *http.Response
	upBodyDone bool
	respCh     chan chunk

	quit       chan struct{}
	over       bool
	reset      bool
	clientSent bool // response headers written to the client
	dynamic    map[string]*structpb.Struct
	entry      Entry
}

// ServeHTTP handles one downstream request as Envoy's filter chain would.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	route, ok := p.route(r.URL.Path)
	x := &exchange{
		p: p, w: w, r: r, route: route,
		quit:    make(chan struct{}),
		dynamic: map[string]*structpb.Struct{},
		entry:   Entry{Method: r.Method, Path: r.URL.RequestURI(), Route: route.Prefix},
	}
	if !ok {
		x.localReply(http.StatusNotFound, nil, nil, "route_not_found")
		x.finish()
		return
	}
	x.mode = p.modeFor(route)
	if route.Disabled {
		x.mode = &filterv3.ProcessingMode{RequestHeaderMode: skip, ResponseHeaderMode: skip, RequestTrailerMode: skip, ResponseTrailerMode: skip}
	}
	x.req = dir{hdrMode: headerMode(x.mode.RequestHeaderMode), bodyMode: x.mode.RequestBodyMode,
		trailerMode: x.mode.RequestTrailerMode}
	x.res = dir{resp: true, hdrMode: headerMode(x.mode.ResponseHeaderMode), bodyMode: x.mode.ResponseBodyMode,
		trailerMode: x.mode.ResponseTrailerMode}
	if p.cfg.Metadata != nil {
		x.md = &extprocv3.ProcessingRequest{MetadataContext: p.cfg.Metadata(r)}
	}
	_ = http.NewResponseController(w).EnableFullDuplex()
	x.run()
	x.finish()
	if x.reset {
		panic(http.ErrAbortHandler)
	}
}

func headerMode(m filterv3.ProcessingMode_HeaderSendMode) filterv3.ProcessingMode_HeaderSendMode {
	if m == skip {
		return skip
	}
	return send
}

func (x *exchange) run() {
	d := &x.req
	d.hdrs = requestHeaders(x.r)
	x.entry.RequestID = get(d.hdrs, "x-request-id")
	d.noBody = x.r.Body == nil || x.r.Body == http.NoBody || x.r.ContentLength == 0
	if !d.noBody {
		// Read before the body is: net/http fills in the values as it reaches the end.
		for k := range x.r.Trailer {
			x.trailerKeys = append(x.trailerKeys, k)
		}
		x.reqCh = make(chan chunk)
		x.reqRead = make(chan struct{})
		go func() {
			defer close(x.reqRead)
			x.readBody(x.r.Body, x.reqCh, 32<<10)
		}()
	}
	if d.hdrMode == send {
		x.sendHeaders(d)
	} else {
		d.hdrAnswered = true
		x.afterHeaders(d)
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for !x.over {
		var timerC <-chan time.Time
		if dl := x.nextDeadline(); !dl.IsZero() {
			timer.Reset(time.Until(dl))
			timerC = timer.C
		}
		select {
		case ev := <-x.srvCh:
			x.onServer(ev)
		case c := <-x.reqCh:
			x.onReqChunk(c)
		case u := <-x.upCh:
			x.upCh = nil
			x.onUpstream(u)
		case c := <-x.respCh:
			x.onRespChunk(c)
		case <-timerC:
			x.onTimeout()
		case <-x.r.Context().Done():
			x.clientGone()
		}
		if timerC != nil && !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// clientGone ends the exchange after a downstream disconnect: Envoy closes the side stream
// and resets the upstream request (docs §7.2).
func (x *exchange) clientGone() {
	x.entry.ClientCancelled = true
	x.over = true
	x.closeStream()
}

func (x *exchange) nextDeadline() time.Time {
	if x.complete {
		return time.Time{}
	}
	a, b := x.req.deadline, x.res.deadline
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// finish releases everything the exchange holds and records the log entry.
func (x *exchange) finish() {
	close(x.quit)
	x.stopBodyRead()
	x.closeStream()
	if x.upResp != nil && !x.upBodyDone || x.upCh != nil {
		if x.entry.UpstreamRequested {
			x.entry.UpstreamCancelled = true
		}
	}
	if x.upCancel != nil {
		x.upCancel()
	}
	if x.upResp != nil {
		x.upResp.Body.Close()
	}
	if x.reqPipe != nil {
		x.reqPipe.end(errors.New("standin: downstream request ended"))
	}
	if len(x.dynamic) > 0 {
		x.entry.DynamicMetadata = x.dynamic
	}
	if x.reset {
		x.entry.Reset = true
	}
	x.p.record(x.entry)
}

// stopBodyRead returns once the goroutine reading the downstream request body has stopped:
// after the handler returns, net/http reads the connection itself, and a Read still running
// here would race it ("invalid concurrent Body.Read call"). A Read blocked on a client that
// is still sending is interrupted: on HTTP/1 by a read deadline in the past (the connection
// is not reused, as Envoy closes an HTTP/1 connection whose request was not fully read), on
// HTTP/2 by closing the body (the stream is reset when the handler returns).
func (x *exchange) stopBodyRead() {
	if x.reqRead == nil {
		return
	}
	x.readMu.Lock()
	x.readStop = true
	inRead := x.reading
	x.readMu.Unlock()
	if !inRead {
		// It returns before its next Read. Deadlines are left alone: once the body is
		// read to its end, net/http reads the connection in the background, and a
		// deadline would look like a client disconnect to it.
		<-x.reqRead
		return
	}
	if x.r.ProtoMajor == 1 {
		if err := http.NewResponseController(x.w).SetReadDeadline(time.Unix(1, 0)); err != nil {
			// A writer without deadlines: the Read cannot be interrupted, waiting could hang.
			x.p.log.Debug("cannot interrupt the request body read", "err", err)
			return
		}
	} else if err := x.r.Body.Close(); err != nil {
		x.p.log.Debug("closing the request body", "err", err)
	}
	<-x.reqRead
}

// readBody feeds the downstream request body to the loop in chunks; the last chunk carries
// eos (possibly empty).
func (x *exchange) readBody(body io.Reader, ch chan<- chunk, readSize int) {
	read := x.chunker(body, false, readSize)
	for {
		x.readMu.Lock()
		if x.readStop {
			x.readMu.Unlock()
			return
		}
		x.reading = true
		x.readMu.Unlock()
		data, err := read()
		x.readMu.Lock()
		x.reading = false
		x.readMu.Unlock()
		c := chunk{data: data}
		if err == io.EOF {
			c.eos = true
			c.trailers = requestTrailers(x.r.Trailer) // filled in at the body's end
		} else if err != nil {
			c.err = err
		}
		if len(data) > 0 || err != nil {
			select {
			case ch <- c:
			case <-x.quit:
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// chunker returns what reads body chunk by chunk: as the reads deliver it (at most readSize
// bytes at a time), or cut to the sizes Config.Cuts gives, waiting for each chunk to fill. Each
// chunk is a new slice; io.EOF may come with the last one.
func (x *exchange) chunker(body io.Reader, response bool, readSize int) func() ([]byte, error) {
	var cuts []int
	if x.p.cfg.Cuts != nil {
		cuts = x.p.cfg.Cuts(x.r, response)
	}
	if len(cuts) == 0 {
		buf := make([]byte, readSize)
		return func() ([]byte, error) {
			n, err := body.Read(buf)
			return bytes.Clone(buf[:n]), err
		}
	}
	i := 0
	return func() ([]byte, error) {
		size := max(cuts[min(i, len(cuts)-1)], 1)
		i++
		b := make([]byte, size)
		n, err := io.ReadFull(body, b)
		if err == io.ErrUnexpectedEOF {
			err = io.EOF
		}
		return b[:n], err
	}
}

// readUpstream feeds the upstream response body re-split to ChunkSize (or cut as
// Config.Cuts says), with HTTP/1 style final empty eos chunk or eos on the last data chunk.
func (x *exchange) readUpstream(body io.Reader, ch chan<- chunk) {
	size, lastEOS := x.p.cfg.ChunkSize, x.p.cfg.EOSOnLastChunk
	emit := func(c chunk) bool {
		select {
		case ch <- c:
			return true
		case <-x.quit:
			return false
		}
	}
	read := x.chunker(body, true, 32<<10)
	var pending []byte
	for {
		data, err := read()
		for len(data) > 0 {
			k := len(data)
			if size > 0 && k > size {
				k = size
			}
			if pending != nil && !emit(chunk{data: pending}) {
				return
			}
			pending = data[:k:k]
			data = data[k:]
			if !lastEOS {
				if !emit(chunk{data: pending}) {
					return
				}
				pending = nil
			}
		}
		switch {
		case err == io.EOF:
			if pending == nil {
				pending = []byte{}
			}
			emit(chunk{data: pending, eos: true, trailers: x.upTrailers()})
			return
		case err != nil:
			if pending != nil && !emit(chunk{data: pending}) {
				return
			}
			emit(chunk{err: err})
			return
		}
	}
}

// ---- side stream ----

func (x *exchange) openStream() bool {
	if x.stream != nil {
		return true
	}
	ctx, cancel := context.WithCancel(context.Background())
	var kv []string
	for k, v := range x.route.InitialMetadata {
		if strings.HasPrefix(v, "%REQ(") && strings.HasSuffix(v, ")%") {
			v = x.r.Header.Get(v[5 : len(v)-2])
		}
		kv = append(kv, strings.ToLower(k), v)
	}
	if len(kv) > 0 {
		ctx = metadata.AppendToOutgoingContext(ctx, kv...)
	}
	s, err := x.p.client.Process(ctx)
	x.entry.SideStream = true
	if err != nil {
		cancel()
		x.sideFailure(err)
		return false
	}
	x.stream, x.streamCancel = startSender(s, x.p.log), cancel
	x.srvCh = make(chan srvEvent)
	x.recvDone = make(chan struct{})
	go func(ch chan<- srvEvent, done chan<- struct{}) {
		defer close(done)
		delivering := true
		for {
			m, err := s.Recv()
			if delivering {
				select {
				case ch <- srvEvent{m, err}:
				case <-x.quit:
					delivering = false
				}
			}
			if err != nil {
				return
			}
		}
	}(x.srvCh, x.recvDone)
	return true
}

// closeStream half-closes the side stream and resets it (docs §2.5): at once, as Envoy does
// by default, or with GracefulClose once the server ended the call or RemoteCloseTimeout
// passed. It does not wait.
func (x *exchange) closeStream() {
	if x.stream == nil {
		return
	}
	x.stream.close()
	cancel, done, wait := x.streamCancel, x.recvDone, x.p.cfg.RemoteCloseTimeout
	if !x.p.cfg.GracefulClose {
		cancel()
	} else {
		go func() {
			t := time.NewTimer(wait)
			defer t.Stop()
			select {
			case <-done:
			case <-t.C:
			}
			cancel()
		}()
	}
	x.stream = nil
	x.srvCh = nil
}

func (x *exchange) send(kind string, m *extprocv3.ProcessingRequest) bool {
	if !x.openStream() {
		return false
	}
	if x.md != nil {
		m.MetadataContext = x.md.MetadataContext
	}
	if !x.sentAny {
		x.sentAny = true
		m.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  x.mode.RequestBodyMode,
			ResponseBodyMode: x.mode.ResponseBodyMode,
		}
	}
	x.entry.Sent = append(x.entry.Sent, kind)
	x.p.log.Debug("ext_proc send", "kind", kind, "path", x.entry.Path)
	x.stream.send(m)
	return true
}

func (x *exchange) arm(d *dir) {
	if d.bodyMode == modeDuplex {
		return
	}
	if d.deadline.IsZero() {
		d.deadline = time.Now().Add(x.p.cfg.MessageTimeout)
		d.overridden = false
	}
}

func (x *exchange) answered(d *dir) {
	d.expect = d.expect[1:]
	d.deadline = time.Time{}
	if len(d.expect) > 0 {
		x.arm(d)
	}
}

func (x *exchange) sendHeaders(d *dir) {
	h := &extprocv3.HttpHeaders{Headers: headerMap(d.hdrs), EndOfStream: d.noBody}
	m := &extprocv3.ProcessingRequest{}
	kind := "request_headers"
	if d.resp {
		kind = "response_headers"
		m.Request = &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: h}
	} else {
		m.Request = &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: h}
	}
	if x.send(kind, m) {
		d.expect = append(d.expect, "headers")
		x.arm(d)
	}
}

func (x *exchange) sendBody(d *dir, data []byte, eos bool) bool {
	b := &extprocv3.HttpBody{Body: data, EndOfStream: eos}
	m := &extprocv3.ProcessingRequest{}
	kind := "request_body"
	if d.resp {
		kind = "response_body"
		m.Request = &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: b}
	} else {
		m.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: b}
	}
	if !x.send(kind, m) {
		return false
	}
	d.chunksSent++
	if d.bodyMode != modeDuplex {
		d.expect = append(d.expect, "body")
		x.arm(d)
	}
	return true
}

// ---- failures and local replies ----

func (x *exchange) minor() int { return x.p.cfg.EnvoyMinor }

// sideFailure handles a failed side stream (docs §7.1).
func (x *exchange) sideFailure(err error) {
	st := status.Convert(err)
	details := fmt.Sprintf("ext_proc_error_gRPC_error_%d{%s}", st.Code(), st.Message())
	if x.failOpen() {
		x.p.log.Debug("ext_proc failure, continuing", "err", err)
		x.processingComplete()
		return
	}
	x.localError(x.p.cfg.StatusOnError, details)
}

// failOpen reports whether failure_mode_allow applies now: never for a duplex direction after
// its first body chunk (1.36+).
func (x *exchange) failOpen() bool {
	if !x.p.cfg.FailureModeAllow {
		return false
	}
	for _, d := range []*dir{&x.req, &x.res} {
		if d.bodyMode == modeDuplex && d.chunksSent > 0 {
			return false
		}
	}
	return true
}

func (x *exchange) onTimeout() {
	if x.failOpen() {
		x.processingComplete()
		return
	}
	x.localError(http.StatusGatewayTimeout, "ext_proc_error_per-message_timeout_exceeded")
}

func (x *exchange) spurious(what string) {
	x.p.log.Debug("spurious ext_proc answer", "answer", what, "path", x.entry.Path)
	if x.minor() < 35 || x.p.cfg.FailureModeAllow && !x.duplexStarted() {
		x.processingComplete()
		return
	}
	x.localError(x.p.cfg.StatusOnError, "ext_proc_error_spurious_message_"+what)
}

func (x *exchange) duplexStarted() bool {
	return x.req.bodyMode == modeDuplex && x.req.chunksSent > 0 || x.res.bodyMode == modeDuplex && x.res.chunksSent > 0
}

// localError is an Envoy-generated error: a local reply before response headers reached the
// client, a reset afterwards (docs §4).
func (x *exchange) localError(code int, details string) {
	x.localReply(code, nil, nil, details)
}

// localReply ends the exchange with a reply of Envoy's own, or a reset when the client
// already has response headers.
func (x *exchange) localReply(code int, hs []header, body []byte, details string) {
	if h := x.p.hook; h != nil {
		h("local_reply", false)
	}
	x.complete = true
	x.closeStream()
	x.over = true
	x.entry.Details = details
	if x.clientSent {
		x.reset = true
		return
	}
	h := x.w.Header()
	for k := range h {
		delete(h, k)
	}
	if len(body) > 0 {
		h.Set("content-type", "text/plain")
	}
	for _, hv := range hs {
		h.Del(hv.key)
	}
	copyTo(h, hs)
	h.Set("content-length", strconv.Itoa(len(body)))
	// A request whose body is still streaming upstream (STREAMED, or FULL_DUPLEX_STREAMED
	// after the headers answer) cannot be finished: Envoy resets the downstream stream after
	// the reply, and the upstream request with it (docs §4).
	if x.req.released && !x.req.ended && (x.req.bodyMode == modeStreamed || x.req.bodyMode == modeDuplex) {
		x.reset = true
		h.Set("connection", "close")
	}
	// Envoy does not keep an HTTP/1 connection whose request it has not read to the end
	// (doEndStream): the reply is followed by the connection's close.
	if x.r.ProtoMajor == 1 && x.reqCh != nil {
		h.Set("connection", "close")
	}
	x.w.WriteHeader(code)
	n, _ := x.w.Write(body)
	x.entry.BytesToClient += int64(n)
	x.entry.Status = code
	x.clientSent = true
	_ = http.NewResponseController(x.w).Flush()
}

// processingComplete stops consulting the server; held data continues unprocessed.
func (x *exchange) processingComplete() {
	if x.complete {
		return
	}
	x.complete = true
	x.closeStream()
	if h := x.p.hook; h != nil {
		h("processing_complete", false)
	}
	x.req.deadline, x.res.deadline = time.Time{}, time.Time{}
	x.passthrough(&x.req)
	x.passthrough(&x.res)
}

// passthrough continues d without the server: queued STREAMED chunks flow unmodified,
// duplex chunks already handed to the server are lost.
func (x *exchange) passthrough(d *dir) {
	if d.hdrs == nil || d.ended {
		return
	}
	if !d.released {
		x.release(d, nil, false)
	}
	if d.bodyMode != modeDuplex {
		for _, c := range d.queue {
			x.deliver(d, c.data)
			if c.eos {
				x.end(d)
			}
		}
	}
	d.queue = nil
	if !d.ended {
		x.deliver(d, d.held)
		d.held = nil
		if d.heldEOS || d.noBody {
			x.end(d)
		}
	}
}

// ---- destinations ----

// release passes d's headers on: upstream for the request, to the client for the response.
// whole means body is the complete body (buffered).
func (x *exchange) release(d *dir, body []byte, whole bool) {
	if d.released {
		return
	}
	d.released = true
	if d.resp {
		hs := d.hdrs
		if whole && get(hs, "content-length") == "" && !d.noBody && d.trailers == nil {
			hs = append(hs, header{"content-length", strconv.Itoa(len(body))})
		}
		h := x.w.Header()
		copyTo(h, hs)
		code, _ := strconv.Atoi(get(hs, ":status"))
		x.entry.Status = code
		if x.entry.Details == "" {
			x.entry.Details = "via_upstream"
		}
		x.w.WriteHeader(code)
		x.clientSent = true
		x.deliver(d, body)
		if whole || d.noBody {
			x.end(d)
		} else {
			_ = http.NewResponseController(x.w).Flush()
		}
		return
	}
	x.startUpstream(body, whole)
	if whole {
		x.end(d) // or, with trailers, once they are answered
	}
}

func (x *exchange) deliver(d *dir, b []byte) {
	if len(b) == 0 {
		return
	}
	if d.resp {
		n, _ := x.w.Write(b)
		x.entry.BytesToClient += int64(n)
		_ = http.NewResponseController(x.w).Flush()
		return
	}
	if x.reqPipe != nil {
		x.reqPipe.write(b)
	}
}

func (x *exchange) end(d *dir) {
	if d.ended {
		return
	}
	if d.trailers != nil && !d.trlDone && !x.complete && d.trailerMode == send {
		x.sendTrailers(d) // the end waits for the trailers answer
		return
	}
	d.ended = true
	if !d.resp {
		if x.reqPipe != nil {
			x.reqPipe.endWithTrailers(d.trailers)
		}
		return
	}
	for _, t := range d.trailers {
		x.w.Header().Add(http.TrailerPrefix+t.key, t.value)
	}
	x.over = true
}

func (x *exchange) sendTrailers(d *dir) {
	if d.trlSent {
		return
	}
	d.trlSent = true
	t := &extprocv3.HttpTrailers{Trailers: headerMap(d.trailers)}
	m := &extprocv3.ProcessingRequest{}
	kind := "request_trailers"
	if d.resp {
		kind = "response_trailers"
		m.Request = &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: t}
	} else {
		m.Request = &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: t}
	}
	if x.send(kind, m) {
		d.expect = append(d.expect, "trailers")
		x.arm(d)
	}
}

func (x *exchange) onTrailersAnswer(d *dir, tr *extprocv3.TrailersResponse) {
	if !d.trlSent || d.trlDone || d.bodyMode != modeDuplex && (len(d.expect) == 0 || d.expect[0] != "trailers") {
		x.spurious(d.name() + "_trailers")
		return
	}
	if i := slices.Index(d.expect, "trailers"); i >= 0 {
		d.expect = slices.Delete(d.expect, i, i+1)
		d.deadline = time.Time{}
		if len(d.expect) > 0 {
			x.arm(d)
		}
	}
	hs, err := mutate(d.trailers, tr.GetHeaderMutation(), false)
	if err != nil {
		x.localError(x.p.cfg.StatusOnError, "ext_proc_error_header_mutation")
		return
	}
	d.trailers, d.trlDone = hs, true
	x.end(d)
}

func (x *exchange) startUpstream(body []byte, whole bool) {
	d := &x.req
	u := *x.p.cfg.Upstream
	path := get(d.hdrs, ":path")
	rel, err := u.Parse(strings.TrimSuffix(u.Path, "/") + path)
	if err != nil {
		x.localError(http.StatusBadRequest, "invalid_path")
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	if x.route.Timeout > 0 {
		ctx, cancel = context.WithTimeout(context.Background(), x.route.Timeout)
	}
	x.upCancel = cancel
	var rd io.Reader
	cl := int64(-1)
	switch {
	case d.noBody:
		rd, cl = nil, 0
	case whole && d.trailers == nil:
		rd, cl = bytes.NewReader(body), int64(len(body))
	case whole:
		// Trailers follow the body, once answered: chunked, through the pipe.
		x.reqPipe = newPipe()
		x.reqPipe.write(body)
		rd = x.reqPipe
	default:
		x.reqPipe = newPipe()
		x.reqPipe.write(body)
		rd = x.reqPipe
		if v := get(d.hdrs, "content-length"); v != "" {
			cl, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	req, err := http.NewRequestWithContext(ctx, get(d.hdrs, ":method"), rel.String(), rd)
	if err != nil {
		cancel()
		x.localError(http.StatusBadRequest, "invalid_request")
		return
	}
	copyTo(req.Header, del(append([]header(nil), d.hdrs...), "content-length"))
	req.ContentLength = cl
	if len(x.trailerKeys) > 0 && x.reqPipe != nil {
		// The trailers the client announced; their values come at the body's end.
		req.Trailer = http.Header{}
		for _, k := range x.trailerKeys {
			req.Trailer[k] = nil
		}
		x.reqPipe.trailer = req.Trailer
	}
	if cl == 0 && !d.noBody {
		req.Body = http.NoBody
	}
	x.entry.UpstreamRequested = true
	x.upCh = make(chan upResult, 1)
	ch := x.upCh
	go func() {
		resp, err := x.p.rt.RoundTrip(req)
		select {
		case ch <- upResult{resp, err}:
		case <-x.quit:
			if resp != nil {
				resp.Body.Close()
			}
		}
	}()
}

// ---- events ----

func (x *exchange) onReqChunk(c chunk) {
	if c.err != nil {
		// The client went away mid-body.
		x.clientGone()
		return
	}
	if c.eos {
		x.reqCh = nil
		x.req.trailers = c.trailers
	}
	x.onData(&x.req, c.data, c.eos)
}

func (x *exchange) onUpstream(u upResult) {
	if u.err != nil {
		code, details := http.StatusServiceUnavailable, "upstream_reset_before_response_started{connection_failure}"
		if errors.Is(u.err, context.DeadlineExceeded) {
			code, details = http.StatusGatewayTimeout, "upstream_response_timeout"
		}
		x.localError(code, details)
		return
	}
	x.upResp = u.resp
	d := &x.res
	d.hdrs = responseHeaders(u.resp)
	d.noBody = bodyless(u.resp) || x.r.Method == http.MethodHead
	if d.noBody {
		x.upBodyDone = true
	} else {
		x.respCh = make(chan chunk)
		go x.readUpstream(u.resp.Body, x.respCh)
	}
	if d.hdrMode == send && !x.complete {
		x.sendHeaders(d)
		return
	}
	d.hdrAnswered = true
	x.afterHeaders(d)
}

// requestTrailers returns the trailers a client sent (announced ones it left empty are
// not sent), or nil.
func requestTrailers(t http.Header) []header {
	var hs []header
	for k, vs := range t {
		for _, v := range vs {
			hs = append(hs, header{strings.ToLower(k), v})
		}
	}
	return hs
}

// upTrailers returns the upstream response's trailers, read after the body's EOF.
func (x *exchange) upTrailers() []header {
	var hs []header
	for k, vs := range x.upResp.Trailer {
		for _, v := range vs {
			hs = append(hs, header{strings.ToLower(k), v})
		}
	}
	return hs
}

func bodyless(resp *http.Response) bool {
	return resp.ContentLength == 0 || resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusNotModified
}

func (x *exchange) onRespChunk(c chunk) {
	if c.err != nil {
		x.respCh = nil
		x.upBodyDone = true
		x.localError(http.StatusBadGateway, "upstream_reset_after_response_started")
		return
	}
	if c.eos {
		x.respCh = nil
		x.upBodyDone = true
		x.res.trailers = c.trailers
	}
	x.onData(&x.res, c.data, c.eos)
}

// onData handles body data from d's source (docs §2.2).
func (x *exchange) onData(d *dir, data []byte, eos bool) {
	if h := x.p.hook; h != nil {
		h(d.name()+"_data", eos)
	}
	if d.ended {
		return
	}
	if x.complete || d.bodyMode == modeNone {
		if d.released {
			x.deliver(d, data)
			if eos {
				x.end(d)
			}
			return
		}
		d.held = append(d.held, data...)
		d.heldEOS = eos
		return
	}
	// With trailers the server never sees end_of_stream on a body message (docs §2.3).
	srvEOS := eos && d.trailers == nil
	switch d.bodyMode {
	case modeBuffered:
		d.held = append(d.held, data...)
		d.heldEOS = eos
		if len(d.held) > x.p.cfg.RequestBufferLimit {
			if d.resp {
				x.localError(http.StatusInternalServerError, "response_payload_too_large")
			} else {
				x.localReply(http.StatusRequestEntityTooLarge, nil, []byte("Payload Too Large"), "request_payload_too_large")
			}
			return
		}
		if eos && d.hdrAnswered {
			x.sendBody(d, d.held, srvEOS)
		}
	case modeStreamed:
		if !d.hdrAnswered {
			d.held = append(d.held, data...)
			d.heldEOS = eos
			return
		}
		if eos && !srvEOS && len(data) == 0 {
			// Trailers end the body: no empty body message.
			if n := len(d.queue); n > 0 {
				d.queue[n-1].eos = true
			} else {
				x.end(d)
			}
			return
		}
		if x.sendBody(d, data, srvEOS) {
			d.queue = append(d.queue, chunk{data: data, eos: eos})
		}
	case modeDuplex:
		// Sent at once, even while the headers answer is pending; nothing moves on to the
		// destination but what the server sends back (docs §2.2).
		d.heldEOS = eos
		if len(data) > 0 || srvEOS {
			x.sendBody(d, data, srvEOS)
		}
		if eos && !srvEOS {
			x.sendTrailers(d)
		}
	}
}

// afterHeaders continues d once its headers answer arrived or headers were skipped.
func (x *exchange) afterHeaders(d *dir) {
	if x.complete {
		x.passthrough(d)
		return
	}
	switch d.bodyMode {
	case modeNone:
		x.release(d, d.held, false)
		d.held = nil
		if d.heldEOS || d.noBody {
			x.end(d)
		}
	case modeBuffered:
		if d.noBody {
			x.release(d, nil, true)
			return
		}
		if d.hdrMode == skip {
			d.hdrs = del(d.hdrs, "content-length")
			x.release(d, nil, false)
		}
		if d.heldEOS {
			x.sendBody(d, d.held, d.trailers == nil)
		}
	case modeStreamed, modeDuplex:
		d.hdrs = del(d.hdrs, "content-length")
		if d.noBody {
			x.release(d, nil, true)
			return
		}
		x.release(d, nil, false)
		if d.bodyMode == modeStreamed && (len(d.held) > 0 || d.heldEOS) {
			data, eos := d.held, d.heldEOS
			d.held = nil
			if eos && d.trailers != nil && len(data) == 0 {
				x.end(d)
				return
			}
			if x.sendBody(d, data, eos && d.trailers == nil) {
				d.queue = append(d.queue, chunk{data: data, eos: eos})
			}
		}
	}
}

// ---- answers ----

func (x *exchange) onServer(ev srvEvent) {
	if x.complete {
		return
	}
	if ev.err != nil {
		x.srvCh = nil
		if ev.err == io.EOF {
			// The server ended the call with OK: continue without it.
			x.processingComplete()
			return
		}
		x.sideFailure(ev.err)
		return
	}
	m := ev.msg
	if t := m.GetOverrideMessageTimeout(); t != nil {
		x.overrideTimeout(t.AsDuration())
		return
	}
	x.applyMetadata(m.GetDynamicMetadata())
	switch r := m.Response.(type) {
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		x.immediate(r.ImmediateResponse)
	case *extprocv3.ProcessingResponse_RequestHeaders:
		x.onHeadersAnswer(&x.req, r.RequestHeaders.GetResponse(), m.GetModeOverride())
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		x.onHeadersAnswer(&x.res, r.ResponseHeaders.GetResponse(), m.GetModeOverride())
	case *extprocv3.ProcessingResponse_RequestBody:
		x.onBodyAnswer(&x.req, r.RequestBody.GetResponse())
	case *extprocv3.ProcessingResponse_ResponseBody:
		x.onBodyAnswer(&x.res, r.ResponseBody.GetResponse())
	case *extprocv3.ProcessingResponse_RequestTrailers:
		x.onTrailersAnswer(&x.req, r.RequestTrailers)
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		x.onTrailersAnswer(&x.res, r.ResponseTrailers)
	default:
		x.spurious("unknown")
	}
	x.closeEarly()
}

// closeEarly closes the side stream as soon as no further message can be exchanged
// (Envoy 1.37, ext_proc_stream_close_optimization).
func (x *exchange) closeEarly() {
	if x.minor() < 37 || x.stream == nil || x.complete || !x.quiet(&x.req) || !x.quiet(&x.res) {
		return
	}
	x.p.log.Debug("ext_proc stream closed early", "path", x.entry.Path)
	x.closeStream()
}

// quiet reports that d will send no further message and awaits no answer.
func (x *exchange) quiet(d *dir) bool {
	if len(d.expect) > 0 {
		return false
	}
	if d.hdrs == nil {
		return d.hdrMode == skip && d.bodyMode == modeNone
	}
	if d.trailerMode == send && !d.noBody && !d.ended {
		return false // trailers may still come
	}
	return d.hdrAnswered && (d.bodyMode == modeNone || d.noBody || d.ended)
}

func (x *exchange) overrideTimeout(t time.Duration) {
	for _, d := range []*dir{&x.req, &x.res} {
		if d.deadline.IsZero() || d.overridden {
			continue
		}
		if max := x.p.cfg.MaxMessageTimeout; max == 0 || t < time.Millisecond || t > max {
			continue
		}
		d.deadline = time.Now().Add(t)
		d.overridden = true
	}
}

func (x *exchange) applyMetadata(s *structpb.Struct) {
	for ns, v := range s.GetFields() {
		if !contains(x.p.cfg.ReceivingNamespaces, ns) || v.GetStructValue() == nil {
			continue
		}
		cur := x.dynamic[ns]
		if cur == nil {
			cur = &structpb.Struct{Fields: map[string]*structpb.Value{}}
			x.dynamic[ns] = cur
		}
		for k, f := range v.GetStructValue().GetFields() {
			cur.Fields[k] = proto.Clone(f).(*structpb.Value)
		}
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func (x *exchange) immediate(ir *extprocv3.ImmediateResponse) {
	code := int(ir.GetStatus().GetCode())
	if code < 200 {
		code = http.StatusOK
	}
	hs, err := mutate(nil, ir.GetHeaders(), false)
	if err != nil {
		x.localError(x.p.cfg.StatusOnError, "ext_proc_error_immediate_response_mutation")
		return
	}
	details := strings.Join(strings.Fields(ir.GetDetails()), "_")
	x.localReply(code, hs, ir.GetBody(), details)
}

func (x *exchange) onHeadersAnswer(d *dir, cr *extprocv3.CommonResponse, override *filterv3.ProcessingMode) {
	if len(d.expect) == 0 || d.expect[0] != "headers" {
		x.spurious(d.name() + "_headers")
		return
	}
	x.answered(d)
	d.hdrAnswered = true
	dropCL := d.bodyMode == modeStreamed || d.bodyMode == modeDuplex
	hs, err := mutate(d.hdrs, cr.GetHeaderMutation(), dropCL)
	if err != nil {
		x.localError(x.p.cfg.StatusOnError, "ext_proc_error_header_mutation")
		return
	}
	d.hdrs = hs
	if override != nil && x.p.cfg.AllowModeOverride && x.mode.RequestBodyMode != modeDuplex && x.mode.ResponseBodyMode != modeDuplex {
		if override.ResponseHeaderMode != filterv3.ProcessingMode_DEFAULT && !x.res.released && x.res.hdrs == nil {
			x.res.hdrMode = override.ResponseHeaderMode
		}
		if !x.req.released {
			x.req.bodyMode = override.RequestBodyMode
		}
		x.res.bodyMode = override.ResponseBodyMode
	}
	if cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		if bm := cr.GetBodyMutation(); bm != nil {
			body := bm.GetBody()
			d.hdrs = del(d.hdrs, "content-length")
			// The replacement is the whole message: nothing more goes to the server.
			d.trailerMode, d.trailers = skip, nil
			x.release(d, body, true)
			return
		}
	}
	x.afterHeaders(d)
}

func (x *exchange) onBodyAnswer(d *dir, cr *extprocv3.CommonResponse) {
	bm := cr.GetBodyMutation()
	sr := bm.GetStreamedResponse()
	if d.bodyMode == modeDuplex {
		// Only streamed_response, only after the headers answer, only while Envoy is in
		// its body state (a chunk was sent) and the direction has not ended (docs §2.2, §5.2).
		if !d.hdrAnswered || sr == nil || d.chunksSent == 0 || d.ended {
			x.spurious(d.name() + "_body")
			return
		}
		x.deliver(d, sr.GetBody())
		if sr.GetEndOfStream() {
			x.end(d)
		}
		return
	}
	if len(d.expect) == 0 || d.expect[0] != "body" || sr != nil && d.bodyMode == modeStreamed {
		x.spurious(d.name() + "_body")
		return
	}
	x.answered(d)
	switch d.bodyMode {
	case modeBuffered:
		body := d.held
		d.held = nil
		switch {
		case bm.GetClearBody() || sr != nil:
			body = nil
		case bm.GetBody() != nil:
			body = bm.GetBody()
		}
		if !d.released {
			hs, err := mutate(d.hdrs, cr.GetHeaderMutation(), false)
			if err != nil {
				x.localError(x.p.cfg.StatusOnError, "ext_proc_error_header_mutation")
				return
			}
			if cl := get(hs, "content-length"); cl != "" && cl != strconv.Itoa(len(body)) {
				x.localError(x.p.cfg.StatusOnError, "mismatch_between_content_length_and_the_length_of_the_mutated_body")
				return
			}
			d.hdrs = hs
			x.release(d, body, true)
			return
		}
		x.deliver(d, body)
		x.end(d)
	case modeStreamed:
		c := d.queue[0]
		d.queue = d.queue[1:]
		data := c.data
		switch {
		case bm.GetClearBody():
			data = nil
		case bm.GetBody() != nil:
			data = bm.GetBody()
		}
		x.deliver(d, data)
		if c.eos {
			x.end(d)
		}
	default:
		x.spurious(d.name() + "_body")
	}
}
