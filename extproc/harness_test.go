package extproc

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// fakeCounter counts every prompt as input tokens and every non-empty
// output delta as one token, so tests can reason about exact amounts.
type fakeCounter struct {
	input     int
	allowance int // when the body has no max_tokens

	mu       sync.Mutex
	observed []int
	// held is how many live counts hold scratch space (Hold without
	// Release).
	held atomic.Int64
}

var _ tokenCounter = (*fakeCounter)(nil)

func (f *fakeCounter) Count(r tokenizer.Request) (tokenizer.Count, error) {
	var body struct {
		Model         string   `json:"model"`
		Stream        bool     `json:"stream"`
		MaxTokens     *float64 `json:"max_tokens"`
		N             int      `json:"n"`
		StreamOptions *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if err := json.Unmarshal(r.Body, &body); err != nil {
		return tokenizer.Count{}, fmt.Errorf("%w: %v", tokenizer.ErrMalformed, err)
	}
	c := tokenizer.Count{Model: body.Model, Encoding: "o200k_base", Exact: true, InputTokens: f.input, Stream: body.Stream,
		ModelKey: strings.ToLower(body.Model), Choices: 1, CapFloor: 1}
	switch {
	case strings.HasSuffix(r.Path, "/chat/completions"):
		c.API, c.AddCapField = tokenizer.ChatCompletions, "max_completion_tokens"
	case strings.HasSuffix(r.Path, "/completions"):
		c.API, c.AddCapField = tokenizer.Completions, "max_tokens"
	case strings.HasSuffix(r.Path, "/messages"):
		c.API, c.AddCapField = tokenizer.Messages, "max_tokens"
	case strings.HasSuffix(r.Path, ":streamGenerateContent?alt=sse"):
		c.API = tokenizer.Gemini
	default:
		return tokenizer.Count{}, fmt.Errorf("%w: path %q", tokenizer.ErrUnknownAPI, r.Path)
	}
	c.OutputAllowance, c.AllowanceSource = f.allowance, tokenizer.FromDefault
	if body.MaxTokens != nil {
		// As the tokenizer meters caps: up to its default bound, rounded
		// up, never below 0.
		if *body.MaxTokens > 1<<20 {
			return tokenizer.Count{API: c.API}, fmt.Errorf("%w: %v", tokenizer.ErrInvalidCap, *body.MaxTokens)
		}
		n := int(math.Ceil(max(*body.MaxTokens, 0)))
		c.OutputCap, c.OutputAllowance, c.AllowanceSource = n, n, tokenizer.FromRequest
		c.CapFields = []string{"max_tokens"}
	}
	c.ChoiceAllowance = c.OutputAllowance
	if body.N > 1 {
		c.Choices = body.N
		c.OutputAllowance *= body.N
	}
	c.IncludeUsage = body.StreamOptions != nil && body.StreamOptions.IncludeUsage
	c.HiddenReasoning = strings.HasPrefix(body.Model, "o3") // as the real counter says of OpenAI's o3
	return c, nil
}

func (f *fakeCounter) NewLive(string) liveCounter { return &deltaCount{held: &f.held} }

func (f *fakeCounter) Observe(_ string, c tokenizer.Count, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.observed = append(f.observed, n/max(1, c.Choices)) // as the estimator learns it
}

// deltaCount counts one token per non-empty delta, and its Hold and
// Release in its counter's count of streams holding scratch space.
type deltaCount struct {
	n       int
	held    *atomic.Int64
	holding bool
}

func (d *deltaCount) Write(s string) {
	if s != "" {
		d.n++
	}
}
func (d *deltaCount) Tokens() int { return d.n }
func (d *deltaCount) Hold() {
	if !d.holding {
		d.holding = true
		d.held.Add(1)
	}
}
func (d *deltaCount) Release() bool {
	if !d.holding {
		return false
	}
	d.holding = false
	d.held.Add(-1)
	return true
}

// recordingStore is the real memory store, recording what was reserved and
// settled, so tests assert the amounts charged.
type recordingStore struct {
	inner buckets.Store

	mu       sync.Mutex
	reserved map[string]float64
	keys     []string             // every bucket key a reservation used
	settled  map[string][]float64 // by reservation ID: every Settle call
	extended float64
	// lateExtends counts Extend calls on a reservation already settled.
	lateExtends int
	errs        []error
	// failExtend makes every Extend fail as an unreachable store does.
	failExtend atomic.Bool
	// onExtend, when set, runs at the start of every Extend.
	onExtend func()
	paused   map[string]time.Time
	renewals int
	fail     atomic.Bool
}

// Renew implements buckets.Renewer when the inner store does, counting calls.
func (s *recordingStore) Renew(ctx context.Context, r *buckets.Reservation) error {
	s.mu.Lock()
	s.renewals++
	s.mu.Unlock()
	if rn, ok := s.inner.(buckets.Renewer); ok {
		return rn.Renew(ctx, r)
	}
	return nil
}

var _ buckets.Store = (*recordingStore)(nil)

func newRecordingStore(inner buckets.Store) *recordingStore {
	if inner == nil {
		inner = buckets.NewMemory(buckets.MemoryOptions{})
	}
	return &recordingStore{
		inner:    inner,
		reserved: map[string]float64{},
		settled:  map[string][]float64{},
		paused:   map[string]time.Time{},
	}
}

var errStoreDown = errors.New("store down")

func (s *recordingStore) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if s.fail.Load() {
		return buckets.Decision{}, errStoreDown
	}
	d, err := s.inner.Reserve(ctx, req)
	if err == nil && d.OK {
		s.mu.Lock()
		s.reserved[d.Reservation.ID] = d.Reservation.Cost
		for _, b := range req.Buckets {
			s.keys = append(s.keys, b.Key)
		}
		s.mu.Unlock()
	}
	return d, err
}

