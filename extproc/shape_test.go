package extproc

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	anthropic "github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/google/go-cmp/cmp"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"google.golang.org/genai"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/tokenizer"
)

// sdkError is what an official SDK surfaced of an error answer.
type sdkError struct {
	status int
	// kind is the provider's error kind as the SDK reads it: OpenAI's
	// error.type, Anthropic's error.type, Google's error.status.
	kind    string
	message string
	// tokengate is tokengate's own fields (code, type, bucket, quota,
	// capacity, cost) where the SDK hands them over.
	tokengate map[string]any
}

// sdkTransport is an SDK's HTTP transport to a rig: it counts the
// attempts the SDK makes and keeps the headers of the last answer; with
// onRefusal set it runs that on each 429 before the SDK reads it.
type sdkTransport struct {
	base      http.RoundTripper
	onRefusal func(*http.Response)
	attempts  atomic.Int32

	mu   sync.Mutex
	last http.Header
}

func newSDKTransport(r *rig) *sdkTransport { return &sdkTransport{base: r.front.Client().Transport} }

func (s *sdkTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	s.attempts.Add(1)
	resp, err := s.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.last = resp.Header.Clone()
	s.mu.Unlock()
	if resp.StatusCode == 429 && s.onRefusal != nil {
		s.onRefusal(resp)
	}
	return resp, nil
}

func (s *sdkTransport) client() *http.Client { return &http.Client{Transport: s} }

// header is the last answer's headers.
func (s *sdkTransport) header() http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

// sdkAPI is one provider API and its official Go SDK, pointed at a rig.
type sdkAPI struct {
	name string
	path string
	// body is a request of this API as the SDK would send it.
	body func(maxTokens int) string
	// call sends one small request through the SDK, with hdr added and
	// at most retries retries, and returns the SDK's error (nil on
	// success).
	call func(t *testing.T, r *rig, hc *http.Client, hdr http.Header, maxTokens, retries int) error
	// read is what the SDK surfaced of err.
	read func(t *testing.T, err error) sdkError
	// answer is a provider's answer that the SDK accepts.
	answer string
}

// sdkContext bounds one SDK call: a test that goes wrong fails instead of
// hanging.
func sdkContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var openAISDK = sdkAPI{
	answer: `{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,` +
		`"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}`,
	name: "openai",
	path: chatPath,
	body: func(n int) string {
		return `{"model":"gpt-4o-mini","max_tokens":` + strconv.Itoa(n) + `,"messages":[{"role":"user","content":"Say hello"}]}`
	},
	call: func(t *testing.T, r *rig, hc *http.Client, hdr http.Header, maxTokens, retries int) error {
		opts := []option.RequestOption{option.WithBaseURL(r.front.URL + "/v1/"), option.WithAPIKey("sk-test"),
			option.WithMaxRetries(retries), option.WithHTTPClient(hc)}
		for k, vs := range hdr {
			for _, v := range vs {
				opts = append(opts, option.WithHeaderAdd(k, v))
			}
		}
		c := openai.NewClient(opts...)
		_, err := c.Chat.Completions.New(sdkContext(t), openai.ChatCompletionNewParams{
			Model: "gpt-4o-mini", MaxTokens: openai.Int(int64(maxTokens)),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hello")},
		})
		return err
	},
	read: func(t *testing.T, err error) sdkError {
		t.Helper()
		var e *openai.Error
		if !errors.As(err, &e) {
			t.Fatalf("openai: %v is not an API error", err)
		}
		// The SDK's raw JSON is the body's error object, where tokengate's
		// fields sit beside OpenAI's.
		var raw map[string]any
		if err := json.Unmarshal([]byte(e.RawJSON()), &raw); err != nil {
			t.Fatalf("openai: error object %q: %v", e.RawJSON(), err)
		}
		return sdkError{status: e.StatusCode, kind: e.Type, message: e.Message, tokengate: raw}
	},
}

