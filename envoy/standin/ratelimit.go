package standin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/h2c"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
)

// RateLimitFilterName is the canonical name of Envoy's global rate-limit
// HTTP filter, the default key of its per-route configuration.
const RateLimitFilterName = "envoy.filters.http.ratelimit"

// RateLimitConfig configures a [RateLimitProxy]. Filter and one of
// Upstream or Next are required; the zero value of every other field means
// Envoy's default. [NewRateLimitProxy] copies the Config; later changes
// have no effect.
type RateLimitConfig struct {
	// RLS is the connection to the rate-limit service, as the cluster of
	// Filter.rate_limit_service would be (see Dial); the proxy does not
	// close it. Nil stands for a cluster that does not exist: every call
	// fails at once, synchronously, with UNAVAILABLE (docs/envoy-ratelimit.md
	// §1.1, §2.8).
	RLS *grpc.ClientConn
	// Filter is the filter's configuration as Envoy takes it, checked by
	// Envoy's own constraints: domain, stage, request_type, timeout
	// (default 20ms, 0s for none), failure_mode_deny and
	// failure_mode_deny_percent, rate_limited_as_resource_exhausted,
	// enable_x_ratelimit_headers, disable_x_envoy_ratelimited_header,
	// rate_limited_status, response_headers_to_add, status_on_error,
	// filter_enabled, filter_enforced, rate_limits, metadata_namespace and
	// enable_retry_after_header are honoured; rate_limit_service must name a
	// V3 service, but RLS is what is called.
	Filter *rlfilterv3.RateLimit
	// FilterName is the filter's name in http_filters, under which routes,
	// virtual hosts and the route configuration hold its RateLimitPerRoute
	// (typed_per_filter_config); default RateLimitFilterName.
	FilterName string
	// Routes is the route configuration; its first virtual host serves every
	// request. A route matches by prefix or path (and headers); its
	// route.cluster, rate_limits, include_vh_rate_limits, metadata and
	// typed_per_filter_config are honoured, as are the virtual host's
	// rate_limits and typed_per_filter_config and the route configuration's
	// typed_per_filter_config (§2.4). Nil is one route, prefix "/", to a
	// cluster named "upstream", with no rate limits of its own.
	Routes *routev3.RouteConfiguration
	// Upstream is the base URL of every cluster; the request's path and
	// query are appended to its path.
	Upstream *url.URL
	// Next, when set, replaces forwarding to Upstream: it is the rest of the
	// filter chain and the router. It receives the request with the RLS's
	// request_headers_to_add and a context through which it may set dynamic
	// metadata (SetDynamicMetadata) for the stream-done call.
	Next http.Handler
	// Metadata, if set, returns the dynamic metadata a request carries when
	// it reaches the filter (JWT claims set by an earlier filter, say).
	Metadata func(*http.Request) map[string]*structpb.Struct
	// HitsAddend, if set, returns the filter state envoy.ratelimit.hits_addend
	// of a request, the request-level hits_addend of both calls (§2.5); it is
	// read again for the stream-done call. Unset, or false, means 0.
	HitsAddend func(*http.Request) (uint32, bool)
	// ServiceCluster is Envoy's --service-cluster, the value of the
	// source_cluster action.
	ServiceCluster string
	// RemoteAddress, if set, returns a request's downstream remote address
	// (the connection manager's trusted client address, which may come from
	// x-forwarded-for). Unset, it is the TCP peer's IP.
	RemoteAddress func(*http.Request) string
	// Runtime holds runtime values, in percent (0 to 100): the runtime keys
	// of filter_enabled, filter_enforced and failure_mode_deny_percent (by
	// default ratelimit.http_filter_enabled and ratelimit.http_filter_enforcing)
	// and ratelimit.<disable_key>.http_filter_enabled. A key not set takes
	// its configured default.
	Runtime map[string]uint32
	// Random draws the numbers fractional percentages are decided by; nil is
	// math/rand/v2.
	Random func() uint64
	// FormatDescriptorValues turns on the runtime guard
	// envoy.reloadable_features.enable_formatter_for_ratelimit_action_descriptor_value
	// (off by default): generic_key and header_value_match values are then
	// formatted (§2.3).
	FormatDescriptorValues bool
	// Transport carries upstream requests; nil means a private *http.Transport.
	Transport http.RoundTripper
	// Logger receives debug logs; nil discards them.
	Logger *slog.Logger
}

