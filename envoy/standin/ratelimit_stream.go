package standin

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// rlStream is one request through the rate-limit filter, owned by the
// handler's goroutine until the handler returns, then by the stream-done
// call's.
type rlStream struct {
	p     *RateLimitProxy
	w     http.ResponseWriter
	r     *http.Request
	hdrs  http.Header // the request's headers as the filter sees them, RLS additions included
	rq    *rlRequest
	md    *streamMetadata
	route *rlRoute
	per   *rlPerRoute // the most specific RateLimitPerRoute, nil when none
	e     RateLimitEntry
	// populated: the filter built the request's descriptors, so the stream's
	// end makes a stream-done call (§2.2, onDestroy).
	populated bool
	// cancelled: the client went away while the request's call was in
	// flight; Envoy cancels it and makes no stream-done call.
	cancelled bool
}

// ServeHTTP runs one request through the filter as Envoy's decodeHeaders,
// complete() and onDestroy do (§2.2, §2.8).
func (p *RateLimitProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("x-request-id") == "" {
		r.Header.Set("x-request-id", newRequestID()) // the connection manager's, before any filter
	}
	s := &rlStream{p: p, w: w, r: r, hdrs: r.Header.Clone(), md: &streamMetadata{ns: map[string]*structpb.Struct{}}}
	s.e = RateLimitEntry{RequestID: r.Header.Get("x-request-id"), Method: r.Method, Path: r.URL.RequestURI()}
	if p.cfg.Metadata != nil {
		for ns, fields := range p.cfg.Metadata(r) {
			s.md.set(ns, fields)
		}
	}
	s.rq = &rlRequest{
		header: s.header, first: s.firstHeader, query: r.URL.Query(), remote: p.remote(r), md: s.md,
		service: p.cfg.ServiceCluster, internal: r.Header.Get("x-envoy-internal") == "true",
	}
	s.route = p.match(r, s.header)
	if s.route == nil {
		s.localReply(http.StatusNotFound, nil, nil, "route_not_found")
		p.record(s.e)
		return
	}
	s.rq.route = s.route
	s.e.Route = s.route.name
	if s.e.Route == "" {
		s.e.Route = s.route.prefix + s.route.path
	}
	// The most specific RateLimitPerRoute: route, then virtual host, then
	// route configuration (§2.4).
	for _, pr := range []*rlPerRoute{s.route.perRoute, p.vhPerRoute, p.rcPerRoute} {
		if pr != nil {
			s.per = pr
			break
		}
	}
	s.decode()
	s.end()
}

// firstHeader reads a request header as the request_headers action does:
// its first value only (envoy-ratelimit.md §2.3), pseudo headers included.
func (s *rlStream) firstHeader(name string) (string, bool) {
	if vs, ok := s.hdrs[http.CanonicalHeaderKey(name)]; ok && len(vs) > 1 {
		return vs[0], true
	}
	return s.header(name)
}

// header reads a request header as Envoy's header map has it: pseudo
// headers included, repeated values joined by ",".
func (s *rlStream) header(name string) (string, bool) {
	switch name {
	case ":method":
		return s.r.Method, true
	case ":path":
		return s.r.URL.RequestURI(), true
	case ":authority":
		return s.r.Host, true
	case ":scheme":
		return "http", true
	}
	vs, ok := s.hdrs[http.CanonicalHeaderKey(name)]
	if !ok || len(vs) == 0 {
		return "", false
	}
	return strings.Join(vs, ","), true
}

func (s *rlStream) decode() {
	p := s.p
	if !p.fraction(p.f.GetFilterEnabled(), "ratelimit.http_filter_enabled") {
		s.forward(nil, nil) // §2.2: no call, and no stream-done call
		return
	}
	switch p.f.GetRequestType() {
	case "internal":
		if !s.rq.internal {
			s.forward(nil, nil)
			return
		}
	case "external":
		if s.rq.internal {
			s.forward(nil, nil)
			return
		}
	}
	s.populated = true
	descs, opts := s.descriptors(false)
	if len(descs) == 0 {
		s.forward(nil, nil)
		return
	}
	c := s.call(descs, false)
	s.e.Calls = append(s.e.Calls, c)
	if c.Cancelled {
		s.cancelled = true
		s.e.ClientCancelled = true
		return
	}
	s.complete(c, opts)
}