func (s *recordingStore) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if s.onExtend != nil {
		s.onExtend()
	}
	s.mu.Lock()
	if len(s.settled[r.ID]) > 0 {
		s.lateExtends++
	}
	s.mu.Unlock()
	if s.failExtend.Load() {
		return false, fmt.Errorf("%w: connection refused", buckets.ErrStore)
	}
	ok, err := s.inner.Extend(ctx, r, n)
	s.mu.Lock()
	if ok {
		s.extended += n
	}
	if err != nil {
		s.errs = append(s.errs, err)
	}
	s.mu.Unlock()
	return ok, err
}

func (s *recordingStore) Settle(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	s.mu.Lock()
	s.settled[r.ID] = append(s.settled[r.ID], actual)
	s.mu.Unlock()
	return s.inner.Settle(ctx, r, actual)
}

// Inspect implements buckets.Inspector when the inner store does.
func (s *recordingStore) Inspect(ctx context.Context, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState, error) {
	in, ok := s.inner.(buckets.Inspector)
	if !ok {
		return nil, nil, errors.ErrUnsupported
	}
	return in.Inspect(ctx, bs, qs)
}

// InUse implements buckets.Inspector when the inner store does.
func (s *recordingStore) InUse(ctx context.Context, ss []buckets.Slot) ([]int, error) {
	in, ok := s.inner.(buckets.Inspector)
	if !ok {
		return nil, errors.ErrUnsupported
	}
	return in.InUse(ctx, ss)
}

// ListSpend implements buckets.SpendLister when the inner store does.
func (s *recordingStore) ListSpend(ctx context.Context, q buckets.SpendQuery) (buckets.SpendList, error) {
	l, ok := s.inner.(buckets.SpendLister)
	if !ok {
		return buckets.SpendList{}, errors.ErrUnsupported
	}
	return l.ListSpend(ctx, q)
}

func (s *recordingStore) Pause(ctx context.Context, b buckets.Bucket, until time.Time) error {
	s.mu.Lock()
	s.paused[b.Name] = until
	s.mu.Unlock()
	return s.inner.Pause(ctx, b, until)
}