// RateLimitCall is one ShouldRateLimit call the proxy made.
type RateLimitCall struct {
	// StreamDone marks the call made when the stream ended, for the
	// descriptors with apply_on_stream_done; its answer is ignored.
	StreamDone bool
	Request    *rlsv3.RateLimitRequest
	// Response is the answer, nil when the call failed (Err).
	Response *rlsv3.RateLimitResponse
	Err      error
	// Cancelled reports that the client went away while the call was in
	// flight, and the call was cancelled.
	Cancelled bool
}

// RateLimitEntry describes one finished downstream request, like an access
// log line. Entries are values; [RateLimitProxy.Log] returns copies.
type RateLimitEntry struct {
	RequestID string
	Method    string
	Path      string
	// Route is the name of the matched route, or its prefix or path.
	Route string
	// Status is the status code sent to the client (0 if none was sent).
	Status int
	// Details is %RESPONSE_CODE_DETAILS%: "via_upstream",
	// "request_rate_limited", "rate_limiter_error", "route_not_found", ...
	Details string
	// Flags is %RESPONSE_FLAGS% for what the filter did: "RL" (rate limited),
	// "RLSE" (rate-limit service error), else empty.
	Flags string
	// Calls are the ShouldRateLimit calls made, the request's then the
	// stream-done one.
	Calls []RateLimitCall
	// AddedHeaders are the headers the filter added to the response, the
	// local reply's or the upstream's, in order, as "key: value".
	AddedHeaders []string
	// UpstreamRequested reports that the request went on past the filter.
	UpstreamRequested bool
	// ClientCancelled reports that the client went away before the response
	// ended.
	ClientCancelled bool
	// DynamicMetadata is the stream's dynamic metadata at its end.
	DynamicMetadata map[string]*structpb.Struct
}

// RateLimitStats are the filter's counters, cluster.<cluster>.ratelimit.*
// in Envoy (§2.1 #13), summed over routes.
type RateLimitStats struct {
	OK, Error, OverLimit, FailureModeAllowed int
}

// RateLimitProxy is the stand-in for an Envoy listener with the global
// rate-limit HTTP filter (envoy.filters.http.ratelimit) in front of an
// upstream: for every request it builds descriptors from the configured
// actions, calls ShouldRateLimit over a real gRPC connection, and forwards,
// answers 429, or fails open or closed, as Envoy does
// (docs/envoy-ratelimit.md §2). When the stream ends it makes the
// stream-done call for apply_on_stream_done descriptors. Create it with
// [NewRateLimitProxy] (the zero value is not usable); it is an
// http.Handler, safe for concurrent use.
//
// Not emulated: the extension and the cluster-metadata sources of
// actions, weighted clusters and route matching beyond prefix, path and
// headers, per-call :authority, stats per route cluster, the
// not-implemented quota fields.
type RateLimitProxy struct {
	cfg          RateLimitConfig
	f            *rlfilterv3.RateLimit
	client       rlsv3.RateLimitServiceClient
	filterName   string
	timeout      time.Duration
	filterPols   []*rlPolicy
	filterResp   []responseHeader
	rcPerRoute   *rlPerRoute
	vhPols       []*rlPolicy
	vhPerRoute   *rlPerRoute
	routes       []*rlRoute
	namespace    string
	limitedCode  int
	errorCode    int
	rt           http.RoundTripper
	ownRT        *http.Transport
	log          *slog.Logger
	randMu       sync.Mutex
	random       func() uint64
	mu           sync.Mutex
	entries      []RateLimitEntry
	stats        RateLimitStats
	changed      chan struct{}
	inflightDone sync.WaitGroup
}

