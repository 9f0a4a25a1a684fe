package envoy

import (
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Limits the tokengate checks apply. They follow docs/envoy-ext-proc.md
// (§1.4, §3.1, §5.2).
const (
	// MinMessageTimeout is the shortest message_timeout that lets tokengate
	// count a multi-megabyte prompt before Envoy answers 504 on its own.
	MinMessageTimeout = time.Second
	// MinRouteTimeout is the shortest non-zero route timeout that does not
	// cut long generations; 0s (no timeout) is preferred.
	MinRouteTimeout = 300 * time.Second
	// MinIdleTimeout is the shortest stream idle timeout that survives a
	// model thinking before its first token.
	MinIdleTimeout = 60 * time.Second
)

// httpProtocolOptionsKey is the typed_extension_protocol_options key that
// selects the upstream HTTP protocol of a cluster.
const httpProtocolOptionsKey = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

func (u *unit) check() {
	for _, e := range u.extProcs {
		u.checkExtProc(e)
	}
	for _, pr := range u.perRoutes {
		u.checkPerRoute(pr)
	}
	for _, h := range u.hcms {
		u.checkHCM(h)
	}
	for _, rl := range u.rateLimits {
		u.checkRateLimit(rl)
	}
	for _, pr := range u.rlPerRoutes {
		u.domains = append(u.domains, domainAt{joinPath(pr.path, "domain"), pr.cfg.GetDomain()})
	}
	u.checkDomains()
	for _, rc := range u.routeCfgs {
		if rc.path == "" { // a bare route configuration; those inside an HCM are checked with it
			u.checkRoutes(rc.path, rc.rc, nil, 0)
		}
	}
	u.checkPolicies()
}

// checkExtProc applies the tokengate rules to one ext_proc filter config.
func (u *unit) checkExtProc(e extProcAt) {
	cfg := e.cfg
	u.grpcMetadataPolicies(cfg.GetGrpcService().GetInitialMetadata(), joinPath(e.path, "grpc_service.initial_metadata"))
	if u.partial {
		// An EnvoyFilter MERGE: every field left out comes from the filter
		// Istio already has, so the merged result is not known here.
		return
	}
	u.checkGRPCService(cfg.GetGrpcService(), joinPath(e.path, "grpc_service"), extProcUse)
	pm := cfg.GetProcessingMode()
	u.checkModes(pm, joinPath(e.path, "processing_mode"))

	if cfg.GetObservabilityMode() {
		u.add(Error, joinPath(e.path, "observability_mode"), RuleObservability,
			"observability_mode makes Envoy ignore every answer: tokengate could neither refuse a "+
				"request nor cut off a stream")
	}

	// The per-message timer runs for the request headers and body in
	// BUFFERED and STREAMED modes; tokengate answers the last of them only
	// when the prompt is counted and reserved. In FULL_DUPLEX_STREAMED the
	// request is bounded by the stream idle timeout instead (§3.2).
	if pm.GetRequestBodyMode() != extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		mt := joinPath(e.path, "message_timeout")
		switch d := cfg.GetMessageTimeout(); {
		case d == nil:
			u.add(Warning, mt, RuleMessageTimeout,
				"message_timeout is not set: Envoy's 200 ms default answers 504 while tokengate still counts a "+
					"large prompt or waits for a busy store; set at least %v (10s recommended)", MinMessageTimeout)
		case d.AsDuration() < MinMessageTimeout:
			u.add(Warning, mt, RuleMessageTimeout,
				"message_timeout %v is too short to count a large prompt: Envoy answers 504 when it runs out; "+
					"set at least %v (10s recommended)", d.AsDuration(), MinMessageTimeout)
		}
	}

	duplex := pm.GetRequestBodyMode() == extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED ||
		pm.GetResponseBodyMode() == extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
	switch {
	case !hasRaw(e.raw, "failure_mode_allow", "failureModeAllow"):
		u.add(Warning, joinPath(e.path, "failure_mode_allow"), RuleFailureMode,
			"failure_mode_allow is not stated: Envoy then fails closed, answering 500 to every request while "+
				"tokengate is unreachable; state false (strict metering) or true (pass traffic unmetered "+
				"while tokengate is down) so the choice is deliberate")
	case cfg.GetFailureModeAllow() && duplex:
		u.add(Warning, joinPath(e.path, "failure_mode_allow"), RuleFailureDuplex,
			"with FULL_DUPLEX_STREAMED, failure_mode_allow: true is honoured only until that direction's "+
				"first body chunk (Envoy ≥ 1.36); later failures reset the stream, and Envoy 1.35 rejects the "+
				"combination")
	}

	if !slices.Contains(cfg.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), MetadataNamespace) {
		u.add(Warning, joinPath(e.path, "metadata_options.receiving_namespaces.untyped"), RuleMetadata,
			"namespace %q is not listed: Envoy drops the token counts tokengate reports, so access logs "+
				"and later filters cannot see %%DYNAMIC_METADATA(%s:...)%%", MetadataNamespace, MetadataNamespace)
	}
}

