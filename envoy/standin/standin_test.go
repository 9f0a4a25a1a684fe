package standin

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

const (
	sseA = "data: {\"n\":1}\n\n"
	sseB = "data: {\"n\":2}\n\n"
	sseC = "data: [DONE]\n\n"
)

var headersOnly = &filterv3.ProcessingMode{
	RequestHeaderMode:  filterv3.ProcessingMode_SEND,
	ResponseHeaderMode: filterv3.ProcessingMode_SEND,
}

func streamedMode() *filterv3.ProcessingMode {
	return &filterv3.ProcessingMode{
		RequestHeaderMode:  filterv3.ProcessingMode_SEND,
		RequestBodyMode:    filterv3.ProcessingMode_STREAMED,
		ResponseHeaderMode: filterv3.ProcessingMode_SEND,
		ResponseBodyMode:   filterv3.ProcessingMode_STREAMED,
	}
}

// Scenario §9.2.1: GET, headers only.
func TestHeadersOnlyGET(t *testing.T) {
	h := newHarness(t, Config{Mode: headersOnly}, echo, sse(sseA, sseB), false)
	res := h.do(t, "GET", "/v1/models", "")
	if res.status != 200 || res.body != sseA+sseB {
		t.Fatalf("got %d %q, want 200 %q", res.status, res.body, sseA+sseB)
	}
	ps := ended(t, h.next(t))
	if diff := cmp.Diff([]string{"request_headers", "response_headers"}, ps.kinds()); diff != "" {
		t.Errorf("messages (-want +got):\n%s", diff)
	}
	msgs := ps.messages()
	if !msgs[0].GetRequestHeaders().GetEndOfStream() {
		t.Error("request_headers.end_of_stream = false for a GET")
	}
	if got := msgs[0].GetProtocolConfig(); got == nil || msgs[1].GetProtocolConfig() != nil {
		t.Errorf("protocol_config must be on the first message only: %v / %v", got, msgs[1].GetProtocolConfig())
	}
	hs := map[string]string{}
	for _, hv := range msgs[0].GetRequestHeaders().GetHeaders().GetHeaders() {
		if hv.GetValue() != "" {
			t.Errorf("header %s has value set; Envoy sends raw_value", hv.GetKey())
		}
		hs[hv.GetKey()] = string(hv.GetRawValue())
	}
	if hs[":method"] != "GET" || hs[":path"] != "/v1/models" || hs[":authority"] == "" {
		t.Errorf("pseudo-headers = %v", hs)
	}
	e := h.entry(t, 1)
	if e.Status != 200 || e.Details != "via_upstream" || !e.SideStream || e.UpstreamCancelled || e.BytesToClient != int64(len(sseA+sseB)) {
		t.Errorf("entry = %+v", e)
	}
}

// The recommended modes (§5.2): BUFFERED request, FULL_DUPLEX_STREAMED response, with
// HTTP/1 style (empty eos chunk) and HTTP/2 style (eos on the last data) bodies.
func TestRecommendedModesEcho(t *testing.T) {
	for _, tc := range []struct {
		name      string
		chunk     int
		eosOnLast bool
		h2        bool
	}{
		{"as read, http1 eos", 0, false, false},
		{"one byte, http1 eos", 1, false, false},
		{"7 bytes, eos on last", 7, true, false},
		{"h2c, 5 bytes", 5, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{ChunkSize: tc.chunk, EOSOnLastChunk: tc.eosOnLast}, echo, sse(sseA, sseB, sseC), tc.h2)
			body := `{"model":"gpt-4o","stream":true}`
			res := h.doWith(t, h.client(tc.h2), "POST", "/v1/chat/completions", body, "content-type", "application/json")
			if want := sseA + sseB + sseC; res.status != 200 || res.body != want {
				t.Fatalf("got %d %q, want 200 %q", res.status, res.body, want)
			}
			if res.header.Get("content-type") != "text/event-stream" {
				t.Errorf("content-type = %q", res.header.Get("content-type"))
			}
			_, _, bodies := h.up.snapshot()
			if len(bodies) != 1 || string(bodies[0]) != body {
				t.Errorf("upstream bodies = %q, want [%q]", bodies, body)
			}
			ps := ended(t, h.next(t))
			msgs := ps.messages()
			kinds := ps.kinds()
			if diff := cmp.Diff([]string{"request_headers", "request_body", "response_headers"}, kinds[:3]); diff != "" {
				t.Errorf("messages (-want +got):\n%s", diff)
			}
			if rb := msgs[1].GetRequestBody(); string(rb.GetBody()) != body || !rb.GetEndOfStream() {
				t.Errorf("request_body = %q eos=%v, want whole body with eos", rb.GetBody(), rb.GetEndOfStream())
			}
			var got strings.Builder
			for i, m := range msgs[3:] {
				b := m.GetResponseBody()
				if b == nil {
					t.Fatalf("message %d is %s, want response_body", i+3, kindOf(m))
				}
				if tc.chunk > 0 && len(b.Body) > tc.chunk {
					t.Errorf("chunk of %d bytes exceeds ChunkSize %d", len(b.Body), tc.chunk)
				}
				last := i == len(msgs)-4
				if b.EndOfStream != last {
					t.Errorf("response_body %d eos=%v, want %v", i, b.EndOfStream, last)
				}
				if last && (len(b.Body) == 0) == tc.eosOnLast {
					t.Errorf("last response_body has %d bytes; EOSOnLastChunk=%v", len(b.Body), tc.eosOnLast)
				}
				got.Write(b.Body)
			}
			if got.String() != sseA+sseB+sseC {
				t.Errorf("server saw %q", got.String())
			}
		})
	}
}

