package extproc

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/envoy/standin"
)

const chatPath = "/v1/chat/completions"

func words(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = chatChunk(" w")
	}
	return out
}

func streamOf(events ...string) []byte {
	return append(sse(events...), []byte("data: [DONE]\n\n")...)
}

// Scenario 2: a small JSON request, BUFFERED: admitted, reserved input plus
// the request's max_tokens (S7), forwarded, and the response carries the
// limit headers (S17).
func TestScenario02BufferedSmallAdmitted(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(`{"id":"x","choices":[]}`)}}
	r := newRig(t, u, rigOptions{})
	resp, body := r.post(t, chatPath, `{"model":"gpt-4o-mini","max_tokens":50,"messages":[]}`, nil)
	if resp.StatusCode != 200 || body != `{"id":"x","choices":[]}` {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
	got := map[string]string{
		"limit":     resp.Header.Get(headerLimit),
		"remaining": resp.Header.Get(headerRemaining),
	}
	want := map[string]string{"limit": "10000", "remaining": "9940"} // 10000 − (10 input + 50 cap)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("limit headers (-want +got):\n%s", diff)
	}
	if resp.Header.Get(headerReset) == "" {
		t.Error("no reset header")
	}
	o := r.outcome(t)
	if o.Decision != "admitted" || o.Reserved != 60 {
		t.Errorf("outcome %+v, want admitted with 60 reserved", o)
	}
	// No usage in the body: the reservation stands.
	if diff := cmp.Diff([]float64{60}, r.store.settlements(t)); diff != "" {
		t.Errorf("settled (-want +got):\n%s", diff)
	}
}

