package e2e

import (
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
)

// hostileCap is the user bucket of the hostile-input tests; hostileSlots
// its concurrency limit.
const (
	hostileCap   = 200000
	hostileSlots = 2
)

// hostilePolicies: "open" meters anonymous requests in one shared bucket,
// "strict" (routes under /strict/) refuses them with 401 (S9a).
func hostilePolicies() []extproc.Policy {
	pol := func(name, anonymous string) extproc.Policy {
		return extproc.Policy{
			Name:        name,
			Identities:  []extproc.Identity{{Name: "user", Header: headerUser}},
			Anonymous:   anonymous,
			Buckets:     []extproc.BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: hostileCap, Rate: tinyRate}}},
			Concurrency: []extproc.ConcurrencyRule{{Name: "inflight", Per: "user", Max: hostileSlots}},
			InjectUsage: true,
		}
	}
	return []extproc.Policy{pol("open", "shared"), pol("strict", "reject")}
}

func chatBody(extra string) []byte {
	return []byte(`{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Say hello"}]` + extra + `}`)
}

// charge says what an admitted request must be charged at settlement (S8).
type charge int

const (
	chargeNothing  charge = iota // refused before any reservation
	chargeUsage                  // the provider's reported usage
	chargeLive                   // the prompt and the output counted live
	chargeReserved               // the reservation stands: no usage could be read
	chargeZero                   // refunded: the provider bills no failed call
)

type hostileCase struct {
	name string
	// path defaults to /v1/chat/completions.
	path string
	body []byte
	// replay names the recording the upstream answers with; default
	// openai/chat-stream-gpt-4o-mini.
	replay string
	mode   string            // the mock upstream's answer
	header map[string]string // beside x-user (set to the case name unless anonymous)
	// anonymous sends no identity header.
	anonymous bool
	// disconnect makes the client leave after the first bytes of the body.
	disconnect bool

	wantStatus   int
	wantCode     string // the JSON error's code when not 200
	wantDecision string
	wantSettle   string // the settle outcome, "" when nothing was reserved
	charge       charge
	// check, if set, inspects what the client received.
	check func(t *testing.T, x exchange, rec recording)
}

