package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/envoy"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/tokenizer"
)

// The mode matrix: every request body mode tokengate supports (BUFFERED,
// STREAMED, FULL_DUPLEX_STREAMED) with every response body mode (STREAMED,
// FULL_DUPLEX_STREAMED), through the stand-in, on the memory store and on
// Redis. Each combination has routes of its own, /<request>-<response>/...,
// so one gateway per store serves them all.

const (
	modeBuffered = filterv3.ProcessingMode_BUFFERED
	modeStreamed = filterv3.ProcessingMode_STREAMED
	modeDuplex   = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
)

// Limits of the matrix's gateway: a body limit below the stand-in's buffer
// limit (1 MiB), so that tokengate, not Envoy, refuses an oversized
// BUFFERED body; the tight bucket admits one request of tightCost at a time.
const (
	matrixMaxBody = 512 << 10
	meterCap      = 1e8
	tightCap      = 5000
	tightTokens   = 3000 // max_tokens of the requests on the tight route
	cutCap        = 5    // the cut policy's output cap (S14)
)

// Request headers the matrix's stand-in and upstream read.
const (
	headerCutRequest  = "x-cut-request"  // sizes the request body is cut to
	headerCutResponse = "x-cut-response" // sizes the response body is cut to
	headerID          = "x-request-id"
)

type combo struct {
	name      string
	req, resp filterv3.ProcessingMode_BodySendMode
}

func modeName(m filterv3.ProcessingMode_BodySendMode) string {
	switch m {
	case modeBuffered:
		return "buffered"
	case modeStreamed:
		return "streamed"
	}
	return "duplex"
}

func combos() []combo {
	var out []combo
	for _, req := range []filterv3.ProcessingMode_BodySendMode{modeBuffered, modeStreamed, modeDuplex} {
		for _, resp := range []filterv3.ProcessingMode_BodySendMode{modeStreamed, modeDuplex} {
			out = append(out, combo{name: modeName(req) + "-" + modeName(resp), req: req, resp: resp})
		}
	}
	return out
}

// mode is the filter's processing mode: trailers SEND where a duplex body
// needs them, and for request trailers in every mode, so that they are
// tested too.
func (c combo) mode() *filterv3.ProcessingMode {
	m := &filterv3.ProcessingMode{
		RequestHeaderMode: filterv3.ProcessingMode_SEND, RequestBodyMode: c.req, RequestTrailerMode: filterv3.ProcessingMode_SEND,
		ResponseHeaderMode: filterv3.ProcessingMode_SEND, ResponseBodyMode: c.resp, ResponseTrailerMode: filterv3.ProcessingMode_SKIP,
	}
	if c.resp == modeDuplex {
		m.ResponseTrailerMode = filterv3.ProcessingMode_SEND
	}
	return m
}

// matrixPolicies: "meter" meters each user (no rewrite, so the upstream
// gets exactly what the client sent); "inject" asks for usage (S15);
// "tight" holds one large request at a time; "cut" caps output (S14).
func matrixPolicies() []extproc.Policy {
	user := []extproc.Identity{{Name: "user", Header: headerUser}}
	bucket := func(name string, capacity float64) []extproc.BucketRule {
		return []extproc.BucketRule{{Name: name, Per: "user", Limit: buckets.Limit{Capacity: capacity, Rate: tinyRate}}}
	}
	return []extproc.Policy{
		{Name: "meter", Identities: user, Buckets: bucket("meter", meterCap)},
		{Name: "inject", Identities: user, Buckets: bucket("inject", meterCap), InjectUsage: true, ClampOutput: true},
		{Name: "tight", Identities: user, Buckets: bucket("tight", tightCap), InjectUsage: true},
		{Name: "cut", Identities: user, Buckets: bucket("cut", meterCap), MaxOutputTokens: cutCap, InjectUsage: true},
	}
}

// matrixRoutes: per combination, a route per policy.
func matrixRoutes() []standin.Route {
	var routes []standin.Route
	for _, c := range combos() {
		for _, pol := range []string{"inject", "tight", "cut", "meter"} {
			prefix := "/" + c.name + "/" + pol + "/"
			routes = append(routes, standin.Route{Prefix: prefix, Mode: c.mode(), InitialMetadata: map[string]string{"x-tokengate-policy": pol}})
		}
	}
	return routes
}

// cutsFromHeaders is the stand-in's Cuts: the sizes a request names in
// headerCutRequest and headerCutResponse.
func cutsFromHeaders(r *http.Request, response bool) []int {
	h := headerCutRequest
	if response {
		h = headerCutResponse
	}
	var sizes []int
	for _, f := range strings.Split(r.Header.Get(h), ",") {
		if n, err := strconv.Atoi(strings.TrimSpace(f)); err == nil {
			sizes = append(sizes, n)
		}
	}
	return sizes
}