func answerHeaders(req bool, mut *extprocv3.HeaderMutation) *extprocv3.ProcessingResponse {
	hr := &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{HeaderMutation: mut}}
	if req {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: hr}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: hr}}
}

func setHeader(k, v string) *extprocv3.HeaderMutation {
	return &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}}}
}

// scripted runs the echo server but lets answer replace the answer to chosen messages;
// answer returns nil to echo, and stop=true to end the server's handler with err.
func scripted(answer func(m *extprocv3.ProcessingRequest) (resp *extprocv3.ProcessingResponse, stop bool, err error)) func(*procStream) error {
	return func(ps *procStream) error {
		var pc *extprocv3.ProtocolConfiguration
		for {
			m, err := ps.recv()
			if err != nil {
				return nil
			}
			if pc == nil {
				pc = m.GetProtocolConfig()
			}
			resp, stop, err := answer(m)
			if stop {
				return err
			}
			if resp == nil {
				resp = echoAnswer(m, pc, nil)
			}
			if err := ps.send(resp); err != nil {
				return nil
			}
		}
	}
}

// Scenario §9.2.3: BUFFERED body rewrite, with and without fixing content-length.
func TestBufferedRewrite(t *testing.T) {
	const newBody = `{"max_tokens":10}`
	for _, tc := range []struct {
		name       string
		mut        *extprocv3.HeaderMutation
		wantStatus int
		wantUp     int
	}{
		{"content-length fixed", setHeader("content-length", "17"), 200, 1},
		{"content-length removed", &extprocv3.HeaderMutation{RemoveHeaders: []string{"content-length"}}, 200, 1},
		{"content-length stale", nil, 500, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				if m.GetRequestBody() == nil {
					return nil, false, nil
				}
				return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
					Response: &extprocv3.CommonResponse{HeaderMutation: tc.mut, BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte(newBody)}}},
				}}}, false, nil
			}), sse(sseA), false)
			res := h.do(t, "POST", "/v1/chat/completions", `{"max_tokens":100000}`)
			if res.status != tc.wantStatus {
				t.Fatalf("status = %d, want %d", res.status, tc.wantStatus)
			}
			calls, _, bodies := h.up.snapshot()
			if calls != tc.wantUp {
				t.Fatalf("upstream calls = %d, want %d", calls, tc.wantUp)
			}
			if calls == 1 && string(bodies[0]) != newBody {
				t.Errorf("upstream body = %q, want %q", bodies[0], newBody)
			}
			if e := h.entry(t, 1); tc.wantStatus == 500 && e.Details != "mismatch_between_content_length_and_the_length_of_the_mutated_body" {
				t.Errorf("details = %q", e.Details)
			}
		})
	}
}

