package standin

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// duplexRequestMode is FULL_DUPLEX_STREAMED in both directions, trailers SEND (required).
func duplexRequestMode() *filterv3.ProcessingMode {
	return &filterv3.ProcessingMode{
		RequestHeaderMode:   filterv3.ProcessingMode_SEND,
		RequestBodyMode:     filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		RequestTrailerMode:  filterv3.ProcessingMode_SEND,
		ResponseHeaderMode:  filterv3.ProcessingMode_SEND,
		ResponseBodyMode:    filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseTrailerMode: filterv3.ProcessingMode_SEND,
	}
}

func requestBodyAnswer(m *extprocv3.BodyMutation) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
		Response: &extprocv3.CommonResponse{BodyMutation: m}}}}
}

// Envoy's default close (§2.5) is a half-close followed at once by a reset: by the time the
// request is logged the side stream is cancelled, although the server never ended the call.
func TestSideStreamResetAtClose(t *testing.T) {
	for _, minor := range []int{36, 37} {
		t.Run(fmt.Sprintf("1.%d", minor), func(t *testing.T) {
			h := newHarness(t, Config{Mode: headersOnly, EnvoyMinor: minor}, func(ps *procStream) error {
				var pc *extprocv3.ProtocolConfiguration
				for {
					m, err := ps.recv()
					if err != nil {
						break
					}
					if pc == nil {
						pc = m.GetProtocolConfig()
					}
					if err := ps.send(echoAnswer(m, pc, nil)); err != nil {
						break
					}
				}
				<-ps.s.Context().Done() // a server that never ends the call itself
				return nil
			}, sse(sseA), false)
			if res := h.do(t, "GET", "/v1/models", ""); res.status != 200 || res.body != sseA {
				t.Fatalf("got %d %q", res.status, res.body)
			}
			h.entry(t, 1)
			ctxs := h.sideContexts()
			if len(ctxs) != 1 || !errors.Is(ctxs[0].Err(), context.Canceled) {
				t.Fatalf("side stream not reset when the request finished (contexts %v)", ctxs)
			}
			ps := ended(t, h.next(t))
			if code := status.Code(ps.end); ps.end != io.EOF && code != codes.Canceled {
				t.Errorf("server's Recv ended with %v, want io.EOF or Canceled", ps.end)
			}
		})
	}
}

// GracefulClose (runtime guard ext_proc_graceful_grpc_close): half-close, then wait for the
// server to end the call, and reset only after RemoteCloseTimeout.
func TestGracefulClose(t *testing.T) {
	t.Run("server ends the call", func(t *testing.T) {
		release := make(chan struct{})
		sawEOF := make(chan error, 1)
		h := newHarness(t, Config{Mode: headersOnly, GracefulClose: true, RemoteCloseTimeout: time.Minute}, func(ps *procStream) error {
			for {
				m, err := ps.recv()
				if err != nil {
					sawEOF <- ps.s.Context().Err() // still alive after the half-close
					break
				}
				if err := ps.send(echoAnswer(m, nil, nil)); err != nil {
					break
				}
			}
			<-release
			return nil
		}, sse(sseA), false)
		h.do(t, "GET", "/v1/models", "")
		h.entry(t, 1)
		if err := <-sawEOF; err != nil {
			t.Errorf("server context at the half-close: %v, want alive", err)
		}
		ctx := h.sideContexts()[0]
		if ctx.Err() != nil {
			t.Fatal("graceful close reset the stream before the server ended the call")
		}
		close(release)
		waitChan(t, ctx.Done(), "the stream's end after the server returned")
		if ps := ended(t, h.next(t)); ps.end != io.EOF {
			t.Errorf("server's Recv ended with %v, want io.EOF", ps.end)
		}
	})
	t.Run("server never ends the call", func(t *testing.T) {
		h := newHarness(t, Config{Mode: headersOnly, GracefulClose: true, RemoteCloseTimeout: 20 * time.Millisecond}, func(ps *procStream) error {
			for {
				m, err := ps.recv()
				if err != nil {
					break
				}
				if err := ps.send(echoAnswer(m, nil, nil)); err != nil {
					break
				}
			}
			<-ps.s.Context().Done()
			return nil
		}, sse(sseA), false)
		h.do(t, "GET", "/v1/models", "")
		ended(t, h.next(t)) // reset after RemoteCloseTimeout
	})
}