func sizes(ns []int) string {
	s := make([]string, len(ns))
	for i, n := range ns {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

// randomCuts cuts n bytes at random boundaries, chunks of 1 byte to max.
func randomCuts(rng *rand.Rand, n, most int) []int {
	var out []int
	for n > 0 {
		k := min(n, 1+rng.IntN(most))
		out = append(out, k)
		n -= k
	}
	return out
}

// bodyLog is the matrix's upstream: it reads each request's body to its end
// and records it by request id, or records that it broke off (the request
// was reset); then it answers as llm does.
type bodyLog struct {
	next *llm

	mu       sync.Mutex
	whole    map[string][]byte
	trailers map[string]http.Header
	broken   map[string]int
	requests atomic.Int64
}

func newBodyLog() *bodyLog {
	return &bodyLog{next: newLLM(), whole: map[string][]byte{}, trailers: map[string]http.Header{}, broken: map[string]int{}}
}

func (b *bodyLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b.requests.Add(1)
	body, err := io.ReadAll(r.Body)
	id := r.Header.Get(headerID)
	b.mu.Lock()
	if err != nil {
		b.broken[id]++
	} else {
		b.whole[id] = body
		b.trailers[id] = r.Trailer.Clone()
	}
	b.mu.Unlock()
	if err != nil {
		return
	}
	r.Body = http.NoBody
	b.next.ServeHTTP(w, r)
}

// got returns the body the upstream received whole for request id.
func (b *bodyLog) got(id string) ([]byte, http.Header, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	body, ok := b.whole[id]
	return body, b.trailers[id], ok
}

// call is one request of the matrix.
type call struct {
	path     string // under the combination's prefix, starting with /<policy>/
	body     []byte
	replay   string
	mock     string
	cutReq   []int
	cutResp  []int
	chunked  bool // no content-length
	trailers bool // request trailers (implies chunked)
	h2       bool // HTTP/2 (h2c) instead of HTTP/1.1
	// mayReset accepts a client error: a reply of the gateway's own sent
	// while the client is still writing its body is followed by the
	// connection's close (as Envoy closes an HTTP/1 connection whose
	// request it did not read to the end), and the client may read the
	// reset before the reply. The exchange then carries the error, and
	// the stand-in's entry what was sent.
	mayReset bool
}

// matrixRig is one gateway serving every combination, its upstream, and
// what the test expects each user bucket to hold at the end.
type matrixRig struct {
	g       *gateway
	h2      *http.Client // an h2c client of the gateway
	up      *bodyLog
	led     *ledger
	counter *tokenizer.Counter
	seq     atomic.Int64

	mu    sync.Mutex
	spent map[string]float64 // bucket name → user → tokens settled
}

func newMatrixRig(t *testing.T, store buckets.Store) *matrixRig {
	return newMatrixRigLimit(t, store, matrixMaxBody)
}

// newMatrixRigLimit is newMatrixRig with tokengate's body limit maxBody.
func newMatrixRigLimit(t *testing.T, store buckets.Store, maxBody int) *matrixRig {
	t.Helper()
	up := newBodyLog()
	srv := httptest.NewServer(up)
	t.Cleanup(func() {
		srv.Close()
		if n := up.next.stuck.Load(); n > 0 {
			t.Errorf("%d upstream requests were neither finished nor cancelled within %v", n, waitFor)
		}
	})
	base, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	led := newLedger(store)
	g := startGateway(t, gatewayConfig{
		store: led, policies: matrixPolicies(), upstream: base, routes: matrixRoutes(),
		maxBodyBytes: maxBody, cuts: cutsFromHeaders,
	})
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &protos, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &matrixRig{g: g, h2: &http.Client{Transport: tr}, up: up, led: led, counter: newCounter(t), spent: map[string]float64{}}
}

// do sends c for user through combination co and returns what the client
// saw, the request's id, and the stand-in's log entry.
func (m *matrixRig) do(t *testing.T, co combo, user string, c call) (exchange, string, standin.Entry) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	id := fmt.Sprintf("%s-%d", co.name, m.seq.Add(1))
	var rd io.Reader = bytes.NewReader(c.body)
	if c.chunked || c.trailers {
		rd = io.MultiReader(rd) // hides the length: chunked
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.g.url+"/"+co.name+c.path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if c.chunked || c.trailers {
		req.ContentLength = -1
	}
	if c.trailers {
		req.Trailer = http.Header{"X-Checksum": {fmt.Sprint(len(c.body))}}
	}
	m.headers(req.Header, id, user, c)
	client := m.g.client
	if c.h2 {
		client = m.h2
	}
	resp, err := client.Do(req)
	if err != nil && c.mayReset {
		return exchange{err: err}, id, m.entry(t, id)
	}
	if err != nil {
		t.Fatalf("%s: %v", id, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return exchange{status: resp.StatusCode, header: resp.Header, body: b, err: err}, id, m.entry(t, id)
}

func (m *matrixRig) headers(h http.Header, id, user string, c call) {
	h.Set("content-type", "application/json")
	h.Set(headerID, id)
	h.Set(headerUser, user)
	h.Set(headerReplay, c.replay)
	if c.mock != "" {
		h.Set(headerMock, c.mock)
	}
	if len(c.cutReq) > 0 {
		h.Set(headerCutRequest, sizes(c.cutReq))
	}
	if len(c.cutResp) > 0 {
		h.Set(headerCutResponse, sizes(c.cutResp))
	}
}

// entry waits for the stand-in's log entry of request id.
func (m *matrixRig) entry(t *testing.T, id string) standin.Entry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	for n := 1; ; {
		log, err := m.g.proxy.WaitLog(ctx, n)
		if err != nil {
			t.Fatalf("no stand-in log entry for %s: %v", id, err)
		}
		for _, e := range log {
			if e.RequestID == id {
				return e
			}
		}
		n = len(log) + 1
	}
}

// outcome waits for the outcome of the n-th request (counted from 1) the
// gateway finished.
func (m *matrixRig) outcome(t *testing.T, n int) extproc.Outcome {
	t.Helper()
	return m.g.outcomes.wait(t, n)[n-1]
}

// settled records that tokens were settled from bucket for user.
func (m *matrixRig) settled(bucket, user string, tokens int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.spent[bucket+"/"+user] += float64(tokens)
}

// checkLevels fails unless every bucket of the matrix holds its capacity
// less what the test saw settled from it (S8): per bucket name, the sorted
// levels of its users.
func (m *matrixRig) checkLevels(t *testing.T) {
	t.Helper()
	m.led.checkSettled(t)
	caps := map[string]float64{"meter": meterCap, "inject": meterCap, "tight": tightCap, "cut": meterCap}
	for name, capacity := range caps {
		var want []float64
		m.mu.Lock()
		for k, v := range m.spent {
			if strings.HasPrefix(k, name+"/") {
				want = append(want, capacity-v)
			}
		}
		m.mu.Unlock()
		slices.Sort(want)
		got := m.led.levels(t, name)
		if diff := cmp.Diff(want, got, levelsEqual); diff != "" {
			t.Errorf("bucket %s levels (-want +got):\n%s", name, diff)
		}
	}
}

// The three-by-two mode matrix (§2.2, §3.2): in every combination of
// request and response body mode, on the memory store and on Redis,
//   - recorded streams of four APIs, their bodies cut at random boundaries
//     and (on the memory store, or on both in the load run) at every byte,
//     reach the client unchanged, are counted as the tokenizer counts the
//     same body, and settle at the recorded usage (S8);
//   - a large prompt, cut at random, likewise;
//   - the usage rewrite (S15) reaches the upstream in BUFFERED and duplex
//     mode, and STREAMED forwards the body untouched;
//   - a request short of tokens gets 429 and one that can never be admitted
//     413 (S4, S16), and a body over the limit 413: before the upstream is
//     contacted in BUFFERED and duplex mode, with the upstream request reset
//     and never complete in STREAMED mode;
//   - a hard output cap cuts the stream cleanly (S14), ends the upstream in
//     duplex mode, and settles what was counted, or the provider's usage when
//     STREAMED lets the upstream finish;
//   - request trailers reach the upstream.
func TestModeMatrix(t *testing.T) {
	checkGoroutines(t)
	stores := map[string]func(t *testing.T) buckets.Store{
		"memory": func(*testing.T) buckets.Store { return buckets.NewMemory(buckets.MemoryOptions{}) },
		"redis": func(t *testing.T) buckets.Store {
			srv := redistest.Start(t)
			rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
			t.Cleanup(func() { rc.Close() })
			return redisstore.New(rc, redisstore.Options{})
		},
	}
	for _, name := range []string{"memory", "redis"} {
		t.Run(name, func(t *testing.T) {
			m := newMatrixRig(t, stores[name](t))
			seed := uint64(time.Now().UnixNano())
			t.Logf("random cuts seeded with %d", seed)
			rng := rand.New(rand.NewPCG(seed, 1))
			for _, co := range combos() {
				t.Run(co.name, func(t *testing.T) {
					// Every byte a boundary on one store; the other cuts at
					// random only, outside the load run.
					t.Run("replay", func(t *testing.T) { matrixReplay(t, m, co, rng, name == "memory" || heavy) })
					t.Run("large", func(t *testing.T) { matrixLarge(t, m, co, rng) })
					t.Run("rewrite", func(t *testing.T) { matrixRewrite(t, m, co) })
					t.Run("refuse", func(t *testing.T) { matrixRefuse(t, m, co) })
					t.Run("too large", func(t *testing.T) { matrixTooLarge(t, m, co) })
					t.Run("cut off", func(t *testing.T) { matrixCutOff(t, m, co) })
					t.Run("trailers", func(t *testing.T) { matrixTrailers(t, m, co) })
				})
			}
			m.checkLevels(t)
		})
	}
}

// matrixMix: recorded streams that carry usage, of four APIs and both
// framings (SSE and Gemini's JSON array).
var matrixMix = []string{
	"openai/chat-stream-tool-result-turn",
	"anthropic/messages-stream-text",
	"gemini/stream-json-array",
	"openai/responses-stream-basic",
}

// admitted checks an admitted request that ran to its end: its prompt
// counted as the tokenizer counts body, settled at the recorded usage.
func (m *matrixRig) admitted(t *testing.T, n int, rec recording, body []byte, bucket, user string) {
	t.Helper()
	o := m.outcome(t, n)
	c, err := m.counter.Count(tokenizer.Request{Path: rec.Path, Body: body})
	if err != nil {
		t.Fatal(err)
	}
	want := [4]any{"admitted", "complete", c.InputTokens, rec.Total}
	if diff := cmp.Diff(want, [4]any{o.Decision, o.SettleOutcome, o.InputTokens, o.Settled}); diff != "" {
		t.Errorf("%s: decision, settlement, input tokens, settled (-want +got):\n%s", rec.Name, diff)
	}
	m.settled(bucket, user, o.Settled)
}

// matrixReplay replays matrixMix: cut at random, and, with every, with a
// boundary at every byte of the request and of the answer (outside the
// load run, the longer answers are cut at random every 1 to 16 bytes
// instead).
func matrixReplay(t *testing.T, m *matrixRig, co combo, rng *rand.Rand, every bool) {
	for _, name := range matrixMix {
		rec := loadRecording(t, name)
		splits := [][2][]int{{randomCuts(rng, len(rec.Request), 64), randomCuts(rng, len(rec.Response), 700)}}
		if every {
			resp := []int{1}
			if len(rec.Response) > 4<<10 && !heavy {
				resp = randomCuts(rng, len(rec.Response), 16)
			}
			splits = append(splits, [2][]int{{1}, resp})
		}
		for _, cut := range splits {
			n := m.g.outcomes.len() + 1
			c := call{path: "/meter" + rec.Path, body: rec.Request, replay: name, cutReq: cut[0], cutResp: cut[1]}
			var x exchange
			var id string
			if strings.HasSuffix(rec.Path, "/chat/completions") {
				id = m.sdkChat(t, co, "replay", c, rec)
			} else {
				x, id, _ = m.do(t, co, "replay", c)
				if x.err != nil || x.status != 200 || !bytes.Equal(x.body, rec.Response) {
					t.Errorf("%s cut %v: status %d err %v, body of %d bytes, want the recording's %d", name, cut, x.status, x.err, len(x.body), len(rec.Response))
				}
			}
			if got, _, ok := m.up.got(id); !ok || !bytes.Equal(got, rec.Request) {
				t.Errorf("%s cut %v: the upstream got %q, want the client's body", name, cut, trim(got))
			}
			m.admitted(t, n, rec, rec.Request, "meter", "replay")
		}
	}
}

// sdkChat replays a chat recording through the official OpenAI SDK and
// checks the stream it parsed: every choice finished, the usage reported.
func (m *matrixRig) sdkChat(t *testing.T, co combo, user string, c call, rec recording) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	id := fmt.Sprintf("%s-%d", co.name, m.seq.Add(1))
	client := openai.NewClient(option.WithBaseURL(m.g.url+"/"+co.name+strings.TrimSuffix(c.path, "chat/completions")),
		option.WithAPIKey("sk-e2e"), option.WithMaxRetries(0), option.WithHTTPClient(m.g.client))
	opts := []option.RequestOption{option.WithRequestBody("application/json", c.body)}
	h := http.Header{}
	m.headers(h, id, user, c)
	for k := range h {
		opts = append(opts, option.WithHeader(k, h.Get(k)))
	}
	stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{}, opts...)
	defer stream.Close()
	finish, usage := "", 0
	for stream.Next() {
		ch := stream.Current()
		usage = max(usage, int(ch.Usage.TotalTokens))
		for _, choice := range ch.Choices {
			if choice.FinishReason != "" {
				finish = choice.FinishReason
			}
		}
	}
	if err := stream.Err(); err != nil || finish == "" || usage != rec.Total {
		t.Errorf("%s through the SDK: err %v, finish_reason %q, usage %d (want %d)", rec.Name, err, finish, usage, rec.Total)
	}
	m.entry(t, id)
	return id
}

// largePrompt is a chat request of about n bytes with multi-byte text.
func largePrompt(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"`)
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "Paragraph %d: Grüße aus Köln, 東京からこんにちは 🙂 — \\\"quoted\\\"\\n", i)
	}
	b.WriteString(`"}]}`)
	return []byte(b.String())
}

