package extproc

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

const (
	buffered = filterv3.ProcessingMode_BUFFERED
	streamed = filterv3.ProcessingMode_STREAMED
	duplex   = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
)

// requestServer is a server with one policy whose bucket holds capacity
// tokens, counting with counter, outcomes reported on the returned channel.
func requestServer(t *testing.T, capacity float64, counter tokenCounter, maxBody int) (*Server, chan Outcome) {
	t.Helper()
	pol := Policy{Name: "p", InjectUsage: true, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: capacity, Rate: 1e-9}}}}
	return policyServer(t, pol, counter, maxBody)
}

// policyServer is a server with the one policy pol, which drive's
// processors follow when it is named "p"; otherwise as requestServer.
func policyServer(t *testing.T, pol Policy, counter tokenCounter, maxBody int) (*Server, chan Outcome) {
	t.Helper()
	outcomes := make(chan Outcome, 16)
	s, err := NewServer(Config{
		Policies: []Policy{pol}, DefaultPolicy: pol.Name, Store: buckets.NewMemory(buckets.MemoryOptions{}),
		counter: counter, MaxBodyBytes: maxBody, Logger: slog.New(slog.DiscardHandler),
		OnFinish: func(o Outcome) { outcomes <- o },
	})
	if err != nil {
		t.Fatal(err)
	}
	return s, outcomes
}

// exchange is what Envoy sends for one request in a body mode: the headers
// (with content-length when cl), the body cut into chunks of size bytes,
// end_of_stream on the last, or trailers after it.
func exchange(mode filterv3.ProcessingMode_BodySendMode, body []byte, size int, cl, trailers bool) []*extprocv3.ProcessingRequest {
	hdr := []string{":path", chatPath, ":method", "POST"}
	if cl {
		hdr = append(hdr, "content-length", strconv.Itoa(len(body)))
	}
	msgs := []*extprocv3.ProcessingRequest{{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headersOf(hdr...)}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: duplex},
	}}
	if mode == buffered {
		size = len(body)
	}
	for i := 0; i < len(body) || i == 0; i += size {
		end := min(i+size, len(body))
		msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: bytes.Clone(body[i:end]), EndOfStream: end == len(body) && !trailers}}})
	}
	if trailers {
		msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
	}
	return msgs
}

// The messages Envoy sends, one by one (§1.2), for tests that write the
// sequence out.

func reqHeadersMsg(reqMode, respMode filterv3.ProcessingMode_BodySendMode, path string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headersOf(":path", path, ":method", "POST")}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: reqMode, ResponseBodyMode: respMode},
	}
}

func reqBodyMsg(body string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: eos}}}
}

func respHeadersMsg(status, contentType string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: headersOf(":status", status, "content-type", contentType), EndOfStream: eos}}}
}

func respBodyMsg(body string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: eos}}}
}

func respTrailersMsg() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
}