var anthropicSDK = sdkAPI{
	answer: `{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"hi"}],` +
		`"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":1}}`,
	name: "anthropic",
	path: "/v1/messages",
	body: func(n int) string {
		return `{"model":"claude-sonnet-4-5","max_tokens":` + strconv.Itoa(n) + `,"messages":[{"role":"user","content":"Say hello"}]}`
	},
	call: func(t *testing.T, r *rig, hc *http.Client, hdr http.Header, maxTokens, retries int) error {
		opts := []aoption.RequestOption{aoption.WithoutEnvironmentDefaults(), aoption.WithBaseURL(r.front.URL), aoption.WithAPIKey("sk-ant-test"),
			aoption.WithMaxRetries(retries), aoption.WithHTTPClient(hc)}
		for k, vs := range hdr {
			for _, v := range vs {
				opts = append(opts, aoption.WithHeaderAdd(k, v))
			}
		}
		c := anthropic.NewClient(opts...)
		_, err := c.Messages.New(sdkContext(t), anthropic.MessageNewParams{
			Model: "claude-sonnet-4-5", MaxTokens: int64(maxTokens),
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Say hello"))},
		})
		return err
	},
	read: func(t *testing.T, err error) sdkError {
		t.Helper()
		var e *anthropic.Error
		if !errors.As(err, &e) {
			t.Fatalf("anthropic: %v is not an API error", err)
		}
		var raw struct {
			Type      string         `json:"type"`
			Tokengate map[string]any `json:"tokengate"`
		}
		if err := json.Unmarshal([]byte(e.RawJSON()), &raw); err != nil {
			t.Fatalf("anthropic: error body %q: %v", e.RawJSON(), err)
		}
		if raw.Type != "error" {
			t.Errorf("anthropic: body type %q, want error: %s", raw.Type, e.RawJSON())
		}
		return sdkError{status: e.StatusCode, kind: string(e.Type()), message: e.Message, tokengate: raw.Tokengate}
	},
}

var geminiSDK = sdkAPI{
	answer: `{"candidates":[{"content":{"role":"model","parts":[{"text":"hi"}]},"finishReason":"STOP"}],` +
		`"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":1,"totalTokenCount":11}}`,
	name: "gemini",
	path: "/v1beta/models/gemini-2.0-flash:generateContent",
	body: func(n int) string {
		return `{"contents":[{"role":"user","parts":[{"text":"Say hello"}]}],"generationConfig":{"maxOutputTokens":` + strconv.Itoa(n) + `}}`
	},
	call: func(t *testing.T, r *rig, hc *http.Client, hdr http.Header, maxTokens, retries int) error {
		c, err := genai.NewClient(t.Context(), &genai.ClientConfig{APIKey: "test-key", Backend: genai.BackendGeminiAPI,
			HTTPClient: hc, HTTPOptions: genai.HTTPOptions{BaseURL: r.front.URL, Headers: hdr}})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Models.GenerateContent(sdkContext(t), "gemini-2.0-flash", genai.Text("Say hello"),
			&genai.GenerateContentConfig{MaxOutputTokens: int32(maxTokens)})
		return err
	},
	read: func(t *testing.T, err error) sdkError {
		t.Helper()
		var e genai.APIError
		if !errors.As(err, &e) {
			t.Fatalf("gemini: %v is not an API error", err)
		}
		out := sdkError{status: e.Code, kind: e.Status, message: e.Message}
		for _, d := range e.Details {
			if d["@type"] == "type.googleapis.com/google.rpc.ErrorInfo" && d["domain"] == "tokengate" {
				out.tokengate, _ = d["metadata"].(map[string]any)
				if reason, ok := d["reason"].(string); ok && out.tokengate != nil {
					out.tokengate["code"] = strings.ToLower(reason)
				}
			}
		}
		return out
	},
}

var officialSDKs = []sdkAPI{openAISDK, anthropicSDK, geminiSDK}

