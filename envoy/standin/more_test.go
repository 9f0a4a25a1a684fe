package standin

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestMain fails the package when exchanges leave goroutines behind.
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		deadline := time.Now().Add(5 * time.Second)
		for {
			buf := make([]byte, 1<<20)
			stacks := string(buf[:runtime.Stack(buf, true)])
			leak := strings.Contains(stacks, "standin.(*exchange)")
			if !leak {
				break
			}
			if time.Now().After(deadline) {
				os.Stderr.WriteString("leaked exchange goroutines:\n" + stacks)
				code = 1
				break
			}
			runtime.Gosched()
			<-time.After(10 * time.Millisecond)
		}
	}
	os.Exit(code)
}

func TestUnknownRouteAndRequestID(t *testing.T) {
	h := newHarness(t, Config{Mode: headersOnly, Routes: []Route{{Prefix: "/v1/"}}}, echo, sse(sseA), false)
	if res := h.do(t, "GET", "/other", ""); res.status != 404 {
		t.Errorf("unknown route: %d, want 404", res.status)
	}
	if e := h.entry(t, 1); e.Details != "route_not_found" || e.SideStream {
		t.Errorf("entry = %+v", e)
	}
	h.do(t, "GET", "/v1/models", "")
	ps := ended(t, h.next(t))
	var id string
	for _, hv := range ps.messages()[0].GetRequestHeaders().GetHeaders().GetHeaders() {
		if hv.Key == "x-request-id" {
			id = string(hv.RawValue)
		}
	}
	if e := h.entry(t, 2); id == "" || e.RequestID != id {
		t.Errorf("x-request-id %q, entry %q", id, e.RequestID)
	}
}

// Scenario §9.2.6: STREAMED request; an ImmediateResponse on the last chunk answers the
// client and resets the upstream request that already started.
func TestStreamedRequestImmediateResetsUpstream(t *testing.T) {
	h := newHarness(t, Config{Mode: streamedMode()}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		if b := m.GetRequestBody(); b != nil && b.EndOfStream {
			return immediate(429, `{"error":"tokens"}`, ""), false, nil
		}
		return nil, false, nil
	}), sse(sseA), false)
	pr, pw := io.Pipe()
	go func() {
		pw.Write([]byte(`{"messages":`))
		pw.Write([]byte(`[]}`))
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", pr)
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 429 || string(b) != `{"error":"tokens"}` {
		t.Errorf("got %d %q", resp.StatusCode, b)
	}
	e := h.entry(t, 1)
	if !e.Reset || !e.UpstreamRequested || !e.UpstreamCancelled {
		t.Errorf("entry = %+v", e)
	}
	h.up.mu.Lock()
	defer h.up.mu.Unlock()
	if len(h.up.bodyErrs) == 1 && h.up.bodyErrs[0] == nil {
		t.Errorf("upstream received a complete request: %q", h.up.bodies[0])
	}
}

// Scenario §9.2.7: FULL_DUPLEX request; the server withholds the headers answer until it
// has the whole body (no timer), then sends a rewritten body in pieces; or refuses first.
func TestDuplexRequest(t *testing.T) {
	mode := &filterv3.ProcessingMode{
		RequestHeaderMode:   filterv3.ProcessingMode_SEND,
		RequestBodyMode:     filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		RequestTrailerMode:  filterv3.ProcessingMode_SEND,
		ResponseHeaderMode:  filterv3.ProcessingMode_SEND,
		ResponseBodyMode:    filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseTrailerMode: filterv3.ProcessingMode_SEND,
	}
	for _, refuse := range []bool{false, true} {
		handle := func(ps *procStream) error {
			var pc *extprocv3.ProtocolConfiguration
			for {
				m, err := ps.recv()
				if err != nil {
					return nil
				}
				if pc == nil {
					pc = m.GetProtocolConfig()
				}
				switch {
				case m.GetRequestHeaders() != nil:
					// withheld until the body is complete
				case m.GetRequestBody() != nil && m.GetRequestBody().EndOfStream:
					if refuse {
						ps.send(immediate(429, "no", ""))
						continue
					}
					ps.send(answerHeaders(true, nil))
					for i, part := range []string{`{"rewritten"`, `:true}`} {
						ps.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
							Response: &extprocv3.CommonResponse{BodyMutation: streamed([]byte(part), i == 1)}}}})
					}
				case m.GetRequestBody() != nil:
				default:
					ps.send(echoAnswer(m, pc, nil))
				}
			}
		}
		h := newHarness(t, Config{Mode: mode, MessageTimeout: time.Millisecond}, handle, sse(sseA), false)
		res := h.do(t, "POST", "/v1/chat/completions", strings.Repeat("x", 100<<10))
		calls, _, bodies := h.up.snapshot()
		if refuse {
			if res.status != 429 || calls != 0 {
				t.Errorf("refused: got %d, upstream calls %d", res.status, calls)
			}
			continue
		}
		if res.status != 200 || res.body != sseA || calls != 1 || string(bodies[0]) != `{"rewritten":true}` {
			t.Errorf("got %d %q; upstream %d %q", res.status, res.body, calls, bodies)
		}
	}
}