func matrixLarge(t *testing.T, m *matrixRig, co combo, rng *rand.Rand) {
	rec := loadRecording(t, "openai/chat-stream-tool-result-turn")
	body := largePrompt(200 << 10)
	n := m.g.outcomes.len() + 1
	x, id, _ := m.do(t, co, "large", call{path: "/meter" + rec.Path, body: body, replay: rec.Name,
		cutReq: randomCuts(rng, len(body), 40<<10), cutResp: randomCuts(rng, len(rec.Response), 300)})
	if x.err != nil || x.status != 200 || !bytes.Equal(x.body, rec.Response) {
		t.Errorf("status %d err %v, body of %d bytes, want the recording's %d", x.status, x.err, len(x.body), len(rec.Response))
	}
	if got, _, ok := m.up.got(id); !ok || !bytes.Equal(got, body) {
		t.Errorf("the upstream got %d bytes (whole %v), want the client's %d", len(got), ok, len(body))
	}
	m.admitted(t, n, rec, body, "meter", "large")
}

// S15: the usage rewrite reaches the upstream where the body can still be
// replaced (BUFFERED, duplex); STREAMED forwards what the client sent. The
// stream settles at the provider's usage either way.
func matrixRewrite(t *testing.T, m *matrixRig, co combo) {
	rec := loadRecording(t, "openai/chat-stream-tool-result-turn")
	body := []byte(`{"model":"gpt-4o-mini","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"What is 1231 * 2331?"}]}`)
	n := m.g.outcomes.len() + 1
	x, id, _ := m.do(t, co, "rewrite", call{path: "/inject" + rec.Path, body: body, replay: rec.Name, cutReq: []int{7}})
	if x.err != nil || x.status != 200 {
		t.Fatalf("status %d err %v", x.status, x.err)
	}
	got, _, ok := m.up.got(id)
	var sent struct {
		StreamOptions *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if err := json.Unmarshal(got, &sent); !ok || err != nil {
		t.Fatalf("the upstream got %q (whole %v): %v", trim(got), ok, err)
	}
	rewritten := sent.StreamOptions != nil && sent.StreamOptions.IncludeUsage
	if want := co.req != modeStreamed; rewritten != want || !rewritten && !bytes.Equal(got, body) {
		t.Errorf("upstream body %s: rewritten %v, want %v", got, rewritten, want)
	}
	o := m.outcome(t, n)
	if o.Decision != "admitted" || o.Settled != rec.Total {
		t.Errorf("outcome %+v, want admitted and the recorded %d settled", o, rec.Total)
	}
	m.settled("inject", "rewrite", o.Settled)
}

// checkNotForwarded fails unless the upstream never got request id whole,
// and in BUFFERED and duplex mode was never contacted at all (§3.2, §4).
func (m *matrixRig) checkNotForwarded(t *testing.T, co combo, id string, e standin.Entry) {
	t.Helper()
	if _, _, ok := m.up.got(id); ok {
		t.Errorf("%s: the upstream received the whole request", id)
	}
	switch {
	case co.req != modeStreamed && e.UpstreamRequested:
		t.Errorf("%s: the upstream was contacted before the decision (entry %+v)", id, e)
	case co.req == modeStreamed && e.UpstreamRequested && !e.UpstreamCancelled && !e.Reset:
		t.Errorf("%s: the partial upstream request was neither cancelled nor reset (entry %+v)", id, e)
	}
}

// S4, S16: with one large request held open, the next one gets 429; one
// whose output cap, or whose prompt, is larger than the bucket gets 413.
// None reaches the upstream.
func matrixRefuse(t *testing.T, m *matrixRig, co combo) {
	rec := loadRecording(t, "openai/chat-stream-tool-result-turn")
	body := []byte(fmt.Sprintf(`{"model":"gpt-4o-mini","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"What is 1231 * 2331?"}]}`, tightTokens))
	n := m.g.outcomes.len() + 1
	held := m.up.next.held.Load()
	first := make(chan exchange, 1)
	go func() {
		x, _, _ := m.do(t, co, "refuse", call{path: "/tight" + rec.Path, body: body, replay: rec.Name, mock: mockHold})
		first <- x
	}()
	deadline := time.Now().Add(waitFor)
	for m.up.next.held.Load() == held {
		if time.Now().After(deadline) {
			t.Fatal("the first request never reached the upstream")
		}
		time.Sleep(time.Millisecond) // polling a deadline
	}
	for _, tc := range []struct {
		body   []byte
		status int
		code   string
	}{
		{body, 429, "rate_limit_exceeded"},
		{bytes.Replace(body, []byte(strconv.Itoa(tightTokens)), []byte(strconv.Itoa(2*tightCap)), 1), 413, "request_too_large"},
		// A prompt larger than the bucket (S4).
		{largePrompt(40 << 10), 413, "request_too_large"},
	} {
		x, id, e := m.do(t, co, "refuse", call{path: "/tight" + rec.Path, body: tc.body, replay: rec.Name, cutReq: []int{11}})
		je, err := x.jsonError()
		if x.status != tc.status || err != nil || je.Error.Code != tc.code {
			t.Errorf("status %d %+v (%v), want %d %s", x.status, je.Error, err, tc.status, tc.code)
		}
		m.checkNotForwarded(t, co, id, e)
	}
	m.up.next.releaseHeld()
	if x := <-first; x.status != 200 || x.err != nil {
		t.Errorf("held request: status %d err %v", x.status, x.err)
	}
	outs := m.g.outcomes.wait(t, n+3)[n-1:]
	var decisions []string
	for _, o := range outs {
		decisions = append(decisions, o.Decision)
		if o.Decision == "admitted" {
			if o.Settled != rec.Total {
				t.Errorf("held request settled %d, want the recorded %d", o.Settled, rec.Total)
			}
			m.settled("tight", "refuse", o.Settled)
		}
	}
	slices.Sort(decisions)
	if diff := cmp.Diff([]string{"admitted", "never_admissible", "never_admissible", "refused_tokens"}, decisions); diff != "" {
		t.Errorf("decisions (-want +got):\n%s", diff)
	}
}

// A body over the limit gets 413: announced by its content-length, at the
// headers in every mode; sent chunked, as soon as it passes the limit.
func matrixTooLarge(t *testing.T, m *matrixRig, co combo) {
	rec := loadRecording(t, "openai/chat-stream-tool-result-turn")
	body := largePrompt(matrixMaxBody + 64<<10)
	for _, chunked := range []bool{false, true} {
		n := m.g.outcomes.len() + 1
		x, id, e := m.do(t, co, "large", call{path: "/meter" + rec.Path, body: body, replay: rec.Name, chunked: chunked, mayReset: true})
		if x.err != nil && x.status == 0 {
			// The client read the close before the reply: the stand-in
			// says what it sent.
			if e.Status != 413 {
				t.Errorf("chunked %v: the client got %v and the gateway sent %d, want 413", chunked, x.err, e.Status)
			}
		} else {
			je, err := x.jsonError()
			if x.status != 413 || err != nil || je.Error.Code != "request_too_large" {
				t.Errorf("chunked %v: status %d %+v (%v), want 413 request_too_large", chunked, x.status, je.Error, err)
			}
		}
		if !chunked && e.UpstreamRequested {
			t.Errorf("a content-length over the limit reached the upstream (entry %+v)", e)
		}
		m.checkNotForwarded(t, co, id, e)
		if o := m.outcome(t, n); o.Decision != "bad_request" || o.Reserved != 0 {
			t.Errorf("chunked %v: outcome %+v, want bad_request with nothing reserved", chunked, o)
		}
	}
}

// S14: a hard output cap ends the stream cleanly, as the SDK reads it, and
// as Gemini's JSON array (finishReason MAX_TOKENS). In duplex the upstream
// is cancelled and what was counted is settled (the event in flight
// included: Gemini's first element holds some fifty tokens of thought);
// STREAMED cannot end the response early, so the upstream runs on and its
// usage is settled.
func matrixCutOff(t *testing.T, m *matrixRig, co combo) {
	for _, name := range []string{"openai/chat-stream-tool-result-turn", "gemini/stream-json-array"} {
		rec := loadRecording(t, name)
		n := m.g.outcomes.len() + 1
		c := call{path: "/cut" + rec.Path, body: rec.Request, replay: name, cutResp: []int{97}}
		if co.resp == modeDuplex {
			// The upstream sends half its answer, then waits until it is
			// cancelled: only the cut-off can end it.
			c.mock = mockHang
		}
		var id string
		if strings.HasSuffix(rec.Path, "/chat/completions") {
			id = m.sdkCut(t, co, c)
		} else {
			var x exchange
			x, id, _ = m.do(t, co, "cut", c)
			if reason := lastGeminiFinish(t, x); x.status != 200 || reason != "MAX_TOKENS" {
				t.Errorf("%s: status %d, last finishReason %q, want MAX_TOKENS", name, x.status, reason)
			}
		}
		e := m.entry(t, id)
		o := m.outcome(t, n)
		want := rec.Total
		if co.resp == modeDuplex {
			want = o.InputTokens + o.Output
		}
		if !o.CutOff || o.Settled != want {
			t.Errorf("%s: outcome %+v, want cut off with %d settled", name, o, want)
		}
		if e.UpstreamCancelled != (co.resp == modeDuplex) || e.Reset {
			t.Errorf("%s: upstream cancelled %v reset %v; want cancelled only in duplex, never reset", name, e.UpstreamCancelled, e.Reset)
		}
		m.settled("cut", "cut", o.Settled)
	}
}

// sdkCut reads a cut-off chat stream through the OpenAI SDK: it must end
// with finish_reason "length" after at most the cap's tokens.
func (m *matrixRig) sdkCut(t *testing.T, co combo, c call) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	id := fmt.Sprintf("%s-%d", co.name, m.seq.Add(1))
	client := openai.NewClient(option.WithBaseURL(m.g.url+"/"+co.name+strings.TrimSuffix(c.path, "chat/completions")),
		option.WithAPIKey("sk-e2e"), option.WithMaxRetries(0), option.WithHTTPClient(m.g.client))
	opts := []option.RequestOption{option.WithRequestBody("application/json", c.body)}
	h := http.Header{}
	m.headers(h, id, "cut", c)
	for k := range h {
		opts = append(opts, option.WithHeader(k, h.Get(k)))
	}
	stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{}, opts...)
	defer stream.Close()
	finish, deltas := "", 0
	for stream.Next() {
		for _, choice := range stream.Current().Choices {
			if choice.Delta.Content != "" {
				deltas++
			}
			if choice.FinishReason != "" {
				finish = choice.FinishReason
			}
		}
	}
	if err := stream.Err(); err != nil || finish != "length" || deltas == 0 || deltas > cutCap {
		t.Errorf("cut-off stream through the SDK: err %v, finish_reason %q after %d content deltas; want length after 1..%d", err, finish, deltas, cutCap)
	}
	return id
}

