package envoy_test

import (
	"fmt"

	"github.com/tokengate/tokengate/envoy"
)

func ExampleValidate() {
	filter := []byte(`name: envoy.filters.http.ext_proc
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
  grpc_service: {envoy_grpc: {cluster_name: tokengate}}
  processing_mode:
    request_body_mode: BUFFERED
    response_body_mode: FULL_DUPLEX_STREAMED
  message_timeout: 10s
  metadata_options: {receiving_namespaces: {untyped: [tokengate]}}
`)
	problems := envoy.Validate("filter.yaml", filter)
	for _, p := range problems {
		fmt.Println(p.Line, p.Column, p.Severity, p.Rule, p.Path)
	}
	fmt.Println("fails:", envoy.HasErrors(problems))
	// Output:
	// 2 1 warning failure-mode-explicit typed_config.failure_mode_allow
	// 5 3 error duplex-trailer-mode typed_config.processing_mode.response_trailer_mode
	// fails: true
}

func ExampleCheck() {
	policy := []byte(`apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: {name: tokengate}
spec:
  extProc:
  - backendRefs: [{name: tokengate, port: 50051}]
    failOpen: false
    messageTimeout: 10s
    processingMode:
      request: {body: Buffered}
      response: {body: Streamed}
    metadata: {writableNamespaces: [tokengate]}
`)
	r := envoy.Check("policy.yaml", policy, envoy.Options{})
	fmt.Println(r.Checked)
	for _, p := range r.Problems {
		fmt.Println(p.Line, p.Column, p.Severity, p.Rule, p.Path)
	}
	for _, m := range r.Modes {
		fmt.Println(m.Request, m.Response, m.Supported, m.Mode.Recommended)
	}
	// Output:
	// [EnvoyExtensionPolicy tokengate]
	// 11 18 warning streamed-response spec.extProc[0].processingMode.response.body
	// BUFFERED STREAMED true the fallback for Envoy ≤ 1.33: a cut-off cannot end the response or cancel the upstream
}

func ExampleLooksLikeEnvoy() {
	fmt.Println(envoy.LooksLikeEnvoy(envoy.Recommended()))
	fmt.Println(envoy.LooksLikeEnvoy([]byte("apiVersion: networking.istio.io/v1alpha3\nkind: EnvoyFilter\n")))
	fmt.Println(envoy.LooksLikeEnvoy([]byte("default_policy: default\npolicies: []\n")))
	// Output:
	// true
	// true
	// false
}