// Scenario §9.2.24: mode_override in the request-headers answer; body modes are always
// taken from the override.
func TestModeOverride(t *testing.T) {
	mode := &filterv3.ProcessingMode{
		RequestHeaderMode:  filterv3.ProcessingMode_SEND,
		RequestBodyMode:    filterv3.ProcessingMode_BUFFERED,
		ResponseHeaderMode: filterv3.ProcessingMode_SEND,
	}
	for _, allow := range []bool{true, false} {
		h := newHarness(t, Config{Mode: mode, AllowModeOverride: allow}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
			if m.GetRequestHeaders() != nil {
				r := answerHeaders(true, nil)
				r.ModeOverride = &filterv3.ProcessingMode{ResponseBodyMode: filterv3.ProcessingMode_STREAMED}
				return r, false, nil
			}
			return nil, false, nil
		}), sse(sseA, sseB), false)
		res := h.do(t, "POST", "/v1/chat/completions", `{}`)
		if res.status != 200 || res.body != sseA+sseB {
			t.Fatalf("got %d %q", res.status, res.body)
		}
		kinds := slices.Compact(ended(t, h.next(t)).kinds())
		want := []string{"request_headers", "response_headers", "response_body"}
		if !allow {
			want = []string{"request_headers", "request_body", "response_headers"}
		}
		if diff := cmp.Diff(want, kinds); diff != "" {
			t.Errorf("allow=%v: messages (-want +got):\n%s", allow, diff)
		}
	}
}

// override_message_timeout extends the running timer once, within max_message_timeout.
func TestOverrideMessageTimeout(t *testing.T) {
	for _, tc := range []struct {
		max  time.Duration
		want int
	}{{5 * time.Second, 200}, {0, 504}} {
		h := newHarness(t, Config{Mode: headersOnly, MessageTimeout: 30 * time.Millisecond, MaxMessageTimeout: tc.max}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
			return nil, false, nil
		}), sse(sseA), false)
		h.proc.handle = func(ps *procStream) error {
			m, err := ps.recv()
			if err != nil {
				return nil
			}
			ps.send(&extprocv3.ProcessingResponse{OverrideMessageTimeout: durationpb.New(2 * time.Second),
				Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}})
			// A slow server: answer after the original timeout has passed.
			select {
			case <-time.After(150 * time.Millisecond):
			case <-ps.s.Context().Done():
				return nil
			}
			ps.send(echoAnswer(m, nil, nil))
			return echo(ps)
		}
		if res := h.do(t, "GET", "/v1/models", ""); res.status != tc.want {
			t.Errorf("max %v: status %d, want %d", tc.max, res.status, tc.want)
		}
	}
}

// A BUFFERED response over the buffer limit is a clean 500 (headers still held).
func TestBufferedResponseOverLimit(t *testing.T) {
	mode := &filterv3.ProcessingMode{RequestHeaderMode: filterv3.ProcessingMode_SEND, ResponseHeaderMode: filterv3.ProcessingMode_SEND,
		ResponseBodyMode: filterv3.ProcessingMode_BUFFERED}
	h := newHarness(t, Config{Mode: mode, RequestBufferLimit: 20}, echo, sse(sseA, sseB), false)
	res := h.do(t, "GET", "/v1/models", "")
	if e := h.entry(t, 1); res.status != 500 || e.Details != "response_payload_too_large" {
		t.Errorf("got %d %q", res.status, e.Details)
	}
	h2 := newHarness(t, Config{Mode: mode}, echo, sse(sseA, sseB), false)
	if res := h2.do(t, "GET", "/v1/models", ""); res.status != 200 || res.body != sseA+sseB || res.header.Get("content-length") != "30" {
		t.Errorf("buffered echo: %d %q cl=%q", res.status, res.body, res.header.Get("content-length"))
	}
}

// The route timeout answers 504 when the upstream does not answer in time.
func TestRouteTimeout(t *testing.T) {
	h := newHarness(t, Config{Mode: headersOnly, Routes: []Route{{Prefix: "/", Timeout: 30 * time.Millisecond}}}, echo,
		func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, false)
	res := h.do(t, "GET", "/v1/models", "")
	if e := h.entry(t, 1); res.status != 504 || e.Details != "upstream_response_timeout" {
		t.Errorf("got %d %q", res.status, e.Details)
	}
}

