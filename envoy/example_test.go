package envoy_test

import (
	"fmt"

	"github.com/tokengate/tokengate/envoy"
)

func ExampleValidate() {
	filter := []byte(`
name: envoy.filters.http.ext_proc
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
  grpc_service: {envoy_grpc: {cluster_name: tokengate}}
  failure_mode_allow: false
  processing_mode:
    request_body_mode: BUFFERED
    response_body_mode: STREAMED
  message_timeout: 10s
  metadata_options: {receiving_namespaces: {untyped: [tokengate]}}
`)
	problems := envoy.Validate("filter.yaml", filter)
	for _, p := range problems {
		fmt.Println(p.Severity, p.Rule, p.Path)
	}
	fmt.Println("fails:", envoy.HasErrors(problems))
	// Output:
	// warning processing-mode typed_config.processing_mode.response_body_mode
	// fails: false
}

func ExampleLooksLikeEnvoy() {
	fmt.Println(envoy.LooksLikeEnvoy(envoy.Recommended()))
	fmt.Println(envoy.LooksLikeEnvoy([]byte("default_policy: default\npolicies: []\n")))
	// Output:
	// true
	// false
}