// Scenario 3: the body is rewritten in the request-body answer (S15 inject,
// output clamp) with content-length fixed in the same answer.
func TestScenario03BodyRewrite(t *testing.T) {
	u := &upstream{Chunks: [][]byte{streamOf(chatChunk("hi"))}}
	pol := Policy{Name: "p", InjectUsage: true, ClampOutput: true, MaxOutputTokens: 40,
		Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	resp, _ := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"max_tokens":500,"messages":[]}`, nil)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	var sent map[string]any
	if err := json.Unmarshal([]byte(u.lastBody()), &sent); err != nil {
		t.Fatalf("upstream body %q: %v", u.lastBody(), err)
	}
	got := map[string]any{"max_tokens": sent["max_tokens"], "stream_options": sent["stream_options"]}
	want := map[string]any{"max_tokens": 40.0, "stream_options": map[string]any{"include_usage": true}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("upstream body (-want +got):\n%s", diff)
	}
	if cl := u.lastHeader().Get("content-length"); cl != "" && cl != itoa(len(u.lastBody())) {
		t.Errorf("content-length %s for a %d byte body", cl, len(u.lastBody()))
	}
	if o := r.outcome(t); o.Reserved != 50 {
		t.Errorf("reserved %d, want 50 (10 input + 40 capped output)", o.Reserved)
	}
}

// Scenario 4: a refused request gets a clean 429 with Retry-After and the
// limit headers (S16); the upstream is never contacted; the decision is in
// the dynamic metadata (S24).
func TestScenario04Refused429(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 100, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	body := `{"model":"gpt-4o-mini","max_tokens":80,"messages":[]}`
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("first request: %d", resp.StatusCode)
	}
	r.outcome(t)
	resp, got := r.post(t, chatPath, body, nil)
	if resp.StatusCode != 429 {
		t.Fatalf("status %d, want 429", resp.StatusCode)
	}
	var e errorBody
	if err := json.Unmarshal([]byte(got), &e); err != nil {
		t.Fatalf("body %q: %v", got, err)
	}
	if e.Error.Code != "rate_limit_exceeded" || e.Error.Type != "tokens" {
		t.Errorf("error %+v", e.Error)
	}
	hdr := map[string]string{}
	for _, k := range []string{headerRetryAfter, headerLimit, headerRemaining} {
		hdr[k] = resp.Header.Get(k)
	}
	// Envoy overwrites its default text/plain with the reply's content-type.
	if slices.Contains(resp.Header.Values("content-type"), "application/json") {
		hdr["content-type"] = "application/json"
	}
	// The first request settled at 100 (no usage: reservation stands, 10+80=90);
	// 10 remain; the second needs 90: 80 short at 1 token/s.
	want := map[string]string{"content-type": "application/json", headerRetryAfter: "80", headerLimit: "100", headerRemaining: "10"}
	if diff := cmp.Diff(want, hdr); diff != "" {
		t.Errorf("headers (-want +got):\n%s", diff)
	}
	if n := u.requests.Load(); n != 1 {
		t.Errorf("upstream saw %d requests, want 1", n)
	}
	e2 := r.entry(t, 2)
	if e2.UpstreamRequested {
		t.Error("refused request reached the upstream")
	}
	md := e2.DynamicMetadata["tokengate"].AsMap()
	if md["decision"] != "refused_tokens" {
		t.Errorf("dynamic metadata %v", md)
	}
}

// S4: a request that can never fit is a 413 without Retry-After, naming
// capacity and cost.
func TestNeverAdmissible413(t *testing.T) {
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 100, Rate: 1}}}}
	r := newRig(t, nil, rigOptions{policies: []Policy{pol}})
	resp, got := r.post(t, chatPath, `{"model":"m","max_tokens":500,"messages":[]}`, nil)
	if resp.StatusCode != 413 || resp.Header.Get(headerRetryAfter) != "" {
		t.Fatalf("status %d retry-after %q, want 413 without Retry-After", resp.StatusCode, resp.Header.Get(headerRetryAfter))
	}
	var e errorBody
	if err := json.Unmarshal([]byte(got), &e); err != nil {
		t.Fatal(err)
	}
	want := errorDetail{Code: "request_too_large", Type: "tokens", Bucket: "user", Capacity: 100, Cost: 510}
	e.Error.Message = ""
	if diff := cmp.Diff(want, e.Error); diff != "" {
		t.Errorf("error (-want +got):\n%s", diff)
	}
}

// S23: malformed JSON and unknown API shapes get a 400 naming the problem,
// and reserve nothing.
func TestBadInput400(t *testing.T) {
	r := newRig(t, nil, rigOptions{})
	for _, tc := range []struct{ path, body, code string }{
		{chatPath, `{"model":`, "malformed_json"},
		{"/v1/unknown", `{"model":"m"}`, "unknown_api"},
		{chatPath, `{"model":"m","max_tokens":1e9}`, "invalid_max_tokens"},
	} {
		resp, got := r.post(t, tc.path, tc.body, nil)
		var e errorBody
		_ = json.Unmarshal([]byte(got), &e)
		if resp.StatusCode != 400 || e.Error.Code != tc.code {
			t.Errorf("%s %s: got %d %q, want 400 %s", tc.path, tc.body, resp.StatusCode, got, tc.code)
		}
	}
	if n := len(r.store.settlements(t)); n != 0 {
		t.Errorf("%d reservations for bad input", n)
	}
}

// S21: an unreachable store answers 503 with Retry-After.
func TestStoreDown503(t *testing.T) {
	r := newRig(t, nil, rigOptions{})
	r.store.fail.Store(true)
	resp, _ := r.post(t, chatPath, `{"model":"m","messages":[]}`, nil)
	if resp.StatusCode != 503 || resp.Header.Get(headerRetryAfter) != "1" {
		t.Errorf("got %d retry-after %q, want 503 with Retry-After 1", resp.StatusCode, resp.Header.Get(headerRetryAfter))
	}
}

// S9a: a missing identity under Anonymous "reject" is a 401; identities
// from a header are hashed when configured and split the buckets.
func TestIdentity(t *testing.T) {
	pol := Policy{Name: "p", Anonymous: "reject",
		Identities: []Identity{{Name: "key", Header: "authorization", Hash: true}},
		Buckets:    []BucketRule{{Name: "user", Per: "key", Limit: buckets.Limit{Capacity: 100, Rate: 0.001}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	body := `{"model":"m","max_tokens":80,"messages":[]}`
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 401 {
		t.Errorf("no identity: %d, want 401", resp.StatusCode)
	}
	for _, tc := range []struct {
		key  string
		want int
	}{{"Bearer sk-a", 200}, {"Bearer sk-a", 429}, {"Bearer sk-b", 200}} {
		if resp, _ := r.post(t, chatPath, body, map[string]string{"authorization": tc.key}); resp.StatusCode != tc.want {
			t.Errorf("%s: %d, want %d", tc.key, resp.StatusCode, tc.want)
		}
	}
}

// Scenario 8: SSE in STREAMED mode, normal end: the client gets the stream
// byte for byte.
func TestScenario08StreamedNormalEnd(t *testing.T) {
	stream := streamOf(words(5)...)
	u := &upstream{Chunks: [][]byte{stream[:37], stream[37:100], stream[100:]}}
	r := newRig(t, u, rigOptions{mode: streamedMode()})
	resp, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if resp.StatusCode != 200 || got != string(stream) {
		t.Fatalf("status %d, body differs:\n got %q\nwant %q", resp.StatusCode, got, stream)
	}
	o := r.outcome(t)
	if o.Output != 5 || o.Settled != 15 || o.SettleOutcome != "complete" {
		t.Errorf("outcome %+v, want 5 output, settled 15, complete", o)
	}
}

// Scenario 9: SSE in FULL_DUPLEX_STREAMED, normal end.
func TestScenario09DuplexNormalEnd(t *testing.T) {
	stream := streamOf(words(7)...)
	u := &upstream{Chunks: [][]byte{stream}}
	r := newRig(t, u, rigOptions{mode: duplexMode()})
	resp, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if resp.StatusCode != 200 || got != string(stream) {
		t.Fatalf("status %d, body differs:\n got %q\nwant %q", resp.StatusCode, got, stream)
	}
	o := r.outcome(t)
	if o.Output != 7 || o.Settled != 17 {
		t.Errorf("outcome %+v, want 7 output, settled 17", o)
	}
	if diff := cmp.Diff([]float64{17}, r.store.settlements(t)); diff != "" {
		t.Errorf("settled (-want +got):\n%s", diff)
	}
}

// Scenario 10: a per-request hard cap (S14) cuts a FULL_DUPLEX stream: the
// client's stream ends cleanly with finish_reason "length" and [DONE], the
// upstream is cancelled, later events never reach the client, and what was
// counted is settled.
func TestScenario10DuplexCutOff(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(3)...), sse(words(3)...), sse(words(3)...)}, Hang: true}
	pol := Policy{Name: "p", MaxOutputTokens: 4, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: duplexMode()})
	resp, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if n := strings.Count(got, `" w"`); n != 4 {
		t.Errorf("client got %d content events, want 4", n)
	}
	if !strings.Contains(got, `"finish_reason":"length"`) || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Errorf("stream does not end with a length finish and [DONE]:\n%s", got)
	}
	e := r.entry(t, 1)
	if e.Reset || !e.UpstreamCancelled {
		t.Errorf("entry %+v: want a clean end and a cancelled upstream", e)
	}
	o := r.outcome(t)
	if !o.CutOff || o.Settled != 15 {
		t.Errorf("outcome %+v, want cut off, settled 15 (10 input + 5 counted)", o)
	}
}

// Scenarios 13–15: any chunking of the upstream body (down to one byte,
// splitting events, separators and UTF-8 code points) gives the client the
// same bytes and the same counts.
func TestScenario13to15Chunking(t *testing.T) {
	stream := streamOf(chatChunk("héllo 🙂"), chatChunk(" wörld"), chatChunk("!"))
	stream = append(stream, []byte("data: {\"tail\":true}")...) // event without a blank line at eos (15)
	for _, size := range []int{0, 1, 2, 3, 7, 64} {
		for _, mode := range []struct {
			name string
			mode func() *filterv3.ProcessingMode
		}{{"duplex", duplexMode}, {"streamed", streamedMode}} {
			u := &upstream{Chunks: [][]byte{stream}}
			r := newRig(t, u, rigOptions{chunkSize: size, mode: mode.mode()})
			_, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[]}`, nil)
			if got != string(stream) {
				t.Errorf("%s chunk %d: body differs:\n got %q\nwant %q", mode.name, size, got, stream)
			}
			if o := r.outcome(t); o.Output != 3 {
				t.Errorf("%s chunk %d: counted %d, want 3", mode.name, size, o.Output)
			}
		}
	}
}