// Over h2c, a reset after response headers is a stream error for the client, and the
// connection stays usable for the next request.
func TestH2ResetAfterHeaders(t *testing.T) {
	var n atomic.Int32 // side streams of the two requests may overlap
	h := newHarness(t, Config{}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		if m.GetResponseBody() != nil {
			if n.Add(1) == 1 {
				return immediate(429, "x", ""), false, nil
			}
		}
		return nil, false, nil
	}), sse(sseA), true)
	c := h.client(true)
	req, _ := http.NewRequestWithContext(context.Background(), "POST", h.front.URL+"/v1/chat/completions", strings.NewReader(`{}`))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil || resp.ProtoMajor != 2 {
		t.Errorf("proto %d, body error %v; want an HTTP/2 stream reset", resp.ProtoMajor, err)
	}
	if res := h.doWith(t, c, "POST", "/v1/chat/completions", `{}`); res.status != 200 || res.body != sseA {
		t.Errorf("second request: %d %q", res.status, res.body)
	}
}

// Envoy 1.37 closes the side stream once nothing more can be exchanged, here right after
// the request headers answer, while the response is still streaming.
func TestEarlyStreamClose137(t *testing.T) {
	mode := &filterv3.ProcessingMode{RequestHeaderMode: filterv3.ProcessingMode_SEND, ResponseHeaderMode: filterv3.ProcessingMode_SKIP}
	release := make(chan struct{})
	h := newHarness(t, Config{Mode: mode}, echo, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		io.WriteString(w, sseA)
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, sseB)
	}, false)
	done := make(chan result, 1)
	go func() { done <- h.do(t, "GET", "/v1/models", "") }()
	ps := ended(t, h.next(t)) // ends while the upstream is held
	close(release)
	if res := <-done; res.status != 200 || res.body != sseA+sseB {
		t.Errorf("got %d %q", res.status, res.body)
	}
	if diff := cmp.Diff([]string{"request_headers"}, ps.kinds()); diff != "" {
		t.Errorf("messages (-want +got):\n%s", diff)
	}
}

// Handler serves h2c on a plain httptest server.
func TestHandlerH2C(t *testing.T) {
	h := newHarness(t, Config{}, echo, sse(sseA, sseC), false)
	front := httptest.NewServer(h.proxy.Handler())
	defer front.Close()
	resp, err := h.client(true).Post(front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.ProtoMajor != 2 || string(b) != sseA+sseC {
		t.Errorf("got HTTP/%d %q %v", resp.ProtoMajor, b, err)
	}
}

// Scenario §9.2.16: an upstream with trailers. With trailer mode SEND the last body message
// has no end_of_stream and the trailers message follows; with SKIP the server never sees an
// end_of_stream. The client gets the (mutated) trailers either way.
func TestResponseTrailers(t *testing.T) {
	withTrailers := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("trailer", "x-usage")
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(200)
		io.WriteString(w, sseA)
		w.(http.Flusher).Flush()
		io.WriteString(w, sseB)
		w.Header().Set("x-usage", "42")
	}
	streamedTrailers := streamedMode()
	streamedTrailers.ResponseTrailerMode = filterv3.ProcessingMode_SEND
	for _, tc := range []struct {
		name     string
		mode     *filterv3.ProcessingMode
		eosLast  bool
		h2       bool
		wantTail []string
	}{
		{"duplex", nil, false, false, []string{"response_body", "response_trailers"}},
		{"duplex h2c eos on last", nil, true, true, []string{"response_body", "response_trailers"}},
		{"streamed send", streamedTrailers, false, false, []string{"response_body", "response_trailers"}},
		{"streamed skip", streamedMode(), false, false, []string{"response_body"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{Mode: tc.mode, EOSOnLastChunk: tc.eosLast}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				if m.GetResponseTrailers() != nil {
					return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
						ResponseTrailers: &extprocv3.TrailersResponse{HeaderMutation: setHeader("x-tokengate-tokens", "7")}}}, false, nil
				}
				return nil, false, nil
			}), withTrailers, tc.h2)
			resp, err := h.client(tc.h2).Post(h.front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(b) != sseA+sseB {
				t.Fatalf("body %q, %v", b, err)
			}
			wantTok := "7"
			if len(tc.wantTail) == 1 {
				wantTok = ""
			}
			if resp.Trailer.Get("x-usage") != "42" || resp.Trailer.Get("x-tokengate-tokens") != wantTok {
				t.Errorf("trailers = %v", resp.Trailer)
			}
			ps := ended(t, h.next(t))
			kinds := slices.Compact(ps.kinds())
			if diff := cmp.Diff(tc.wantTail, kinds[len(kinds)-len(tc.wantTail):]); diff != "" {
				t.Errorf("messages %v (-want +got):\n%s", kinds, diff)
			}
			for _, m := range ps.messages() {
				if b := m.GetResponseBody(); b != nil && b.EndOfStream {
					t.Errorf("response_body with end_of_stream although trailers exist")
				}
			}
		})
	}
}