// settlements returns every settled amount, and fails the test when a
// reservation was settled other than exactly once.
func (s *recordingStore) settlements(t *testing.T) []float64 {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var all []float64
	for id := range s.reserved {
		got := s.settled[id]
		if len(got) != 1 {
			t.Errorf("reservation %s settled %d times (%v), want exactly once", id, len(got), got)
		}
		all = append(all, got...)
	}
	return all
}

// upstream is a scripted LLM upstream. It writes Chunks with a flush after
// each; with Hang it then holds the response open until the client (the
// stand-in) goes away, so only a cut-off can end it.
type upstream struct {
	Status      int
	ContentType string
	Header      map[string]string
	Chunks      [][]byte
	Hang        bool
	// Pause, when set, holds the response after its first chunk until it
	// is closed.
	Pause chan struct{}

	mu        sync.Mutex
	bodies    []string
	headers   []http.Header
	cancelled atomic.Int32
	requests  atomic.Int32
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.requests.Add(1)
	b, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	u.bodies = append(u.bodies, string(b))
	u.headers = append(u.headers, r.Header.Clone())
	u.mu.Unlock()
	ct := u.ContentType
	if ct == "" {
		ct = "text/event-stream"
	}
	w.Header().Set("content-type", ct)
	for k, v := range u.Header {
		w.Header().Set(k, v)
	}

	status := u.Status
	if status == 0 {
		status = 200
	}
	w.WriteHeader(status)
	f := w.(http.Flusher)
	for i, c := range u.Chunks {
		if _, err := w.Write(c); err != nil {
			u.cancelled.Add(1)
			return
		}
		f.Flush()
		if i == 0 && u.Pause != nil {
			select {
			case <-u.Pause:
			case <-r.Context().Done():
				u.cancelled.Add(1)
				return
			}
		}
	}
	if u.Hang {
		select {
		case <-r.Context().Done():
			u.cancelled.Add(1)
		case <-time.After(10 * time.Second):
		}
	}
}

func (u *upstream) lastBody() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.bodies) == 0 {
		return ""
	}
	return u.bodies[len(u.bodies)-1]
}

func (u *upstream) lastHeader() http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.headers) == 0 {
		return nil
	}
	return u.headers[len(u.headers)-1]
}

// rig is a tokengate server behind the Envoy stand-in.
type rig struct {
	srv      *Server
	store    *recordingStore
	counter  *fakeCounter
	proxy    *standin.Proxy
	front    *httptest.Server
	upstream *upstream
	outcomes chan Outcome
	conn     *grpc.ClientConn // to the server, as the stand-in's
	// streams receives the context of every ext_proc stream the server
	// opens: it is done when Envoy (the stand-in) has closed the stream.
	streams chan context.Context
}

type rigOptions struct {
	policies      []Policy
	tokenizer     *tokenizer.Counter // the real counter instead of the fake
	mode          *filterv3.ProcessingMode
	routes        []standin.Route
	chunkSize     int
	eosOnLast     bool
	http2         bool
	upstream      http.Handler // default: the rig's *upstream
	upURL         string       // overrides the upstream URL (connect failures)
	maxMsgTimeout time.Duration
	// msgTimeout is the stand-in's message_timeout. Zero means 10s: a
	// rig shares the machine with the rest of the suite under -race, and
	// Envoy's 200 ms default would answer 504 to a slow scheduler. Tests
	// of the timer itself set it.
	msgTimeout    time.Duration
	store         buckets.Store // default: a memory store
	bufferLimit   int
	logger        *slog.Logger
	now           func() time.Time // the server's clock; default time.Now
	clock         *fakeClock       // the server's clock and timers; overrides now
	maxBodyBytes  int
	maxEventBytes int
	idleTimeout   time.Duration
	maxStreams    int
	// wrap, when set, is the store the server uses, around the rig's
	// recording store (a store that settles asynchronously, say).
	wrap   func(*recordingStore) buckets.Store
	prices *pricing.Table
}