// TestHostileInput sends hostile requests and responses through the
// stand-in (S23), with the memory store and with Redis. Each gets its defined answer: a status with a JSON error
// naming what is wrong, or a response settled as S8 says. After each, no
// reservation is left unsettled, the bucket holds exactly what the request
// was charged, every concurrency slot can be taken again, and no goroutine
// is left.
func TestHostileInput(t *testing.T) {
	deep := strings.Repeat("[", 100000) + strings.Repeat("]", 100000)
	bigPrompt := strings.Repeat("All work and no play makes Jack a dull boy. ", 3<<20/44)
	cases := []hostileCase{{
		name: "malformed JSON", body: []byte(`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"`),
		wantStatus: 400, wantCode: "malformed_json", wantDecision: "bad_request",
	}, {
		name: "not JSON at all", body: []byte("model=gpt-4o-mini&prompt=hi"),
		wantStatus: 400, wantCode: "malformed_json", wantDecision: "bad_request",
	}, {
		name: "deeply nested content", body: []byte(`{"model":"gpt-4o-mini","messages":[{"role":"user","content":` + deep + `}]}`),
		wantStatus: 400, wantCode: "malformed_json", wantDecision: "bad_request",
	}, {
		name: "deeply nested unknown field", body: chatBody(`,"metadata":` + deep),
		wantStatus: 400, wantCode: "malformed_json", wantDecision: "bad_request",
	}, {
		name: "body over the limit", body: chatBody(`,"padding":"` + strings.Repeat("x", 9<<20) + `"`),
		wantStatus: 413, wantCode: "request_too_large", wantDecision: "bad_request",
	}, {
		// S4: waiting cannot make it fit, so it must not look retryable.
		name: "multi-MB prompt beyond capacity", body: []byte(`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"` + bigPrompt + `"}]}`),
		wantStatus: 413, wantCode: "request_too_large", wantDecision: "never_admissible",
		check: func(t *testing.T, x exchange, _ recording) {
			if ra := x.header.Get("retry-after"); ra != "" {
				t.Errorf("a never admissible request carries Retry-After %q (S4)", ra)
			}
			if !strings.Contains(string(x.body), fmt.Sprint(hostileCap)) {
				t.Errorf("413 body %q does not name the capacity %d (S4)", trim(x.body), hostileCap)
			}
		},
	}, {
		name: "absurd max_tokens", body: chatBody(`,"max_tokens":1000000000000000`),
		wantStatus: 400, wantCode: "invalid_max_tokens", wantDecision: "bad_request",
	}, {
		// A cap tokengate can meter is the provider's to refuse: the
		// request is forwarded and the provider's own 400 reaches the client.
		name: "negative max_tokens", body: chatBody(`,"max_tokens":-5`),
		mode: mockStatus, header: map[string]string{"x-mock-status": "400"}, replay: "openai/error-400-bad-request",
		wantStatus: 400, wantCode: "unsupported_parameter", wantDecision: "admitted", wantSettle: "upstream_error", charge: chargeZero,
	}, {
		name: "max_tokens of the wrong type", body: chatBody(`,"max_tokens":"lots"`),
		wantStatus: 400, wantCode: "invalid_max_tokens", wantDecision: "bad_request",
	}, {
		name: "small decoy beside a large cap", body: chatBody(`,"max_tokens":1,"max_completion_tokens":` + fmt.Sprint(hostileCap)),
		wantStatus: 413, wantCode: "request_too_large", wantDecision: "never_admissible",
	}, {
		name: "unknown model", body: []byte(`{"model":"no-such-model-9","stream":true,"messages":[{"role":"user","content":"hi"}]}`),
		wantStatus: 400, wantCode: "unknown_model", wantDecision: "bad_request",
	}, {
		name: "invalid UTF-8 in the prompt", body: []byte("{\"model\":\"gpt-4o-mini\",\"stream\":true,\"stream_options\":{\"include_usage\":true},\"messages\":[{\"role\":\"user\",\"content\":\"caf\xe9 \xff\xfe\xc3\"}]}"),
		wantStatus: 200, wantDecision: "admitted", wantSettle: "complete", charge: chargeUsage,
	}, {
		name: "missing identity, shared anonymous bucket", anonymous: true, body: chatBody(`,"stream_options":{"include_usage":true}`),
		wantStatus: 200, wantDecision: "admitted", wantSettle: "complete", charge: chargeUsage,
	}, {
		name: "missing identity, strict route", anonymous: true, path: "/strict/v1/chat/completions", body: chatBody(""),
		wantStatus: 401, wantCode: "missing_identity", wantDecision: "unauthorized",
	}, {
		name: "gzip stream", mode: mockGzip, body: chatBody(`,"stream_options":{"include_usage":true}`),
		wantStatus: 200, wantDecision: "admitted", wantSettle: "complete", charge: chargeReserved,
		check: func(t *testing.T, x exchange, rec recording) {
			if ce := x.header.Get("content-encoding"); ce != "gzip" {
				t.Fatalf("content-encoding %q, want the upstream's gzip passed on", ce)
			}
			zr, err := gzip.NewReader(bytes.NewReader(x.body))
			if err != nil {
				t.Fatal(err)
			}
			plain, err := io.ReadAll(zr)
			if err != nil || !bytes.Equal(plain, rec.Response) {
				t.Errorf("gzip body does not decompress to the recording (%v)", err)
			}
		},
	}, {
		name: "gzip JSON response", mode: mockGzip, replay: "openai/chat-basic",
		body:       []byte(`{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}`),
		wantStatus: 200, wantDecision: "admitted", wantSettle: "complete", charge: chargeReserved,
	}, {
		name: "stream that ends without usage", replay: "openai/chat-stream-no-usage", body: chatBody(""),
		wantStatus: 200, wantDecision: "admitted", wantSettle: "complete", charge: chargeLive,
		check: func(t *testing.T, x exchange, rec recording) {
			if !bytes.Equal(x.body, rec.Response) {
				t.Errorf("the client's stream differs from the upstream's (S15: the injected usage request stays invisible)")
			}
		},
	}, {
		name: "upstream error", mode: mockStatus, header: map[string]string{"x-mock-status": "500"}, replay: "openai/error-400-bad-request", body: chatBody(""),
		wantStatus: 500, wantDecision: "admitted", wantSettle: "upstream_error", charge: chargeZero,
	}, {
		name: "client disconnects mid-stream", mode: mockHang, replay: "openai/chat-stream-no-usage", body: chatBody(""), disconnect: true,
		wantStatus: 200, wantDecision: "admitted", wantSettle: "aborted", charge: chargeLive,
	}}
	stores := []struct {
		name string
		new  func(t *testing.T) buckets.Store
	}{
		{"memory", func(*testing.T) buckets.Store { return buckets.NewMemory(buckets.MemoryOptions{}) }},
		{"redis", func(t *testing.T) buckets.Store {
			srv := redistest.Start(t)
			rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
			t.Cleanup(func() { rc.Close() })
			return redisstore.New(rc, redisstore.Options{})
		}},
	}
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					checkGoroutines(t)
					hostile(t, st.new(t), tc)
				})
			}
		})
	}
}