// Scenario 16: HTTP/2-style eos on the last data chunk is a normal end too.
func TestScenario16EOSOnLastChunk(t *testing.T) {
	stream := streamOf(words(2)...)
	u := &upstream{Chunks: [][]byte{stream}}
	r := newRig(t, u, rigOptions{eosOnLast: true})
	_, got := r.post(t, chatPath, `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if got != string(stream) {
		t.Errorf("body differs:\n got %q\nwant %q", got, stream)
	}
	if o := r.outcome(t); o.SettleOutcome != "complete" || o.Settled != 12 {
		t.Errorf("outcome %+v, want complete, 12", o)
	}
}

// Scenario 17: the upstream is asked for an uncompressed answer.
func TestScenario17AcceptEncodingRemoved(t *testing.T) {
	u := &upstream{Chunks: [][]byte{streamOf(words(1)...)}}
	r := newRig(t, u, rigOptions{})
	r.post(t, chatPath, `{"model":"m","stream":true,"messages":[]}`, map[string]string{"accept-encoding": "gzip"})
	if ae := u.lastHeader().Get("accept-encoding"); strings.Contains(ae, "gzip") {
		t.Errorf("upstream saw accept-encoding %q", ae)
	}
}

// Scenario 18 and S18: an upstream 429 with Retry-After pauses the provider
// bucket, passes the wait on, and is refunded (the provider bills no failed
// call).
func TestScenario18Upstream429(t *testing.T) {
	u := &upstream{Status: 429, ContentType: "application/json", Header: map[string]string{"retry-after": "7"},
		Chunks: [][]byte{[]byte(`{"error":{"message":"slow down"}}`)}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "openai", Provider: true, Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	resp, _ := r.post(t, chatPath, `{"model":"m","max_tokens":10,"messages":[]}`, nil)
	if resp.StatusCode != 429 || resp.Header.Get(headerRetryAfter) != "7" {
		t.Errorf("got %d retry-after %q, want 429 / 7", resp.StatusCode, resp.Header.Get(headerRetryAfter))
	}
	r.outcome(t)
	if diff := cmp.Diff([]float64{0}, r.store.settlements(t)); diff != "" {
		t.Errorf("settled (-want +got):\n%s", diff)
	}
	r.store.mu.Lock()
	_, paused := r.store.paused["openai"]
	r.store.mu.Unlock()
	if !paused {
		t.Error("provider bucket not paused")
	}
	// The paused bucket now refuses for about the provider's wait.
	resp, _ = r.post(t, chatPath, `{"model":"m","max_tokens":10,"messages":[]}`, nil)
	if resp.StatusCode != 429 {
		t.Errorf("after the pause: %d, want 429", resp.StatusCode)
	}
}

// Scenario 19: the upstream cannot be reached: the router's local reply is
// not sent to the server (Envoy 1.34 and later), which sees the side stream
// end after it let the request on and before any answer, as when a client
// hangs up then. It cannot tell the two apart, and charges both as a
// hang-up (S8): a non-streamed request keeps its reservation, a stream pays
// its prompt. Each reservation is settled once.
func TestScenario19UpstreamConnectFailure(t *testing.T) {
	r := newRig(t, nil, rigOptions{upURL: "http://127.0.0.1:1"})
	resp, _ := r.post(t, chatPath, `{"model":"m","max_tokens":10,"messages":[]}`, nil)
	if resp.StatusCode < 500 {
		t.Errorf("status %d, want a 5xx local reply", resp.StatusCode)
	}
	if o := r.outcome(t); o.SettleOutcome != "no_response" || o.Settled != 10+10 {
		t.Errorf("outcome %+v, want no_response with the reservation of 20 settled", o)
	}
	resp, _ = r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":10,"messages":[]}`, nil)
	if resp.StatusCode < 500 {
		t.Errorf("stream: status %d, want a 5xx local reply", resp.StatusCode)
	}
	if o := r.outcome(t); o.SettleOutcome != "no_response" || o.Settled != 10 {
		t.Errorf("stream: outcome %+v, want no_response with the prompt of 10 settled", o)
	}
	r.store.settlements(t)
}