// policies are the rate limits that apply to the request (§2.4): the most
// specific RateLimitPerRoute's, else the filter's, else the route's and
// the virtual host's of the filter's stage.
func (s *rlStream) policies() []*rlPolicy {
	p := s.p
	if s.per != nil && len(s.per.pols) > 0 {
		return s.per.pols
	}
	if len(p.filterPols) > 0 {
		return p.filterPols
	}
	var out []*rlPolicy
	add := func(pols []*rlPolicy) {
		for _, pol := range pols {
			if pol.stage != p.f.GetStage() {
				continue
			}
			if pol.disableKey != "" && !p.fraction(nil, "ratelimit."+pol.disableKey+".http_filter_enabled") {
				continue
			}
			out = append(out, pol)
		}
	}
	add(s.route.pols)
	vh := rlfilterv3.RateLimitPerRoute_OVERRIDE
	if s.per != nil {
		vh = s.per.vh
	}
	if s.route.includeVH {
		vh = rlfilterv3.RateLimitPerRoute_INCLUDE
	}
	switch vh {
	case rlfilterv3.RateLimitPerRoute_INCLUDE:
		add(p.vhPols)
	case rlfilterv3.RateLimitPerRoute_OVERRIDE:
		if len(s.route.pols) == 0 {
			add(p.vhPols)
		}
	}
	return out
}

// descriptors builds the descriptors of the request's call (streamDone
// false) or of the stream-done call, with each one's x_ratelimit_option.
func (s *rlStream) descriptors(streamDone bool) ([]*commonv3.RateLimitDescriptor, []routev3.RateLimit_XRateLimitOption) {
	var ds []*commonv3.RateLimitDescriptor
	var opts []routev3.RateLimit_XRateLimitOption
	for _, pol := range s.policies() {
		if pol.onStreamDone != streamDone {
			continue
		}
		if d, ok := pol.descriptor(s.rq); ok {
			ds = append(ds, d)
			opts = append(opts, pol.xOption)
		}
	}
	return ds, opts
}

// domain is the most specific RateLimitPerRoute's domain, else the
// filter's (§2.6).
func (s *rlStream) domain() string {
	if s.per != nil && s.per.domain != "" {
		return s.per.domain
	}
	return s.p.f.GetDomain()
}

// call makes one ShouldRateLimit call. The request's call is cancelled
// when the client goes away; the stream-done call outlives the stream.
func (s *rlStream) call(descs []*commonv3.RateLimitDescriptor, streamDone bool) RateLimitCall {
	p := s.p
	var hits uint32
	if p.cfg.HitsAddend != nil {
		hits, _ = p.cfg.HitsAddend(s.r)
	}
	c := RateLimitCall{StreamDone: streamDone, Request: &rlsv3.RateLimitRequest{Domain: s.domain(), Descriptors: descs, HitsAddend: hits}}
	if p.client == nil {
		c.Err = status.Error(codes.Unavailable, "rate-limit service cluster not found") // at once, synchronously (§1.1)
		return c
	}
	parent := s.r.Context()
	if streamDone {
		parent = context.Background()
	}
	ctx, cancel := context.WithCancel(parent)
	if p.timeout > 0 {
		ctx, cancel = context.WithTimeout(parent, p.timeout)
	}
	defer cancel()
	c.Response, c.Err = p.client.ShouldRateLimit(ctx, c.Request)
	c.Cancelled = c.Err != nil && !streamDone && s.r.Context().Err() != nil
	return c
}