// rlRoute is one compiled route.
type rlRoute struct {
	name, prefix, path string
	headers            []headerMatch
	cluster            string
	pols               []*rlPolicy
	includeVH          bool
	perRoute           *rlPerRoute
	metadata           map[string]*structpb.Struct
}

// rlPerRoute is a compiled RateLimitPerRoute.
type rlPerRoute struct {
	domain string
	vh     rlfilterv3.RateLimitPerRoute_VhRateLimitsOptions
	pols   []*rlPolicy
}

// responseHeader is one of the filter's response_headers_to_add.
type responseHeader struct {
	key    string
	value  *format
	action corev3.HeaderValueOption_HeaderAppendAction
}

// NewRateLimitProxy checks cfg as Envoy checks the filter's configuration
// and returns a proxy.
func NewRateLimitProxy(cfg RateLimitConfig) (*RateLimitProxy, error) {
	if cfg.Filter == nil {
		return nil, errors.New("standin: RateLimitConfig.Filter is nil")
	}
	if err := cfg.Filter.ValidateAll(); err != nil {
		return nil, fmt.Errorf("standin: RateLimitConfig.Filter: %w", err)
	}
	if v := cfg.Filter.GetRateLimitService().GetTransportApiVersion(); v != corev3.ApiVersion_V3 {
		return nil, fmt.Errorf("standin: rate_limit_service.transport_api_version is %v; Envoy takes only V3", v)
	}
	if cfg.Next == nil && (cfg.Upstream == nil || cfg.Upstream.Host == "") {
		return nil, errors.New("standin: RateLimitConfig needs Next or an absolute Upstream URL")
	}
	p := &RateLimitProxy{
		cfg: cfg, f: cfg.Filter, filterName: cfg.FilterName, rt: cfg.Transport, log: cfg.Logger,
		random: cfg.Random, changed: make(chan struct{}), namespace: cfg.Filter.GetMetadataNamespace(),
		timeout: 20 * time.Millisecond, limitedCode: 429, errorCode: 500,
	}
	if cfg.RLS != nil {
		p.client = rlsv3.NewRateLimitServiceClient(cfg.RLS)
	}
	if p.filterName == "" {
		p.filterName = RateLimitFilterName
	}
	if p.namespace == "" {
		p.namespace = "envoy.filters.http.ratelimit"
	}
	if t := cfg.Filter.GetTimeout(); t != nil {
		p.timeout = t.AsDuration()
	}
	if c := int(cfg.Filter.GetRateLimitedStatus().GetCode()); c != 0 {
		p.limitedCode = c
		if c < 400 {
			p.limitedCode = 429 // §2.1 #10
		}
	}
	if c := int(cfg.Filter.GetStatusOnError().GetCode()); c != 0 {
		p.errorCode = c
		if c < 100 || c > 511 {
			p.errorCode = 500 // §2.1 #12
		}
	}
	if p.random == nil {
		p.random = rand.Uint64
	}
	if p.rt == nil {
		p.ownRT = &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 16}
		p.rt = p.ownRT
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	var errs []error
	var err error
	if p.filterPols, err = p.compilePolicies(cfg.Filter.GetRateLimits(), filterList); err != nil {
		errs = append(errs, fmt.Errorf("standin: Filter.rate_limits: %w", err))
	}
	for i, h := range cfg.Filter.GetResponseHeadersToAdd() {
		f, err := compileFormat(h.GetHeader().GetValue())
		if err != nil {
			errs = append(errs, fmt.Errorf("standin: Filter.response_headers_to_add[%d]: %w", i, err))
			continue
		}
		action := h.GetAppendAction()
		if a := h.GetAppend(); a != nil && !a.GetValue() {
			action = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
		}
		p.filterResp = append(p.filterResp, responseHeader{strings.ToLower(h.GetHeader().GetKey()), f, action})
	}
	if err := p.compileRoutes(cfg.Routes); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return p, nil
}