func hasRaw(m map[string]any, names ...string) bool {
	for _, n := range names {
		if _, ok := m[n]; ok {
			return true
		}
	}
	return false
}

// checkModes checks that a processing mode is one tokengate supports (see
// Modes), and records it with its advice.
func (u *unit) checkModes(pm *extprocv3.ProcessingMode, path string) {
	at := func(f string) string { return joinPath(path, f) }
	p, pos := u.where(path)
	u.c.report.Modes = append(u.c.report.Modes, modeUse(u.c.file, p, pos, pm))

	if pm.GetRequestHeaderMode() == extprocv3.ProcessingMode_SKIP {
		u.add(Error, at("request_header_mode"), RuleProcessingMode,
			"request headers are skipped: tokengate needs them to find the API key, model route and policy; "+
				"use SEND")
	}
	if pm.GetResponseHeaderMode() == extprocv3.ProcessingMode_SKIP {
		u.add(Error, at("response_header_mode"), RuleProcessingMode,
			"response headers are skipped: tokengate needs :status and content-type to tell a stream "+
				"from a provider error, and to add the rate-limit headers (S17); use SEND")
	}
	switch m := pm.GetRequestBodyMode(); m {
	case extprocv3.ProcessingMode_BUFFERED:
	case extprocv3.ProcessingMode_STREAMED:
		u.add(Warning, at("request_body_mode"), RuleStreamedRequest,
			"request_body_mode STREAMED: tokengate holds the last chunk until the prompt is counted, but "+
				"Envoy has already sent the headers and the first chunks upstream, so a refusal resets a "+
				"half-sent upstream request; use BUFFERED, or FULL_DUPLEX_STREAMED with request_trailer_mode "+
				"SEND on Envoy ≥ 1.34")
	case extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if pm.GetRequestTrailerMode() != extprocv3.ProcessingMode_SEND {
			u.add(Error, at("request_trailer_mode"), RuleDuplexTrailers,
				"request_body_mode FULL_DUPLEX_STREAMED needs request_trailer_mode SEND; Envoy rejects the "+
					"filter otherwise")
		}
	case extprocv3.ProcessingMode_NONE:
		u.add(Error, at("request_body_mode"), RuleProcessingMode,
			"request_body_mode NONE: tokengate never sees the prompt and cannot count or reserve it (S7); "+
				"%s", supportedRequestModes)
	case extprocv3.ProcessingMode_BUFFERED_PARTIAL:
		u.add(Error, at("request_body_mode"), RuleProcessingMode,
			"request_body_mode %v sends only the part of the prompt that fits the buffer, so tokengate "+
				"cannot count it (S7); %s", m, supportedRequestModes)
	default:
		u.add(Error, at("request_body_mode"), RuleProcessingMode,
			"request_body_mode %v is not a mode tokengate speaks; %s", m, supportedRequestModes)
	}
	switch m := pm.GetResponseBodyMode(); m {
	case extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if pm.GetResponseTrailerMode() != extprocv3.ProcessingMode_SEND {
			u.add(Error, at("response_trailer_mode"), RuleDuplexTrailers,
				"response_body_mode FULL_DUPLEX_STREAMED needs response_trailer_mode SEND; Envoy rejects the "+
					"filter otherwise")
		}
	case extprocv3.ProcessingMode_STREAMED:
		u.add(Warning, at("response_body_mode"), RuleStreamedResp,
			"response_body_mode STREAMED (the fallback for Envoy ≤ 1.33): output is metered live, but a "+
				"cut-off (S14) cannot end the response or cancel the upstream; the client's response ends only "+
				"when the model stops, and the provider keeps billing; use FULL_DUPLEX_STREAMED with "+
				"response_trailer_mode SEND on Envoy ≥ 1.34 (≥ 1.36 recommended)")
	case extprocv3.ProcessingMode_NONE:
		u.add(Error, at("response_body_mode"), RuleProcessingMode,
			"response_body_mode NONE: tokengate cannot meter output tokens, settle real usage (S8) or cut "+
				"off a stream (S14); %s", supportedResponseModes)
	case extprocv3.ProcessingMode_BUFFERED, extprocv3.ProcessingMode_BUFFERED_PARTIAL:
		u.add(Error, at("response_body_mode"), RuleProcessingMode,
			"response_body_mode %v holds the whole response: clients see no streaming, a long answer "+
				"overflows the buffer (500) and cut-off (S14) is impossible; %s", m, supportedResponseModes)
	default:
		u.add(Error, at("response_body_mode"), RuleProcessingMode,
			"response_body_mode %v is not a mode tokengate speaks; %s", m, supportedResponseModes)
	}
}