// complete acts on the answer to the request's call (§2.8).
func (s *rlStream) complete(c RateLimitCall, opts []routev3.RateLimit_XRateLimitOption) {
	p := s.p
	if c.Err != nil {
		p.count(func(st *RateLimitStats) { st.Error++ })
		deny := p.f.GetFailureModeDeny()
		if fp := p.f.GetFailureModeDenyPercent(); fp != nil {
			deny = p.fraction(fp, "")
		}
		if deny {
			s.e.Flags = "RLSE"
			s.localReply(p.errorCode, nil, nil, "rate_limiter_error")
			return
		}
		p.count(func(st *RateLimitStats) { st.FailureModeAllowed++ })
		s.forward(nil, nil)
		return
	}
	resp := c.Response
	if dm := resp.GetDynamicMetadata(); len(dm.GetFields()) > 0 {
		s.md.set(p.namespace, dm)
	}
	over := resp.GetOverallCode() == rlsv3.RateLimitResponse_OVER_LIMIT
	p.count(func(st *RateLimitStats) {
		if over {
			st.OverLimit++
		} else {
			st.OK++ // anything but OVER_LIMIT is OK, UNKNOWN included (§1.3)
		}
	})
	var hs []header
	for _, h := range resp.GetResponseHeadersToAdd() {
		hs = append(hs, header{strings.ToLower(h.GetKey()), h.GetValue()})
	}
	if over && !p.f.GetDisableXEnvoyRatelimitedHeader() {
		hs = append(hs, header{"x-envoy-ratelimited", "true"})
	}
	if len(resp.GetStatuses()) > 0 {
		on := func(i int) bool {
			opt := routev3.RateLimit_UNSPECIFIED
			if i < len(opts) {
				opt = opts[i]
			}
			switch opt {
			case routev3.RateLimit_DRAFT_VERSION_03:
				return true
			case routev3.RateLimit_OFF:
				return false
			}
			return p.f.GetEnableXRatelimitHeaders() == rlfilterv3.RateLimit_DRAFT_VERSION_03
		}
		hs = append(hs, xRateLimitHeaders(resp.GetStatuses(), on)...)
	}
	if over && p.fraction(p.f.GetFilterEnforced(), "ratelimit.http_filter_enforcing") {
		s.e.Flags = "RL"
		hs = s.filterResponseHeaders(hs)
		if p.f.GetEnableRetryAfterHeader() && get(hs, "retry-after") == "" {
			if ra := retryAfter(resp.GetStatuses()); ra != "" {
				hs = append(hs, header{"retry-after", ra})
			}
		}
		s.localReply(p.limitedCode, hs, resp.GetRawBody(), "request_rate_limited")
		return
	}
	var add []header
	for _, h := range resp.GetRequestHeadersToAdd() {
		add = append(add, header{strings.ToLower(h.GetKey()), h.GetValue()})
	}
	s.forward(add, hs)
}

// filterResponseHeaders applies the filter's response_headers_to_add to a
// rate-limited reply's headers, after the RLS's and the X-RateLimit ones
// (§2.1 #11).
func (s *rlStream) filterResponseHeaders(hs []header) []header {
	for _, h := range s.p.filterResp {
		v := h.value.text(s.rq)
		switch h.action {
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if get(hs, h.key) == "" {
				hs = append(hs, header{h.key, v})
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD:
			hs = append(del(hs, h.key), header{h.key, v})
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if get(hs, h.key) != "" {
				hs = append(del(hs, h.key), header{h.key, v})
			}
		default:
			hs = append(hs, header{h.key, v})
		}
	}
	return hs
}

// isGRPC reports a gRPC client, which gets local replies as gRPC statuses.
func (s *rlStream) isGRPC() bool {
	return strings.HasPrefix(s.r.Header.Get("content-type"), "application/grpc")
}

// localReply answers the client without the upstream: status code, the
// headers in order (a content-type among them replacing the default), the
// body. A gRPC client gets HTTP 200 with the status as grpc-status, 429
// as UNAVAILABLE or, with rate_limited_as_resource_exhausted,
// RESOURCE_EXHAUSTED (§2.1 #6).
func (s *rlStream) localReply(code int, hs []header, body []byte, details string) {
	h := s.w.Header()
	s.added(hs)
	for _, x := range hs {
		h.Add(x.key, x.value)
	}
	s.e.Status, s.e.Details = code, details
	if s.isGRPC() {
		gs := grpcStatusOf(code)
		if code == s.p.limitedCode && details == "request_rate_limited" && s.p.f.GetRateLimitedAsResourceExhausted() {
			gs = int(codes.ResourceExhausted)
		}
		h.Set("content-type", "application/grpc")
		h.Set("grpc-status", strconv.Itoa(gs))
		if len(body) > 0 {
			h.Set("grpc-message", string(body))
		}
		s.e.Status = http.StatusOK
		s.w.WriteHeader(http.StatusOK)
		return
	}
	if len(body) > 0 && h.Get("content-type") == "" {
		h.Set("content-type", "text/plain")
	}
	h.Set("content-length", strconv.Itoa(len(body)))
	s.w.WriteHeader(code)
	if _, err := s.w.Write(body); err != nil {
		s.e.ClientCancelled = true
	}
}

// forward passes the request on, to Next or to the upstream, with add
// appended to its headers and respAdd to the response's (§2.8).
func (s *rlStream) forward(add, respAdd []header) {
	for _, h := range add {
		s.r.Header.Add(h.key, h.value)
		s.hdrs.Add(h.key, h.value)
	}
	s.e.UpstreamRequested = true
	s.added(respAdd)
	if s.p.cfg.Next != nil {
		aw := &appendingWriter{ResponseWriter: s.w, add: respAdd}
		s.p.cfg.Next.ServeHTTP(aw, s.r.WithContext(context.WithValue(s.r.Context(), metadataKey{}, s.md)))
		aw.WriteHeader(http.StatusOK) // a handler that wrote nothing answered 200
		s.e.Status, s.e.Details = aw.status, "via_upstream"
		s.e.ClientCancelled = s.r.Context().Err() != nil
		return
	}
	u := *s.p.cfg.Upstream
	target, err := u.Parse(strings.TrimSuffix(u.Path, "/") + s.r.URL.RequestURI())
	if err != nil {
		s.localReply(http.StatusBadRequest, nil, nil, "invalid_path")
		return
	}
	req, err := http.NewRequestWithContext(s.r.Context(), s.r.Method, target.String(), s.r.Body)
	if err != nil {
		s.localReply(http.StatusBadRequest, nil, nil, "invalid_request")
		return
	}
	for k, vs := range s.r.Header {
		if !hopByHop[strings.ToLower(k)] {
			req.Header[k] = vs
		}
	}
	req.ContentLength, req.Host = s.r.ContentLength, s.r.Host
	if s.r.ContentLength == 0 {
		req.Body = http.NoBody
	}
	resp, err := s.p.rt.RoundTrip(req)
	if err != nil {
		if s.r.Context().Err() != nil {
			s.e.ClientCancelled = true
			return
		}
		s.localReply(http.StatusServiceUnavailable, nil, []byte("upstream connect error or disconnect/reset before headers"), "upstream_reset_before_response_started")
		return
	}
	defer resp.Body.Close()
	h := s.w.Header()
	for k, vs := range resp.Header {
		if !hopByHop[strings.ToLower(k)] {
			h[k] = vs
		}
	}
	for _, x := range respAdd {
		h.Add(x.key, x.value)
	}
	for k := range resp.Trailer {
		h.Add("Trailer", k)
	}
	s.w.WriteHeader(resp.StatusCode)
	s.e.Status, s.e.Details = resp.StatusCode, "via_upstream"
	rc := http.NewResponseController(s.w)
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if _, err := s.w.Write(buf[:n]); err != nil {
				s.e.ClientCancelled = true
				return
			}
			if err := rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
				s.e.ClientCancelled = true
				return
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			s.e.ClientCancelled = s.r.Context().Err() != nil
			return
		}
	}
	for k, vs := range resp.Trailer {
		h[k] = vs
	}
}