// Scenario 20: the client disconnects mid-stream: the request settles the
// prompt plus what was counted, exactly once.
func TestScenario20ClientDisconnect(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(3)...)}, Hang: true}
	r := newRig(t, u, rigOptions{})
	req, _ := http.NewRequest("POST", r.front.URL+chatPath,
		strings.NewReader(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`))
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	o := r.outcome(t)
	if o.SettleOutcome != "aborted" || o.Settled != 13 {
		t.Errorf("outcome %+v, want aborted settled 13 (10 input + 3 counted)", o)
	}
	r.store.settlements(t)
}

// Scenario 26: running counts land in the receiving namespace.
func TestScenario26DynamicMetadata(t *testing.T) {
	u := &upstream{Chunks: [][]byte{streamOf(words(4)...)}}
	r := newRig(t, u, rigOptions{})
	r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":20,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	md := r.entry(t, 1).DynamicMetadata["tokengate"].AsMap()
	want := map[string]any{"decision": "admitted", "input_tokens": 10.0, "output_tokens": 4.0, "reserved_tokens": 30.0, "settled_tokens": 14.0}
	if diff := cmp.Diff(want, md); diff != "" {
		t.Errorf("dynamic metadata (-want +got):\n%s", diff)
	}
}

// Scenario 27: the route names the policy through grpc_initial_metadata;
// a disabled route opens no side stream.
func TestScenario27PerRoutePolicy(t *testing.T) {
	gold := Policy{Name: "gold", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	silver := Policy{Name: "silver", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 50, Rate: 1}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{gold, silver}, routes: []standin.Route{
		{Prefix: "/gold", InitialMetadata: map[string]string{"x-tokengate-policy": "gold"}},
		{Prefix: "/silver", InitialMetadata: map[string]string{"x-tokengate-policy": "silver"}},
		{Prefix: "/off", Disabled: true},
	}})
	body := `{"model":"m","max_tokens":100,"messages":[]}`
	for _, tc := range []struct {
		path string
		want int
	}{{"/gold" + chatPath, 200}, {"/silver" + chatPath, 413}, {"/off" + chatPath, 200}} {
		if resp, _ := r.post(t, tc.path, body, nil); resp.StatusCode != tc.want {
			t.Errorf("%s: %d, want %d", tc.path, resp.StatusCode, tc.want)
		}
	}
	if e := r.entry(t, 3); e.SideStream {
		t.Error("disabled route opened a side stream")
	}
}

// Scenario 28: an HTTP/2 downstream sees the same cut-off as HTTP/1.
func TestScenario28HTTP2CutOff(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(5)...)}, Hang: true}
	pol := Policy{Name: "p", MaxOutputTokens: 2, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, http2: true})
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"messages":[]}`))
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(resp.Body); err != nil {
		t.Fatalf("HTTP/2 body did not end cleanly: %v", err)
	}
	if resp.ProtoMajor != 2 || !strings.Contains(buf.String(), `"finish_reason":"length"`) {
		t.Errorf("proto %d body %q", resp.ProtoMajor, buf.String())
	}
}