// An unreachable ext_proc server fails the request with status_on_error, or lets it through
// with failure_mode_allow (§7.1).
func TestServerUnavailable(t *testing.T) {
	for _, tc := range []struct {
		allow bool
		want  int
	}{{false, 503}, {true, 200}} {
		h := newHarness(t, Config{Mode: headersOnly, FailureModeAllow: tc.allow, StatusOnError: 503}, echo, sse(sseA), false)
		cc, err := grpc.NewClient("passthrough:///down",
			grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return nil, errors.New("connection refused") }),
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		cfg := h.proxy.cfg
		cfg.ExtProc = cc
		p, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		front := httptest.NewServer(p)
		resp, err := http.Get(front.URL + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		front.Close()
		es := p.Log()
		if resp.StatusCode != tc.want || len(es) != 1 || tc.want == 503 && !strings.HasPrefix(es[0].Details, "ext_proc_error_gRPC_error_14{") {
			t.Errorf("allow=%v: got %d, log %+v", tc.allow, resp.StatusCode, es)
		}
	}
}

// Dynamic metadata from several answers merges per namespace; namespaces not listed as
// receiving are dropped (§6.2, scenario 26).
func TestDynamicMetadataMerge(t *testing.T) {
	md := func(kv map[string]any) *structpb.Struct { s, _ := structpb.NewStruct(kv); return s }
	h := newHarness(t, Config{Mode: headersOnly, ReceivingNamespaces: []string{"tokengate"}}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		if m.GetRequestHeaders() != nil {
			r := answerHeaders(true, nil)
			r.DynamicMetadata = md(map[string]any{"tokengate": map[string]any{"reserved": 100, "policy": "gold"}, "other": map[string]any{"x": 1}})
			return r, false, nil
		}
		r := answerHeaders(false, nil)
		r.DynamicMetadata = md(map[string]any{"tokengate": map[string]any{"reserved": 40, "settled": 40}})
		return r, false, nil
	}), sse(sseA), false)
	h.do(t, "GET", "/v1/models", "")
	want := map[string]*structpb.Struct{"tokengate": md(map[string]any{"reserved": 40, "policy": "gold", "settled": 40})}
	if diff := cmp.Diff(want, h.entry(t, 1).DynamicMetadata, protocmp.Transform()); diff != "" {
		t.Errorf("dynamic metadata (-want +got):\n%s", diff)
	}
}

// Server closes mid-response (§2.5, §7.1, scenario 21): OK-close in STREAMED flushes the
// queued chunk unmodified and lets the rest through; an error fails closed with a reset, or
// continues unprocessed with failure_mode_allow (not for duplex once a chunk was sent).
func TestServerCloseMidResponse(t *testing.T) {
	hold := make(chan struct{})
	events := []string{sseA, sseB, sseC}
	slow := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(200)
		io.WriteString(w, events[0])
		w.(http.Flusher).Flush()
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
		io.WriteString(w, events[1]+events[2])
	}
	for _, tc := range []struct {
		name      string
		mode      *filterv3.ProcessingMode
		err       error
		allow     bool
		wantBody  string
		wantReset bool
	}{
		{"streamed ok close", streamedMode(), nil, false, sseA + sseB + sseC, false},
		{"streamed error fail open", streamedMode(), status.Error(codes.Internal, "x"), true, sseA + sseB + sseC, false},
		{"streamed error fail closed", streamedMode(), status.Error(codes.Internal, "x"), false, "", true},
		{"duplex error fail open ignored", nil, status.Error(codes.Internal, "x"), true, "", true},
		{"duplex ok close loses the chunk in flight", nil, nil, false, sseB + sseC, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hold = make(chan struct{})
			h := newHarness(t, Config{Mode: tc.mode, FailureModeAllow: tc.allow}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				if m.GetResponseBody() != nil {
					return nil, true, tc.err
				}
				return nil, false, nil
			}), slow, false)
			stopped := make(chan struct{}, 1)
			h.proxy.hook = func(ev string, _ bool) {
				if ev == "processing_complete" || ev == "local_reply" {
					stopped <- struct{}{}
				}
			}
			resp, err := h.client(false).Post(h.front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			waitChan(t, stopped, "the stand-in to stop consulting the server")
			close(hold)
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if (err != nil) != tc.wantReset || !tc.wantReset && string(b) != tc.wantBody {
				t.Errorf("got %q, %v; want %q reset=%v", b, err, tc.wantBody, tc.wantReset)
			}
			if e := h.entry(t, 1); e.Reset != tc.wantReset {
				t.Errorf("entry = %+v", e)
			}
		})
	}
}