// The provider's own kind of each refusal status, as its documentation
// names it: Anthropic's error types, Google's canonical status names.
var (
	anthropicKind = map[int]string{400: "invalid_request_error", 401: "authentication_error", 413: "request_too_large",
		429: "rate_limit_error", 500: "api_error", 503: "api_error"}
	googleKind = map[int]string{400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 413: "INVALID_ARGUMENT",
		429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
)

// refusalCase is one kind of refusal: how to provoke it and what every
// client must read of it.
type refusalCase struct {
	name     string
	opts     func(t *testing.T) rigOptions
	hdr      http.Header
	maxToken int
	// before runs before the SDK's request (to drain a bucket, say); its
	// result runs after it.
	before func(t *testing.T, r *rig, api sdkAPI) (after func())
	status int
	retry  string // x-should-retry
	code   string // tokengate's code
	typ    string // tokengate's type (OpenAI's error.type)
	bucket string
	quota  string
}

// refusalCases provokes every kind of refusal tokengate answers itself.
func refusalCases() []refusalCase {
	small := []Policy{{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}}}}
	realTokenizer := func(t *testing.T, o rigOptions) rigOptions {
		t.Helper()
		// Caps above 4096 are absurd here: the Anthropic SDK refuses
		// larger non-streamed requests itself.
		tc, err := tokenizer.New(tokenizer.Options{MaxOutputTokens: 4096})
		if err != nil {
			t.Fatal(err)
		}
		o.tokenizer = tc
		if o.policies == nil {
			o.policies = small
		}
		return o
	}
	drain := func(t *testing.T, r *rig, api sdkAPI) func() {
		t.Helper()
		if resp, body := r.post(t, api.path, api.body(600), nil); resp.StatusCode != 200 {
			t.Fatalf("the draining request: %d %s", resp.StatusCode, body)
		}
		return func() {}
	}
	users := []Identity{{Name: "user", Header: "x-user"}}
	return []refusalCase{
		{name: "429 tokens", opts: func(t *testing.T) rigOptions { return realTokenizer(t, rigOptions{}) },
			maxToken: 600, before: drain, status: 429, retry: "false", code: "rate_limit_exceeded", typ: "tokens", bucket: "user"},
		{name: "429 requests", opts: func(t *testing.T) rigOptions {
			return realTokenizer(t, rigOptions{policies: []Policy{{Name: "p", Concurrency: []ConcurrencyRule{{Name: "slots", Max: 1, Lease: time.Minute}},
				Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}}}})
		}, maxToken: 10, before: func(t *testing.T, r *rig, api sdkAPI) func() {
			t.Helper()
			done := make(chan struct{})
			go func() {
				defer close(done)
				req, err := http.NewRequest("POST", r.front.URL+api.path, strings.NewReader(api.body(10)))
				if err != nil {
					t.Error(err)
					return
				}
				resp, err := r.front.Client().Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				defer resp.Body.Close()
				// Held open until the upstream is let go: a client that
				// hung up would free its slot.
				if _, err := io.Copy(io.Discard, resp.Body); err != nil {
					t.Error(err)
				}
			}()
			deadline := time.Now().Add(5 * time.Second)
			for r.upstream.requests.Load() == 0 {
				if time.Now().After(deadline) {
					t.Fatal("the first request never reached the upstream")
				}
				time.Sleep(5 * time.Millisecond) // polling a deadline
			}
			return func() { close(r.upstream.Pause); <-done }
		}, status: 429, retry: "true", code: "rate_limit_exceeded", typ: "requests", bucket: "slots"},
		{name: "429 budget", opts: func(t *testing.T) rigOptions {
			return realTokenizer(t, rigOptions{policies: []Policy{{Name: "p",
				Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}},
				Quotas:  []QuotaRule{{Name: "monthly", Window: mustWindow(t, "month", "UTC"), Limit: 1000}}}}})
		}, maxToken: 600, before: drain, status: 429, retry: "false", code: "budget_exceeded", typ: "budget", quota: "monthly"},
		{name: "413 never admissible", opts: func(t *testing.T) rigOptions { return realTokenizer(t, rigOptions{}) },
			maxToken: 3000, status: 413, retry: "false", code: "request_too_large", typ: "tokens", bucket: "user"},
		{name: "413 body too large", opts: func(t *testing.T) rigOptions { return realTokenizer(t, rigOptions{maxBodyBytes: 40}) },
			maxToken: 10, status: 413, retry: "false", code: "request_too_large", typ: "invalid_request_error"},
		{name: "401 missing identity", opts: func(t *testing.T) rigOptions {
			return realTokenizer(t, rigOptions{policies: []Policy{{Name: "p", Identities: users, Anonymous: anonymousReject,
				Buckets: []BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}}})
		}, maxToken: 10, status: 401, retry: "false", code: "missing_identity", typ: "invalid_request_error"},
		{name: "400 duplicate identity", opts: func(t *testing.T) rigOptions {
			return realTokenizer(t, rigOptions{policies: []Policy{{Name: "p", Identities: users,
				Buckets: []BucketRule{{Name: "user", Per: "user", Limit: buckets.Limit{Capacity: 1000, Rate: 1}}}}}})
		}, hdr: http.Header{"X-User": {"alice", "bob"}}, maxToken: 10, status: 400, retry: "false", code: "duplicate_identity", typ: "invalid_request_error"},
		{name: "400 invalid max tokens", opts: func(t *testing.T) rigOptions { return realTokenizer(t, rigOptions{}) },
			maxToken: 5000, status: 400, retry: "false", code: "invalid_max_tokens", typ: "invalid_request_error"},
		{name: "500 unknown policy", opts: func(t *testing.T) rigOptions {
			return realTokenizer(t, rigOptions{routes: []standin.Route{{Prefix: "/", InitialMetadata: map[string]string{"x-tokengate-policy": "nope"}}}})
		}, maxToken: 10, status: 500, retry: "false", code: "unknown_policy", typ: "server_error"},
		{name: "503 store unavailable", opts: func(t *testing.T) rigOptions { return realTokenizer(t, rigOptions{}) },
			before:   func(t *testing.T, r *rig, _ sdkAPI) func() { r.store.fail.Store(true); return func() {} },
			maxToken: 10, status: 503, retry: "true", code: "rate_limiter_unavailable", typ: "server_error"},
	}
}

