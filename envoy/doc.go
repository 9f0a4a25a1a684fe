// Package envoy holds the Envoy configuration that ships with tokengate and
// checks Envoy configuration against Envoy's own API and tokengate's needs.
//
// tokengate runs beside Envoy as an external processor (ext_proc): Envoy
// sends it each request's headers and body, and streams the response body
// to it, so that tokengate can count the prompt before the upstream sees
// it, meter output live and end a stream cleanly when a hard budget runs
// out (SPEC S7, S13, S14). That only works when Envoy is configured for it.
// Validate (and Check, which also takes the policies of a tokengate
// configuration) reads plain Envoy YAML, Istio EnvoyFilters and Envoy
// Gateway EnvoyExtensionPolicies, decodes them as Envoy does, and reports
// each problem at the line, column and field of the user's file: errors
// where Envoy would reject the file or tokengate cannot work with it,
// warnings where it works but loses something.
//
// tokengate also serves Envoy's rate-limit service API: the same checks
// apply to Envoy's global rate-limit filter (envoy.filters.http.ratelimit)
// and its rate_limit_service cluster (V3, HTTP/2, a timeout, a failure
// mode stated, domains the tokengate configuration maps), and to what
// controllers make of their own resources: Envoy Gateway's
// BackendTrafficPolicy rate limits, Envoy AI Gateway's QuotaPolicy and
// agentgateway's remoteRateLimit policies (see ratelimit.go and
// ratelimit_controllers.go).
//
// Modes lists the body-mode combinations tokengate supports and which Envoy
// versions each fits. The recommended configuration (Envoy ≥ 1.36) and the
// STREAMED fallback for older Envoy are embedded: see Files, Recommended and
// StreamedFallback.
package envoy

import "embed"

// File names of the shipped configurations inside Files.
const (
	RecommendedFile      = "envoy.yaml"
	StreamedFallbackFile = "envoy-1.33-streamed.yaml"
)

// Files holds the shipped Envoy configurations, by file name. It is
// read-only and safe for concurrent use.
//
//go:embed envoy.yaml envoy-1.33-streamed.yaml
var Files embed.FS

// Recommended returns a copy of envoy.yaml: the bootstrap for Envoy ≥ 1.36
// that fronts an OpenAI-compatible upstream (mockllm:9000 in the compose
// stack) with tokengate at tokengate:50051.
func Recommended() []byte { return mustRead(RecommendedFile) }

// StreamedFallback returns a copy of envoy-1.33-streamed.yaml: the same
// bootstrap with the response body in STREAMED mode, for Envoy 1.33–1.35.
// A cut-off there cannot end the response or cancel the upstream.
func StreamedFallback() []byte { return mustRead(StreamedFallbackFile) }

func mustRead(name string) []byte {
	b, err := Files.ReadFile(name)
	if err != nil {
		panic("envoy: embedded file missing: " + name) // impossible: go:embed checks at build time
	}
	return b // ReadFile returns a fresh copy
}