// lastGeminiFinish parses a Gemini JSON-array answer and returns the last
// finishReason in it.
func lastGeminiFinish(t *testing.T, x exchange) string {
	t.Helper()
	var elems []struct {
		Candidates []struct {
			FinishReason string `json:"finishReason"`
		} `json:"candidates"`
	}
	if err := json.Unmarshal(x.body, &elems); err != nil {
		t.Errorf("the answer is not a JSON array (%v): %s", err, trim(x.body))
		return ""
	}
	reason := ""
	for _, e := range elems {
		for _, c := range e.Candidates {
			if c.FinishReason != "" {
				reason = c.FinishReason
			}
		}
	}
	return reason
}

// Request trailers (trailer mode SEND) end the body in every mode, over
// HTTP/1.1 (chunked) and HTTP/2: the decision comes first, then the
// trailers reach the upstream after the whole body (§2.3).
func matrixTrailers(t *testing.T, m *matrixRig, co combo) {
	rec := loadRecording(t, "anthropic/messages-stream-text")
	for _, h2 := range []bool{false, true} {
		n := m.g.outcomes.len() + 1
		x, id, _ := m.do(t, co, "trailers", call{path: "/meter" + rec.Path, body: rec.Request, replay: rec.Name, trailers: true, cutReq: []int{50}, h2: h2})
		if x.err != nil || x.status != 200 || !bytes.Equal(x.body, rec.Response) {
			t.Errorf("h2 %v: status %d err %v, body of %d bytes", h2, x.status, x.err, len(x.body))
		}
		got, tr, ok := m.up.got(id)
		if !ok || !bytes.Equal(got, rec.Request) || tr.Get("X-Checksum") != strconv.Itoa(len(rec.Request)) {
			t.Errorf("h2 %v: the upstream got %q (whole %v) with trailers %v", h2, trim(got), ok, tr)
		}
		m.admitted(t, n, rec, rec.Request, "meter", "trailers")
	}
}