// drive hands msgs to a new processor of s, as its stream would, and
// returns every answer sent after each message.
func drive(t *testing.T, s *Server, msgs []*extprocv3.ProcessingRequest) [][]*extprocv3.ProcessingResponse {
	t.Helper()
	p := newProcessor(context.Background(), s, s.live.Load(), "p")
	defer p.finish()
	answers := make([][]*extprocv3.ProcessingResponse, len(msgs))
	for i, m := range msgs {
		if p.done {
			break
		}
		err := p.handle(m, func(r *extprocv3.ProcessingResponse) error {
			answers[i] = append(answers[i], proto.Clone(r).(*extprocv3.ProcessingResponse))
			return nil
		})
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	return answers
}

// kindOf names an answer, and its part of the body when it carries one.
func kindOf(r *extprocv3.ProcessingResponse) string {
	switch x := r.Response.(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return "headers"
	case *extprocv3.ProcessingResponse_RequestBody:
		bm := x.RequestBody.GetResponse().GetBodyMutation()
		switch {
		case bm.GetStreamedResponse() != nil:
			return fmt.Sprintf("streamed eos=%v", bm.GetStreamedResponse().GetEndOfStream())
		case bm.GetBody() != nil:
			return "body replaced"
		}
		return "body"
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return "trailers"
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return fmt.Sprintf("immediate %d", x.ImmediateResponse.GetStatus().GetCode())
	}
	return fmt.Sprintf("%T", r.Response)
}

// bigChat is a chat request of about n bytes whose prompt mixes ASCII with
// multi-byte characters, so that chunks cut through UTF-8 sequences and
// JSON escapes.
func bigChat(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"`)
	for b.Len() < n {
		b.WriteString(`Grüße, 世界! \"quoted\" 🙂 and a tab\t; `)
	}
	b.WriteString(`"}]}`)
	return []byte(b.String())
}

// §3.2, FULL_DUPLEX_STREAMED: nothing is answered, not even the headers,
// until the body is complete; then the headers answer (content-length and
// accept-encoding removed, the decision's metadata), then the body — here
// rewritten with include_usage (S15) — in chunks of at most 64 KiB, with
// end_of_stream on the last only, or followed by the trailers answer.
func TestDuplexRequestWithheld(t *testing.T) {
	body := bigChat(150_000)
	want, err := rewriteBody(tokenizer.Count{API: tokenizer.ChatCompletions}, body, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, trailers := range []bool{false, true} {
		t.Run(fmt.Sprintf("trailers=%v", trailers), func(t *testing.T) {
			s, outcomes := requestServer(t, 1e6, &fakeCounter{input: 10, allowance: 100}, 1<<20)
			msgs := exchange(duplex, body, 10_000, true, trailers)
			answers := drive(t, s, msgs)
			last := len(msgs) - 1
			for i, a := range answers[:last] {
				if len(a) > 0 {
					t.Fatalf("message %d (%s) answered with %s before the body was complete", i, msgs[i].String()[:40], kindOf(a[0]))
				}
			}
			final := answers[last]
			var kinds []string
			var got []byte
			for _, a := range final {
				kinds = append(kinds, kindOf(a))
				if sr := a.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
					if len(sr.Body) > duplexChunk {
						t.Errorf("streamed chunk of %d bytes, more than %d", len(sr.Body), duplexChunk)
					}
					got = append(got, sr.Body...)
				}
			}
			n := (len(want) + duplexChunk - 1) / duplexChunk
			wantKinds := []string{"headers"}
			for i := range n {
				wantKinds = append(wantKinds, fmt.Sprintf("streamed eos=%v", i == n-1 && !trailers))
			}
			if trailers {
				wantKinds = append(wantKinds, "trailers")
			}
			if diff := cmp.Diff(wantKinds, kinds); diff != "" {
				t.Errorf("answers to the last message (-want +got):\n%s", diff)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("the body sent back (%d bytes) is not the rewritten body (%d bytes)", len(got), len(want))
			}
			hm := final[0].GetRequestHeaders().GetResponse().GetHeaderMutation()
			if diff := cmp.Diff([]string{"accept-encoding", "content-length"}, hm.GetRemoveHeaders()); diff != "" {
				t.Errorf("headers removed (-want +got):\n%s", diff)
			}
			if d := final[0].GetDynamicMetadata().GetFields()["tokengate"].GetStructValue().GetFields()["decision"].GetStringValue(); d != "admitted" {
				t.Errorf("headers answer metadata decision %q, want admitted (S24)", d)
			}
			if o := <-outcomes; o.Decision != "admitted" || o.Reserved != 110 {
				t.Errorf("outcome %+v, want admitted with 110 reserved", o)
			}
		})
	}
}

// §3.2, §4: a refusal in FULL_DUPLEX_STREAMED mode is the only answer: no
// headers answer, so Envoy replies locally and never contacts the upstream.
// So is a body over MaxBodyBytes, refused as soon as it passes the bound,
// and a content-length above it, refused at the headers.
func TestDuplexRequestRefused(t *testing.T) {
	body := bigChat(5_000)
	for _, tc := range []struct {
		name     string
		capacity float64
		maxBody  int
		cl       bool
		want     string
		at       int // the message answered
	}{
		{"429", 150, 1 << 20, true, "immediate 429", -1},
		{"413 never admissible", 20, 1 << 20, false, "immediate 413", -1},
		{"413 body", 1e6, 3_000, false, "immediate 413", 4},
		{"413 content-length", 1e6, 3_000, true, "immediate 413", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, outcomes := requestServer(t, tc.capacity, &fakeCounter{input: 10, allowance: 100}, tc.maxBody)
			if tc.name == "429" {
				// Another request holds most of the bucket: what is left is
				// less than this request's cost, not than its capacity.
				b := buckets.Bucket{Name: "g", Key: newProcessor(context.Background(), s, s.live.Load(), "p").key("g", "", false), Limit: s.live.Load().byName["p"].Buckets[0].Limit}
				if d, err := s.cfg.Store.Reserve(context.Background(), buckets.Request{Cost: 100, Buckets: []buckets.Bucket{b}}); err != nil || !d.OK {
					t.Fatalf("holding the bucket: %+v %v", d, err)
				}
			}
			msgs := exchange(duplex, body, 1_000, tc.cl, false)
			answers := drive(t, s, msgs)
			at := tc.at
			if at < 0 {
				at = len(msgs) - 1
			}
			for i, a := range answers {
				var kinds []string
				for _, r := range a {
					kinds = append(kinds, kindOf(r))
				}
				want := []string(nil)
				if i == at {
					want = []string{tc.want}
				}
				if diff := cmp.Diff(want, kinds); diff != "" {
					t.Errorf("answers to message %d (-want +got):\n%s", i, diff)
				}
			}
			if o := <-outcomes; o.Reserved != 0 || o.SettleOutcome != "" {
				t.Errorf("outcome %+v: a refused request reserves nothing", o)
			}
		})
	}
}