func (u *unit) checkPerRoute(pr perRouteAt) {
	o := pr.cfg.GetOverrides()
	if o == nil {
		return
	}
	u.grpcMetadataPolicies(o.GetGrpcInitialMetadata(), joinPath(pr.path, "overrides.grpc_initial_metadata"))
	u.grpcMetadataPolicies(o.GetGrpcService().GetInitialMetadata(), joinPath(pr.path, "overrides.grpc_service.initial_metadata"))
	if u.partial {
		return
	}
	if o.GetProcessingMode() != nil {
		u.checkModes(o.GetProcessingMode(), joinPath(pr.path, "overrides.processing_mode"))
	}
	u.checkGRPCService(o.GetGrpcService(), joinPath(pr.path, "overrides.grpc_service"), extProcUse)
}

// grpcUse names, for messages, what a gRPC cluster to tokengate carries.
type grpcUse struct {
	stream   string // "the ext_proc gRPC stream"
	call     string // "ext_proc call"
	carrying string // what travels in plaintext without TLS
}

var (
	extProcUse = grpcUse{"the ext_proc gRPC stream", "ext_proc call", "the ext_proc stream carries every prompt, answer and API key"}
	rlsUse     = grpcUse{"the rate-limit service's calls", "ShouldRateLimit call",
		"the rate-limit calls carry every request's descriptors, the identities tokengate meters,"}
)

// checkGRPCService checks, in a bootstrap, that the gRPC cluster of
// tokengate's ext_proc or rate-limit service exists, speaks HTTP/2, and is
// encrypted unless it is on this host.
func (u *unit) checkGRPCService(gs *corev3.GrpcService, path string, use grpcUse) {
	name := gs.GetEnvoyGrpc().GetClusterName()
	if name == "" || u.bootstrap == nil {
		return
	}
	at := joinPath(path, "envoy_grpc.cluster_name")
	for i, c := range u.bootstrap.GetStaticResources().GetClusters() {
		if c.GetName() == name {
			cp := indexPath("static_resources.clusters", i)
			u.checkHTTP2(c, cp, use)
			u.checkTLS(c, cp, use)
			return
		}
	}
	if u.bootstrap.GetDynamicResources().GetCdsConfig() != nil || u.bootstrap.GetDynamicResources().GetCdsResourcesLocator() != "" {
		return // the cluster may come from CDS
	}
	u.add(Error, at, RuleGRPCCluster,
		"cluster %q does not exist among static_resources.clusters: Envoy rejects the configuration", name)
}