func hostile(t *testing.T, store buckets.Store, tc hostileCase) {
	if tc.path == "" {
		tc.path = "/v1/chat/completions"
	}
	if tc.replay == "" {
		tc.replay = "openai/chat-stream-gpt-4o-mini"
	}
	rec := loadRecording(t, tc.replay)
	probe := loadRecording(t, "openai/chat-stream-gpt-4o-mini")
	led := newLedger(store)
	up := newLLM()
	g := startGateway(t, gatewayConfig{
		store: led, policies: hostilePolicies(), upstream: startLLM(t, up),
		routes: []standin.Route{
			{Prefix: "/strict/", InitialMetadata: map[string]string{"x-tokengate-policy": "strict"}},
			{Prefix: "/"},
		},
		bufferLimit: 16 << 20, // tokengate, not the stand-in, answers large bodies
	})
	user := strings.ReplaceAll(tc.name, " ", "-")
	hdr := map[string]string{headerReplay: tc.replay, headerUser: user}
	if tc.anonymous {
		delete(hdr, headerUser)
		user = ""
	}
	if tc.mode != "" {
		hdr[headerMock] = tc.mode
	}
	for k, v := range tc.header {
		hdr[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()

	var x exchange
	if tc.disconnect {
		x = disconnect(ctx, t, g, tc.path, tc.body, hdr)
	} else {
		x = g.post(ctx, tc.path, tc.body, hdr)
	}
	if x.err != nil {
		t.Fatalf("request failed: %v", x.err)
	}
	if x.status != tc.wantStatus {
		t.Errorf("status %d, want %d; body %q", x.status, tc.wantStatus, trim(x.body))
	}
	if tc.wantCode != "" {
		e, err := x.jsonError()
		if err != nil {
			t.Error(err)
		} else if e.Error.Code != tc.wantCode {
			t.Errorf("error code %q (%s), want %q", e.Error.Code, e.Error.Message, tc.wantCode)
		}
	}
	if tc.check != nil && !t.Failed() {
		tc.check(t, x, rec)
	}

	o := g.outcomes.wait(t, 1)[0]
	got := fmt.Sprintf("decision=%s settle=%s", o.Decision, o.SettleOutcome)
	want := fmt.Sprintf("decision=%s settle=%s", tc.wantDecision, tc.wantSettle)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("outcome %+v (-want +got):\n%s", o, diff)
	}
	var wantCharge int
	switch tc.charge {
	case chargeUsage:
		wantCharge = rec.Total
	case chargeLive:
		wantCharge = o.InputTokens + o.Output
		if o.Output == 0 {
			t.Errorf("outcome %+v counted no output live (S13)", o)
		}
	case chargeReserved:
		wantCharge = o.Reserved
	}
	if o.Settled != wantCharge {
		t.Errorf("settled %d tokens, want %d (outcome %+v)", o.Settled, wantCharge, o)
	}
	n := led.checkSettled(t)
	if tc.charge == chargeNothing && n != 0 {
		t.Errorf("%d reservations for a request refused before admission, want none", n)
	}
	// The bucket holds exactly what the request was charged: nothing of
	// the reservation is leaked.
	for _, b := range led.named("user") {
		if diff := cmp.Diff(hostileCap-float64(wantCharge), led.level(t, b), levelsEqual); diff != "" {
			t.Errorf("bucket level after the request (-want +got):\n%s", diff)
		}
	}
	if tc.disconnect {
		pollUntil(t, "the upstream request cancelled", func() bool { return up.cancelled.Load() > 0 })
	}
	// Every concurrency slot of the identity can be taken again.
	checkSlotsFree(t, g, up, probe, []string{user}, hostileSlots)
}

// disconnect sends a request, reads the first events of the response body
// (they have passed tokengate, so output was counted) and goes away.
func disconnect(ctx context.Context, t *testing.T, g *gateway, path string, body []byte, hdr map[string]string) exchange {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return exchange{err: err}
	}
	first := make([]byte, 2048)
	n, err := io.ReadFull(resp.Body, first)
	cancel()
	resp.Body.Close()
	if err != nil {
		return exchange{status: resp.StatusCode, err: fmt.Errorf("reading the first bytes: %w", err)}
	}
	return exchange{status: resp.StatusCode, header: resp.Header, body: first[:n]}
}