// Every refusal reaches each official SDK in its own API's error shape:
// OpenAI's {"error":{"code","message","type"}}, Anthropic's
// {"type":"error","error":{"type","message"}} with its documented type for
// the status, Google's {"error":{"code","message","status"}} with the
// canonical status name; tokengate's own fields ride where the SDK hands
// them over (S16, S23).
func TestRefusalInEachAPIsOwnErrorShape(t *testing.T) {
	for _, rc := range refusalCases() {
		for _, api := range officialSDKs {
			t.Run(rc.name+"/"+api.name, func(t *testing.T) {
				o := rc.opts(t)
				u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
				if rc.typ == "requests" {
					u.Pause = make(chan struct{})
				}
				r := newRig(t, u, o)
				after := func() {}
				if rc.before != nil {
					after = rc.before(t, r, api)
				}
				tr := newSDKTransport(r)
				err := api.call(t, r, tr.client(), rc.hdr, rc.maxToken, 0)
				after()
				if err == nil {
					t.Fatalf("the SDK saw no error, want a %d", rc.status)
				}
				got := api.read(t, err)
				wantKind := map[string]string{"openai": rc.typ, "anthropic": anthropicKind[rc.status], "gemini": googleKind[rc.status]}[api.name]
				if got.status != rc.status || got.kind != wantKind {
					t.Errorf("the SDK read %d %q, want %d %q (%v)", got.status, got.kind, rc.status, wantKind, err)
				}
				if got.message == "" || strings.HasPrefix(got.message, "{") {
					t.Errorf("the SDK read no message of its own: %q", got.message)
				}
				h := tr.header()
				if g := h.Get(headerShouldRetry); g != rc.retry {
					t.Errorf("x-should-retry %q, want %q", g, rc.retry)
				}
				if waits := rc.status == 429 || rc.status == 503; waits != (h.Get(headerRetryAfterMs) != "") || waits != (h.Get(headerRetryAfter) != "") {
					t.Errorf("Retry-After %q, retry-after-ms %q on a %d", h.Get(headerRetryAfter), h.Get(headerRetryAfterMs), rc.status)
				}
				want := map[string]string{"code": rc.code, "type": rc.typ, "bucket": rc.bucket, "quota": rc.quota}
				for k, v := range want {
					if g, _ := got.tokengate[k].(string); g != v {
						t.Errorf("tokengate's %s is %q, want %q (fields %v)", k, g, v, got.tokengate)
					}
				}
			})
		}
	}
}

// clockRig is a rig on the real tokenizer whose server and memory store
// read the same fake clock, with one bucket "user" of capacity 1000
// refilling at rate tokens a second, and an upstream answering api's
// answer.
// drainClockRig takes n tokens of a clock rig's bucket, as a request in
// flight would hold them.
func drainClockRig(t *testing.T, r *rig, rate, n float64) {
	t.Helper()
	b := buckets.Bucket{Name: "user", Key: bucketKey("p", "user", globalPart), Limit: buckets.Limit{Capacity: 1000, Rate: rate}}
	d, err := r.store.inner.Reserve(t.Context(), buckets.Request{Cost: n, Buckets: []buckets.Bucket{b}})
	if err != nil || !d.OK {
		t.Fatalf("draining the bucket: %+v %v", d, err)
	}
}