// Scenario §9.2.7 in detail: in FULL_DUPLEX_STREAMED the body reaches the server while the
// headers answer is pending, no timer runs, the upstream is contacted only after the
// headers answer and receives exactly the server's streamed_response chunks, chunked, with
// content-length removed.
func TestDuplexRequestWaitsForHeadersAnswer(t *testing.T) {
	parts := []string{`{"model":`, `"m","messages":`, `[]}`}
	var h *harness
	var upCallsBeforeAnswer int
	var seen []string
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
				// withheld until the whole body is in
			case m.GetRequestBody() != nil:
				seen = append(seen, string(m.GetRequestBody().Body))
				if !m.GetRequestBody().EndOfStream {
					continue
				}
				upCallsBeforeAnswer, _, _ = h.up.snapshot()
				ps.send(answerHeaders(true, setHeader("content-length", "999")))
				for i, out := range []string{"A", "BB", "CCC"} {
					ps.send(requestBodyAnswer(streamed([]byte(out), i == 2)))
				}
			default:
				ps.send(echoAnswer(m, pc, nil))
			}
		}
	}
	var upTE []string
	var upCL int64
	h = newHarness(t, Config{Mode: duplexRequestMode(), MessageTimeout: time.Nanosecond}, handle, func(w http.ResponseWriter, r *http.Request) {
		upTE, upCL = r.TransferEncoding, r.ContentLength
		sse(sseA)(w, r)
	}, false)
	pr, pw := io.Pipe()
	go func() {
		for _, p := range parts {
			pw.Write([]byte(p))
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", pr)
	req.ContentLength = int64(len(strings.Join(parts, "")))
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || string(b) != sseA {
		t.Fatalf("got %d %q %v", resp.StatusCode, b, err)
	}
	ended(t, h.next(t))
	if strings.Join(seen, "") != strings.Join(parts, "") {
		t.Errorf("server received %q before answering, want the whole body", seen)
	}
	if upCallsBeforeAnswer != 0 {
		t.Errorf("upstream contacted %d times before the headers answer", upCallsBeforeAnswer)
	}
	calls, _, bodies := h.up.snapshot()
	if calls != 1 || string(bodies[0]) != "ABBCCC" {
		t.Errorf("upstream got %d requests %q, want one with the server's body %q", calls, bodies, "ABBCCC")
	}
	if cl := h.up.headers[0].Get("content-length"); cl != "" || upCL != -1 || len(upTE) != 1 || upTE[0] != "chunked" {
		t.Errorf("upstream content-length %q/%d, transfer-encoding %v; want none, chunked", cl, upCL, upTE)
	}
	if e := h.entry(t, 1); e.Status != 200 || e.Reset || e.UpstreamCancelled {
		t.Errorf("entry = %+v", e)
	}
}

// A duplex request direction answers only with streamed_response, only after the headers
// answer, only once a chunk was sent, and nothing after its end_of_stream (§2.2, §5.2):
// anything else is spurious (500 on 1.35+) and the upstream is never contacted or is reset.
func TestDuplexRequestSpurious(t *testing.T) {
	for _, tc := range []struct {
		name string
		// script answers each message; nil echoes (duplex bodies echoed).
		script     func(m *extprocv3.ProcessingRequest, ps *procStream) bool
		holdBody   bool // the client sends its body only after the response
		wantUp     bool // the upstream was contacted after the headers answer (and must be cancelled)
		wantStatus int
	}{
		{"body answer before the headers answer", func(m *extprocv3.ProcessingRequest, ps *procStream) bool {
			if m.GetRequestBody() != nil {
				ps.send(requestBodyAnswer(streamed(m.GetRequestBody().Body, m.GetRequestBody().EndOfStream)))
				return true
			}
			return m.GetRequestHeaders() != nil // withheld
		}, false, false, 500},
		{"plain body mutation", func(m *extprocv3.ProcessingRequest, ps *procStream) bool {
			if b := m.GetRequestBody(); b != nil && b.EndOfStream {
				ps.send(answerHeaders(true, nil))
				ps.send(bodyFor(true, []byte("{}")))
				return true
			}
			return m.GetRequestHeaders() != nil || m.GetRequestBody() != nil
		}, false, true, 500},
		{"body answer before any chunk was sent", func(m *extprocv3.ProcessingRequest, ps *procStream) bool {
			if m.GetRequestHeaders() != nil {
				ps.send(answerHeaders(true, nil))
				ps.send(requestBodyAnswer(streamed([]byte("{}"), true)))
				return true
			}
			return false
		}, true, true, 500},
		{"body answer after end_of_stream", func(m *extprocv3.ProcessingRequest, ps *procStream) bool {
			if b := m.GetRequestBody(); b != nil && b.EndOfStream {
				ps.send(answerHeaders(true, nil))
				ps.send(requestBodyAnswer(streamed([]byte("{}"), true)))
				ps.send(requestBodyAnswer(streamed([]byte("late"), false)))
				return true
			}
			return m.GetRequestHeaders() != nil || m.GetRequestBody() != nil
		}, false, true, 500},
	} {
		t.Run(tc.name, func(t *testing.T) {
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
					if !tc.script(m, ps) {
						ps.send(echoAnswer(m, pc, nil))
					}
				}
			}
			// The upstream answers only when its client goes away, so a stand-in that
			// ignored the spurious answer would never finish.
			h := newHarness(t, Config{Mode: duplexRequestMode()}, handle, func(w http.ResponseWriter, r *http.Request) {
				<-r.Context().Done()
			}, false)
			pr, pw := io.Pipe()
			defer pw.Close()
			if !tc.holdBody {
				go func() {
					pw.Write([]byte(`{"a":1}`))
					pw.Close()
				}()
			}
			req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", pr)
			c := h.client(false)
			c.Timeout = 5 * time.Second
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			e := h.entry(t, 1)
			if resp.StatusCode != tc.wantStatus || e.Details != "ext_proc_error_spurious_message_request_body" {
				t.Errorf("got %d %q, want %d spurious request body", resp.StatusCode, e.Details, tc.wantStatus)
			}
			if e.UpstreamRequested != tc.wantUp || e.UpstreamCancelled != tc.wantUp {
				t.Errorf("upstream requested %v cancelled %v, want %v", e.UpstreamRequested, e.UpstreamCancelled, tc.wantUp)
			}
		})
	}
}