// Every byte boundary (§9.1 rule 10): in every combination, a small
// recorded request cut in two at each of its bytes in turn, its answer cut
// in two at a byte that moves along with it, reaches both ends unchanged
// and settles at the recorded usage.
func TestModeMatrixEveryBoundary(t *testing.T) {
	checkGoroutines(t)
	m := newMatrixRig(t, buckets.NewMemory(buckets.MemoryOptions{}))
	rec := loadRecording(t, "anthropic/messages-stream-text")
	for _, co := range combos() {
		t.Run(co.name, func(t *testing.T) {
			for k := 1; k < len(rec.Request); k++ {
				n := m.g.outcomes.len() + 1
				r := k * len(rec.Response) / len(rec.Request)
				x, id, _ := m.do(t, co, "every", call{path: "/meter" + rec.Path, body: rec.Request, replay: rec.Name,
					cutReq: []int{k, len(rec.Request)}, cutResp: []int{r, len(rec.Response)}})
				if x.err != nil || x.status != 200 || !bytes.Equal(x.body, rec.Response) {
					t.Fatalf("cut at %d and %d: status %d err %v, body of %d bytes", k, r, x.status, x.err, len(x.body))
				}
				if got, _, ok := m.up.got(id); !ok || !bytes.Equal(got, rec.Request) {
					t.Fatalf("cut at %d: the upstream got %q", k, trim(got))
				}
				m.admitted(t, n, rec, rec.Request, "meter", "every")
			}
		})
	}
	m.checkLevels(t)
}

