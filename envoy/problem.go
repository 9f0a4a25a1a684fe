package envoy

import (
	"fmt"
	"strings"
)

// Severity tells whether a Problem makes a configuration unusable with
// tokengate (Error) or only limits what tokengate can do with it (Warning).
// The zero value is Error, so a Problem built without a severity fails.
type Severity int

const (
	// Error: the configuration is rejected by Envoy, or tokengate cannot
	// meter the traffic it carries correctly.
	Error Severity = iota
	// Warning: the configuration works, with documented limits.
	Warning
)

// String returns "error" or "warning".
func (s Severity) String() string {
	if s == Warning {
		return "warning"
	}
	return "error"
}

// Rule names, one per class of problem. They appear in Problem.Rule and in
// the text of Problem.Error so that a report can be searched by rule.
//
// Errors: Envoy would reject the configuration, or tokengate cannot work
// with it. Warnings: it works, but something is lost (a token count in the
// access log, a clean cut-off, a deliberate failure mode, confidentiality).
const (
	// Errors.
	RuleYAML            = "yaml"                  // not YAML, a duplicate key, a value JSON cannot hold
	RuleShape           = "shape"                 // not a kind of document validate knows
	RuleDecode          = "decode"                // Envoy's API rejects a field, value or @type
	RuleEnvoy           = "envoy-constraint"      // Envoy's own field constraints (ValidateAll)
	RuleRouterLast      = "router-last"           // a filter follows the router, or there is no router
	RuleExtProcOrder    = "ext-proc-after-router" // the ext_proc filter comes after the router
	RuleGRPCCluster     = "grpc-cluster-exists"   // grpc_service.envoy_grpc names no cluster
	RuleRouteCluster    = "route-cluster-exists"  // a static route sends to no cluster
	RuleGRPCHTTP2       = "grpc-cluster-http2"    // the ext_proc or rate-limit cluster does not speak HTTP/2
	RuleProcessingMode  = "processing-mode"       // a processing mode tokengate does not support
	RuleDuplexTrailers  = "duplex-trailer-mode"   // FULL_DUPLEX_STREAMED without that direction's trailer mode SEND
	RuleObservability   = "observability-mode"    // answers ignored: no enforcement
	RulePolicy          = "policy-exists"         // a route names a policy the tokengate configuration lacks
	RuleIstio           = "istio-envoyfilter"     // an EnvoyFilter field Istio rejects
	RuleEnvoyGatewayCRD = "envoy-gateway-crd"     // an EnvoyExtensionPolicy or BackendTrafficPolicy field Envoy Gateway rejects
	RuleRLSTransport    = "rls-transport-v3"      // rate_limit_service.transport_api_version is not V3
	RuleAIGatewayCRD    = "ai-gateway-crd"        // a QuotaPolicy field Envoy AI Gateway rejects
	RuleAgentgateway    = "agentgateway-config"   // a remoteRateLimit field agentgateway rejects

	// Warnings.
	RuleMetadata        = "metadata-namespace"    // tokengate's dynamic metadata is dropped
	RuleFailureMode     = "failure-mode-explicit" // failure_mode_allow not stated
	RuleFailureDuplex   = "failure-mode-duplex"   // fail-open is honoured only until the first duplex chunk
	RuleGRPCTLS         = "grpc-cluster-tls"      // plaintext to a tokengate that is not on this host
	RuleStreamedRequest = "streamed-request"      // the upstream is contacted before the decision
	RuleStreamedResp    = "streamed-response"     // a cut-off cannot end the response or cancel the upstream
	RuleMessageTimeout  = "message-timeout"       // too short to count a large prompt
	RuleRouteTimeout    = "route-timeout"         // route timeout cuts long generations
	RuleIdleTimeout     = "stream-idle-timeout"   // idle timeout missing or too short
	RuleMergeUnchecked  = "merge-unchecked"       // an EnvoyFilter MERGE whose result validate cannot see
	RuleRLSTimeout      = "rls-timeout"           // the rate-limit call's timeout is Envoy's 20 ms, none, or too short
	RuleRLSFailureMode  = "rls-failure-mode"      // failure_mode_deny (failureMode) not stated
	RuleRLSRequestCost  = "rls-request-cost"      // a response cost without a request cost of 0: every request also costs 1
	RuleRLSDomain       = "rls-domain-mapped"     // a rate-limit domain no rls section of the tokengate configuration maps
)

// Problem is one finding about an Envoy YAML file. The zero value is an
// error-level problem with no location. A Problem is a plain value and is
// safe to copy and share between goroutines.
type Problem struct {
	File string // file name as given to Validate
	// Line and Column locate the problem in File (1-based): the key of the
	// field named by Path, or, when that field is absent, the nearest
	// enclosing key. Zero when unknown.
	Line, Column int
	// Path is the YAML path of the field, e.g.
	// static_resources.listeners[0].filter_chains[0]; empty for the whole
	// document. Envoy fields are named in proto spelling (typed_config,
	// also when the file writes typedConfig); Kubernetes fields and keys
	// with YAML errors as written. For an EnvoyExtensionPolicy it names the
	// CRD field that produces the Envoy setting at fault.
	Path     string
	Rule     string   // one of the Rule* names
	Message  string   // what is wrong, and what it means for tokengate
	Severity Severity // Error (the zero value) or Warning
}

// Error formats the problem as "file:line:col: path: message (rule)";
// warnings read "file:line:col: warning: path: message (rule)".
func (p Problem) Error() string {
	var b strings.Builder
	b.WriteString(p.File)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
		if p.Column > 0 {
			fmt.Fprintf(&b, ":%d", p.Column)
		}
	}
	if b.Len() > 0 {
		b.WriteString(": ")
	}
	if p.Severity == Warning {
		b.WriteString("warning: ")
	}
	if p.Path != "" {
		b.WriteString(p.Path)
		b.WriteString(": ")
	}
	fmt.Fprintf(&b, "%s (%s)", p.Message, p.Rule)
	return b.String()
}

// HasErrors reports whether any problem is an error; warnings alone do not
// fail a validation.
func HasErrors(problems []Problem) bool {
	for _, p := range problems {
		if p.Severity == Error {
			return true
		}
	}
	return false
}
