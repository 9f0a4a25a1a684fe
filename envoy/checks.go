package envoy

import (
	"slices"
	"strings"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
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

func (v *validation) check() {
	for _, e := range v.extProcs {
		v.checkExtProc(e)
	}
	for _, pr := range v.perRoutes {
		v.checkPerRoute(pr)
	}
	for _, h := range v.hcms {
		v.checkHCM(h)
	}
	for _, rc := range v.routeCfgs {
		if rc.path == "" { // a bare route configuration; those inside an HCM are checked with it
			v.checkRoutes(rc.path, rc.rc, nil, 0)
		}
	}
}

// checkExtProc applies the tokengate rules to one ext_proc filter config.
func (v *validation) checkExtProc(e extProcAt) {
	cfg := e.cfg
	v.checkGRPCService(cfg.GetGrpcService(), joinPath(e.path, "grpc_service"))
	pm := cfg.GetProcessingMode()
	v.checkModes(pm, joinPath(e.path, "processing_mode"))

	if cfg.GetObservabilityMode() {
		v.add(Error, joinPath(e.path, "observability_mode"), RuleObservability,
			"observability_mode makes Envoy ignore every answer: tokengate could neither refuse a "+
				"request nor cut off a stream")
	}

	mt := joinPath(e.path, "message_timeout")
	switch d := cfg.GetMessageTimeout(); {
	case pm.GetRequestBodyMode() == extprocv3.ProcessingMode_BUFFERED && d == nil:
		v.add(Error, mt, RuleMessageTimeout,
			"message_timeout is not set: Envoy's 200 ms default answers 504 while tokengate still counts a "+
				"large buffered prompt; set at least %v (10s recommended)", MinMessageTimeout)
	case d != nil && d.AsDuration() < MinMessageTimeout:
		sev := Warning
		if pm.GetRequestBodyMode() == extprocv3.ProcessingMode_BUFFERED {
			sev = Error
		}
		v.add(sev, mt, RuleMessageTimeout,
			"message_timeout %v is too short to count a large prompt: Envoy answers 504 when it runs out; "+
				"set at least %v (10s recommended)", d.AsDuration(), MinMessageTimeout)
	}

	if !hasRaw(e.raw, "failure_mode_allow", "failureModeAllow") {
		v.add(Error, joinPath(e.path, "failure_mode_allow"), RuleFailureMode,
			"failure_mode_allow is not stated: Envoy then fails closed, answering 500 to every request while "+
				"tokengate is unreachable; state false (strict metering) or true (pass traffic unmetered "+
				"while tokengate is down) so the choice is deliberate")
	} else if cfg.GetFailureModeAllow() && pm.GetResponseBodyMode() == extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		v.add(Warning, joinPath(e.path, "failure_mode_allow"), RuleFailureMode,
			"with FULL_DUPLEX_STREAMED, failure_mode_allow is honoured only until the first body chunk "+
				"(Envoy ≥ 1.36); later failures reset the stream")
	}

	if !slices.Contains(cfg.GetMetadataOptions().GetReceivingNamespaces().GetUntyped(), MetadataNamespace) {
		v.add(Error, joinPath(e.path, "metadata_options.receiving_namespaces.untyped"), RuleMetadata,
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

// checkModes checks that a processing mode lets tokengate count the prompt
// and meter the output (SPEC S7, S13, S14).
func (v *validation) checkModes(pm *extprocv3.ProcessingMode, path string) {
	at := func(f string) string { return joinPath(path, f) }
	if pm.GetRequestHeaderMode() == extprocv3.ProcessingMode_SKIP {
		v.add(Error, at("request_header_mode"), RuleProcessingMode,
			"request headers are skipped: tokengate needs them to find the API key, model route and policy")
	}
	if pm.GetResponseHeaderMode() == extprocv3.ProcessingMode_SKIP {
		v.add(Error, at("response_header_mode"), RuleProcessingMode,
			"response headers are skipped: tokengate needs :status and content-type to tell a stream "+
				"from a provider error, and to add the rate-limit headers (S17)")
	}
	switch pm.GetRequestBodyMode() {
	case extprocv3.ProcessingMode_BUFFERED:
	case extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if pm.GetRequestTrailerMode() != extprocv3.ProcessingMode_SEND {
			v.add(Error, at("request_trailer_mode"), RuleProcessingMode,
				"request_body_mode FULL_DUPLEX_STREAMED needs request_trailer_mode SEND (Envoy rejects it otherwise)")
		}
	case extprocv3.ProcessingMode_NONE:
		v.add(Error, at("request_body_mode"), RuleProcessingMode,
			"request_body_mode NONE: tokengate never sees the prompt and cannot count or reserve it (S7); "+
				"use BUFFERED (or FULL_DUPLEX_STREAMED with request_trailer_mode SEND)")
	default:
		v.add(Error, at("request_body_mode"), RuleProcessingMode,
			"request_body_mode %v: tokengate counts the whole prompt before forwarding it (S7); "+
				"use BUFFERED (or FULL_DUPLEX_STREAMED with request_trailer_mode SEND)", pm.GetRequestBodyMode())
	}
	switch pm.GetResponseBodyMode() {
	case extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		if pm.GetResponseTrailerMode() != extprocv3.ProcessingMode_SEND {
			v.add(Error, at("response_trailer_mode"), RuleProcessingMode,
				"response_body_mode FULL_DUPLEX_STREAMED needs response_trailer_mode SEND (Envoy rejects it otherwise)")
		}
	case extprocv3.ProcessingMode_STREAMED:
		v.add(Warning, at("response_body_mode"), RuleProcessingMode,
			"response_body_mode STREAMED (fallback for Envoy < 1.36): output is metered live, but a cut-off "+
				"(S14) cannot end the response or cancel the upstream; the client's response ends only when "+
				"the model stops, and the provider keeps billing; use FULL_DUPLEX_STREAMED with "+
				"response_trailer_mode SEND on Envoy ≥ 1.36")
	case extprocv3.ProcessingMode_NONE:
		v.add(Error, at("response_body_mode"), RuleProcessingMode,
			"response_body_mode NONE: tokengate cannot meter output tokens, settle real usage (S8) or cut "+
				"off a stream (S14); use FULL_DUPLEX_STREAMED with response_trailer_mode SEND")
	default:
		v.add(Error, at("response_body_mode"), RuleProcessingMode,
			"response_body_mode %v holds the whole response: clients see no streaming, a long answer "+
				"overflows the buffer (500) and cut-off (S14) is impossible; use FULL_DUPLEX_STREAMED with "+
				"response_trailer_mode SEND", pm.GetResponseBodyMode())
	}
}

func (v *validation) checkPerRoute(pr perRouteAt) {
	o := pr.cfg.GetOverrides()
	if o == nil {
		return
	}
	if o.GetProcessingMode() != nil {
		v.checkModes(o.GetProcessingMode(), joinPath(pr.path, "overrides.processing_mode"))
	}
	v.checkGRPCService(o.GetGrpcService(), joinPath(pr.path, "overrides.grpc_service"))
}

// checkGRPCService checks, in a bootstrap, that the ext_proc gRPC cluster
// exists and speaks HTTP/2.
func (v *validation) checkGRPCService(gs *corev3.GrpcService, path string) {
	name := gs.GetEnvoyGrpc().GetClusterName()
	if name == "" || v.bootstrap == nil {
		return
	}
	at := joinPath(path, "envoy_grpc.cluster_name")
	for i, c := range v.bootstrap.GetStaticResources().GetClusters() {
		if c.GetName() == name {
			v.checkHTTP2(c, indexPath("static_resources.clusters", i))
			return
		}
	}
	if v.bootstrap.GetDynamicResources().GetCdsConfig() != nil || v.bootstrap.GetDynamicResources().GetCdsResourcesLocator() != "" {
		v.add(Warning, at, RuleGRPCCluster,
			"cluster %q is not among the static clusters; it must come from CDS, or every request fails", name)
		return
	}
	v.add(Error, at, RuleGRPCCluster,
		"cluster %q does not exist: Envoy would reject the configuration", name)
}

func (v *validation) checkHTTP2(c *clusterv3.Cluster, path string) {
	if c.GetHttp2ProtocolOptions() != nil {
		return // deprecated spelling, still honoured
	}
	if a, ok := c.GetTypedExtensionProtocolOptions()[httpProtocolOptionsKey]; ok {
		var opts upstreamhttpv3.HttpProtocolOptions
		if a.MessageIs(&opts) && a.UnmarshalTo(&opts) == nil &&
			opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() != nil {
			return
		}
	}
	v.add(Error, path, RuleGRPCHTTP2,
		"cluster %q carries the ext_proc gRPC stream but does not speak HTTP/2: set "+
			"typed_extension_protocol_options[%q].explicit_http_config.http2_protocol_options",
		c.GetName(), httpProtocolOptionsKey)
}

// checkHCM checks the routes of a connection manager that runs ext_proc.
func (v *validation) checkHCM(h hcmAt) {
	var names []string
	enabledByDefault := false
	for _, f := range h.hcm.GetHttpFilters() {
		var ep extprocv3.ExternalProcessor
		if a := f.GetTypedConfig(); a != nil && a.MessageIs(&ep) {
			names = append(names, f.GetName())
			if !f.GetDisabled() {
				enabledByDefault = true
			}
		}
	}
	if len(names) == 0 {
		return
	}
	idle := defaultStreamIdle
	if d := h.hcm.GetStreamIdleTimeout(); d != nil {
		idle = d.AsDuration()
	}
	if rc := h.hcm.GetRouteConfig(); rc != nil {
		v.checkRoutes(joinPath(h.path, "route_config"), rc, &routeScope{names, enabledByDefault}, idle)
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
func (v *validation) checkRoutes(path string, rc *routev3.RouteConfiguration, scope *routeScope, hcmIdle time.Duration) {
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
				v.add(Error, joinPath(rp, "route.timeout"), RuleRouteTimeout,
					"route timeout is not set: Envoy's 15s default cuts off long generations mid-stream; "+
						"set timeout: 0s (no limit, bounded by the idle timeout) or at least %v", MinRouteTimeout)
			case timeout.AsDuration() != 0 && timeout.AsDuration() < MinRouteTimeout:
				v.add(Error, joinPath(rp, "route.timeout"), RuleRouteTimeout,
					"route timeout %v cuts off long generations mid-stream; set timeout: 0s or at least %v",
					timeout.AsDuration(), MinRouteTimeout)
			}
			idle, where := hcmIdle, "stream_idle_timeout"
			if d := ra.GetIdleTimeout(); d != nil {
				idle, where = d.AsDuration(), "route.idle_timeout"
			}
			switch {
			case idle == 0 && isZero(timeout):
				v.add(Warning, joinPath(rp, "route.idle_timeout"), RuleIdleTimeout,
					"both the route timeout and the %s are disabled: nothing ends a stalled upstream, and "+
						"its tokens stay reserved until the reservation expires", where)
			case idle != 0 && idle < MinIdleTimeout:
				v.add(Warning, joinPath(rp, "route.idle_timeout"), RuleIdleTimeout,
					"%s %v may end a stream while the model is still thinking before its first token; "+
						"use at least %v", where, idle, MinIdleTimeout)
			}
		}
	}
}

func isZero(d *durationpb.Duration) bool { return d != nil && d.AsDuration() == 0 }