// Limits of the hostile-upstream gateway: reported usage is bounded by
// usageMargin × what the model can do (gpt-4o-mini is in no model table:
// usageWindow, and the request's cap) + usageSlack; one unfinished event
// may hold maxEvent bytes; a non-streamed body is read for usage up to
// maxBody bytes.
const (
	usageMargin = 2
	usageSlack  = 100
	usageWindow = 1000
	maxEvent    = 8 << 10
	maxBody     = 64 << 10
	upstreamCap = 1e6
)

// hostileUpstreamCase is an answer no honest provider sends, and what it
// must be charged.
type hostileUpstreamCase struct {
	name        string
	path        string
	body        string
	contentType string
	response    string
	// disconnect makes the client leave after the first bytes (the mock
	// sends half of the response, then holds).
	disconnect bool
	wantSettle string
	// want is the charge, from the outcome (the counted prompt and output).
	want func(o extproc.Outcome) int
	// clamped and unread are what the outcome must say.
	clamped, unread bool
}

// TestHostileUpstream replays answers a broken or hostile upstream could
// send, with the memory store and with Redis, and checks each bucket of the
// request — the user's and the per-model one that every user shares — to
// the token afterwards: a usage of 2^53−1 tokens or far beyond the cap is
// charged at the bound of what the model can do (S8); a stream that ends without its end
// charges what was counted over an early, low usage (Anthropic's
// message_start, Gemini's running usageMetadata); an event without end or
// a body beyond the bound is forwarded and charged at the reservation; a
// malformed usage is ignored. Nothing is left reserved, every slot is free.
func TestHostileUpstream(t *testing.T) {
	chat := func(extra string) string {
		return `{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"Say hello"}]` + extra + `}`
	}
	chunk := func(text string) string {
		return `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"` + text + `"},"finish_reason":null}]}` + "\n\n"
	}
	var anthropic, gemini strings.Builder
	anthropic.WriteString("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n")
	anthropic.WriteString("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	for range 400 {
		anthropic.WriteString("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" word\"}}\n\n")
	}
	for range 300 {
		gemini.WriteString(`data: {"candidates":[{"content":{"parts":[{"text":" word"}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":12,"candidatesTokenCount":1,"totalTokenCount":13}}` + "\r\n\r\n")
	}
	charged := func(in, out int) func(extproc.Outcome) int { return func(extproc.Outcome) int { return in + out } }
	cases := []hostileUpstreamCase{{
		name: "prompt of 2^53-1 tokens", body: chat(`,"stream":true,"stream_options":{"include_usage":true}`),
		response:   chunk("Hi") + chunk(" there") + `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":9007199254740991,"completion_tokens":2,"total_tokens":9007199254740993}}` + "\n\ndata: [DONE]\n\n",
		wantSettle: "complete", clamped: true,
		want: func(o extproc.Outcome) int { return usageWindow*usageMargin + usageSlack + 2 },
	}, {
		name: "output far beyond the cap", body: chat(""), contentType: "application/json",
		response:   `{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1000000,"total_tokens":1000009}}`,
		wantSettle: "complete", clamped: true, want: charged(9, 20*usageMargin+usageSlack),
	}, {
		name: "anthropic early usage, client leaves", path: "/v1/messages",
		body:     `{"model":"claude-sonnet-4-5","max_tokens":2000,"stream":true,"messages":[{"role":"user","content":"Say hello"}]}`,
		response: anthropic.String(), disconnect: true, wantSettle: "aborted",
		want: func(o extproc.Outcome) int { return 25 + o.Output },
	}, {
		name: "gemini running usage, client leaves", path: "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
		body:     `{"contents":[{"role":"user","parts":[{"text":"Say hello"}]}],"generationConfig":{"maxOutputTokens":2000}}`,
		response: gemini.String(), disconnect: true, wantSettle: "aborted",
		want: func(o extproc.Outcome) int { return 12 + o.Output },
	}, {
		name: "event without end", body: chat(`,"stream":true`),
		response:   chunk("Hi") + "data: " + strings.Repeat("x", 48<<10) + "\n\n" + chunk("more") + "data: [DONE]\n\n",
		wantSettle: "complete", unread: true,
		want: func(o extproc.Outcome) int { return o.Reserved },
	}, {
		name: "usage beyond the body bound", body: chat(""), contentType: "application/json",
		response:   `{"pad":"` + strings.Repeat("x", maxBody) + `","usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`,
		wantSettle: "complete", want: func(o extproc.Outcome) int { return o.Reserved },
	}, {
		name: "negative usage", body: chat(""), contentType: "application/json",
		response:   `{"id":"x","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":-500,"total_tokens":-491}}`,
		wantSettle: "complete", want: func(o extproc.Outcome) int { return o.Reserved },
	}}
	stores := []struct {
		name string
		new  func(t *testing.T) buckets.Store
	}{
		{"memory", func(*testing.T) buckets.Store { return buckets.NewMemory(buckets.MemoryOptions{}) }},
		{"redis", func(t *testing.T) buckets.Store {
			srv := redistest.Start(t)
			rc := redis.NewClient(&redis.Options{Addr: srv.Addr})
			t.Cleanup(func() { rc.Close() })
			return redisstore.New(rc, redisstore.Options{})
		}},
	}
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					checkGoroutines(t)
					hostileUpstream(t, st.new(t), tc)
				})
			}
		})
	}
}