func (u *unit) checkHTTP2(c *clusterv3.Cluster, path string, use grpcUse) {
	if c.GetHttp2ProtocolOptions() != nil {
		return // deprecated spelling, still honoured
	}
	if a, ok := c.GetTypedExtensionProtocolOptions()[httpProtocolOptionsKey]; ok {
		var opts upstreamhttpv3.HttpProtocolOptions
		if a.MessageIs(&opts) && a.UnmarshalTo(&opts) == nil {
			if opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() != nil {
				return
			}
			// ALPN picks HTTP/2 only over TLS.
			if opts.GetAutoConfig().GetHttp2ProtocolOptions() != nil && c.GetTransportSocket() != nil {
				return
			}
		}
	}
	u.add(Error, path, RuleGRPCHTTP2,
		"cluster %q carries %s but does not speak HTTP/2 (gRPC needs it; every "+
			"%s would fail): set typed_extension_protocol_options[%q].explicit_http_config."+
			"http2_protocol_options", c.GetName(), use.stream, use.call, httpProtocolOptionsKey)
}

const rawBufferType = "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"

// checkTLS warns when the ext_proc stream or the rate-limit calls leave
// the host in plaintext: they carry prompts, answers, credentials or
// identities, and tokengate believes the identities it is sent.
func (u *unit) checkTLS(c *clusterv3.Cluster, path string, use grpcUse) {
	if ts := c.GetTransportSocket(); ts != nil && ts.GetTypedConfig().GetTypeUrl() != rawBufferType {
		return
	}
	if len(c.GetTransportSocketMatches()) > 0 {
		return
	}
	var remote []string
	for _, ep := range c.GetLoadAssignment().GetEndpoints() {
		for _, lb := range ep.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			if sa == nil || isLoopback(sa.GetAddress()) {
				continue // a pipe or an internal address stays on the host
			}
			remote = append(remote, net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))))
		}
	}
	if len(remote) == 0 {
		return
	}
	u.add(Warning, joinPath(path, "transport_socket"), RuleGRPCTLS,
		"cluster %q reaches tokengate at %s without TLS, and that address is not loopback: %s "+
			"in plaintext, and whoever reaches tokengate's "+
			"port can spend any identity's budget; add a transport_socket with an UpstreamTlsContext (and a "+
			"client certificate for mTLS), unless a mesh sidecar encrypts the hop",
		c.GetName(), strings.Join(remote, ", "), use.carrying)
}