// §4: a local reply to a duplex request that is on its way upstream (headers answered, body
// not finished) resets the downstream stream and the upstream request, as in STREAMED.
func TestDuplexRequestImmediateResetsUpstream(t *testing.T) {
	h := newHarness(t, Config{Mode: duplexRequestMode()}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		return nil, false, nil
	}), sse(sseA), false)
	h.up.started = make(chan struct{}, 1)
	h.proc.handle = func(ps *procStream) error {
		for {
			m, err := ps.recv()
			if err != nil {
				return nil
			}
			if b := m.GetRequestBody(); b != nil && b.EndOfStream {
				ps.send(answerHeaders(true, nil))
				ps.send(requestBodyAnswer(streamed([]byte(`{"messages":`), false)))
				// The refusal comes once the upstream has the request's beginning.
				waitChan(t, h.up.started, "the upstream request")
				ps.send(immediate(429, `{"error":"tokens"}`, ""))
			}
		}
	}
	res := h.do(t, "POST", "/v1/chat/completions", `{"messages":[]}`)
	if res.status != 429 || res.body != `{"error":"tokens"}` {
		t.Errorf("got %d %q, want the 429 local reply", res.status, res.body)
	}
	if !res.close {
		t.Error("HTTP/1 reply without connection: close; Envoy closes the connection")
	}
	e := h.entry(t, 1)
	if !e.Reset || !e.UpstreamRequested || !e.UpstreamCancelled {
		t.Errorf("entry = %+v, want reset and the upstream cancelled", e)
	}
	waitChan(t, h.up.gone, "the upstream's end")
	h.up.mu.Lock()
	defer h.up.mu.Unlock()
	// The upstream has the request's headers; its body may not have left the stand-in yet.
	if len(h.up.bodyErrs) != 1 || h.up.bodyErrs[0] == nil || !strings.HasPrefix(`{"messages":`, string(h.up.bodies[0])) {
		t.Errorf("upstream read %q, error %v; want (part of) the server's first chunk, then the request reset", h.up.bodies, h.up.bodyErrs)
	}
}