// added logs headers the filter adds to the response.
func (s *rlStream) added(hs []header) {
	for _, x := range hs {
		s.e.AddedHeaders = append(s.e.AddedHeaders, x.key+": "+x.value)
	}
}

// appendingWriter appends the filter's queued response headers when the
// rest of the chain writes its response headers.
type appendingWriter struct {
	http.ResponseWriter
	add    []header
	status int
}

func (a *appendingWriter) WriteHeader(code int) {
	if a.status != 0 {
		return
	}
	a.status = code
	for _, x := range a.add {
		a.Header().Add(x.key, x.value)
	}
	a.ResponseWriter.WriteHeader(code)
}

func (a *appendingWriter) Write(b []byte) (int, error) {
	a.WriteHeader(http.StatusOK)
	return a.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (a *appendingWriter) Unwrap() http.ResponseWriter { return a.ResponseWriter }

// Flush lets streaming handlers flush through the wrapper. A flush fails
// only when the client went away, which the handler's next Write reports.
func (a *appendingWriter) Flush() {
	a.WriteHeader(http.StatusOK)
	_ = http.NewResponseController(a.ResponseWriter).Flush()
}

// end finishes the stream as onDestroy does (§2.2): unless the request's
// call was cancelled, or the filter never built descriptors, the
// stream-done descriptors go in one more call, made once the handler has
// returned (the response has ended), whose answer is ignored. The request
// is logged after it.
func (s *rlStream) end() {
	if !s.populated || s.cancelled {
		s.e.DynamicMetadata = s.md.snapshot()
		s.p.record(s.e)
		return
	}
	s.r = s.r.Clone(context.Background()) // the handler's request must not be used after it returns
	s.p.inflightDone.Add(1)
	go func() {
		defer s.p.inflightDone.Done()
		if descs, _ := s.descriptors(true); len(descs) > 0 {
			s.e.Calls = append(s.e.Calls, s.call(descs, true))
		}
		s.e.DynamicMetadata = s.md.snapshot()
		s.p.record(s.e)
	}()
}