func newRig(t *testing.T, u *upstream, o rigOptions) *rig {
	t.Helper()
	if u == nil {
		u = &upstream{}
	}
	if o.msgTimeout == 0 {
		o.msgTimeout = 10 * time.Second
	}
	r := &rig{store: newRecordingStore(o.store), counter: &fakeCounter{input: 10, allowance: 100}, upstream: u,
		outcomes: make(chan Outcome, 1024), streams: make(chan context.Context, 1024)}
	if o.policies == nil {
		o.policies = []Policy{{Name: "default", InjectUsage: true, Buckets: []BucketRule{{Name: "global", Limit: buckets.Limit{Capacity: 10000, Rate: 100}}}}}
	}
	srv, err := NewServer(Config{
		Policies: o.policies, DefaultPolicy: o.policies[0].Name,
		Store: wrapStore(o.wrap, r.store), Counter: o.tokenizer, counter: counterFor(o.tokenizer, r.counter), Prices: o.prices,
		OnFinish: func(oc Outcome) { r.outcomes <- oc },
		Logger:   cmp.Or(o.logger, slog.New(slog.DiscardHandler)),
		Now:      clockNow(o.clock, o.now),

		MaxBodyBytes: o.maxBodyBytes, MaxEventBytes: o.maxEventBytes,
		StreamIdleTimeout: o.idleTimeout, MaxStreams: o.maxStreams,
		afterFunc: func() func(time.Duration, func()) stopper {
			if o.clock == nil {
				return nil
			}
			return o.clock.afterFunc
		}(),
	})
	if err != nil {
		t.Fatal(err)
	}
	r.srv = srv
	g := grpc.NewServer(append(srv.ServerOptions(), grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		r.streams <- ss.Context()
		return h(srv, ss)
	}))...)
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	var handler http.Handler = u
	if o.upstream != nil {
		handler = o.upstream
	}
	up := httptest.NewServer(handler)
	upURL, _ := url.Parse(up.URL)
	if o.upURL != "" {
		upURL, _ = url.Parse(o.upURL)
	}
	proxy, err := standin.New(standin.Config{
		ExtProc: conn, Upstream: upURL, Mode: o.mode, Routes: o.routes,
		ChunkSize: o.chunkSize, EOSOnLastChunk: o.eosOnLast, MaxMessageTimeout: o.maxMsgTimeout, MessageTimeout: o.msgTimeout, RequestBufferLimit: o.bufferLimit,
		ReceivingNamespaces: []string{"tokengate"},
	})
	if err != nil {
		t.Fatal(err)
	}
	r.proxy, r.conn = proxy, conn
	r.front = httptest.NewUnstartedServer(proxy.Handler())
	if o.http2 {
		r.front.Config.Protocols = new(http.Protocols)
		r.front.Config.Protocols.SetHTTP1(true)
		r.front.Config.Protocols.SetUnencryptedHTTP2(true)
	}
	r.front.Start()
	t.Cleanup(func() {
		r.front.Close()
		proxy.Close()
		up.Close()
		conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		g.Stop()
	})
	return r
}

// wrapStore is wrap(s), or s without wrap.
func wrapStore(wrap func(*recordingStore) buckets.Store, s *recordingStore) buckets.Store {
	if wrap == nil {
		return s
	}
	return wrap(s)
}

// post sends a request through the stand-in and returns the response with
// its body read.
func (r *rig) post(t *testing.T, path, body string, hdr map[string]string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest("POST", r.front.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading response: %v", err)
	}
	return resp, string(b)
}

// postHeaders is post with every value of each header sent, in order, as
// separate header lines.
func (r *rig) postHeaders(t *testing.T, path, body string, hdr http.Header) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest("POST", r.front.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header = hdr.Clone()
	req.Header.Set("content-type", "application/json")
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading response: %v", err)
	}
	return resp, string(b)
}

// outcome waits for the next finished request.
func (r *rig) outcome(t *testing.T) Outcome {
	t.Helper()
	select {
	case o := <-r.outcomes:
		return o
	case <-time.After(5 * time.Second):
		t.Fatal("no request finished within 5s")
		return Outcome{}
	}
}