// S12: a request short of tokens waits when the policy allows it, and is
// forwarded once the tokens are there.
func TestWaiting(t *testing.T) {
	pol := Policy{Name: "p", MaxWait: 2 * time.Second, MaxQueue: 4,
		Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 100, Rate: 200}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, maxMsgTimeout: 5 * time.Second})
	body := `{"model":"m","max_tokens":80,"messages":[]}`
	for i := range 3 {
		if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
			t.Errorf("request %d: %d, want 200 after a wait", i, resp.StatusCode)
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// Scenario 17: a compressed answer is passed through unread and settled at
// the reservation; a cut-off could not append to it.
func TestScenario17CompressedPassThrough(t *testing.T) {
	gz := []byte("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xffnot-really-gzip")
	u := &upstream{Header: map[string]string{"content-encoding": "gzip"}, Chunks: [][]byte{gz}}
	pol := Policy{Name: "p", MaxOutputTokens: 1, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	req, _ := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"max_tokens":50,"messages":[]}`))
	req.Header.Set("accept-encoding", "gzip")
	tr := &http.Transport{DisableCompression: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	buf.ReadFrom(resp.Body)
	resp.Body.Close()
	if !bytes.Equal(buf.Bytes(), gz) {
		t.Errorf("body %q, want the upstream's bytes", buf.Bytes())
	}
	if o := r.outcome(t); o.Settled != 11 || o.CutOff {
		t.Errorf("outcome %+v, want settled at the reservation (11), no cut-off", o)
	}
}

// Scenario 16 with trailers (HTTP/2 upstream): the last body chunk has no
// eos and the trailers end the stream. The tail is forwarded before the
// trailers answer, and the request settles as complete. Driven message by
// message, as Envoy would.
func TestScenario16Trailers(t *testing.T) {
	r := newRig(t, nil, rigOptions{})
	p := newProcessor(context.Background(), r.srv, r.srv.live.Load(), "default")
	var got []*extprocv3.ProcessingResponse
	send := func(m *extprocv3.ProcessingResponse) error {
		got = append(got, proto.Clone(m).(*extprocv3.ProcessingResponse))
		return nil
	}
	stream := streamOf(words(3)...)
	tailEvent := []byte("data: {\"tail\":1}")
	for _, m := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headersOf(":path", chatPath)}},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_BUFFERED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: []byte(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]}`), EndOfStream: true}}},
		{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: headersOf(":status", "200", "content-type", "text/event-stream")}}},
		{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: append(append([]byte{}, stream...), tailEvent...)}}},
		{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}},
	} {
		if err := p.handle(m, send); err != nil {
			t.Fatal(err)
		}
	}
	p.finish()
	var bodies []string
	for _, m := range got {
		if sr := m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
			if sr.GetEndOfStream() {
				t.Error("a body answer ended the stream before the trailers answer")
			}
			bodies = append(bodies, string(sr.GetBody()))
		}
	}
	if diff := cmp.Diff([]string{string(stream), string(tailEvent)}, bodies); diff != "" {
		t.Errorf("forwarded (-want +got):\n%s", diff)
	}
	if last := got[len(got)-1]; last.GetResponseTrailers() == nil {
		t.Errorf("last answer %v, want the trailers answer", last)
	}
	if o := r.outcome(t); o.SettleOutcome != "complete" || o.Settled != 13 {
		t.Errorf("outcome %+v, want complete, 13", o)
	}
}