func hostileUpstream(t *testing.T, store buckets.Store, tc hostileUpstreamCase) {
	if tc.path == "" {
		tc.path = "/v1/chat/completions"
	}
	if tc.contentType == "" {
		tc.contentType = "text/event-stream"
	}
	name := "hostile/" + tc.name
	recordingCache.Store(name, recording{Name: name, Path: tc.path, Request: []byte(tc.body), Response: []byte(tc.response), ContentType: tc.contentType, Total: -1})
	pol := extproc.Policy{
		Name:       "hostile-upstream",
		Identities: []extproc.Identity{{Name: "user", Header: headerUser}},
		Buckets: []extproc.BucketRule{
			{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: upstreamCap, Rate: tinyRate}},
			{Name: "model", Per: "model", Limit: buckets.Limit{Capacity: upstreamCap, Rate: tinyRate}},
		},
		Concurrency: []extproc.ConcurrencyRule{{Name: "inflight", Per: "user", Max: hostileSlots}},
		InjectUsage: true,
	}
	led := newLedger(store)
	up := newLLM()
	g := startGateway(t, gatewayConfig{
		store: led, policies: []extproc.Policy{pol}, upstream: startLLM(t, up),
		tune: func(c *extproc.Config) {
			c.UsageMargin, c.UsageSlack, c.MaxEventBytes, c.MaxBodyBytes = usageMargin, usageSlack, maxEvent, maxBody
			c.UsageContextWindow = usageWindow
		},
	})
	user := strings.ReplaceAll(tc.name, " ", "-")
	hdr := map[string]string{headerReplay: name, headerUser: user}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var x exchange
	if tc.disconnect {
		hdr[headerMock] = mockHang
		x = disconnect(ctx, t, g, tc.path, []byte(tc.body), hdr)
	} else {
		x = g.post(ctx, tc.path, []byte(tc.body), hdr)
	}
	if x.err != nil || x.status != 200 {
		t.Fatalf("status %d, err %v; want 200", x.status, x.err)
	}
	if !tc.disconnect && string(x.body) != tc.response {
		t.Errorf("the client got %d bytes, want the upstream's %d byte for byte", len(x.body), len(tc.response))
	}
	o := g.outcomes.wait(t, 1)[0]
	want := tc.want(o)
	if o.Settled != want || o.SettleOutcome != tc.wantSettle || o.UsageClamped != tc.clamped || o.StreamUnread != tc.unread {
		t.Errorf("outcome %+v, want %s settled %d, usage clamped %v, stream unread %v", o, tc.wantSettle, want, tc.clamped, tc.unread)
	}
	if tc.disconnect && o.Output <= 1 {
		t.Errorf("outcome %+v counted no output before the client left", o)
	}
	led.checkSettled(t)
	for _, name := range []string{"user", "model"} {
		bs := led.named(name)
		if len(bs) != 1 {
			t.Fatalf("%d %s buckets used, want 1", len(bs), name)
		}
		if diff := cmp.Diff(upstreamCap-float64(want), led.level(t, bs[0]), levelsEqual); diff != "" {
			t.Errorf("%s bucket after the request (-want +got):\n%s", name, diff)
		}
	}
	if tc.disconnect {
		pollUntil(t, "the upstream request cancelled", func() bool { return up.cancelled.Load() > 0 })
	}
	probe := loadRecording(t, "openai/chat-stream-gpt-4o-mini")
	checkSlotsFree(t, g, up, probe, []string{user}, hostileSlots)
}
