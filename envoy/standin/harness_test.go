package standin

import (
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
)

// procStream is one side stream as the hand-written test server sees it.
type procStream struct {
	s  extprocv3.ExternalProcessor_ProcessServer
	md metadata.MD

	mu   sync.Mutex
	got  []*extprocv3.ProcessingRequest
	end  error // what Recv returned last, or the failed Send
	done chan struct{}
}

func (ps *procStream) recv() (*extprocv3.ProcessingRequest, error) {
	m, err := ps.s.Recv()
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if err != nil {
		ps.end = err
		return nil, err
	}
	ps.got = append(ps.got, m)
	return m, nil
}

// send sends m; a failed Send (the call ended) is kept as the stream's end when Recv has
// not reported one yet.
func (ps *procStream) send(m *extprocv3.ProcessingResponse) error {
	err := ps.s.Send(m)
	if err != nil {
		ps.mu.Lock()
		if ps.end == nil {
			ps.end = err
		}
		ps.mu.Unlock()
	}
	return err
}

// kinds lists the kinds of messages received so far.
func (ps *procStream) kinds() []string {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	var out []string
	for _, m := range ps.got {
		out = append(out, kindOf(m))
	}
	return out
}

func (ps *procStream) messages() []*extprocv3.ProcessingRequest {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return append([]*extprocv3.ProcessingRequest(nil), ps.got...)
}

func kindOf(m *extprocv3.ProcessingRequest) string {
	switch m.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingRequest_RequestBody:
		return "request_body"
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingRequest_ResponseBody:
		return "response_body"
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return "response_trailers"
	}
	return "unknown"
}

// fakeProc is a hand-written ext_proc server: handle scripts each stream.
type fakeProc struct {
	extprocv3.UnimplementedExternalProcessorServer
	handle func(ps *procStream) error

	mu      sync.Mutex
	streams []*procStream
	opened  chan *procStream
}

func (f *fakeProc) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	md, _ := metadata.FromIncomingContext(s.Context())
	ps := &procStream{s: s, md: md, done: make(chan struct{})}
	defer close(ps.done)
	f.mu.Lock()
	f.streams = append(f.streams, ps)
	f.mu.Unlock()
	select {
	case f.opened <- ps: // tests take at most cap(opened) streams with next
	default:
	}
	return f.handle(ps)
}

func (f *fakeProc) all() []*procStream {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*procStream(nil), f.streams...)
}

// echo answers every message with CONTINUE and no mutation, echoing duplex bodies back. It
// learns the body modes from protocol_config on the stream's first message.
func echo(ps *procStream) error {
	var pc *extprocv3.ProtocolConfiguration
	for {
		m, err := ps.recv()
		if err != nil {
			return nil
		}
		if pc == nil {
			pc = m.GetProtocolConfig()
		}
		if err := ps.send(echoAnswer(m, pc, nil)); err != nil {
			return nil
		}
	}
}

// echoAnswer is the pass-through answer to m; body, when non-nil, replaces a duplex body.
func echoAnswer(m *extprocv3.ProcessingRequest, pc *extprocv3.ProtocolConfiguration, body []byte) *extprocv3.ProcessingResponse {
	const duplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	switch r := m.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
	case *extprocv3.ProcessingRequest_RequestBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: bodyAnswer(r.RequestBody, pc.GetRequestBodyMode() == duplex, body)}}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
			ResponseBody: bodyAnswer(r.ResponseBody, pc.GetResponseBodyMode() == duplex, body)}}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
	}
	return &extprocv3.ProcessingResponse{}
}

func bodyAnswer(b *extprocv3.HttpBody, duplex bool, body []byte) *extprocv3.BodyResponse {
	if !duplex {
		return &extprocv3.BodyResponse{}
	}
	if body == nil {
		body = b.Body
	}
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: streamed(body, b.EndOfStream)}}
}

func streamed(body []byte, eos bool) *extprocv3.BodyMutation {
	return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: eos}}}
}

// upstream is a test upstream that records what it received and whether its client went
// away before the handler finished.
type upstream struct {
	mu        sync.Mutex
	bodies    [][]byte
	headers   []http.Header
	cancelled int
	calls     int
	bodyErrs  []error                                      // errors reading each request body
	trailers  []http.Header                                // each request's trailers
	serve     func(w http.ResponseWriter, r *http.Request) // writes the response
	gone      chan struct{}                                // receives when a request context ends early
	started   chan struct{}                                // receives when a request arrives, if set
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if u.started != nil {
		select {
		case u.started <- struct{}{}:
		default:
		}
	}
	body, err := io.ReadAll(r.Body)
	u.mu.Lock()
	u.calls++
	u.bodies = append(u.bodies, body)
	u.bodyErrs = append(u.bodyErrs, err)
	u.trailers = append(u.trailers, r.Trailer.Clone())
	u.headers = append(u.headers, r.Header.Clone())
	u.mu.Unlock()
	u.serve(w, r)
	if r.Context().Err() != nil {
		u.mu.Lock()
		u.cancelled++
		u.mu.Unlock()
		select {
		case u.gone <- struct{}{}:
		default:
		}
	}
}