// Gemini's streamGenerateContent without alt=sse answers a JSON array
// whose elements arrive one after the other: tokengate counts them live
// (S13), settles the recorded usage at the end (S8), and cuts the stream at
// a hard cap with finishReason MAX_TOKENS and a well-formed array (S14).
func TestGeminiJSONArrayStream(t *testing.T) {
	checkGoroutines(t)
	m := newMatrixRig(t, buckets.NewMemory(buckets.MemoryOptions{}))
	rec := loadRecording(t, "gemini/stream-json-array")
	co := combo{name: "buffered-duplex", req: modeBuffered, resp: modeDuplex}

	x, _, _ := m.do(t, co, "gemini", call{path: "/meter" + rec.Path, body: rec.Request, replay: rec.Name, cutResp: []int{5}})
	if x.status != 200 || !bytes.Equal(x.body, rec.Response) {
		t.Errorf("status %d, body of %d bytes, want the recording's %d", x.status, len(x.body), len(rec.Response))
	}
	o := m.outcome(t, 1)
	if o.Settled != rec.Total || !o.Usage || o.Output < 50 {
		t.Errorf("outcome %+v: want the recorded %d settled, the usage read and the output (some fifty tokens) counted live", o, rec.Total)
	}
	m.settled("meter", "gemini", o.Settled)

	x, id, _ := m.do(t, co, "gemini", call{path: "/cut" + rec.Path, body: rec.Request, replay: rec.Name, mock: mockHang})
	if reason := lastGeminiFinish(t, x); x.status != 200 || reason != "MAX_TOKENS" {
		t.Errorf("cut-off: status %d, last finishReason %q, want MAX_TOKENS:\n%s", x.status, reason, trim(x.body))
	}
	if e := m.entry(t, id); !e.UpstreamCancelled {
		t.Errorf("the upstream was not cancelled at the cut-off (entry %+v)", e)
	}
	o = m.outcome(t, 2)
	if !o.CutOff || o.Settled != o.InputTokens+o.Output {
		t.Errorf("cut-off outcome %+v: want cut off, the prompt and the output counted settled", o)
	}
	m.settled("cut", "gemini", o.Settled)
	m.checkLevels(t)
}

