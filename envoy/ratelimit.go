package envoy

import (
	"slices"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
)

// Checks of Envoy's global rate-limit filter (envoy.filters.http.ratelimit)
// calling tokengate's rate-limit service, following docs/envoy-ratelimit.md
// (§1.1, §2.1).

// RateLimitFilterName is the canonical name of Envoy's global rate-limit
// HTTP filter.
const RateLimitFilterName = "envoy.filters.http.ratelimit"

// MinRateLimitTimeout is the shortest rate-limit call timeout that leaves
// tokengate time for a store round trip under load; Envoy's default is
// 20 ms.
const MinRateLimitTimeout = 100 * time.Millisecond

type rateLimitAt struct {
	path string
	cfg  *rlfilterv3.RateLimit
	raw  map[string]any
}

type rlPerRouteAt struct {
	path string
	cfg  *rlfilterv3.RateLimitPerRoute
}

// domainAt is a rate-limit domain a filter or route sends.
type domainAt struct {
	path, name string
}

func isRateLimit(f *hcmv3.HttpFilter) bool {
	return f.GetTypedConfig().MessageIs(&rlfilterv3.RateLimit{})
}

// checkRateLimit applies tokengate's rules to one rate-limit filter
// config: a V3 service on an HTTP/2 cluster, a timeout that is neither
// Envoy's 20 ms default nor none, and a failure mode stated.
func (u *unit) checkRateLimit(e rateLimitAt) {
	cfg := e.cfg
	u.domains = append(u.domains, domainAt{joinPath(e.path, "domain"), cfg.GetDomain()})
	if u.partial {
		return // an EnvoyFilter MERGE: what it leaves out comes from Istio's filter
	}
	at := func(f string) string { return joinPath(e.path, f) }
	rls := cfg.GetRateLimitService()
	if v := rls.GetTransportApiVersion(); v != corev3.ApiVersion_V3 {
		u.add(Error, at("rate_limit_service.transport_api_version"), RuleRLSTransport,
			"transport_api_version is %v: Envoy takes only V3 for the rate-limit service, and tokengate "+
				"serves envoy.service.ratelimit.v3.RateLimitService; set V3", v)
	}
	u.checkGRPCService(rls.GetGrpcService(), at("rate_limit_service.grpc_service"), rlsUse)

	outcome := "lets the request through unmetered"
	if cfg.GetFailureModeDeny() || cfg.GetFailureModeDenyPercent() != nil {
		outcome = "refuses the request (status_on_error)"
	}
	switch d := cfg.GetTimeout(); {
	case d == nil:
		u.add(Warning, at("timeout"), RuleRLSTimeout,
			"timeout is not set: Envoy's 20 ms default ends every call that waits on a busy store, and "+
				"Envoy then %s; set at least %v (250ms recommended)", outcome, MinRateLimitTimeout)
	case d.AsDuration() == 0:
		u.add(Warning, at("timeout"), RuleRLSTimeout,
			"timeout 0s: a rate-limit service that stalls holds every request until the client gives up; "+
				"set a timeout of at least %v (250ms recommended)", MinRateLimitTimeout)
	case d.AsDuration() < MinRateLimitTimeout:
		u.add(Warning, at("timeout"), RuleRLSTimeout,
			"timeout %v is shorter than a store round trip under load: Envoy then %s; set at least %v",
			d.AsDuration(), outcome, MinRateLimitTimeout)
	}
	if !hasRaw(e.raw, "failure_mode_deny", "failureModeDeny", "failure_mode_deny_percent", "failureModeDenyPercent") {
		u.add(Warning, at("failure_mode_deny"), RuleRLSFailureMode,
			"failure_mode_deny is not stated: Envoy then fails open, letting every request through "+
				"unmetered while tokengate is unreachable; state true (answer status_on_error, strict "+
				"metering) or false so the choice is deliberate")
	}
}

// checkDomains checks, given tokengate configurations with an rls section,
// that every domain the file sends is mapped: the rate-limit service
// answers a domain no mapping names OK with no limit.
func (u *unit) checkDomains() {
	var files, mapped []string
	for _, set := range u.c.opts.Policies {
		if set.Domains != nil {
			files = append(files, set.File)
			mapped = append(mapped, set.Domains...)
		}
	}
	if len(files) == 0 {
		return
	}
	for _, d := range u.domains {
		if d.name == "" || slices.Contains(mapped, d.name) {
			continue
		}
		u.add(Warning, d.path, RuleRLSDomain,
			"domain %q is not mapped in rls.domains of %s (mapped: %s): tokengate's rate-limit service "+
				"answers every descriptor of it OK, with no limit", d.name, strings.Join(files, ", "), quoteAll(mapped))
	}
}