// An early local reply while an HTTP/1 client is still sending a large body: the
// stand-in's body reader stops before the handler returns, so net/http does not panic
// ("invalid concurrent Body.Read call") when it reads the connection again.
func TestEarlyReplyStopsBodyReader(t *testing.T) {
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprintf("chunked=%v", chunked), func(t *testing.T) {
			for i := range 10 {
				h := newHarness(t, Config{RequestBufferLimit: 1024}, echo, sse(sseA), false)
				conn, err := net.Dial("tcp", h.front.Listener.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				part := strings.Repeat("x", 2048)
				write := func() error {
					if chunked {
						_, err := fmt.Fprintf(conn, "%x\r\n%s\r\n", len(part), part)
						return err
					}
					_, err := io.WriteString(conn, part)
					return err
				}
				if chunked {
					io.WriteString(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
				} else {
					fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 8<<20)
				}
				write()
				br := bufio.NewReader(conn)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusRequestEntityTooLarge {
					t.Fatalf("status %d, want 413", resp.StatusCode)
				}
				h.entry(t, 1)
				// The client keeps sending, then pipelines another request.
				for range 64 {
					if write() != nil {
						break
					}
				}
				if chunked {
					io.WriteString(conn, "0\r\n\r\n")
				}
				io.WriteString(conn, "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
				conn.SetReadDeadline(time.Now().Add(10 * time.Second))
				_, err = io.Copy(io.Discard, br) // until the server closes the connection
				conn.Close()
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Fatalf("iteration %d: the connection stayed open", i)
				}
				if log := h.frontLog(); strings.Contains(log, "panic") {
					t.Fatalf("iteration %d: the front server panicked:\n%s", i, log)
				}
			}
		})
	}
}