// §2.3, §5.2 step 5: in FULL_DUPLEX_STREAMED mode response trailers are
// answered with a TrailersResponse after the last body answer, every body
// answer having end_of_stream false. A cut-off (S14) decided on the tail
// that the trailers end (an event without its blank line) keeps that
// shape: the closing events without end_of_stream, then the trailers
// answer, which carries the settlement.
func TestDuplexCutOffAtTrailersAnswersTheTrailers(t *testing.T) {
	pol := Policy{Name: "p", MaxOutputTokens: 2, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}}}
	s, outcomes := policyServer(t, pol, &fakeCounter{input: 10, allowance: 100}, 1<<20)
	answers := drive(t, s, []*extprocv3.ProcessingRequest{
		reqHeadersMsg(buffered, duplex, chatPath),
		reqBodyMsg(`{"model":"m","stream":true,"max_tokens":50,"messages":[]}`, true),
		respHeadersMsg("200", "text/event-stream", false),
		respBodyMsg(string(sse(chatChunk("a"), chatChunk("b")))+"data: "+chatChunk("c"), false),
		respTrailersMsg(),
	})
	last := answers[4]
	if len(last) == 0 || last[len(last)-1].GetResponseTrailers() == nil {
		t.Fatalf("the response trailers got no TrailersResponse as their last answer: %v", last)
	}
	var closing string
	for _, a := range last {
		if sr := a.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
			if sr.GetEndOfStream() {
				t.Errorf("a body answer with end_of_stream before the trailers answer: %q", sr.GetBody())
			}
			closing += string(sr.GetBody())
		}
	}
	if !strings.Contains(closing, `"finish_reason":"length"`) || !strings.HasSuffix(closing, "data: [DONE]\n\n") || strings.Contains(closing, `"content":"c"`) {
		t.Errorf("sent at the trailers %q, want the closing events without the event over the cap", closing)
	}
	md := last[len(last)-1].GetDynamicMetadata()
	if v, ok := md.GetFields()["tokengate"].GetStructValue().GetFields()["settled_tokens"]; !ok || v.GetNumberValue() != 13 {
		t.Errorf("the trailers answer's metadata %v, want settled_tokens 13", md)
	}
	if o := <-outcomes; !o.CutOff || o.SettleOutcome != "cut_off" || o.Settled != 10+3 {
		t.Errorf("outcome %+v, want cut off with the prompt and the 3 tokens counted settled", o)
	}
}

// S12: waiting is bounded: with one request already waiting and MaxQueue 1,
// the next one short of tokens is refused at once.
func TestWaitingQueueBounded(t *testing.T) {
	pol := Policy{Name: "p", MaxWait: 5 * time.Second, MaxQueue: 1,
		Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 100, Rate: 100}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, maxMsgTimeout: 10 * time.Second})
	body := `{"model":"m","max_tokens":80,"messages":[]}`
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("first: %d", resp.StatusCode)
	}
	done := make(chan int)
	go func() {
		resp, _ := r.post(t, chatPath, body, nil)
		done <- resp.StatusCode
	}()
	deadline := time.Now().Add(5 * time.Second)
	for r.srv.live.Load().queues["p"].waiting.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the second request never waited")
		}
		time.Sleep(time.Millisecond) // polling a deadline
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 429 {
		t.Errorf("third request with a full queue: %d, want 429", resp.StatusCode)
	}
	if got := <-done; got != 200 {
		t.Errorf("waiting request: %d, want 200", got)
	}
}

// S9: a stream is never cut because a soft bucket ran out: it is charged
// in full at settlement, into debt.
func TestSoftBucketNeverCuts(t *testing.T) {
	stream := streamOf(words(30)...)
	u := &upstream{Chunks: [][]byte{stream}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "soft", Limit: buckets.Limit{Capacity: 50, Rate: 0.001}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	_, got := r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if got != string(stream) {
		t.Error("the stream was altered")
	}
	if o := r.outcome(t); o.CutOff || o.Settled != 40 {
		t.Errorf("outcome %+v, want no cut-off and 40 settled", o)
	}
	if resp, _ := r.post(t, chatPath, `{"model":"m","max_tokens":1,"messages":[]}`, nil); resp.StatusCode != 429 {
		t.Errorf("request against a bucket in debt: %d, want 429", resp.StatusCode)
	}
}

// S19: headroom is for priority traffic only.
func TestPriorityHeadroom(t *testing.T) {
	pol := Policy{Name: "p", PriorityHeader: "x-priority",
		Buckets: []BucketRule{{Name: "g", Headroom: 50, Limit: buckets.Limit{Capacity: 100, Rate: 0.001}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	body := `{"model":"m","max_tokens":30,"messages":[]}` // 40 tokens
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Errorf("ordinary request above the headroom: %d, want 200", resp.StatusCode)
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 429 {
		t.Errorf("ordinary request into the headroom: %d, want 429", resp.StatusCode)
	}
	if resp, _ := r.post(t, chatPath, body, map[string]string{"x-priority": "true"}); resp.StatusCode != 200 {
		t.Errorf("priority request: %d, want 200", resp.StatusCode)
	}
}

// Scenario 11 (fallback A, STREAMED): at a cut-off the closing events
// replace the chunk and later chunks are cleared; the upstream runs to its
// end and its reported usage, what the provider bills, is settled.
func TestScenario11StreamedCutOff(t *testing.T) {
	usage := `{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}`
	u := &upstream{Chunks: [][]byte{sse(words(3)...), sse(words(3)...), sse(words(3)...), streamOf(usage)}}
	pol := Policy{Name: "p", InjectUsage: true, MaxOutputTokens: 4, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: streamedMode()})
	_, got := r.post(t, chatPath, `{"model":"gpt-4o-mini","stream":true,"messages":[]}`, nil)
	if n := strings.Count(got, `" w"`); n != 4 {
		t.Errorf("client got %d content events, want 4", n)
	}
	if strings.Count(got, "data: [DONE]") != 1 || !strings.HasSuffix(got, "data: [DONE]\n\n") || strings.Contains(got, `"usage"`) {
		t.Errorf("stream after the cut-off:\n%s", got)
	}
	if e := r.entry(t, 1); e.UpstreamCancelled || e.Reset {
		t.Errorf("entry %+v: STREAMED cannot cancel the upstream and must end cleanly", e)
	}
	if o := r.outcome(t); !o.CutOff || o.Settled != 21 {
		t.Errorf("outcome %+v, want cut off and the provider's 21 settled", o)
	}
}

// A request body in STREAMED mode is decided at its last chunk.
func TestStreamedRequestBody(t *testing.T) {
	mode := duplexMode()
	mode.RequestBodyMode = filterv3.ProcessingMode_STREAMED
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 100, Rate: 0.001}}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, mode: mode})
	body := `{"model":"m","max_tokens":60,"messages":[]}`
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 || u.lastBody() != body {
		t.Errorf("first: %d, upstream body %q", resp.StatusCode, u.lastBody())
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 429 {
		t.Errorf("second: %d, want 429", resp.StatusCode)
	}
}