func (p *RateLimitProxy) compilePolicies(rls []*routev3.RateLimit, list policyList) ([]*rlPolicy, error) {
	var out []*rlPolicy
	for i, rl := range rls {
		pol, err := compilePolicy(rl, list, p.cfg.FormatDescriptorValues)
		if err != nil {
			return nil, fmt.Errorf("[%d]: %w", i, err)
		}
		out = append(out, pol)
	}
	return out, nil
}

// perRoute compiles the RateLimitPerRoute a typed_per_filter_config holds
// under the filter's name, if any.
func (p *RateLimitProxy) perRoute(tpfc map[string]*anypb.Any, where string) (*rlPerRoute, error) {
	a, ok := tpfc[p.filterName]
	if !ok {
		return nil, nil
	}
	var pr rlfilterv3.RateLimitPerRoute
	if err := a.UnmarshalTo(&pr); err != nil {
		return nil, fmt.Errorf("standin: %s.typed_per_filter_config[%q]: %w", where, p.filterName, err)
	}
	if err := pr.ValidateAll(); err != nil {
		return nil, fmt.Errorf("standin: %s.typed_per_filter_config[%q]: %w", where, p.filterName, err)
	}
	pols, err := p.compilePolicies(pr.GetRateLimits(), filterList)
	if err != nil {
		return nil, fmt.Errorf("standin: %s.typed_per_filter_config[%q].rate_limits%w", where, p.filterName, err)
	}
	return &rlPerRoute{domain: pr.GetDomain(), vh: pr.GetVhRateLimits(), pols: pols}, nil
}

func (p *RateLimitProxy) compileRoutes(rc *routev3.RouteConfiguration) error {
	if rc == nil {
		p.routes = []*rlRoute{{prefix: "/", cluster: "upstream"}}
		return nil
	}
	if err := rc.ValidateAll(); err != nil {
		return fmt.Errorf("standin: RateLimitConfig.Routes: %w", err)
	}
	var err error
	if p.rcPerRoute, err = p.perRoute(rc.GetTypedPerFilterConfig(), "Routes"); err != nil {
		return err
	}
	if len(rc.GetVirtualHosts()) == 0 {
		return errors.New("standin: RateLimitConfig.Routes has no virtual host")
	}
	vh := rc.GetVirtualHosts()[0]
	if p.vhPols, err = p.compilePolicies(vh.GetRateLimits(), routeList); err != nil {
		return fmt.Errorf("standin: virtual_hosts[0].rate_limits%w", err)
	}
	if p.vhPerRoute, err = p.perRoute(vh.GetTypedPerFilterConfig(), "virtual_hosts[0]"); err != nil {
		return err
	}
	for i, r := range vh.GetRoutes() {
		where := fmt.Sprintf("virtual_hosts[0].routes[%d]", i)
		cr := &rlRoute{name: r.GetName()}
		switch m := r.GetMatch().GetPathSpecifier().(type) {
		case *routev3.RouteMatch_Prefix:
			cr.prefix = m.Prefix
		case *routev3.RouteMatch_Path:
			cr.path = m.Path
		default:
			return fmt.Errorf("standin: %s.match: only prefix and path are emulated", where)
		}
		if cr.headers, err = compileHeaders(r.GetMatch().GetHeaders()); err != nil {
			return fmt.Errorf("standin: %s.match.headers: %w", where, err)
		}
		ra := r.GetRoute()
		if ra == nil {
			return fmt.Errorf("standin: %s: only route actions are emulated", where)
		}
		if ra.GetCluster() == "" {
			return fmt.Errorf("standin: %s.route: only route.cluster is emulated", where)
		}
		cr.cluster = ra.GetCluster()
		cr.includeVH = ra.GetIncludeVhRateLimits().GetValue()
		if cr.pols, err = p.compilePolicies(ra.GetRateLimits(), routeList); err != nil {
			return fmt.Errorf("standin: %s.route.rate_limits%w", where, err)
		}
		if cr.perRoute, err = p.perRoute(r.GetTypedPerFilterConfig(), where); err != nil {
			return err
		}
		cr.metadata = r.GetMetadata().GetFilterMetadata()
		p.routes = append(p.routes, cr)
	}
	return nil
}