func clockRig(t *testing.T, api sdkAPI, rate float64) (*rig, *fakeClock) {
	t.Helper()
	tc, err := tokenizer.New(tokenizer.Options{MaxOutputTokens: 4096})
	if err != nil {
		t.Fatal(err)
	}
	clock := newFakeClock()
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(api.answer)}}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 1000, Rate: rate}}}}
	r := newRig(t, u, rigOptions{tokenizer: tc, policies: []Policy{pol}, clock: clock,
		store: buckets.NewMemory(buckets.MemoryOptions{Now: clock.now})})
	return r, clock
}

// The OpenAI and Anthropic SDKs act on tokengate's retry hints: a 429
// whose wait is longer than they wait (a minute) says x-should-retry:
// false, and they make one attempt where they would have made three; a
// short one says true with the exact wait in retry-after-ms, and they
// retry after it and are admitted (S16).
func TestRetryHintsSDKsActOn(t *testing.T) {
	for _, api := range []sdkAPI{openAISDK, anthropicSDK} {
		t.Run(api.name+"/long wait", func(t *testing.T) {
			r, _ := clockRig(t, api, 1) // 600 tokens come back in 10 minutes
			drainClockRig(t, r, 1, 600)
			tr := newSDKTransport(r)
			err := api.call(t, r, tr.client(), nil, 600, 2)
			if got := api.read(t, err); got.status != 429 {
				t.Fatalf("status %d, want 429", got.status)
			}
			if n := tr.attempts.Load(); n != 1 {
				t.Errorf("the SDK made %d attempts, want 1: no retry can be admitted within the minute it waits", n)
			}
			h := tr.header()
			ms, err := strconv.ParseInt(h.Get(headerRetryAfterMs), 10, 64)
			if err != nil || h.Get(headerShouldRetry) != "false" || time.Duration(ms)*time.Millisecond < sdkRetryCeiling {
				t.Errorf("retry-after-ms %q, x-should-retry %q; want a wait over a minute and false",
					h.Get(headerRetryAfterMs), h.Get(headerShouldRetry))
			}
			if ra, _ := strconv.ParseInt(h.Get(headerRetryAfter), 10, 64); ra != (ms+999)/1000 {
				t.Errorf("Retry-After %q is not retry-after-ms %d rounded up to the second", h.Get(headerRetryAfter), ms)
			}
		})
		t.Run(api.name+"/short wait", func(t *testing.T) {
			r, clock := clockRig(t, api, 10000) // 600 tokens come back in 60 ms
			drainClockRig(t, r, 10000, 600)
			tr := newSDKTransport(r)
			var hints []string
			tr.onRefusal = func(resp *http.Response) {
				// The SDK sleeps the wait in real time; the bucket's clock
				// moves on by the same wait.
				hints = append(hints, resp.Header.Get(headerShouldRetry)+" "+resp.Header.Get(headerRetryAfterMs))
				ms, err := strconv.ParseInt(resp.Header.Get(headerRetryAfterMs), 10, 64)
				if err != nil {
					t.Errorf("retry-after-ms %q: %v", resp.Header.Get(headerRetryAfterMs), err)
				}
				clock.advance(time.Duration(ms) * time.Millisecond)
			}
			if err := api.call(t, r, tr.client(), nil, 600, 2); err != nil {
				t.Fatalf("the SDK's request failed: %v (hints %v)", err, hints)
			}
			if n := tr.attempts.Load(); n != 2 || len(hints) != 1 {
				t.Fatalf("the SDK made %d attempts after %d refusals, want 2 after 1 (hints %v)", n, len(hints), hints)
			}
			if want := "true "; !strings.HasPrefix(hints[0], want) || hints[0] == want {
				t.Errorf("the refusal's x-should-retry and retry-after-ms: %q, want true and the wait", hints[0])
			}
		})
	}
}

