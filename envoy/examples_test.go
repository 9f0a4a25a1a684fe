package envoy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

var examplesDir = filepath.Join(repoRoot, "examples")

// splitDocs splits a multi-document YAML file on its "---" lines.
func splitDocs(data []byte) [][]byte {
	var docs [][]byte
	for _, d := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
		if strings.TrimSpace(stripComments(d)) != "" {
			docs = append(docs, []byte(d))
		}
	}
	return docs
}

func stripComments(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(s, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// k8sHeader identifies a Kubernetes manifest.
type k8sHeader struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

func readManifests(t *testing.T, file string) map[string][]byte {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, d := range splitDocs(data) {
		var h k8sHeader
		if err := yaml.Unmarshal(d, &h); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if h.Kind == "" || h.APIVersion == "" {
			t.Fatalf("%s: a document without apiVersion/kind", file)
		}
		if _, dup := out[h.Kind]; dup {
			t.Fatalf("%s: two %s documents; the test expects one of each kind", file, h.Kind)
		}
		out[h.Kind] = d
	}
	return out
}

func requireClean(t *testing.T, file string, data []byte) {
	t.Helper()
	if ps := Validate(file, data); len(ps) != 0 {
		t.Errorf("Validate(%s):\n%s", file, problemList(ps))
	}
}

func TestPlainEnvoyExample(t *testing.T) {
	file := filepath.Join(examplesDir, "plain-envoy", "tokengate-snippet.yaml")
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	requireClean(t, file, data)
}

// Istio's EnvoyFilter, as far as the example uses it; strict decoding makes
// a misspelt key fail.
type istioEnvoyFilter struct {
	k8sHeader
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		WorkloadSelector struct {
			Labels map[string]string `json:"labels"`
		} `json:"workloadSelector"`
		ConfigPatches []struct {
			ApplyTo string `json:"applyTo"`
			Match   struct {
				Context  string `json:"context"`
				Listener *struct {
					FilterChain struct {
						Filter struct {
							Name      string `json:"name"`
							SubFilter struct {
								Name string `json:"name"`
							} `json:"subFilter"`
						} `json:"filter"`
					} `json:"filterChain"`
				} `json:"listener"`
				RouteConfiguration *struct {
					Vhost struct {
						Route struct {
							Name string `json:"name"`
						} `json:"route"`
					} `json:"vhost"`
				} `json:"routeConfiguration"`
			} `json:"match"`
			Patch struct {
				Operation string          `json:"operation"`
				Value     json.RawMessage `json:"value"`
			} `json:"patch"`
		} `json:"configPatches"`
	} `json:"spec"`
}

type istioServiceEntry struct {
	k8sHeader
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		Hosts      []string `json:"hosts"`
		Location   string   `json:"location"`
		Resolution string   `json:"resolution"`
		Ports      []struct {
			Number   int    `json:"number"`
			Name     string `json:"name"`
			Protocol string `json:"protocol"`
		} `json:"ports"`
	} `json:"spec"`
}

type istioDestinationRule struct {
	k8sHeader
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		Host          string `json:"host"`
		TrafficPolicy struct {
			ConnectionPool struct {
				HTTP struct {
					H2UpgradePolicy  string `json:"h2UpgradePolicy"`
					HTTP2MaxRequests int    `json:"http2MaxRequests"`
				} `json:"http"`
			} `json:"connectionPool"`
			TLS struct {
				Mode string `json:"mode"`
			} `json:"tls"`
		} `json:"trafficPolicy"`
	} `json:"spec"`
}