// Handler returns p wrapped to serve both HTTP/1.1 and HTTP/2 without TLS
// (h2c), e.g. for httptest.NewServer(p.Handler()).
func (p *RateLimitProxy) Handler() http.Handler { return h2c.NewHandler(p, &http2.Server{}) }

// Server returns an *http.Server that serves p over HTTP/1.1 and h2c.
func (p *RateLimitProxy) Server() *http.Server {
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	return &http.Server{Handler: p, Protocols: &protos, ReadHeaderTimeout: 10 * time.Second}
}

// Close waits for stream-done calls in flight and releases idle upstream
// connections of the private transport.
func (p *RateLimitProxy) Close() {
	p.inflightDone.Wait()
	if p.ownRT != nil {
		p.ownRT.CloseIdleConnections()
	}
}

// Log returns one entry per finished request, in finishing order. A
// request is finished once its stream-done call, if any, has returned.
func (p *RateLimitProxy) Log() []RateLimitEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]RateLimitEntry(nil), p.entries...)
}

// Stats returns the filter's counters.
func (p *RateLimitProxy) Stats() RateLimitStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// WaitLog waits until at least n requests have finished and returns the log.
func (p *RateLimitProxy) WaitLog(ctx context.Context, n int) ([]RateLimitEntry, error) {
	for {
		p.mu.Lock()
		if len(p.entries) >= n {
			e := append([]RateLimitEntry(nil), p.entries...)
			p.mu.Unlock()
			return e, nil
		}
		ch := p.changed
		p.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return p.Log(), fmt.Errorf("standin: waiting for %d log entries: %w", n, ctx.Err())
		}
	}
}

func (p *RateLimitProxy) record(e RateLimitEntry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.entries = append(p.entries, e)
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *RateLimitProxy) count(f func(*RateLimitStats)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f(&p.stats)
}

// fraction decides a runtime fractional percentage: the runtime value of
// its key when Runtime has one, else its default (nil: 100%).
func (p *RateLimitProxy) fraction(f *corev3.RuntimeFractionalPercent, key string) bool {
	num, den := uint64(100), uint64(100)
	if f != nil {
		num = uint64(f.GetDefaultValue().GetNumerator())
		den = denominators[f.GetDefaultValue().GetDenominator()]
		if f.GetRuntimeKey() != "" {
			key = f.GetRuntimeKey()
		}
	}
	if v, ok := p.cfg.Runtime[key]; ok {
		num, den = uint64(v), 100
	}
	switch {
	case num >= den:
		return true
	case num == 0:
		return false
	}
	p.randMu.Lock()
	defer p.randMu.Unlock()
	return p.random()%den < num
}

var denominators = map[typev3.FractionalPercent_DenominatorType]uint64{
	typev3.FractionalPercent_HUNDRED:      100,
	typev3.FractionalPercent_TEN_THOUSAND: 10000,
	typev3.FractionalPercent_MILLION:      1000000,
}

// match finds the route of a request: the first whose path matcher and
// headers match.
func (p *RateLimitProxy) match(r *http.Request, get func(string) (string, bool)) *rlRoute {
	for _, rt := range p.routes {
		switch {
		case rt.path != "" && r.URL.Path != rt.path:
		case rt.path == "" && !strings.HasPrefix(r.URL.Path, rt.prefix):
		case !all(rt.headers, get):
		default:
			return rt
		}
	}
	return nil
}

// remote is the downstream remote IP of a request.
func (p *RateLimitProxy) remote(r *http.Request) netip.Addr {
	s := r.RemoteAddr
	if p.cfg.RemoteAddress != nil {
		s = p.cfg.RemoteAddress(r)
	}
	if host, _, err := net.SplitHostPort(s); err == nil {
		s = host
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}
	}
	return a.Unmap()
}