// §3.2, STREAMED: every chunk but the last is answered at once, unchanged;
// the last one's answer carries the decision. The count is the same as
// BUFFERED's, however the body is cut, with the real tokenizer (the cuts
// fall inside UTF-8 sequences and escapes); the body is never rewritten.
// With trailers the decision answers them instead.
func TestStreamedRequestCountsAsBuffered(t *testing.T) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	body := bigChat(8_000)
	s, outcomes := requestServer(t, 1e7, tokenizerCounter{tc}, 1<<20)
	drive(t, s, exchange(buffered, body, 0, true, false))
	want := <-outcomes
	if want.InputTokens < 1_000 {
		t.Fatalf("BUFFERED count %d: the prompt was not counted", want.InputTokens)
	}
	for _, size := range []int{1, 7, 4096, 7_999} {
		for _, trailers := range []bool{false, true} {
			msgs := exchange(streamed, body, size, size%2 == 0, trailers)
			answers := drive(t, s, msgs)
			for i, a := range answers[1:] {
				wantKind := "body"
				if trailers && i == len(answers)-2 {
					wantKind = "trailers"
				}
				if len(a) != 1 || kindOf(a[0]) != wantKind {
					t.Fatalf("size %d trailers %v: message %d answered %d times, first %s; want one %s", size, trailers, i+1, len(a), kindOf(a[0]), wantKind)
				}
			}
			decision := answers[len(answers)-1][0]
			if decision.GetDynamicMetadata() == nil {
				t.Errorf("size %d trailers %v: the last answer carries no decision metadata", size, trailers)
			}
			if got := <-outcomes; got.InputTokens != want.InputTokens || got.Decision != "admitted" {
				t.Errorf("size %d trailers %v: %d input tokens (%s), BUFFERED counts %d", size, trailers, got.InputTokens, got.Decision, want.InputTokens)
			}
		}
	}
}

// A refusal in STREAMED mode answers the last chunk (or the trailers) with
// an ImmediateResponse: Envoy resets the upstream request, which never saw
// its end (§4).
func TestStreamedRequestRefused(t *testing.T) {
	body := bigChat(3_000)
	for _, trailers := range []bool{false, true} {
		s, outcomes := requestServer(t, 20, &fakeCounter{input: 10, allowance: 100}, 1<<20)
		msgs := exchange(streamed, body, 500, false, trailers)
		answers := drive(t, s, msgs)
		if got := answers[len(msgs)-1]; len(got) != 1 || kindOf(got[0]) != "immediate 413" {
			t.Errorf("trailers %v: last message answered %v, want one immediate 413", trailers, got)
		}
		if o := <-outcomes; o.Decision != "never_admissible" {
			t.Errorf("trailers %v: outcome %+v", trailers, o)
		}
	}
}