func TestIstioExample(t *testing.T) {
	dir := filepath.Join(examplesDir, "istio")
	filters := readManifests(t, filepath.Join(dir, "envoyfilter.yaml"))
	mesh := readManifests(t, filepath.Join(dir, "tokengate-mesh.yaml"))

	var ef istioEnvoyFilter
	if err := yaml.UnmarshalStrict(filters["EnvoyFilter"], &ef); err != nil {
		t.Fatalf("EnvoyFilter: %v", err)
	}
	var se istioServiceEntry
	if err := yaml.UnmarshalStrict(mesh["ServiceEntry"], &se); err != nil {
		t.Fatalf("ServiceEntry: %v", err)
	}
	var dr istioDestinationRule
	if err := yaml.UnmarshalStrict(mesh["DestinationRule"], &dr); err != nil {
		t.Fatalf("DestinationRule: %v", err)
	}

	var applied []string
	for i, p := range ef.Spec.ConfigPatches {
		name := fmt.Sprintf("envoyfilter.yaml: spec.configPatches[%d].patch.value", i)
		applied = append(applied, p.ApplyTo)
		switch p.ApplyTo {
		case "HTTP_FILTER":
			if p.Patch.Operation != "INSERT_BEFORE" || p.Match.Listener == nil ||
				p.Match.Listener.FilterChain.Filter.SubFilter.Name != "envoy.filters.http.router" {
				t.Errorf("%s: want INSERT_BEFORE envoy.filters.http.router", name)
			}
			requireClean(t, name, p.Patch.Value)
			var f struct {
				TypedConfig struct {
					GRPCService struct {
						EnvoyGRPC struct {
							ClusterName string `json:"cluster_name"`
						} `json:"envoy_grpc"`
					} `json:"grpc_service"`
				} `json:"typed_config"`
			}
			if err := json.Unmarshal(p.Patch.Value, &f); err != nil {
				t.Fatal(err)
			}
			checkIstioCluster(t, f.TypedConfig.GRPCService.EnvoyGRPC.ClusterName, se, dr)
		case "LISTENER":
			var l listenerv3.Listener
			if err := protojson.Unmarshal(p.Patch.Value, &l); err != nil {
				t.Errorf("%s: not a listener fragment: %v", name, err)
			}
			if l.GetPerConnectionBufferLimitBytes().GetValue() < 1<<20 {
				t.Errorf("%s: per_connection_buffer_limit_bytes = %d, want above Envoy's 1 MiB default",
					name, l.GetPerConnectionBufferLimitBytes().GetValue())
			}
		case "HTTP_ROUTE":
			var r routev3.Route
			if err := protojson.Unmarshal(p.Patch.Value, &r); err != nil {
				t.Fatalf("%s: not a route fragment: %v", name, err)
			}
			var pr extprocv3.ExtProcPerRoute
			if err := r.GetTypedPerFilterConfig()[ExtProcFilterName].UnmarshalTo(&pr); err != nil {
				t.Fatalf("%s: no ExtProcPerRoute for %s: %v", name, ExtProcFilterName, err)
			}
			md := pr.GetOverrides().GetGrpcInitialMetadata()
			if len(md) != 1 || md[0].GetKey() != "x-tokengate-policy" || md[0].GetValue() == "" {
				t.Errorf("%s: grpc_initial_metadata = %v, want one x-tokengate-policy entry", name, md)
			}
		default:
			t.Errorf("%s: unexpected applyTo %q", name, p.ApplyTo)
		}
	}
	if diff := cmp.Diff([]string{"HTTP_FILTER", "LISTENER", "HTTP_ROUTE"}, applied); diff != "" {
		t.Errorf("patches (-want +got):\n%s", diff)
	}
}

// checkIstioCluster: Istio names a ServiceEntry's cluster
// outbound|<port>||<host>; the port must be gRPC (HTTP/2).
func checkIstioCluster(t *testing.T, cluster string, se istioServiceEntry, dr istioDestinationRule) {
	t.Helper()
	m := regexp.MustCompile(`^outbound\|(\d+)\|\|(.+)$`).FindStringSubmatch(cluster)
	if m == nil {
		t.Fatalf("cluster_name %q is not an Istio outbound cluster name", cluster)
	}
	port, host := m[1], m[2]
	if !slices.Contains(se.Spec.Hosts, host) {
		t.Errorf("cluster %q: host %s is not in the ServiceEntry hosts %q", cluster, host, se.Spec.Hosts)
	}
	found := false
	for _, p := range se.Spec.Ports {
		if fmt.Sprint(p.Number) == port {
			found = true
			if p.Protocol != "GRPC" && p.Protocol != "HTTP2" {
				t.Errorf("ServiceEntry port %d protocol %s: ext_proc needs GRPC or HTTP2", p.Number, p.Protocol)
			}
		}
	}
	if !found {
		t.Errorf("cluster %q: port %s is not declared in the ServiceEntry", cluster, port)
	}
	if dr.Spec.Host != host || dr.Spec.TrafficPolicy.ConnectionPool.HTTP.H2UpgradePolicy != "UPGRADE" {
		t.Errorf("DestinationRule for %q with h2UpgradePolicy UPGRADE: got host %q policy %q",
			host, dr.Spec.Host, dr.Spec.TrafficPolicy.ConnectionPool.HTTP.H2UpgradePolicy)
	}
}