func isLoopback(host string) bool {
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// checkHCM checks the filter order and the routes of a connection manager.
func (u *unit) checkHCM(h hcmAt) {
	var names []string
	enabledByDefault := false
	for _, f := range h.hcm.GetHttpFilters() {
		if isExtProc(f) {
			names = append(names, f.GetName())
			if !f.GetDisabled() {
				enabledByDefault = true
			}
		}
	}
	if u.partial {
		return // Istio appends a MERGE's filters to the ones it has
	}
	if rc := h.hcm.GetRouteConfig(); rc != nil {
		u.checkRouteClusters(joinPath(h.path, "route_config"), rc)
	}
	u.checkFilterOrder(h, len(names) > 0 || slices.ContainsFunc(h.hcm.GetHttpFilters(), isRateLimit))
	if len(names) == 0 {
		return
	}
	idle := defaultStreamIdle
	if d := h.hcm.GetStreamIdleTimeout(); d != nil {
		idle = d.AsDuration()
	}
	if rc := h.hcm.GetRouteConfig(); rc != nil {
		u.checkRoutes(joinPath(h.path, "route_config"), rc, &routeScope{names, enabledByDefault}, idle)
	}
}

// checkRouteClusters checks, in a bootstrap, that every cluster an inline
// route table sends to exists: Envoy validates the clusters of a static
// route table by default (validate_clusters) and rejects the configuration
// when one is missing, unless clusters may also come from CDS.
func (u *unit) checkRouteClusters(path string, rc *routev3.RouteConfiguration) {
	if u.bootstrap == nil || (rc.GetValidateClusters() != nil && !rc.GetValidateClusters().GetValue()) {
		return
	}
	if u.bootstrap.GetDynamicResources().GetCdsConfig() != nil || u.bootstrap.GetDynamicResources().GetCdsResourcesLocator() != "" {
		return
	}
	known := make(map[string]bool)
	for _, c := range u.bootstrap.GetStaticResources().GetClusters() {
		known[c.GetName()] = true
	}
	check := func(at, name string) {
		if name != "" && !known[name] {
			u.add(Error, at, RuleRouteCluster,
				"route to cluster %q, which does not exist among static_resources.clusters: Envoy rejects the "+
					"configuration (the route table validates its clusters)", name)
		}
	}
	for i, vh := range rc.GetVirtualHosts() {
		vp := indexPath(joinPath(path, "virtual_hosts"), i)
		for j, r := range vh.GetRoutes() {
			rp := indexPath(joinPath(vp, "routes"), j)
			ra := r.GetRoute()
			check(joinPath(rp, "route.cluster"), ra.GetCluster())
			for k, wc := range ra.GetWeightedClusters().GetClusters() {
				check(joinPath(indexPath(joinPath(rp, "route.weighted_clusters.clusters"), k), "name"), wc.GetName())
			}
		}
	}
}

func isExtProc(f *hcmv3.HttpFilter) bool {
	return f.GetTypedConfig().MessageIs(&extprocv3.ExternalProcessor{})
}

func isRouter(f *hcmv3.HttpFilter) bool {
	if a := f.GetTypedConfig(); a != nil {
		return a.MessageIs(&routerv3.Router{})
	}
	return f.GetName() == "envoy.filters.http.router"
}

// RouterFilterName is the name of Envoy's router, the HTTP filter that must
// end every filter chain.
const RouterFilterName = "envoy.filters.http.router"

// checkFilterOrder: the router is terminal and must be the last HTTP
// filter, or Envoy rejects the configuration; a filter placed after it
// would never see a request anyway.
func (u *unit) checkFilterOrder(h hcmAt, hasExtProc bool) {
	filters := h.hcm.GetHttpFilters()
	fp := joinPath(h.path, "http_filters")
	router := slices.IndexFunc(filters, isRouter)
	if router < 0 {
		if hasExtProc {
			u.add(Error, fp, RuleRouterLast,
				"http_filters has no router (%s): Envoy rejects a chain whose last filter is not terminal, "+
					"and nothing would forward the requests tokengate admits; add it last", RouterFilterName)
		}
		return
	}
	var others []string
	for i := router + 1; i < len(filters); i++ {
		f := filters[i]
		if isExtProc(f) {
			u.add(Error, indexPath(fp, i), RuleExtProcOrder,
				"the ext_proc filter %q comes after the router: Envoy rejects the chain (the router must be "+
					"last), and tokengate would never see a request; move it before %s", f.GetName(), RouterFilterName)
			continue
		}
		others = append(others, strconv.Quote(f.GetName()))
	}
	if len(others) > 0 {
		u.add(Error, indexPath(fp, router), RuleRouterLast,
			"the router is not the last HTTP filter (%s follows it): Envoy rejects the configuration; "+
				"move the router to the end of http_filters", strings.Join(others, ", "))
	}
}

// defaultStreamIdle is Envoy's default HCM stream_idle_timeout.
const defaultStreamIdle = 5 * time.Minute

// routeScope says which filter names are ext_proc filters and whether one
// runs on routes that say nothing about it. A nil scope (bare route
// configuration) treats every route as metered unless it disables ext_proc.
type routeScope struct {
	names            []string
	enabledByDefault bool
}

func (s *routeScope) isExtProc(name string) bool {
	if s == nil {
		return strings.Contains(name, "ext_proc")
	}
	return slices.Contains(s.names, name)
}

// metered reports whether ext_proc runs for a route: its per-filter config
// (route over virtual host) may disable or enable it.
func (s *routeScope) metered(vh *routev3.VirtualHost, r *routev3.Route) bool {
	on := s == nil || s.enabledByDefault
	for _, cfgs := range []map[string]*anypb.Any{vh.GetTypedPerFilterConfig(), r.GetTypedPerFilterConfig()} {
		for name, a := range cfgs {
			if !s.isExtProc(name) {
				continue
			}
			if d, ok := perFilterDisabled(a); ok {
				on = !d
			}
		}
	}
	return on
}

// perFilterDisabled reads a per-filter config: ExtProcPerRoute{disabled} or
// FilterConfig{disabled}. ok is false when it says nothing about disabling.
func perFilterDisabled(a *anypb.Any) (disabled, ok bool) {
	m, err := a.UnmarshalNew()
	if err != nil {
		return false, false
	}
	switch x := m.(type) {
	case *extprocv3.ExtProcPerRoute:
		if x.GetDisabled() {
			return true, true
		}
		return false, x.GetOverrides() != nil
	case *routev3.FilterConfig:
		if x.GetDisabled() {
			return true, true
		}
		if inner := x.GetConfig(); inner != nil {
			if d, ok := perFilterDisabled(inner); ok {
				return d, true
			}
		}
		return false, true
	}
	return false, false
}

// checkRoutes checks the timeouts of every metered route: Envoy's 15 s
// default route timeout kills long generations.
func (u *unit) checkRoutes(path string, rc *routev3.RouteConfiguration, scope *routeScope, hcmIdle time.Duration) {
	if scope == nil {
		hcmIdle = defaultStreamIdle
	}
	for i, vh := range rc.GetVirtualHosts() {
		vp := indexPath(joinPath(path, "virtual_hosts"), i)
		for j, r := range vh.GetRoutes() {
			ra := r.GetRoute()
			if ra == nil || !scope.metered(vh, r) {
				continue
			}
			rp := indexPath(joinPath(vp, "routes"), j)
			timeout := ra.GetTimeout()
			switch {
			case timeout == nil:
				u.add(Warning, joinPath(rp, "route.timeout"), RuleRouteTimeout,
					"route timeout is not set: Envoy's 15s default cuts off long generations mid-stream; "+
						"set timeout: 0s (no limit, bounded by the idle timeout) or at least %v", MinRouteTimeout)
			case timeout.AsDuration() != 0 && timeout.AsDuration() < MinRouteTimeout:
				u.add(Warning, joinPath(rp, "route.timeout"), RuleRouteTimeout,
					"route timeout %v cuts off long generations mid-stream; set timeout: 0s or at least %v",
					timeout.AsDuration(), MinRouteTimeout)
			}
			idle, where := hcmIdle, "stream_idle_timeout"
			if d := ra.GetIdleTimeout(); d != nil {
				idle, where = d.AsDuration(), "route.idle_timeout"
			}
			switch {
			case idle == 0 && isZero(timeout):
				u.add(Warning, joinPath(rp, "route.idle_timeout"), RuleIdleTimeout,
					"both the route timeout and the %s are disabled: nothing ends a stalled upstream, and "+
						"its tokens stay reserved until the reservation expires", where)
			case idle != 0 && idle < MinIdleTimeout:
				u.add(Warning, joinPath(rp, "route.idle_timeout"), RuleIdleTimeout,
					"%s %v may end a stream while the model is still thinking before its first token; "+
						"use at least %v", where, idle, MinIdleTimeout)
			}
		}
	}
}

func isZero(d *durationpb.Duration) bool { return d != nil && d.AsDuration() == 0 }

// checkPolicies checks every policy named in gRPC initial metadata against
// the tokengate configurations given in Options: it must be defined in one
// of those that read the same metadata key.
func (u *unit) checkPolicies() {
	for _, p := range u.policies {
		if p.name == "" {
			continue // tokengate applies its default_policy
		}
		var files, names []string
		found := false
		for _, set := range u.c.opts.Policies {
			key := strings.ToLower(set.Key)
			if key == "" {
				key = DefaultPolicyMetadataKey
			}
			if key != p.key {
				continue
			}
			found = found || slices.Contains(set.Names, p.name)
			files = append(files, set.File)
			for _, n := range set.Names {
				if !slices.Contains(names, n) {
					names = append(names, n)
				}
			}
		}
		if found || len(files) == 0 {
			continue
		}
		where := files[0]
		if len(files) > 1 {
			where = "any of " + strings.Join(files, ", ")
		}
		u.add(Error, p.path, RulePolicy,
			"policy %q is not defined in %s (defined: %s): tokengate refuses every request sent with it "+
				"(unknown_policy)", p.name, where, quoteAll(names))
	}
}

func quoteAll(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = strconv.Quote(n)
	}
	return strings.Join(q, ", ")
}
