package standin

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"
)

// rlsCall is one call as the test's rate-limit service saw it.
type rlsCall struct {
	req *rlsv3.RateLimitRequest
	// deadline is how long the call had left when it arrived; none when
	// the call carried no grpc-timeout.
	deadline    time.Duration
	hasDeadline bool
	ctx         context.Context
}

// recordingRLS is a hand-written rate-limit service, the other side of
// the stand-in: answer scripts every call, and every call is recorded.
type recordingRLS struct {
	rlsv3.UnimplementedRateLimitServiceServer
	answer func(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error)

	mu      sync.Mutex
	calls   []rlsCall
	arrived chan rlsCall
}

func (s *recordingRLS) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	c := rlsCall{req: req, ctx: ctx}
	if d, ok := ctx.Deadline(); ok {
		c.deadline, c.hasDeadline = time.Until(d), true
	}
	s.mu.Lock()
	s.calls = append(s.calls, c)
	s.mu.Unlock()
	select {
	case s.arrived <- c:
	default:
	}
	return s.answer(ctx, req)
}

func (s *recordingRLS) seen() []rlsCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]rlsCall(nil), s.calls...)
}

// ok answers OK with no statuses.
func ok(context.Context, *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	return &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK}, nil
}

// answerWith answers every call with resp.
func answerWith(resp *rlsv3.RateLimitResponse) func(context.Context, *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	return func(context.Context, *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
		return proto.CloneOf(resp), nil
	}
}

type rlHarness struct {
	rls   *recordingRLS
	up    *upstream
	proxy *RateLimitProxy
	front *httptest.Server
}

// serveRLS serves srv on an in-memory listener and returns a client
// connection to it.
func serveRLS(t testing.TB, srv rlsv3.RateLimitServiceServer) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(gs, srv)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient("passthrough:///ratelimit",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// newRLHarness starts the test rate-limit service (none when answer is
// nil: the cluster does not exist), the upstream, and the stand-in in front
// of them. cfg.RLS and cfg.Upstream are filled in.
func newRLHarness(t testing.TB, cfg RateLimitConfig, answer func(context.Context, *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error), serve func(http.ResponseWriter, *http.Request)) *rlHarness {
	t.Helper()
	h := &rlHarness{rls: &recordingRLS{answer: answer, arrived: make(chan rlsCall, 64)}}
	if answer != nil {
		cfg.RLS = serveRLS(t, h.rls)
	}
	if serve == nil {
		serve = func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "upstream says hi") }
	}
	h.up = &upstream{serve: serve, gone: make(chan struct{}, 16)}
	us := httptest.NewServer(h.up)
	t.Cleanup(us.Close)
	cfg.Upstream, _ = url.Parse(us.URL)
	p, err := NewRateLimitProxy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	h.proxy = p
	h.front = httptest.NewUnstartedServer(p)
	h.front.Config = p.Server()
	h.front.Start()
	t.Cleanup(h.front.Close)
	return h
}

func (h *rlHarness) do(t *testing.T, method, path, body string, hdr ...string) result {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, h.front.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{status: resp.StatusCode, header: resp.Header, close: resp.Close, body: string(b), bodyErr: err}
}

// upHeader is the header of the upstream's i-th request.
func (h *rlHarness) upHeader(t *testing.T, i int) http.Header {
	t.Helper()
	h.up.mu.Lock()
	defer h.up.mu.Unlock()
	if i >= len(h.up.headers) {
		t.Fatalf("the upstream had %d requests, want request %d", len(h.up.headers), i)
	}
	return h.up.headers[i]
}

// entry waits for the n-th log entry.
func (h *rlHarness) entry(t *testing.T, n int) RateLimitEntry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	es, err := h.proxy.WaitLog(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	return es[n-1]
}

// filterConfig reads the filter's configuration from Envoy YAML; the
// rate_limit_service and a timeout long enough for a loaded machine are
// added unless given.
func filterConfig(t testing.TB, y string) *rlfilterv3.RateLimit {
	t.Helper()
	if !strings.Contains(y, "rate_limit_service:") {
		y += "\nrate_limit_service:\n  grpc_service: {envoy_grpc: {cluster_name: ratelimit}}\n  transport_api_version: V3\n"
	}
	if !strings.Contains(y, "timeout:") {
		y += "\ntimeout: 10s\n"
	}
	var f rlfilterv3.RateLimit
	fromYAML(t, y, &f)
	return &f
}

// routeConfig reads a route configuration from Envoy YAML.
func routeConfig(t testing.TB, y string) *routev3.RouteConfiguration {
	t.Helper()
	var rc routev3.RouteConfiguration
	fromYAML(t, y, &rc)
	return &rc
}

func fromYAML(t testing.TB, y string, m proto.Message) {
	t.Helper()
	js, err := yaml.YAMLToJSON([]byte(y))
	if err != nil {
		t.Fatal(err)
	}
	if err := protojson.Unmarshal(js, m); err != nil {
		t.Fatalf("%v\n%s", err, y)
	}
}

// entries lists a descriptor's entries as key=value strings.
func entries(req *rlsv3.RateLimitRequest) [][]string {
	var out [][]string
	for _, d := range req.GetDescriptors() {
		var es []string
		for _, e := range d.GetEntries() {
			es = append(es, e.GetKey()+"="+e.GetValue())
		}
		out = append(out, es)
	}
	return out
}