func immediate(code int, body string, ns string) *extprocv3.ProcessingResponse {
	r := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: typev3.StatusCode(code)},
		Headers: setHeader("content-type", "application/json"),
		Body:    []byte(body),
		Details: "token rate limited",
	}}}
	if ns != "" {
		md, _ := structpb.NewStruct(map[string]any{ns: map[string]any{"refused": true}, "other.ns": map[string]any{"x": 1}})
		r.DynamicMetadata = md
	}
	return r
}

// ImmediateResponse per phase (§4): local reply while response headers are held, reset after.
func TestImmediateResponsePerPhase(t *testing.T) {
	const refusal = `{"error":{"code":"rate_limit_exceeded"}}`
	for _, tc := range []struct {
		name      string
		mode      *filterv3.ProcessingMode
		at        string
		wantReset bool
		wantUp    bool
	}{
		{"request headers", nil, "request_headers", false, false},
		{"request body buffered", nil, "request_body", false, false},
		{"response headers", nil, "response_headers", false, true},
		{"response body duplex", nil, "response_body", true, true},
		{"response body streamed", streamedMode(), "response_body", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{Mode: tc.mode, ReceivingNamespaces: []string{"tokengate"}}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				if kindOf(m) == tc.at {
					return immediate(429, refusal, "tokengate"), false, nil
				}
				return nil, false, nil
			}), sse(sseA, sseB), false)
			req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", strings.NewReader(`{"stream":true}`))
			resp, err := h.client(false).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, bodyErr := io.ReadAll(resp.Body)
			resp.Body.Close()
			e := h.entry(t, 1)
			if tc.wantReset {
				if resp.StatusCode != 200 || bodyErr == nil {
					t.Errorf("got %d, body error %v; want 200 then a reset", resp.StatusCode, bodyErr)
				}
				if !e.Reset {
					t.Error("entry.Reset = false")
				}
			} else {
				if resp.StatusCode != 429 || string(b) != refusal || resp.Header.Get("content-type") != "application/json" {
					t.Errorf("got %d %q %q, want the local reply", resp.StatusCode, resp.Header.Get("content-type"), b)
				}
				if e.Status != 429 || e.Details != "token_rate_limited" || e.Reset {
					t.Errorf("entry = %+v", e)
				}
			}
			calls, _, _ := h.up.snapshot()
			if (calls > 0) != tc.wantUp {
				t.Errorf("upstream calls = %d, want called=%v", calls, tc.wantUp)
			}
			want := map[string]*structpb.Struct{"tokengate": {Fields: map[string]*structpb.Value{"refused": structpb.NewBoolValue(true)}}}
			if diff := cmp.Diff(want, e.DynamicMetadata, protocmp.Transform()); diff != "" {
				t.Errorf("dynamic metadata (-want +got):\n%s", diff)
			}
			ended(t, h.next(t))
		})
	}
}

// Scenario §9.2.5: a buffered body over the limit gets 413; the server sees only the
// request headers, then the stream closes.
func TestBufferOverflow413(t *testing.T) {
	gotHeaders := make(chan struct{})
	h := newHarness(t, Config{RequestBufferLimit: 16}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		if m.GetRequestHeaders() != nil {
			close(gotHeaders)
		}
		return nil, false, nil
	}), sse(sseA), false)
	// The body follows the headers message: a reset stream can lose a message in flight.
	pr, pw := io.Pipe()
	go func() {
		select {
		case <-gotHeaders:
		case <-time.After(10 * time.Second):
		}
		pw.Write([]byte(strings.Repeat("x", 100)))
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", pr)
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("status = %d, want 413", resp.StatusCode)
	}
	ps := ended(t, h.next(t))
	if diff := cmp.Diff([]string{"request_headers"}, ps.kinds()); diff != "" {
		t.Errorf("messages (-want +got):\n%s", diff)
	}
	if calls, _, _ := h.up.snapshot(); calls != 0 {
		t.Errorf("upstream calls = %d, want 0", calls)
	}
	if e := h.entry(t, 1); e.Details != "request_payload_too_large" {
		t.Errorf("details = %q", e.Details)
	}
}