// On Anthropic routes the limit headers are also sent in Anthropic's own
// names, anthropic-ratelimit-{tokens,input-tokens,output-tokens}-{limit,
// remaining,reset}, the reset as an RFC 3339 instant, on admitted answers
// and on refusals; the input and output families repeat the one bucket,
// which counts both (S17). OpenAI routes keep OpenAI's names only.
func TestAnthropicRateLimitHeaders(t *testing.T) {
	r, clock := clockRig(t, anthropicSDK, 10)
	t0 := clock.now()
	tr := newSDKTransport(r)
	if err := anthropicSDK.call(t, r, tr.client(), nil, 300, 0); err != nil {
		t.Fatal(err)
	}
	o := r.outcome(t)
	check := func(what string, h http.Header, remaining float64, reset time.Time) {
		t.Helper()
		want := map[string]string{}
		for _, family := range []string{"tokens", "input-tokens", "output-tokens"} {
			p := "anthropic-ratelimit-" + family
			want[p+"-limit"] = "1000"
			want[p+"-remaining"] = strconv.FormatFloat(remaining, 'f', 0, 64)
			want[p+"-reset"] = reset.UTC().Format(time.RFC3339)
		}
		got := map[string]string{}
		for k := range want {
			got[k] = h.Get(k)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%s: Anthropic's limit headers (-want +got):\n%s", what, diff)
		}
		if h.Get(headerLimit) != "1000" || h.Get(headerRemaining) != want["anthropic-ratelimit-tokens-remaining"] {
			t.Errorf("%s: OpenAI's limit headers %q %q", what, h.Get(headerLimit), h.Get(headerRemaining))
		}
	}
	// The bucket was full: it is full again after the reservation refills
	// at 10 tokens a second, rounded up to the second.
	cost := o.Reserved
	reset := t0.Add(time.Duration(math.Ceil(float64(cost)/10)) * time.Second)
	check("admitted", tr.header(), 1000-float64(cost), reset)

	// A refusal: the settled request gave back what it did not use.
	left := 1000 - float64(o.Settled)
	err := anthropicSDK.call(t, r, tr.client(), nil, 990, 0)
	if got := anthropicSDK.read(t, err); got.status != 429 {
		t.Fatalf("status %d, want 429", got.status)
	}
	check("refused", tr.header(), left, t0.Add(time.Duration(math.Ceil(float64(o.Settled)/10))*time.Second))

	tr = newSDKTransport(r)
	_ = openAISDK.call(t, r, tr.client(), nil, 10, 0) // only its headers matter
	if tr.header().Get(headerLimit) == "" {
		t.Fatalf("the OpenAI route's answer has no limit headers: %v", tr.header())
	}
	for k := range tr.header() {
		if strings.HasPrefix(strings.ToLower(k), "anthropic-ratelimit-") {
			t.Errorf("an OpenAI route carries %s", k)
		}
	}
}

// Provider validation stays the provider's: a cap tokengate can meter but
// the provider refuses (max_tokens 0, a negative maxOutputTokens) is
// forwarded, reserved for its prompt alone, and each SDK reads the
// provider's own answer, not one of tokengate's (S23).
func TestProviderValidationStaysTheProviders(t *testing.T) {
	for _, tt := range []struct {
		api      sdkAPI
		cap      int
		answer   string
		kind     string
		contains string
	}{
		{openAISDK, 0, `{"error":{"message":"Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead.",` +
			`"type":"invalid_request_error","param":"max_tokens","code":"integer_below_min_value"}}`, "invalid_request_error", "Expected a value >= 1"},
		{anthropicSDK, 0, `{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: Input should be greater than or equal to 1"},"request_id":"req_1"}`,
			"invalid_request_error", "greater than or equal to 1"},
		// The genai SDK leaves a zero out; a negative cap it sends.
		{geminiSDK, -3, `{"error":{"code":400,"message":"* GenerateContentRequest.generation_config.max_output_tokens: must be positive","status":"INVALID_ARGUMENT"}}`,
			"INVALID_ARGUMENT", "must be positive"},
	} {
		t.Run(tt.api.name, func(t *testing.T) {
			tc, err := tokenizer.New(tokenizer.Options{})
			if err != nil {
				t.Fatal(err)
			}
			u := &upstream{Status: 400, ContentType: "application/json", Chunks: [][]byte{[]byte(tt.answer)}}
			pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}}
			r := newRig(t, u, rigOptions{tokenizer: tc, policies: []Policy{pol}})
			err = tt.api.call(t, r, r.front.Client(), nil, tt.cap, 0)
			if err == nil {
				t.Fatal("the SDK saw no error, want the provider's 400")
			}
			got := tt.api.read(t, err)
			if got.status != 400 || got.kind != tt.kind || !strings.Contains(got.message, tt.contains) {
				t.Errorf("the SDK read %d %q %q, want the provider's 400 %q saying %q", got.status, got.kind, got.message, tt.kind, tt.contains)
			}
			if n := u.requests.Load(); n != 1 {
				t.Errorf("the provider saw %d requests, want 1", n)
			}
			if o := r.outcome(t); o.Reserved != o.InputTokens || o.InputTokens == 0 {
				t.Errorf("reserved %d for a prompt of %d tokens, want the prompt alone", o.Reserved, o.InputTokens)
			}
		})
	}
}