// level reads the level of the bucket of rule r at key from the rig's store.
func (r *rig) level(t *testing.T, rule BucketRule, key string) float64 {
	t.Helper()
	b := buckets.Bucket{Name: rule.Name, Key: key, Limit: rule.Limit, Hard: rule.Hard}
	d, err := r.store.inner.Reserve(context.Background(), buckets.Request{Buckets: []buckets.Bucket{b}})
	if err != nil {
		t.Fatal(err)
	}
	if d.OK {
		if _, err := r.store.inner.Settle(context.Background(), d.Reservation, 0); err != nil {
			t.Fatal(err)
		}
	}
	return d.Buckets[0].Remaining
}

// streamGone waits until the n-th ext_proc stream (counted from 1 since
// the last call) has been closed by the stand-in: the client is gone.
func (r *rig) streamGone(t *testing.T) {
	t.Helper()
	var ctx context.Context
	select {
	case ctx = <-r.streams:
	case <-time.After(5 * time.Second):
		t.Fatal("no ext_proc stream opened within 5s")
	}
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the ext_proc stream stayed open 5s after the client left")
	}
}

// entry waits for the stand-in's access log entry of the n-th request.
func (r *rig) entry(t *testing.T, n int) standin.Entry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	log, err := r.proxy.WaitLog(ctx, n)
	if err != nil {
		t.Fatalf("stand-in log: %v", err)
	}
	return log[n-1]
}

func duplexMode() *filterv3.ProcessingMode { return standin.RecommendedMode() }

func streamedMode() *filterv3.ProcessingMode {
	m := standin.RecommendedMode()
	m.ResponseBodyMode = filterv3.ProcessingMode_STREAMED
	m.ResponseTrailerMode = filterv3.ProcessingMode_SKIP
	return m
}

// sse joins events into an SSE body.
func sse(events ...string) []byte {
	var b strings.Builder
	for _, e := range events {
		b.WriteString("data: ")
		b.WriteString(e)
		b.WriteString("\n\n")
	}
	return []byte(b.String())
}

// chatChunk is one OpenAI chat completion chunk with a content delta.
func chatChunk(content string) string {
	return fmt.Sprintf(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":%q},"finish_reason":null}]}`, content)
}

func headersOf(kv ...string) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return hm
}

// clockNow is c's clock, or now without c.
func clockNow(c *fakeClock, now func() time.Time) func() time.Time {
	if c == nil {
		return now
	}
	return c.now
}

// fakeClock is a clock whose time moves only when the test advances it,
// firing the timers that fall due, on the test's goroutine. Safe for
// concurrent use.
type fakeClock struct {
	mu     sync.Mutex
	t      time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c       *fakeClock
	at      time.Time
	f       func()
	stopped bool
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_000_000, 0)} }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) afterFunc(d time.Duration, f func()) stopper {
	c.mu.Lock()
	defer c.mu.Unlock()
	tm := &fakeTimer{c: c, at: c.t.Add(d), f: f}
	c.timers = append(c.timers, tm)
	return tm
}

func (tm *fakeTimer) Stop() bool {
	tm.c.mu.Lock()
	defer tm.c.mu.Unlock()
	was := !tm.stopped
	tm.stopped = true
	return was
}

// pending is the number of timers not yet fired or stopped.
func (c *fakeClock) pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, tm := range c.timers {
		if !tm.stopped {
			n++
		}
	}
	return n
}

// advance moves the clock on by d and runs every timer due by then.
func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
	for {
		c.mu.Lock()
		var due *fakeTimer
		for _, tm := range c.timers {
			if !tm.stopped && !tm.at.After(c.t) {
				due = tm
				break
			}
		}
		if due != nil {
			due.stopped = true
		}
		c.mu.Unlock()
		if due == nil {
			return
		}
		due.f()
	}
}

func runtimeProcs() int { return runtime.GOMAXPROCS(0) }

// counterFor returns the fake unless the rig runs on the real tokenizer,
// which then goes through Config.Counter.
func counterFor(real *tokenizer.Counter, fake *fakeCounter) tokenCounter {
	if real != nil {
		return nil
	}
	return fake
}