// §9.1 rule 2, request STREAMED: chunks after the headers answer are answered 1:1 in order;
// the server may replace or clear each, but the request ends only where the client's body
// ended.
func TestStreamedRequestChunksKeepEOS(t *testing.T) {
	next := make(chan struct{}, 4)
	var seen []*extprocv3.HttpBody
	h := newHarness(t, Config{Mode: streamedMode()}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		b := m.GetRequestBody()
		if b == nil {
			return nil, false, nil
		}
		seen = append(seen, b)
		next <- struct{}{}
		if len(seen) == 1 {
			return requestBodyAnswer(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_ClearBody{ClearBody: true}}), false, nil
		}
		return requestBodyAnswer(&extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte(strings.ToUpper(string(b.Body)))}}), false, nil
	}), sse(sseA), false)
	pr, pw := io.Pipe()
	go func() {
		for _, p := range []string{"one", "two", "three"} {
			pw.Write([]byte(p))
			select {
			case <-next:
			case <-time.After(10 * time.Second):
			}
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", pr)
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	ended(t, h.next(t))
	var got []string
	for _, b := range seen {
		got = append(got, fmt.Sprintf("%s/%v", b.Body, b.EndOfStream))
	}
	// HTTP/1 chunked: the end arrives as its own empty chunk.
	if diff := cmp.Diff([]string{"one/false", "two/false", "three/false", "/true"}, got); diff != "" {
		t.Errorf("request_body messages (-want +got):\n%s", diff)
	}
	if _, _, bodies := h.up.snapshot(); len(bodies) != 1 || string(bodies[0]) != "TWOTHREE" {
		t.Errorf("upstream bodies %q, want [TWOTHREE]", bodies)
	}
}

// §9.1 rule 3: an answer of the wrong type for the current state is spurious in every body
// mode: a local reply while the client has no response headers, with the upstream reset
// when the request had already left.
func TestSpuriousEveryMode(t *testing.T) {
	buffered := &filterv3.ProcessingMode{RequestHeaderMode: filterv3.ProcessingMode_SEND, RequestBodyMode: filterv3.ProcessingMode_BUFFERED,
		ResponseHeaderMode: filterv3.ProcessingMode_SKIP}
	streamedReq := &filterv3.ProcessingMode{RequestHeaderMode: filterv3.ProcessingMode_SEND, RequestBodyMode: filterv3.ProcessingMode_STREAMED,
		ResponseHeaderMode: filterv3.ProcessingMode_SKIP}
	none := &filterv3.ProcessingMode{RequestHeaderMode: filterv3.ProcessingMode_SEND, ResponseHeaderMode: filterv3.ProcessingMode_SEND}
	trailers := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	for _, tc := range []struct {
		name    string
		mode    *filterv3.ProcessingMode
		at      string
		answer  *extprocv3.ProcessingResponse
		details string
		reset   bool
	}{
		{"none: body answer", none, "request_headers", bodyFor(true, nil), "request_body", false},
		{"none: trailers answer without trailers", none, "request_headers", trailers, "request_trailers", false},
		{"buffered: second headers answer", buffered, "request_body", answerHeaders(true, nil), "request_headers", false},
		{"buffered: body answer to headers", buffered, "request_headers", bodyFor(true, nil), "request_body", false},
		{"streamed: streamed_response", streamedReq, "request_body", requestBodyAnswer(streamed([]byte("x"), true)), "request_body", true},
		{"streamed: body answer before the headers answer", streamedReq, "request_headers", bodyFor(true, nil), "request_body", false},
		{"duplex: empty body answer", duplexRequestMode(), "request_body", requestBodyAnswer(nil), "request_body", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{Mode: tc.mode}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				if kindOf(m) == tc.at && (m.GetRequestBody() == nil || m.GetRequestBody().EndOfStream) {
					return tc.answer, false, nil
				}
				return nil, false, nil
			}), func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, false)
			if tc.at == "request_body" && tc.mode.RequestBodyMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
				// headers answered, then a body answer without streamed_response
				h.proc.handle = func(ps *procStream) error {
					for {
						m, err := ps.recv()
						if err != nil {
							return nil
						}
						if b := m.GetRequestBody(); b != nil && b.EndOfStream {
							ps.send(answerHeaders(true, nil))
							ps.send(tc.answer)
						}
					}
				}
			}
			c := h.client(false)
			c.Timeout = 5 * time.Second
			req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", strings.NewReader(`{"a":1}`))
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			e := h.entry(t, 1)
			if resp.StatusCode != 500 || e.Details != "ext_proc_error_spurious_message_"+tc.details || e.Reset != tc.reset {
				t.Errorf("got %d %q reset=%v, want 500 spurious %s reset=%v", resp.StatusCode, e.Details, e.Reset, tc.details, tc.reset)
			}
			if e.UpstreamRequested && !e.UpstreamCancelled {
				t.Errorf("upstream requested and not cancelled: %+v", e)
			}
		})
	}
}

// trailerBody is a request body that fills in its announced trailers at its end, as a
// client that computes a checksum while sending would.
type trailerBody struct {
	parts []string
	req   *http.Request
	value string
}

func (b *trailerBody) Read(p []byte) (int, error) {
	if len(b.parts) == 0 {
		b.req.Trailer.Set("x-sum", b.value)
		return 0, io.EOF
	}
	n := copy(p, b.parts[0])
	b.parts[0] = b.parts[0][n:]
	if b.parts[0] == "" {
		b.parts = b.parts[1:]
	}
	return n, nil
}