// A route naming an unknown policy is a configuration error: 500, and the
// request does not pass unmetered.
func TestUnknownPolicy(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{routes: []standin.Route{{Prefix: "/", InitialMetadata: map[string]string{"x-tokengate-policy": "ghost"}}}})
	if resp, _ := r.post(t, chatPath, `{"model":"m","messages":[]}`, nil); resp.StatusCode != 500 || u.requests.Load() != 0 {
		t.Errorf("status %d, upstream requests %d; want 500 and none", resp.StatusCode, u.requests.Load())
	}
	// The outcome (and so a metric label) names no policy the route made up.
	if o := r.outcome(t); o.Policy != unknownPolicy || o.Decision != "bad_request" {
		t.Errorf("outcome %+v, want policy %q and decision bad_request", o, unknownPolicy)
	}
}

// S11: a concurrency limit refuses with type "requests" while the slot is
// taken, and the slot is released at settlement.
func TestConcurrencyLimit(t *testing.T) {
	u := &upstream{Chunks: [][]byte{sse(words(1)...)}, Hang: true}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}},
		Concurrency: []ConcurrencyRule{{Name: "inflight", Max: 1}}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	body := `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`
	req, _ := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(body))
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	second, got := r.post(t, chatPath, body, nil)
	var e errorBody
	_ = json.Unmarshal([]byte(got), &e)
	if second.StatusCode != 429 || e.Error.Type != "requests" || second.Header.Get(headerRetryAfter) == "" {
		t.Errorf("while in flight: %d %+v, want 429 of type requests with Retry-After", second.StatusCode, e.Error)
	}
	resp.Body.Close() // the first request ends: its slot is released
	r.outcome(t)
	r.outcome(t)
	req, _ = http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(body))
	third, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	third.Body.Close()
	if third.StatusCode != 200 {
		t.Errorf("after release: %d, want 200", third.StatusCode)
	}
}

// Scenario 5: a body over Envoy's buffer limit is Envoy's own 413; the
// server sees the stream close and reserves nothing.
func TestScenario05BufferOverflow(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{bufferLimit: 64})
	resp, _ := r.post(t, chatPath, `{"model":"m","messages":[{"role":"user","content":"`+strings.Repeat("x", 200)+`"}]}`, nil)
	if resp.StatusCode != 413 || u.requests.Load() != 0 {
		t.Errorf("status %d, upstream requests %d; want 413 and none", resp.StatusCode, u.requests.Load())
	}
	if o := r.outcome(t); o.Decision != "" || o.Reserved != 0 {
		t.Errorf("outcome %+v, want no decision and nothing reserved", o)
	}
}