// STREAMED: data that arrived while the headers answer was pending goes out as one merged
// chunk; later chunks are answered 1:1 and replaced in order.
func TestStreamedMergedChunkAndOneToOne(t *testing.T) {
	reqDone := make(chan struct{})
	upper := func(m *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		b := m.GetResponseBody()
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: []byte(strings.ToUpper(string(b.Body)))}}},
		}}}
	}
	h := newHarness(t, Config{Mode: streamedMode(), ChunkSize: 5}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
		switch kindOf(m) {
		case "request_headers":
			waitChan(t, reqDone, "request body held")
		case "response_body":
			return upper(m), false, nil
		}
		return nil, false, nil
	}), sse(sseA, sseB), false)
	h.proxy.hook = func(ev string, eos bool) {
		if ev == "request_data" && eos {
			close(reqDone)
		}
	}
	pr, pw := io.Pipe()
	go func() {
		for _, s := range []string{"aaa", "bbb", "ccc"} {
			pw.Write([]byte(s))
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", h.front.URL+"/v1/chat/completions", pr)
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := strings.ToUpper(sseA + sseB); string(b) != want {
		t.Errorf("client body = %q, want %q", b, want)
	}
	_, _, bodies := h.up.snapshot()
	if len(bodies) != 1 || string(bodies[0]) != "aaabbbccc" {
		t.Errorf("upstream bodies = %q", bodies)
	}
	ps := ended(t, h.next(t))
	msgs := ps.messages()
	if kindOf(msgs[1]) != "request_body" || string(msgs[1].GetRequestBody().Body) != "aaabbbccc" || !msgs[1].GetRequestBody().EndOfStream {
		t.Errorf("second message = %v, want one merged request_body with eos", msgs[1])
	}
	if kindOf(msgs[2]) != "response_headers" {
		t.Errorf("third message = %s", kindOf(msgs[2]))
	}
	if e := h.entry(t, 1); e.Status != 200 || e.Reset {
		t.Errorf("entry = %+v", e)
	}
}

func bodyFor(req bool, body []byte) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}}}
	if req {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// Scenario §9.2.23: spurious answers fail the request on 1.35+ and are ignored before.
func TestSpuriousAnswer(t *testing.T) {
	for _, tc := range []struct {
		name       string
		minor      int
		at         string
		answer     *extprocv3.ProcessingResponse
		wantStatus int
		wantReset  bool
	}{
		{"response body answer to request headers", 37, "request_headers", bodyFor(false, nil), 500, false},
		{"same on 1.34 is ignored", 34, "request_headers", bodyFor(false, nil), 200, false},
		{"plain body mutation in duplex", 37, "response_body", bodyFor(false, []byte("x")), 200, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{EnvoyMinor: tc.minor}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				if kindOf(m) == tc.at {
					return tc.answer, false, nil
				}
				return nil, false, nil
			}), sse(sseA, sseB), false)
			res := h.do(t, "POST", "/v1/chat/completions", `{}`)
			if res.status != tc.wantStatus || (res.bodyErr != nil) != tc.wantReset {
				t.Errorf("got %d (body error %v), want %d reset=%v", res.status, res.bodyErr, tc.wantStatus, tc.wantReset)
			}
			if e := h.entry(t, 1); e.Reset != tc.wantReset {
				t.Errorf("entry = %+v", e)
			}
		})
	}
}

// Scenario §9.2.22: no answer within message_timeout → 504, or continue with
// failure_mode_allow.
func TestMessageTimeout(t *testing.T) {
	silent := func(ps *procStream) error {
		for {
			if _, err := ps.recv(); err != nil {
				return nil
			}
		}
	}
	for _, allow := range []bool{false, true} {
		h := newHarness(t, Config{MessageTimeout: 20e6, FailureModeAllow: allow}, silent, sse(sseA), false)
		res := h.do(t, "GET", "/v1/models", "")
		e := h.entry(t, 1)
		if !allow && (res.status != 504 || e.Details != "ext_proc_error_per-message_timeout_exceeded") {
			t.Errorf("fail-closed: got %d %q", res.status, e.Details)
		}
		if allow && (res.status != 200 || res.body != sseA) {
			t.Errorf("fail-open: got %d %q", res.status, res.body)
		}
		ended(t, h.next(t))
	}
}

// The timer is never armed for a FULL_DUPLEX_STREAMED direction (§1.4).
func TestDuplexTimerNotArmed(t *testing.T) {
	p := &Proxy{cfg: Config{MessageTimeout: 1}}
	x := &exchange{p: p}
	d := &dir{bodyMode: modeDuplex}
	x.arm(d)
	if !d.deadline.IsZero() {
		t.Error("duplex direction armed")
	}
	d.bodyMode = modeBuffered
	x.arm(d)
	if d.deadline.IsZero() {
		t.Error("buffered direction not armed")
	}
}