func (u *upstream) snapshot() (calls, cancelled int, bodies [][]byte) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls, u.cancelled, append([][]byte(nil), u.bodies...)
}

// sse serves the given events as an SSE stream, one flush each.
func sse(events ...string) func(w http.ResponseWriter, r *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for _, e := range events {
			io.WriteString(w, e)
			w.(http.Flusher).Flush()
		}
	}
}

// endless writes events until the client goes away.
func endless(event string) func(w http.ResponseWriter, r *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for r.Context().Err() == nil {
			if _, err := io.WriteString(w, event); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
			case <-time.After(time.Millisecond):
			}
		}
	}
}

type harness struct {
	proc  *fakeProc
	up    *upstream
	proxy *Proxy
	front *httptest.Server

	mu        sync.Mutex
	sideCtx   []context.Context // the context of each side stream, as the stand-in opened it
	serverLog strings.Builder   // the front server's error log (handler panics land here)
}

// sideContexts returns the contexts of the side streams opened so far.
func (h *harness) sideContexts() []context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]context.Context(nil), h.sideCtx...)
}

// frontLog returns what the front server logged.
func (h *harness) frontLog() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.serverLog.String()
}

type logWriter struct{ h *harness }

func (w logWriter) Write(b []byte) (int, error) {
	w.h.mu.Lock()
	defer w.h.mu.Unlock()
	return w.h.serverLog.Write(b)
}

// newHarness starts the test ext_proc server on an in-memory listener, the upstream, and
// the stand-in in front of them. cfg.ExtProc and cfg.Upstream are filled in, and
// MessageTimeout when it is zero.
func newHarness(t testing.TB, cfg Config, handle func(*procStream) error, serve func(http.ResponseWriter, *http.Request), h2 bool) *harness {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	proc := &fakeProc{handle: handle, opened: make(chan *procStream, 64)}
	extprocv3.RegisterExternalProcessorServer(gs, proc)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	h := &harness{}
	record := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		h.mu.Lock()
		h.sideCtx = append(h.sideCtx, ctx)
		h.mu.Unlock()
		return streamer(ctx, desc, cc, method, opts...)
	}
	cc, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithStreamInterceptor(record))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })

	up := &upstream{serve: serve, gone: make(chan struct{}, 16)}
	us := httptest.NewServer(up)
	t.Cleanup(us.Close)
	cfg.ExtProc = cc
	cfg.Upstream, _ = url.Parse(us.URL)
	if cfg.MessageTimeout == 0 {
		// Envoy's 200ms would turn a slow answer on a loaded machine into a 504; tests of
		// the timer set their own.
		cfg.MessageTimeout = 10 * time.Second
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	front := httptest.NewUnstartedServer(p)
	if h2 {
		front.Config = p.Server()
		front.Config.Handler = p
	}
	front.Config.ErrorLog = log.New(logWriter{h}, "", 0)
	front.Start()
	t.Cleanup(front.Close)
	h.proc, h.up, h.proxy, h.front = proc, up, p, front
	return h
}

func (h *harness) client(h2 bool) *http.Client {
	if !h2 {
		return &http.Client{Transport: &http.Transport{DisableCompression: true}}
	}
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &protos, DisableCompression: true}}
}

type result struct {
	status  int
	header  http.Header
	close   bool // the server closes the connection after this response
	body    string
	bodyErr error
}

func (h *harness) do(t *testing.T, method, path, body string, hdr ...string) result {
	t.Helper()
	return h.doWith(t, h.client(false), method, path, body, hdr...)
}

func (h *harness) doWith(t *testing.T, c *http.Client, method, path, body string, hdr ...string) result {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, h.front.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{status: resp.StatusCode, header: resp.Header, close: resp.Close, body: string(b), bodyErr: err}
}

// lastEntry waits for the n-th log entry.
func (h *harness) entry(t *testing.T, n int) Entry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	es, err := h.proxy.WaitLog(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	return es[n-1]
}

// next waits for the next side stream to open.
func (h *harness) next(t *testing.T) *procStream {
	t.Helper()
	select {
	case ps := <-h.proc.opened:
		return ps
	case <-time.After(10 * time.Second):
		t.Fatal("no side stream opened")
	}
	return nil
}

// ended waits until the server's handler for ps returned.
func ended(t *testing.T, ps *procStream) *procStream {
	t.Helper()
	waitChan(t, ps.done, "side stream end")
	return ps
}

func waitChan(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}