// keepChunk gathers a body in one buffer: of the announced size when the
// content-length is known, else doubling, never larger than twice the body
// nor than MaxBodyBytes; a body in one message is not copied.
func TestKeepChunk(t *testing.T) {
	const limit = 1 << 20
	s, _ := requestServer(t, 1e6, &fakeCounter{}, limit)
	body := bigChat(limit - 100)
	for _, hint := range []int{0, len(body)} {
		p := newProcessor(context.Background(), s, s.live.Load(), "p")
		p.req.sizeHint = hint
		grows, prevCap := 0, 0
		for i := 0; i < len(body); i += 1000 {
			end := min(i+1000, len(body))
			p.keepChunk(body[i:end], end == len(body))
			if c := cap(p.req.body); c != prevCap {
				grows++
				prevCap = c
			}
			if c := cap(p.req.body); c > limit || c > 2*max(len(p.req.body), 1000) && hint == 0 {
				t.Fatalf("hint %d: buffer of %d bytes for %d bytes kept", hint, c, len(p.req.body))
			}
		}
		if !bytes.Equal(p.req.body, body) {
			t.Fatalf("hint %d: the body kept differs", hint)
		}
		if hint > 0 && grows != 1 {
			t.Errorf("content-length known: %d allocations, want 1", grows)
		}
	}
	p := newProcessor(context.Background(), s, s.live.Load(), "p")
	one := []byte(`{"model":"m"}`)
	p.keepChunk(one, true)
	if &p.req.body[0] != &one[0] {
		t.Error("a body in one message was copied")
	}
}

// A STREAMED body that ends with trailers while request_trailer_mode is
// SKIP never shows tokengate its end (§2.3): it is decided when the
// upstream's 200 arrives, whose headers Envoy still holds, so that trailers
// cannot carry a request past the meter. A refusal replaces the upstream's
// answer with the 429.
func TestStreamedRequestTrailersSkipped(t *testing.T) {
	mode := duplexMode()
	mode.RequestBodyMode = streamed
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(`{}`)}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 150, Rate: 1e-9}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: mode})
	post := func() (*http.Response, string) {
		req, err := http.NewRequest("POST", r.front.URL+chatPath, io.MultiReader(strings.NewReader(`{"model":"m","max_tokens":100,"messages":[]}`)))
		if err != nil {
			t.Fatal(err)
		}
		req.ContentLength = -1
		req.Trailer = http.Header{"X-Checksum": {"1"}}
		resp, err := r.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}
	if resp, body := post(); resp.StatusCode != 200 || body != `{}` {
		t.Fatalf("first: %d %q", resp.StatusCode, body)
	}
	if o := r.outcome(t); o.Decision != "admitted" || o.Settled != 110 {
		t.Errorf("first: outcome %+v, want admitted and its reservation settled", o)
	}
	resp, body := post()
	if resp.StatusCode != 429 || !strings.Contains(body, "rate_limit_exceeded") {
		t.Errorf("second: %d %q, want 429", resp.StatusCode, body)
	}
	if o := r.outcome(t); o.Decision != "refused_tokens" {
		t.Errorf("second: outcome %+v, want refused_tokens", o)
	}
	if e := r.entry(t, 2); !slices.Contains(e.Sent, "request_body") || slices.Contains(e.Sent, "request_trailers") {
		t.Errorf("messages sent %v: want body chunks and no trailers (SKIP)", e.Sent)
	}
}

// §2.4: an HTTP/2 POST whose body is one empty DATA frame with END_STREAM
// is sent as its headers, then request_body{"", end_of_stream}, in every
// body mode. It is a request without body, as an HTTP/1 POST with
// content-length 0 is, whose headers carry end_of_stream: it goes on
// unmetered (docs/budgets.md, "not metered: ... a request without body"),
// not refused as malformed JSON.
func TestEmptyBodyWithEndOfStreamIsUnmetered(t *testing.T) {
	for _, tc := range []struct {
		mode filterv3.ProcessingMode_BodySendMode
		want [][]string // the kinds of the answers to the headers, then to the body
	}{
		{buffered, [][]string{{"headers"}, {"body"}}},
		{streamed, [][]string{{"headers"}, {"body"}}},
		{duplex, [][]string{nil, {"headers", "streamed eos=true"}}},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			s, outcomes := requestServer(t, 1e6, &fakeCounter{input: 10, allowance: 100}, 1<<20)
			answers := drive(t, s, []*extprocv3.ProcessingRequest{
				reqHeadersMsg(tc.mode, duplex, chatPath),
				reqBodyMsg("", true),
			})
			var got [][]string
			for _, as := range answers {
				var kinds []string
				for _, a := range as {
					kinds = append(kinds, kindOf(a))
				}
				got = append(got, kinds)
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("answers (-want +got):\n%s", d)
			}
			if o := <-outcomes; o.Decision != "unmetered" || o.Reserved != 0 {
				t.Errorf("outcome %+v, want unmetered with nothing reserved", o)
			}
		})
	}
}