// A path that names no API (a proxy's own) leaves the shape to the body:
// a refusal of a body counted as Anthropic's or Google's is in that API's
// shape, even when the body cannot be counted.
func TestRefusalShapeOfTheBodysAPI(t *testing.T) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := newRig(t, nil, rigOptions{tokenizer: tc})
	for _, tt := range []struct{ body, want string }{
		{`{"model":"claude-sonnet-4-5","max_tokens":"lots","messages":[{"role":"user","content":"hi"}]}`,
			`{"type":"error","error":{"type":"invalid_request_error",`},
		{`{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":"lots"}}`,
			`{"error":{"code":400,`},
		{`{"model":"gpt-4o-mini","max_tokens":"lots","messages":[{"role":"user","content":"hi"}]}`,
			`{"error":{"code":"invalid_max_tokens",`},
	} {
		resp, got := r.post(t, "/llm/proxy", tt.body, nil)
		if resp.StatusCode != 400 || !strings.HasPrefix(got, tt.want) {
			t.Errorf("%s: %d %s, want 400 %s…", tt.body, resp.StatusCode, got, tt.want)
		}
	}
}

// A provider's own 429 passes on the longer of its wait and the provider
// bucket's pause (S18) in every retry hint the SDKs read: retry-after-ms
// too, which they prefer, and x-should-retry: false when the wait is past
// what they wait, so a provider's short retry-after-ms cannot send them
// back within the pause.
func TestProviderRetryHintsAgree(t *testing.T) {
	for _, tt := range []struct {
		retryAfter, ms, should string
		attempts               int32
	}{
		{"120", "120000", "false", 1},
		{"2", "2000", "true", -1},
	} {
		u := &upstream{Status: 429, ContentType: "application/json",
			Header: map[string]string{"retry-after": tt.retryAfter, "retry-after-ms": "500"},
			Chunks: [][]byte{[]byte(`{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}`)}}
		pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "openai", Provider: true, Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}}}}
		r := newRig(t, u, rigOptions{policies: []Policy{pol}})
		if tt.attempts < 0 {
			resp, _ := r.post(t, chatPath, `{"model":"m","max_tokens":10,"messages":[]}`, nil)
			if got := resp.Header.Get(headerRetryAfter) + " " + resp.Header.Get(headerRetryAfterMs) + " " + resp.Header.Get(headerShouldRetry); got != tt.retryAfter+" "+tt.ms+" "+tt.should {
				t.Errorf("Retry-After, retry-after-ms, x-should-retry: %q, want %s %s %s", got, tt.retryAfter, tt.ms, tt.should)
			}
			continue
		}
		tr := newSDKTransport(r)
		err := openAISDK.call(t, r, tr.client(), nil, 10, 2)
		if got := openAISDK.read(t, err); got.status != 429 || got.message != "Rate limit reached" {
			t.Fatalf("the SDK read %d %q, want the provider's 429", got.status, got.message)
		}
		h := tr.header()
		if got := h.Get(headerRetryAfter) + " " + h.Get(headerRetryAfterMs) + " " + h.Get(headerShouldRetry); got != tt.retryAfter+" "+tt.ms+" "+tt.should {
			t.Errorf("Retry-After, retry-after-ms, x-should-retry: %q, want %s %s %s", got, tt.retryAfter, tt.ms, tt.should)
		}
		if n := tr.attempts.Load(); n != tt.attempts {
			t.Errorf("the SDK made %d attempts, want %d", n, tt.attempts)
		}
	}
}
