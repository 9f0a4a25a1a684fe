package envoy

import (
	"encoding/json"
	"path/filepath"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"
)

// TestIstioExtProcHonoursTimerExtension: examples/istio/README.md says
// the EnvoyFilter inserts ext_proc with the "same typed config as
// envoy/envoy.yaml", and gives the batch route the batch policy, whose
// waits (wait.max_wait) tokengate covers by extending Envoy's timer with
// override_message_timeout (docs/envoy.md "What tokengate expects from
// Envoy": max_message_timeout at least the longest wait.max_wait plus one
// second). Envoy honours override_message_timeout only up to
// max_message_timeout, whose default 0 disables the feature
// (docs/envoy-ext-proc.md §1.4, §6.2): without it a waiting request gets
// Envoy's 504 after message_timeout (10s here). envoy/envoy.yaml sets
// max_message_timeout: 30s; the Istio filter sets none.
func TestIstioExtProcHonoursTimerExtension(t *testing.T) {
	filters := readManifests(t, filepath.Join(examplesDir, "istio", "envoyfilter.yaml"))
	var ef istioEnvoyFilter
	if err := yaml.UnmarshalStrict(filters["EnvoyFilter"], &ef); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range ef.Spec.ConfigPatches {
		if p.ApplyTo != "HTTP_FILTER" {
			continue
		}
		var v struct {
			TypedConfig json.RawMessage `json:"typed_config"`
		}
		if err := json.Unmarshal(p.Patch.Value, &v); err != nil {
			t.Fatal(err)
		}
		var a anypb.Any
		if err := protojson.Unmarshal(v.TypedConfig, &a); err != nil {
			t.Fatal(err)
		}
		var cfg extprocv3.ExternalProcessor
		if err := a.UnmarshalTo(&cfg); err != nil {
			t.Fatal(err)
		}
		found = true
		if d := cfg.GetMaxMessageTimeout().AsDuration(); d == 0 {
			t.Errorf("examples/istio/envoyfilter.yaml: ext_proc has no max_message_timeout (Envoy default 0: "+
				"override_message_timeout ignored), message_timeout %v; a request of the batch policy that waits "+
				"for tokens longer than that gets Envoy's 504 (envoy/envoy.yaml sets 30s)", cfg.GetMessageTimeout().AsDuration())
		}
	}
	if !found {
		t.Fatal("no HTTP_FILTER patch")
	}
}