// A provider bucket stands for the organisation's account at the provider
// (S10, S19): every policy draws on the same one, so the account's limit
// holds whichever route a request takes. Other buckets stay per policy.
func TestProviderBucketSharedAcrossPolicies(t *testing.T) {
	provider := BucketRule{Name: "provider", Per: "model", Provider: true, Limit: buckets.Limit{Capacity: 200, Rate: 0.001}}
	own := BucketRule{Name: "own", Limit: buckets.Limit{Capacity: 1000, Rate: 0.001}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{
		policies: []Policy{
			{Name: "gold", Buckets: []BucketRule{own, provider}},
			{Name: "silver", Buckets: []BucketRule{own, provider}},
		},
		routes: []standin.Route{
			{Prefix: "/silver/", InitialMetadata: map[string]string{"x-tokengate-policy": "silver"}},
			{Prefix: "/", InitialMetadata: map[string]string{"x-tokengate-policy": "gold"}},
		},
	})
	body := `{"model":"gpt-4o","max_tokens":110,"messages":[]}` // 120 tokens
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("gold: %d, want 200", resp.StatusCode)
	}
	resp, got := r.post(t, "/silver"+chatPath, body, nil)
	if resp.StatusCode != 429 || !strings.Contains(got, `"bucket":"provider"`) {
		t.Errorf("silver after gold used the shared provider account: %d %s, want 429 on provider", resp.StatusCode, got)
	}
	body = `{"model":"gpt-4o-mini","max_tokens":110,"messages":[]}` // another model: another provider bucket
	if resp, _ := r.post(t, "/silver"+chatPath, body, nil); resp.StatusCode != 200 {
		t.Errorf("silver on another model: %d, want 200", resp.StatusCode)
	}
}

// S9: an under-estimate is debited below zero at settlement, and the outcome
// names the bucket left in debt (for metrics) and the allowance's source.
func TestSettlementIntoDebtReported(t *testing.T) {
	u := &upstream{Chunks: [][]byte{streamOf(words(60)...)}}
	pol := Policy{Name: "p", Buckets: []BucketRule{
		{Name: "soft", Limit: buckets.Limit{Capacity: 50, Rate: 0.001}},
		{Name: "roomy", Limit: buckets.Limit{Capacity: 10000, Rate: 1}},
	}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}})
	r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"messages":[]}`, nil)
	o := r.outcome(t)
	if o.Settled != 70 || o.AllowanceSource != "request" {
		t.Errorf("outcome %+v, want 70 settled (10 input + 60 output) and the request's own cap", o)
	}
	if d := cmp.Diff([]string{"soft"}, o.InDebt); d != "" {
		t.Errorf("buckets in debt (-want +got):\n%s", d)
	}
}

// S8, S11: a response that runs longer than its concurrency slot's lease
// renews the slot and its reservation every third of the lease, so the
// limit keeps counting it; a request without slots renews its reservation
// every third of its lifetime (the stream idle limit).
func TestLongStreamRenewsSlots(t *testing.T) {
	clk := newFakeClock()
	u := &upstream{Chunks: [][]byte{sse(words(3)...)}, Hang: true}
	pol := Policy{Name: "p",
		Buckets:     []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 10000, Rate: 1}}},
		Concurrency: []ConcurrencyRule{{Name: "c", Max: 1, Lease: time.Minute}}}
	for _, slots := range []bool{true, false} {
		if !slots {
			pol.Concurrency = nil
		}
		r := newRig(t, u, rigOptions{policies: []Policy{pol}, clock: clk, idleTimeout: 3 * time.Minute,
			store: buckets.NewMemory(buckets.MemoryOptions{Now: clk.now})})
		req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"max_tokens":100,"messages":[]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := r.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := resp.Body.Read(make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
		for range 30 { // five minutes: five leases, five thirds of the lifetime
			clk.advance(10 * time.Second)
		}
		resp.Body.Close()
		r.outcome(t)
		r.store.mu.Lock()
		got := r.store.renewals
		r.store.mu.Unlock()
		switch {
		case slots && got != 15:
			t.Errorf("a stream open for five leases renewed %d times, want 15 (every third of the lease)", got)
		case !slots && got != 5:
			t.Errorf("a request without slots open for five thirds of its lifetime renewed %d times, want 5", got)
		}
		if n := clk.pending(); n != 0 {
			t.Errorf("%d renewal timers left after settlement", n)
		}
	}
}

// S12: MaxQueue bounds the requests that wait; zero lets none wait, whatever
// MaxWait says: a request short of tokens is refused at once.
func TestMaxQueueZeroMeansNoneWait(t *testing.T) {
	pol := Policy{Name: "p", MaxWait: 5 * time.Second, MaxQueue: 0,
		Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 100, Rate: 100}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	// Envoy's 200 ms message timer is raised so that a loaded machine does
	// not turn the refusal into a 504; a request that waited 0.8 s for its
	// tokens would still be admitted within it.
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, maxMsgTimeout: 10 * time.Second, msgTimeout: 2 * time.Second})
	body := `{"model":"m","max_tokens":80,"messages":[]}`
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 200 {
		t.Fatalf("first: %d", resp.StatusCode)
	}
	if resp, _ := r.post(t, chatPath, body, nil); resp.StatusCode != 429 {
		t.Errorf("second, short of tokens, with MaxQueue 0: %d, want 429 at once", resp.StatusCode)
	}
}
