package e2e

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/metrics"
	"github.com/tokengate/tokengate/tokenizer"
)

// providersDir holds the recorded provider traffic (testdata/providers at
// the repository root; never edited).
const providersDir = "../testdata/providers"

// waitFor bounds every wait of these tests: a wait that takes longer is a
// failure, never a reason to sleep longer.
const waitFor = 30 * time.Second

// tinyRate is the refill rate of buckets whose level must be exact: over the
// few seconds of a test it refills less than waitFor*tinyRate tokens, far
// below the tolerance of the level checks (S1 refuses a zero rate).
const tinyRate = 1e-9

// recording is one recorded provider exchange.
type recording struct {
	Name     string // "<provider>/<case>"
	Path     string // the recorded request path
	Request  []byte
	Response []byte
	// ContentType is the recorded response content type.
	ContentType string
	// Total is the provider's reported usage, input plus output, or -1 when
	// the recording carries none.
	Total int
}

var recordingCache sync.Map // name -> recording

// loadRecording reads a recorded exchange from providersDir.
func loadRecording(t testing.TB, name string) recording {
	t.Helper()
	if r, ok := recordingCache.Load(name); ok {
		return r.(recording)
	}
	dir := filepath.Join(providersDir, filepath.FromSlash(name))
	var meta struct {
		Path  string `json:"path"`
		Files struct {
			Request  string  `json:"request"`
			Response *string `json:"response"`
		} `json:"files"`
		ContentType string `json:"response_content_type"`
		Usage       *struct {
			Total int `json:"total_tokens"`
		} `json:"usage_normalized"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "meta.json"))
	if err != nil {
		t.Fatalf("recording %s: %v (the recordings live in %s)", name, err, providersDir)
	}
	if err := json.Unmarshal(b, &meta); err != nil {
		t.Fatalf("recording %s: meta.json: %v", name, err)
	}
	r := recording{Name: name, Path: meta.Path, ContentType: meta.ContentType, Total: -1}
	if meta.Usage != nil {
		r.Total = meta.Usage.Total
	}
	if r.Request, err = os.ReadFile(filepath.Join(dir, meta.Files.Request)); err != nil {
		t.Fatalf("recording %s: %v", name, err)
	}
	if meta.Files.Response != nil {
		if r.Response, err = os.ReadFile(filepath.Join(dir, *meta.Files.Response)); err != nil {
			t.Fatalf("recording %s: %v", name, err)
		}
	}
	recordingCache.Store(name, r)
	return r
}

// Request headers the mock upstream obeys. The stand-in forwards them as
// Envoy would.
const (
	headerReplay = "x-replay" // the recording to answer with
	headerMock   = "x-mock"   // how to answer: see llm
	headerUser   = "x-user"   // the identity tokengate meters
)

// Answers of the mock upstream, chosen by headerMock.
const (
	mockHold   = "hold"   // send headers and the first chunk, then wait for release
	mockHang   = "hang"   // send half of the stream, then wait for the client to leave
	mockGzip   = "gzip"   // send the recording gzip-compressed
	mockStatus = "status" // answer with x-mock-status and the recording as error body
)

// llmChunk is how many bytes the mock upstream writes between flushes, so
// that events and UTF-8 characters arrive split across chunks (S13).
const llmChunk = 512

// llm is the mock LLM upstream: it answers each request with the recording
// named by headerReplay, in chunks of llmChunk bytes with a flush after
// each, and counts held responses and cancellations. It is safe for
// concurrent use; create it with newLLM.
type llm struct {
	held      atomic.Int64 // responses that reached the hold point
	cancelled atomic.Int64 // responses whose client (the stand-in) went away
	stuck     atomic.Int64 // responses never released nor cancelled

	mu      sync.Mutex
	release chan struct{}
}

func newLLM() *llm { return &llm{release: make(chan struct{})} }

// releaseHeld lets every held response finish, and holds later ones again.
func (u *llm) releaseHeld() {
	u.mu.Lock()
	defer u.mu.Unlock()
	close(u.release)
	u.release = make(chan struct{})
}

func (u *llm) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	release := u.release
	u.mu.Unlock()
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		return
	}
	v, ok := recordingCache.Load(r.Header.Get(headerReplay))
	if !ok {
		http.Error(w, `{"error":{"message":"unknown recording"}}`, http.StatusNotFound)
		return
	}
	rec := v.(recording)
	body := rec.Response
	w.Header().Set("content-type", rec.ContentType)
	mode := r.Header.Get(headerMock)
	status := http.StatusOK
	switch mode {
	case mockGzip:
		var zb bytes.Buffer
		zw := gzip.NewWriter(&zb)
		zw.Write(body)
		zw.Close()
		body = zb.Bytes()
		w.Header().Set("content-encoding", "gzip")
	case mockStatus:
		fmt.Sscan(r.Header.Get("x-mock-status"), &status)
	}
	w.WriteHeader(status)
	f := w.(http.Flusher)
	f.Flush()
	stop := len(body)
	if mode == mockHang {
		stop = len(body) / 2
	}
	for i := 0; i < stop; i += llmChunk {
		if _, err := w.Write(body[i:min(i+llmChunk, stop)]); err != nil {
			u.cancelled.Add(1)
			return
		}
		f.Flush()
		if i == 0 && mode == mockHold {
			u.held.Add(1)
			if !u.wait(r.Context(), release) {
				return
			}
		}
	}
	if mode == mockHang {
		u.wait(r.Context(), nil)
	}
}

// wait holds a response until release is closed (it reports true) or the
// request is cancelled (false). A request that is neither released nor
// cancelled within waitFor is counted as stuck: the gateway failed to
// cancel it.
func (u *llm) wait(ctx context.Context, release <-chan struct{}) bool {
	t := time.NewTimer(waitFor)
	defer t.Stop()
	select {
	case <-release:
		return true
	case <-ctx.Done():
		u.cancelled.Add(1)
	case <-t.C:
		u.stuck.Add(1)
	}
	return false
}

// startLLM serves u on loopback and returns its base URL.
func startLLM(t testing.TB, u *llm) *url.URL {
	t.Helper()
	s := httptest.NewServer(u)
	t.Cleanup(func() {
		u.mu.Lock()
		close(u.release) // nothing stays held past the test
		u.release = make(chan struct{})
		u.mu.Unlock()
		s.Close()
		if n := u.stuck.Load(); n > 0 {
			t.Errorf("%d upstream requests were neither finished nor cancelled within %v", n, waitFor)
		}
	})
	base, err := url.Parse(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	return base
}

// outcomes collects what extproc reports for each finished request.
type outcomes struct {
	mu      sync.Mutex
	list    []extproc.Outcome
	changed chan struct{}
}

func newOutcomes() *outcomes { return &outcomes{changed: make(chan struct{}, 1)} }

func (o *outcomes) add(x extproc.Outcome) {
	o.mu.Lock()
	o.list = append(o.list, x)
	o.mu.Unlock()
	select {
	case o.changed <- struct{}{}:
	default:
	}
}

func (o *outcomes) len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.list)
}

// since returns the outcomes reported after the first n.
func (o *outcomes) since(n int) []extproc.Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.list[n:])
}

// wait waits until at least n outcomes were reported and returns them all.
func (o *outcomes) wait(t testing.TB, n int) []extproc.Outcome {
	t.Helper()
	deadline := time.NewTimer(waitFor)
	defer deadline.Stop()
	for {
		o.mu.Lock()
		got := len(o.list)
		if got >= n {
			defer o.mu.Unlock()
			return slices.Clone(o.list)
		}
		o.mu.Unlock()
		select {
		case <-o.changed:
		case <-deadline.C:
			t.Fatalf("%d requests finished within %v, want %d: a reservation was never settled", got, waitFor, n)
		}
	}
}

// gatewayConfig describes one tokengate instance behind its stand-in.
type gatewayConfig struct {
	store    buckets.Store
	policies []extproc.Policy
	upstream *url.URL
	// routes default to one metered route for everything and the
	// unmetered prefix /direct/ (ext_proc disabled), for comparison.
	routes       []standin.Route
	maxBodyBytes int // tokengate's limit; 0 means its default
	bufferLimit  int // the stand-in's per-connection buffer limit; 0 means 1 MiB
	// cuts, if set, is the stand-in's Config.Cuts: where bodies are cut
	// into body messages.
	cuts func(r *http.Request, response bool) []int
	// metrics, if set, records every outcome, as the tokengate command does.
	metrics *metrics.Metrics
	// tune, if set, adjusts the server's configuration before it starts.
	tune func(*extproc.Config)
}

// gateway is one tokengate ext_proc server on loopback gRPC, with the Envoy
// stand-in in front of it serving HTTP on loopback.
type gateway struct {
	srv      *extproc.Server
	proxy    *standin.Proxy
	url      string // the stand-in's base URL
	client   *http.Client
	outcomes *outcomes
}

// newCounter returns the real token counter.
func newCounter(t testing.TB) *tokenizer.Counter {
	t.Helper()
	c, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func startGateway(t testing.TB, cfg gatewayConfig) *gateway {
	t.Helper()
	g := &gateway{outcomes: newOutcomes()}
	sc := extproc.Config{
		Policies:      cfg.policies,
		DefaultPolicy: cfg.policies[0].Name,
		Store:         cfg.store,
		Counter:       newCounter(t),
		MaxBodyBytes:  cfg.maxBodyBytes,
		Logger:        slog.New(slog.DiscardHandler),
		OnFinish: func(o extproc.Outcome) {
			if cfg.metrics != nil {
				cfg.metrics.Finish(o)
			}
			g.outcomes.add(o)
		},
	}
	if cfg.tune != nil {
		cfg.tune(&sc)
	}
	srv, err := extproc.NewServer(sc)
	if err != nil {
		t.Fatal(err)
	}
	g.srv = srv
	// As the tokengate command: the server's own options (a BUFFERED
	// request body travels as one message, larger than gRPC's default
	// limit, and a body over tokengate's limit must reach tokengate).
	gs := grpc.NewServer(append(srv.ServerOptions(), grpc.StreamInterceptor(markStreams))...)
	srv.Register(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		gs.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	routes := cfg.routes
	if routes == nil {
		routes = []standin.Route{{Prefix: "/direct/", Disabled: true}, {Prefix: "/"}}
	}
	proxy, err := standin.New(standin.Config{
		ExtProc:  conn,
		Upstream: cfg.upstream,
		Routes:   routes,
		// As the shipped envoy.yaml: a loaded CI machine must not turn a
		// slow answer into a 504.
		MessageTimeout:      10 * time.Second,
		MaxMessageTimeout:   30 * time.Second,
		RequestBufferLimit:  cfg.bufferLimit,
		Cuts:                cfg.cuts,
		ReceivingNamespaces: []string{"tokengate"},
	})
	if err != nil {
		t.Fatal(err)
	}
	g.proxy = proxy
	front := httptest.NewServer(proxy.Handler())
	g.url = front.URL
	tr := &http.Transport{MaxIdleConnsPerHost: 256, DisableCompression: true}
	g.client = &http.Client{Transport: tr}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		// A request still open here (a failed test) must not block Close:
		// its handler sees the client gone and cancels its upstream.
		front.CloseClientConnections()
		front.Close()
		proxy.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		gs.Stop()
		<-served
		conn.Close()
	})
	return g
}

// streamKey is the context key under which markStreams keeps each
// ext_proc stream's own context: a test's store can wait on it to know that
// the client has gone, whatever context the server hands the store.
type streamKey struct{}

type markedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s markedStream) Context() context.Context { return s.ctx }

// markStreams is a gRPC stream interceptor that puts each stream's context
// into the stream's context under streamKey.
func markStreams(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	return h(srv, markedStream{ss, context.WithValue(ss.Context(), streamKey{}, ss.Context())})
}

// exchange is what a client saw of one request.
type exchange struct {
	status int
	header http.Header
	body   []byte
	err    error // transport error, or error reading the body
}

// errorBody is the JSON error every refusal carries (S16, S23), as
// OpenAI's shape has it: tokengate's code and type, and the message.
type errorBody struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
		Type    string `json:"type"`
	} `json:"error"`
}

// jsonError reads a refusal in any API's shape into OpenAI's: Anthropic's
// carries tokengate's code and type beside it, Google's in an ErrorInfo.
func (x exchange) jsonError() (errorBody, error) {
	var e errorBody
	var raw struct {
		Type  string `json:"type"`
		Error struct {
			Message string          `json:"message"`
			Status  string          `json:"status"`
			Code    json.RawMessage `json:"code"`
			Type    string          `json:"type"`
			Details []struct {
				Type     string            `json:"@type"`
				Reason   string            `json:"reason"`
				Metadata map[string]string `json:"metadata"`
			} `json:"details"`
		} `json:"error"`
		Tokengate struct {
			Code string `json:"code"`
			Type string `json:"type"`
		} `json:"tokengate"`
	}
	if err := json.Unmarshal(x.body, &raw); err != nil {
		return e, fmt.Errorf("body %q is not a JSON error: %w", trim(x.body), err)
	}
	e.Error.Message = raw.Error.Message
	switch {
	case raw.Type == "error": // Anthropic's
		e.Error.Code, e.Error.Type = raw.Tokengate.Code, raw.Tokengate.Type
	case raw.Error.Status != "": // Google's
		for _, d := range raw.Error.Details {
			if d.Type == "type.googleapis.com/google.rpc.ErrorInfo" {
				e.Error.Code, e.Error.Type = strings.ToLower(d.Reason), d.Metadata["type"]
			}
		}
	default:
		_ = json.Unmarshal(raw.Error.Code, &e.Error.Code) // a provider's error may have no code
		e.Error.Type = raw.Error.Type
	}
	if e.Error.Code == "" || e.Error.Message == "" {
		return e, fmt.Errorf("JSON error %q lacks code or message", trim(x.body))
	}
	return e, nil
}

func trim(b []byte) string {
	if len(b) > 300 {
		return string(b[:300]) + "…"
	}
	return string(b)
}

// post sends body to path through the gateway and reads the whole answer.
func (g *gateway) post(ctx context.Context, path string, body []byte, hdr map[string]string) exchange {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.url+path, bytes.NewReader(body))
	if err != nil {
		return exchange{err: err}
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return exchange{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return exchange{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

// replay posts a recording's request through the gateway, asking the mock
// upstream to answer with the same recording.
func (g *gateway) replay(ctx context.Context, rec recording, user, mode string) exchange {
	hdr := map[string]string{headerReplay: rec.Name}
	if user != "" {
		hdr[headerUser] = user
	}
	if mode != "" {
		hdr[headerMock] = mode
	}
	return g.post(ctx, rec.Path, rec.Request, hdr)
}

// ledger wraps a store and records every reservation and settlement, so a
// test can check that each reservation settled exactly once (S8) and read
// bucket levels afterwards.
type ledger struct {
	buckets.Store

	mu       sync.Mutex
	reserved map[string]*buckets.Reservation
	settles  map[string]int
	seen     map[string]buckets.Bucket // by key
}

var _ buckets.Store = (*ledger)(nil)

func newLedger(s buckets.Store) *ledger {
	return &ledger{Store: s, reserved: map[string]*buckets.Reservation{}, settles: map[string]int{}, seen: map[string]buckets.Bucket{}}
}

func (l *ledger) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	d, err := l.Store.Reserve(ctx, req)
	if err == nil && d.OK {
		l.mu.Lock()
		l.reserved[d.Reservation.ID] = d.Reservation
		for _, b := range req.Buckets {
			l.seen[b.Key] = b
		}
		l.mu.Unlock()
	}
	return d, err
}

func (l *ledger) Settle(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	l.mu.Lock()
	l.settles[r.ID]++
	l.mu.Unlock()
	return l.Store.Settle(ctx, r, actual)
}

// reset forgets what was recorded so far.
func (l *ledger) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	clear(l.reserved)
	clear(l.settles)
}

// checkSettled fails the test unless every reservation was settled exactly
// once (S8), and returns how many there were.
func (l *ledger) checkSettled(t testing.TB) int {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	bad := 0
	for id := range l.reserved {
		if n := l.settles[id]; n != 1 {
			if bad++; bad <= 5 {
				t.Errorf("reservation %s settled %d times, want exactly once (S8)", id, n)
			}
		}
	}
	if bad > 5 {
		t.Errorf("… %d reservations in all were not settled exactly once", bad)
	}
	return len(l.reserved)
}

// named returns every bucket named name that a reservation has used.
func (l *ledger) named(name string) []buckets.Bucket {
	l.mu.Lock()
	defer l.mu.Unlock()
	var bs []buckets.Bucket
	for _, b := range l.seen {
		if b.Name == name {
			bs = append(bs, b)
		}
	}
	return bs
}

// levels returns the current level of every bucket named name that a
// reservation has used, read from the store by a zero-cost reservation.
func (l *ledger) levels(t testing.TB, name string) []float64 {
	t.Helper()
	var out []float64
	for _, b := range l.named(name) {
		out = append(out, l.level(t, b))
	}
	slices.Sort(out)
	return out
}

// level reads the current level of b from the store.
func (l *ledger) level(t testing.TB, b buckets.Bucket) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d, err := l.Store.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{b}})
	if err != nil {
		t.Fatalf("reading the level of bucket %s: %v", b.Name, err)
	}
	if !d.OK {
		// A bucket in debt refuses even a zero cost; its level is still
		// reported.
		return d.Buckets[0].Remaining
	}
	if _, err := l.Store.Settle(ctx, d.Reservation, 0); err != nil {
		t.Fatalf("settling the level probe: %v", err)
	}
	return d.Buckets[0].Remaining
}

// checkGoroutines fails the test if goroutines started during it are still
// running once its cleanups have run. Call it first, so that its cleanup
// runs last.
func checkGoroutines(t testing.TB) {
	t.Helper()
	before := goroutineIDs()
	t.Cleanup(func() {
		deadline := time.Now().Add(waitFor)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		var left []string
		for {
			left = left[:0]
			for id, stack := range goroutines() {
				if _, ok := before[id]; !ok && !benign(stack) {
					left = append(left, stack)
				}
			}
			if len(left) == 0 {
				return
			}
			if time.Now().After(deadline) {
				break
			}
			<-tick.C
		}
		slices.Sort(left)
		if len(left) > 10 {
			left = left[:10]
		}
		t.Errorf("goroutines leaked (%d still running %v after the test; first ones):\n\n%s",
			len(left), waitFor, strings.Join(left, "\n\n"))
	})
}

// benign reports goroutines the runtime, os/signal or the testing package
// start on their own: those whose running function belongs to them.
func benign(stack string) bool {
	_, frames, _ := strings.Cut(stack, "\n")
	for _, p := range []string{"testing.", "runtime.", "os/signal."} {
		if strings.HasPrefix(frames, p) {
			return true
		}
	}
	return false
}

func goroutineIDs() map[string]struct{} {
	out := map[string]struct{}{}
	for id := range goroutines() {
		out[id] = struct{}{}
	}
	return out
}

// goroutines returns the stack of every goroutine but the caller's, by its
// "goroutine N" header.
func goroutines() map[string]string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := map[string]string{}
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 {
			continue // the calling goroutine
		}
		head, _, _ := strings.Cut(g, " [")
		out[head] = g
	}
	return out
}