// An unbounded prompt in FULL_DUPLEX_STREAMED mode (§3.2): no Envoy buffer
// limit applies, tokengate gathers and counts it, and the upstream gets it
// whole, re-sent in chunks. The same prompt against a bucket smaller than
// it gets 413 (S4) and the upstream sees nothing of it. 1 MB by default,
// 50 MB in the load run.
func TestHugePromptDuplex(t *testing.T) {
	checkGoroutines(t)
	size := 1 << 20
	if heavy {
		size = 50 << 20
	}
	m := newMatrixRigLimit(t, buckets.NewMemory(buckets.MemoryOptions{}), 64<<20)
	rec := loadRecording(t, "openai/chat-stream-tool-result-turn")
	body := largePrompt(size)
	co := combo{name: "duplex-duplex", req: modeDuplex, resp: modeDuplex}

	x, id, e := m.do(t, co, "huge", call{path: "/meter" + rec.Path, body: body, replay: rec.Name})
	if x.err != nil || x.status != 200 || !bytes.Equal(x.body, rec.Response) {
		t.Errorf("status %d err %v, body of %d bytes, want the recording's %d", x.status, x.err, len(x.body), len(rec.Response))
	}
	if got, _, ok := m.up.got(id); !ok || !bytes.Equal(got, body) {
		t.Errorf("the upstream got %d bytes (whole %v), want the client's %d", len(got), ok, len(body))
	}
	if e.Status != 200 || e.Reset {
		t.Errorf("stand-in entry %+v", e)
	}
	m.admitted(t, 1, rec, body, "meter", "huge")

	before := m.up.requests.Load()
	x, id, e = m.do(t, co, "huge", call{path: "/tight" + rec.Path, body: body, replay: rec.Name})
	if je, err := x.jsonError(); x.status != 413 || err != nil || je.Error.Code != "request_too_large" {
		t.Errorf("prompt larger than the bucket: status %d %+v (%v), want 413 request_too_large", x.status, je.Error, err)
	}
	if n := m.up.requests.Load() - before; n != 0 || e.UpstreamRequested {
		t.Errorf("the upstream saw %d requests (entry %+v), want none", n, e)
	}
	if _, _, ok := m.up.got(id); ok {
		t.Error("the upstream received the refused prompt")
	}
	if o := m.outcome(t, 2); o.Decision != "never_admissible" || o.InputTokens < size/8 {
		t.Errorf("outcome %+v, want never_admissible with the whole prompt counted", o)
	}
	m.checkLevels(t)
}