// Request trailers (§2.3): with trailer mode SEND the last body message has no
// end_of_stream and request_trailers follows (in FULL_DUPLEX_STREAMED, where it is
// required, the server answers it after its last body answer); with SKIP the server never
// sees an end_of_stream. The upstream gets the trailers either way, mutated by the answer.
func TestRequestTrailers(t *testing.T) {
	skipTrailers := func(m *filterv3.ProcessingMode) *filterv3.ProcessingMode {
		m.RequestTrailerMode = filterv3.ProcessingMode_SKIP
		return m
	}
	withTrailers := func(m *filterv3.ProcessingMode) *filterv3.ProcessingMode {
		m.RequestTrailerMode = filterv3.ProcessingMode_SEND
		return m
	}
	buffered := func() *filterv3.ProcessingMode {
		return &filterv3.ProcessingMode{RequestHeaderMode: filterv3.ProcessingMode_SEND, RequestBodyMode: filterv3.ProcessingMode_BUFFERED,
			ResponseHeaderMode: filterv3.ProcessingMode_SKIP}
	}
	for _, tc := range []struct {
		name string
		mode *filterv3.ProcessingMode
		h2   bool
		send bool // trailer mode SEND
	}{
		{"duplex", duplexRequestMode(), false, true},
		{"duplex h2c", duplexRequestMode(), true, true},
		{"streamed send", withTrailers(streamedMode()), false, true},
		{"buffered send", withTrailers(buffered()), true, true},
		{"buffered skip", skipTrailers(buffered()), false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			duplex := tc.mode.RequestBodyMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
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
					case duplex && m.GetRequestHeaders() != nil:
						ps.send(answerHeaders(true, nil))
					case duplex && m.GetRequestBody() != nil:
						// echoed with end_of_stream false: the trailers end the request
						ps.send(requestBodyAnswer(streamed(m.GetRequestBody().Body, false)))
					case m.GetRequestTrailers() != nil:
						ps.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
							RequestTrailers: &extprocv3.TrailersResponse{HeaderMutation: setHeader("x-checked", "yes")}}})
					default:
						ps.send(echoAnswer(m, pc, nil))
					}
				}
			}
			h := newHarness(t, Config{Mode: tc.mode}, handle, sse(sseA), tc.h2)
			parts := []string{`{"messages":`, `[]}`}
			req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", nil)
			req.Trailer = http.Header{"X-Sum": nil}
			req.Body = io.NopCloser(&trailerBody{parts: append([]string(nil), parts...), req: req, value: "42"})
			req.ContentLength = -1
			c := h.client(tc.h2)
			c.Timeout = 5 * time.Second
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || string(b) != sseA {
				t.Fatalf("got %d %q %v", resp.StatusCode, b, err)
			}
			ps := ended(t, h.next(t))
			var body strings.Builder
			var kinds []string
			for _, m := range ps.messages() {
				if rb := m.GetRequestBody(); rb != nil {
					body.Write(rb.Body)
					if rb.EndOfStream {
						t.Error("request_body with end_of_stream although the request has trailers")
					}
				}
				if k := kindOf(m); strings.HasPrefix(k, "request_") && (len(kinds) == 0 || kinds[len(kinds)-1] != k) {
					kinds = append(kinds, k)
				}
			}
			if body.String() != strings.Join(parts, "") {
				t.Errorf("server saw body %q", body.String())
			}
			wantKinds := []string{"request_headers", "request_body"}
			if tc.send {
				wantKinds = append(wantKinds, "request_trailers")
			}
			if diff := cmp.Diff(wantKinds, kinds); diff != "" {
				t.Errorf("request messages (-want +got):\n%s", diff)
			}
			for _, m := range ps.messages() {
				if tr := m.GetRequestTrailers(); tr != nil {
					hs := tr.GetTrailers().GetHeaders()
					if len(hs) != 1 || hs[0].Key != "x-sum" || string(hs[0].RawValue) != "42" {
						t.Errorf("request_trailers = %v, want x-sum: 42", hs)
					}
				}
			}
			h.up.mu.Lock()
			defer h.up.mu.Unlock()
			if len(h.up.bodies) != 1 || string(h.up.bodies[0]) != strings.Join(parts, "") {
				t.Errorf("upstream bodies %q", h.up.bodies)
			}
			wantChecked := ""
			if tc.send {
				wantChecked = "yes"
			}
			if tr := h.up.trailers[0]; tr.Get("x-sum") != "42" || tr.Get("x-checked") != wantChecked {
				t.Errorf("upstream trailers %v, want x-sum 42 and x-checked %q", tr, wantChecked)
			}
		})
	}
}