// egExtensionPolicy is Envoy Gateway's EnvoyExtensionPolicy
// (gateway.envoyproxy.io/v1alpha1), written from the CRD's fields: decoding
// is strict, so a key the CRD does not know fails. Only extProc is modelled
// in depth.
type egExtensionPolicy struct {
	k8sHeader
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		TargetRef       *egTargetRef      `json:"targetRef,omitempty"`
		TargetRefs      []egTargetRef     `json:"targetRefs,omitempty"`
		TargetSelectors []json.RawMessage `json:"targetSelectors,omitempty"`
		MergeType       *string           `json:"mergeType,omitempty"`
		Wasm            []json.RawMessage `json:"wasm,omitempty"`
		Lua             []json.RawMessage `json:"lua,omitempty"`
		DynamicModule   []json.RawMessage `json:"dynamicModule,omitempty"`
		ExtProc         []egExtProc       `json:"extProc,omitempty"`
	} `json:"spec"`
}

type egTargetRef struct {
	Group       string `json:"group"`
	Kind        string `json:"kind"`
	Name        string `json:"name"`
	SectionName string `json:"sectionName,omitempty"`
}

type egBackendRef struct {
	Group     string  `json:"group,omitempty"`
	Kind      string  `json:"kind,omitempty"`
	Name      string  `json:"name"`
	Namespace string  `json:"namespace,omitempty"`
	Port      *int32  `json:"port,omitempty"`
	Weight    *uint32 `json:"weight,omitempty"`
	Fallback  *bool   `json:"fallback,omitempty"`
}

type egModeOptions struct {
	Body       *string  `json:"body,omitempty"`
	Attributes []string `json:"attributes,omitempty"`
}

type egExtProc struct {
	BackendRef      *egBackendRef   `json:"backendRef,omitempty"`
	BackendRefs     []egBackendRef  `json:"backendRefs,omitempty"`
	BackendSettings json.RawMessage `json:"backendSettings,omitempty"`
	MessageTimeout  *string         `json:"messageTimeout,omitempty"`
	FailOpen        *bool           `json:"failOpen,omitempty"`
	ProcessingMode  *struct {
		Request           *egModeOptions `json:"request,omitempty"`
		Response          *egModeOptions `json:"response,omitempty"`
		AllowModeOverride bool           `json:"allowModeOverride,omitempty"`
	} `json:"processingMode,omitempty"`
	ShadowMode *bool `json:"shadowMode,omitempty"`
	Metadata   *struct {
		AccessibleNamespaces []string `json:"accessibleNamespaces,omitempty"`
		WritableNamespaces   []string `json:"writableNamespaces,omitempty"`
	} `json:"metadata,omitempty"`
	StatusOnError *int32 `json:"statusOnError,omitempty"`
}

type egBackend struct {
	k8sHeader
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		Type         *string  `json:"type,omitempty"`
		AppProtocols []string `json:"appProtocols,omitempty"`
		Endpoints    []struct {
			FQDN *struct {
				Hostname string `json:"hostname"`
				Port     int32  `json:"port"`
			} `json:"fqdn,omitempty"`
			IP *struct {
				Address string `json:"address"`
				Port    int32  `json:"port"`
			} `json:"ip,omitempty"`
		} `json:"endpoints,omitempty"`
	} `json:"spec"`
}

// egBodyModes maps the CRD's body modes onto Envoy's.
var egBodyModes = map[string]string{
	"Streamed":           "STREAMED",
	"Buffered":           "BUFFERED",
	"BufferedPartial":    "BUFFERED_PARTIAL",
	"FullDuplexStreamed": "FULL_DUPLEX_STREAMED",
}