// Scenario §9.2.10: a duplex answer with end_of_stream ends the client's response and
// cancels the upstream request, over HTTP/1 and h2c.
func TestDuplexEarlyEOSCancelsUpstream(t *testing.T) {
	const closing = "data: {\"finish_reason\":\"length\"}\n\ndata: [DONE]\n\n"
	for _, h2 := range []bool{false, true} {
		h := newHarness(t, Config{}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
			if m.GetResponseBody() != nil {
				return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
					Response: &extprocv3.CommonResponse{BodyMutation: streamed([]byte(closing), true)},
				}}}, false, nil
			}
			return nil, false, nil
		}), endless(sseA), h2)
		res := h.doWith(t, h.client(h2), "POST", "/v1/chat/completions", `{}`)
		if res.status != 200 || res.body != closing || res.bodyErr != nil {
			t.Errorf("h2=%v: got %d %q %v, want 200 %q and a clean end", h2, res.status, res.body, res.bodyErr, closing)
		}
		waitChan(t, h.up.gone, "upstream cancellation")
		e := h.entry(t, 1)
		if !e.UpstreamCancelled || e.Reset || e.BytesToClient != int64(len(closing)) {
			t.Errorf("h2=%v: entry = %+v", h2, e)
		}
		ended(t, h.next(t))
	}
}

// Scenario §9.2.27 plus metadata_context: per-route initial metadata, disabled routes.
func TestRoutesAndMetadata(t *testing.T) {
	claims, _ := structpb.NewStruct(map[string]any{"sub": "alice"})
	h := newHarness(t, Config{
		Mode: headersOnly,
		Routes: []Route{
			{Prefix: "/gold", InitialMetadata: map[string]string{"x-tokengate-policy": "gold", "x-request-id": "%REQ(x-request-id)%"}},
			{Prefix: "/off", Disabled: true},
			{Prefix: "/"},
		},
		Metadata: func(r *http.Request) *corev3.Metadata {
			return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": claims}}
		},
	}, echo, sse(sseA), false)
	if res := h.do(t, "GET", "/off/x", ""); res.status != 200 || res.body != sseA {
		t.Fatalf("disabled route: %d %q", res.status, res.body)
	}
	if e := h.entry(t, 1); e.SideStream || len(e.Sent) != 0 {
		t.Errorf("disabled route opened a side stream: %+v", e)
	}
	if res := h.do(t, "GET", "/gold/x", "", "x-request-id", "r-1"); res.status != 200 {
		t.Fatalf("gold route: %d", res.status)
	}
	ps := ended(t, h.next(t))
	if got := ps.md.Get("x-tokengate-policy"); len(got) != 1 || got[0] != "gold" {
		t.Errorf("x-tokengate-policy = %v", got)
	}
	if got := ps.md.Get("x-request-id"); len(got) != 1 || got[0] != "r-1" {
		t.Errorf("x-request-id = %v", got)
	}
	for i, m := range ps.messages() {
		want := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": claims}}
		if diff := cmp.Diff(want, m.GetMetadataContext(), protocmp.Transform()); diff != "" {
			t.Errorf("message %d metadata_context (-want +got):\n%s", i, diff)
		}
	}
	if len(h.proc.all()) != 1 {
		t.Errorf("side streams = %d, want 1", len(h.proc.all()))
	}
}

// Server closes (§2.5, §7.1): OK means continue unprocessed; an error fails the request
// unless failure_mode_allow.
func TestServerClose(t *testing.T) {
	for _, tc := range []struct {
		name       string
		err        error
		allow      bool
		wantStatus int
		wantDetail string
	}{
		{"ok close", nil, false, 200, "via_upstream"},
		{"error, fail closed", status.Error(codes.Internal, "boom"), false, 500, "ext_proc_error_gRPC_error_13{boom}"},
		{"error, fail open", status.Error(codes.Internal, "boom"), true, 200, "via_upstream"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, Config{FailureModeAllow: tc.allow}, scripted(func(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, bool, error) {
				return nil, true, tc.err
			}), sse(sseA), false)
			res := h.do(t, "POST", "/v1/chat/completions", `{"a":1}`)
			e := h.entry(t, 1)
			if res.status != tc.wantStatus || e.Details != tc.wantDetail {
				t.Errorf("got %d %q, want %d %q", res.status, e.Details, tc.wantStatus, tc.wantDetail)
			}
			if tc.wantStatus == 200 && res.body != sseA {
				t.Errorf("body = %q", res.body)
			}
		})
	}
}

