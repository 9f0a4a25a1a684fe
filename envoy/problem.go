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
const (
	RuleYAML            = "yaml"                  // not YAML, or not a YAML mapping
	RuleShape           = "shape"                 // not a kind of Envoy document Validate knows
	RuleDecode          = "decode"                // Envoy's API rejects a field, value or @type
	RuleEnvoy           = "envoy-constraint"      // Envoy's own field constraints (ValidateAll)
	RuleGRPCCluster     = "grpc-cluster-exists"   // grpc_service.envoy_grpc names no cluster
	RuleGRPCHTTP2       = "grpc-cluster-http2"    // the ext_proc cluster does not speak HTTP/2
	RuleProcessingMode  = "processing-mode"       // modes that cannot count prompts or meter output
	RuleMessageTimeout  = "message-timeout"       // too short to count a large prompt
	RuleRouteTimeout    = "route-timeout"         // route timeout cuts long generations
	RuleIdleTimeout     = "stream-idle-timeout"   // idle timeout missing or too short
	RuleFailureMode     = "failure-mode-explicit" // failure_mode_allow not stated
	RuleMetadata        = "metadata-namespace"    // tokengate's dynamic metadata is dropped
	RuleObservability   = "observability-mode"    // answers ignored: no enforcement
	RuleEnvoyGatewayCRD = "envoy-gateway-crd"     // unknown or unfit EnvoyExtensionPolicy field
)

// Problem is one finding about one Envoy YAML document. The zero value is an
// error-level problem with no location. A Problem is a plain value and is
// safe to copy and share between goroutines.
type Problem struct {
	File     string   // file name as given to Validate
	Path     string   // YAML path, e.g. static_resources.listeners[0].filter_chains[0]; empty for the whole document
	Rule     string   // one of the Rule* names
	Message  string   // what is wrong, and what it means for tokengate
	Severity Severity // Error (the zero value) or Warning
}

// Error formats the problem as "file: path: message (rule)"; warnings carry
// a "warning: " prefix before the message.
func (p Problem) Error() string {
	var b strings.Builder
	if p.File != "" {
		b.WriteString(p.File)
		b.WriteString(": ")
	}
	if p.Path != "" {
		b.WriteString(p.Path)
		b.WriteString(": ")
	}
	if p.Severity == Warning {
		b.WriteString("warning: ")
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