// egToEnvoy builds the ext_proc HTTP filter Envoy Gateway generates for one
// extProc entry: headers are sent in a direction exactly when its
// processingMode is present, trailers only for FullDuplexStreamed, every
// other mode is off; failure_mode_allow is stated when failOpen is.
func egToEnvoy(ep egExtProc) ([]byte, error) {
	pm := map[string]any{
		"request_header_mode": "SKIP", "response_header_mode": "SKIP",
		"request_body_mode": "NONE", "response_body_mode": "NONE",
		"request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
	}
	dir := func(o *egModeOptions, prefix string) error {
		if o == nil {
			return nil
		}
		pm[prefix+"_header_mode"] = "SEND"
		if o.Body == nil {
			return nil
		}
		mode, ok := egBodyModes[*o.Body]
		if !ok {
			return fmt.Errorf("processingMode.%s.body %q: not one of the CRD's modes", prefix, *o.Body)
		}
		pm[prefix+"_body_mode"] = mode
		if mode == "FULL_DUPLEX_STREAMED" {
			pm[prefix+"_trailer_mode"] = "SEND"
		}
		return nil
	}
	cfg := map[string]any{
		"@type":           "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
		"grpc_service":    map[string]any{"envoy_grpc": map[string]any{"cluster_name": "extproc"}},
		"processing_mode": pm,
	}
	if p := ep.ProcessingMode; p != nil {
		if err := dir(p.Request, "request"); err != nil {
			return nil, err
		}
		if err := dir(p.Response, "response"); err != nil {
			return nil, err
		}
		cfg["allow_mode_override"] = p.AllowModeOverride
	}
	if ep.FailOpen != nil {
		cfg["failure_mode_allow"] = *ep.FailOpen
	}
	if ep.MessageTimeout != nil {
		d, err := time.ParseDuration(*ep.MessageTimeout)
		if err != nil {
			return nil, fmt.Errorf("messageTimeout: %v", err)
		}
		cfg["message_timeout"] = fmt.Sprintf("%gs", d.Seconds())
	}
	if ep.ShadowMode != nil {
		cfg["observability_mode"] = *ep.ShadowMode
	}
	if m := ep.Metadata; m != nil {
		mo := map[string]any{}
		if m.AccessibleNamespaces != nil {
			mo["forwarding_namespaces"] = map[string]any{"untyped": m.AccessibleNamespaces}
		}
		if m.WritableNamespaces != nil {
			mo["receiving_namespaces"] = map[string]any{"untyped": m.WritableNamespaces}
		}
		cfg["metadata_options"] = mo
	}
	if ep.StatusOnError != nil {
		cfg["status_on_error"] = map[string]any{"code": *ep.StatusOnError}
	}
	return json.Marshal(map[string]any{"name": ExtProcFilterName, "typed_config": cfg})
}

func readEnvoyGateway(t *testing.T) (egExtensionPolicy, egBackend) {
	t.Helper()
	docs := readManifests(t, filepath.Join(examplesDir, "envoy-gateway", "tokengate-policy.yaml"))
	var p egExtensionPolicy
	if err := yaml.UnmarshalStrict(docs["EnvoyExtensionPolicy"], &p); err != nil {
		t.Fatalf("EnvoyExtensionPolicy: %v", err)
	}
	var b egBackend
	if err := yaml.UnmarshalStrict(docs["Backend"], &b); err != nil {
		t.Fatalf("Backend: %v", err)
	}
	for _, kind := range []string{"ClientTrafficPolicy", "HTTPRoute"} {
		if docs[kind] == nil {
			t.Errorf("tokengate-policy.yaml has no %s", kind)
		}
	}
	if !bytes.Contains(docs["HTTPRoute"], []byte("request: 0s")) {
		t.Errorf("HTTPRoute: want timeouts.request: 0s so long generations are not cut")
	}
	return p, b
}