// Scenario §9.2.20: the client goes away mid-stream; the upstream is cancelled and the side
// stream closed.
func TestClientDisconnect(t *testing.T) {
	h := newHarness(t, Config{}, echo, endless(sseA), false)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", h.front.URL+"/v1/chat/completions", strings.NewReader(`{}`))
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(sseA))
	if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != sseA {
		t.Fatalf("first event %q, %v", buf, err)
	}
	cancel()
	resp.Body.Close()
	waitChan(t, h.up.gone, "upstream cancellation")
	e := h.entry(t, 1)
	if !e.ClientCancelled || !e.UpstreamCancelled {
		t.Errorf("entry = %+v", e)
	}
	ps := ended(t, h.next(t))
	if code := status.Code(ps.end); ps.end != io.EOF && code != codes.Canceled {
		t.Errorf("server's Recv ended with %v, want io.EOF or Canceled", ps.end)
	}
	if kinds := ps.kinds(); kinds[len(kinds)-1] != "response_body" {
		t.Errorf("last message = %s, want response_body", kinds[len(kinds)-1])
	}
}

func TestMutate(t *testing.T) {
	base := []header{{":authority", "a"}, {":path", "/p"}, {":method", "POST"}, {"content-length", "3"}, {"x-a", "1"}}
	opt := func(k, v string, raw bool, app bool) *corev3.HeaderValueOption {
		hv := &corev3.HeaderValue{Key: k}
		if raw {
			hv.RawValue = []byte(v)
		} else {
			hv.Value = v
		}
		o := &corev3.HeaderValueOption{Header: hv}
		if app {
			o.Append = wrapperspb.Bool(true)
		}
		return o
	}
	_ = opt
	for _, tc := range []struct {
		name    string
		mut     *extprocv3.HeaderMutation
		dropCL  bool
		want    []header
		wantErr bool
	}{
		{"set raw", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{opt("x-a", "2", true, false)}}, false,
			[]header{{":authority", "a"}, {":path", "/p"}, {":method", "POST"}, {"content-length", "3"}, {"x-a", "2"}}, false},
		{"value only writes empty", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{opt("x-b", "v", false, false)}}, false,
			append(append([]header(nil), base...), header{"x-b", ""}), false},
		{"forbidden ignored", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			opt(":authority", "evil", true, false), opt("host", "evil", true, false), opt("x-envoy-foo", "1", true, false),
			opt("x-envoyfoo", "1", true, false), opt(":method", "GET", true, false)}}, false, base, false},
		{"remove pseudo ignored", &extprocv3.HeaderMutation{RemoveHeaders: []string{":path", "host", "x-a"}}, false, base[:4], false},
		{"content-length skipped when dropped", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{opt("content-length", "9", true, false)}}, true, base, false},
		{"path settable", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{opt(":path", "/q", true, false)}}, false,
			[]header{{":authority", "a"}, {":method", "POST"}, {"content-length", "3"}, {"x-a", "1"}, {":path", "/q"}}, false},
		{"invalid name", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{opt("bad name", "1", true, false)}}, false, nil, true},
		{"both value and raw", &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "x", Value: "a", RawValue: []byte("b")}}}}, false, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := mutate(append([]header(nil), base...), tc.mut, tc.dropCL)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if tc.wantErr {
				return
			}
			if diff := cmp.Diff(tc.want, got, cmp.AllowUnexported(header{})); diff != "" {
				t.Errorf("headers (-want +got):\n%s", diff)
			}
		})
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	_, err := New(Config{EnvoyMinor: 30, ChunkSize: -1, Mode: &filterv3.ProcessingMode{ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}})
	if err == nil {
		t.Fatal("New accepted a bad config")
	}
	for _, want := range []string{"ExtProc", "Upstream", "EnvoyMinor", "ChunkSize", "response_trailer_mode"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}