// The shipped envoy.yaml switched to duplex request bodies (request_body_mode
// FULL_DUPLEX_STREAMED, request_trailer_mode SEND, as its comments and
// `tokengate validate` advise for prompts of any size) is valid, and the
// modes it then names work end to end: admitted and settled at the
// recorded usage, refused with 429 and 413 before the upstream is
// contacted, cut off cleanly.
func TestEnvoyYAMLDuplexRequest(t *testing.T) {
	checkGoroutines(t)
	data := strings.NewReplacer(
		"request_body_mode: BUFFERED", "request_body_mode: FULL_DUPLEX_STREAMED",
		"request_trailer_mode: SKIP", "request_trailer_mode: SEND",
	).Replace(string(envoy.Recommended()))
	if data == string(envoy.Recommended()) {
		t.Fatal("envoy.yaml no longer has the modes this test switches")
	}
	rep := envoy.Check("envoy.yaml", []byte(data), envoy.Options{})
	if envoy.HasErrors(rep.Problems) || len(rep.Modes) != 1 || !rep.Modes[0].Supported {
		t.Fatalf("envoy.yaml with duplex requests: problems %v, modes %+v", rep.Problems, rep.Modes)
	}
	mu := rep.Modes[0]
	co := combo{name: modeName(mu.Request) + "-" + modeName(mu.Response), req: mu.Request, resp: mu.Response}
	if co.name != "duplex-duplex" {
		t.Fatalf("the switched file names modes %s", co.name)
	}
	m := newMatrixRig(t, buckets.NewMemory(buckets.MemoryOptions{}))
	rng := rand.New(rand.NewPCG(1, 1))
	t.Run("replay", func(t *testing.T) { matrixReplay(t, m, co, rng, false) })
	t.Run("refuse", func(t *testing.T) { matrixRefuse(t, m, co) })
	t.Run("too large", func(t *testing.T) { matrixTooLarge(t, m, co) })
	t.Run("cut off", func(t *testing.T) { matrixCutOff(t, m, co) })
	m.checkLevels(t)
}