func TestEnvoyGatewayExample(t *testing.T) {
	p, backend := readEnvoyGateway(t)
	if p.APIVersion != "gateway.envoyproxy.io/v1alpha1" {
		t.Errorf("apiVersion = %q", p.APIVersion)
	}
	if len(p.Spec.ExtProc) != 1 {
		t.Fatalf("extProc has %d entries, want 1", len(p.Spec.ExtProc))
	}
	ep := p.Spec.ExtProc[0]
	doc, err := egToEnvoy(ep)
	if err != nil {
		t.Fatal(err)
	}
	requireClean(t, "tokengate-policy.yaml: spec.extProc[0] as Envoy config", doc)

	if len(ep.BackendRefs) != 1 || ep.BackendRefs[0].Kind != "Backend" || ep.BackendRefs[0].Name != backend.Metadata.Name {
		t.Fatalf("backendRefs = %+v, want the Backend %q", ep.BackendRefs, backend.Metadata.Name)
	}
	if !slices.Contains(backend.Spec.AppProtocols, "gateway.envoyproxy.io/h2c") {
		t.Errorf("Backend appProtocols = %q, want gateway.envoyproxy.io/h2c (gRPC needs HTTP/2)", backend.Spec.AppProtocols)
	}
	port := ep.BackendRefs[0].Port
	if len(backend.Spec.Endpoints) == 0 || backend.Spec.Endpoints[0].FQDN == nil || port == nil ||
		backend.Spec.Endpoints[0].FQDN.Port != *port {
		t.Errorf("backendRefs port and Backend endpoint port differ")
	}
}

// TestEnvoyGatewayMapping: the mapping reports what the CRD cannot express
// well, so the example test above can fail for the right reasons.
func TestEnvoyGatewayMapping(t *testing.T) {
	p, _ := readEnvoyGateway(t)
	base := p.Spec.ExtProc[0]
	str := func(s string) *string { return &s }
	tests := []struct {
		name   string
		change func(*egExtProc)
		want   []finding
	}{
		{"no response processing", func(e *egExtProc) { e.ProcessingMode.Response = nil }, []finding{
			{Error, RuleProcessingMode, "typed_config.processing_mode.response_header_mode"},
			{Error, RuleProcessingMode, "typed_config.processing_mode.response_body_mode"},
		}},
		{"streamed response", func(e *egExtProc) { e.ProcessingMode.Response.Body = str("Streamed") }, []finding{
			{Warning, RuleProcessingMode, "typed_config.processing_mode.response_body_mode"},
		}},
		{"failOpen unset", func(e *egExtProc) { e.FailOpen = nil }, []finding{
			{Error, RuleFailureMode, "typed_config.failure_mode_allow"},
		}},
		{"default message timeout", func(e *egExtProc) { e.MessageTimeout = nil }, []finding{
			{Error, RuleMessageTimeout, "typed_config.message_timeout"},
		}},
		{"no writable namespace", func(e *egExtProc) { e.Metadata = nil }, []finding{
			{Error, RuleMetadata, "typed_config.metadata_options.receiving_namespaces.untyped"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Deep copy through JSON so cases do not share pointers.
			js, _ := json.Marshal(base)
			var e egExtProc
			if err := json.Unmarshal(js, &e); err != nil {
				t.Fatal(err)
			}
			tt.change(&e)
			doc, err := egToEnvoy(e)
			if err != nil {
				t.Fatal(err)
			}
			got := Validate("eg", doc)
			if diff := cmp.Diff(tt.want, findings(got)); diff != "" {
				t.Errorf("findings (-want +got):\n%s\n%s", diff, problemList(got))
			}
		})
	}
}

// TestEnvoyGatewayStrict: a key the CRD does not know fails decoding.
func TestEnvoyGatewayStrict(t *testing.T) {
	doc := []byte("apiVersion: gateway.envoyproxy.io/v1alpha1\nkind: EnvoyExtensionPolicy\n" +
		"spec:\n  extProc:\n  - backendRefs: [{name: t}]\n    processingMode:\n      response:\n        bodyMode: Buffered\n")
	var p egExtensionPolicy
	err := yaml.UnmarshalStrict(doc, &p)
	if err == nil || !strings.Contains(err.Error(), "bodyMode") {
		t.Errorf("UnmarshalStrict with bodyMode = %v, want an unknown-field error naming bodyMode", err)
	}
}
