package envoy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

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

// TestShippedManifests: every YAML file under examples/ that carries Envoy
// configuration (plain Envoy, Istio, Envoy Gateway) is recognised, checked
// and free of errors; the tokengate configurations there are not taken for
// Envoy configuration.
func TestShippedManifests(t *testing.T) {
	type want struct {
		checked, skipped []string
		warnings         []string // rules
	}
	wants := map[string]want{
		"istio/envoyfilter.yaml":              {checked: []string{"EnvoyFilter tokengate"}},
		"istio/tokengate-mesh.yaml":           {skipped: []string{"ServiceEntry tokengate", "DestinationRule tokengate"}},
		"envoy-gateway/tokengate-policy.yaml": {checked: []string{"EnvoyExtensionPolicy tokengate"}, skipped: []string{"Backend tokengate", "ClientTrafficPolicy llm-clients", "HTTPRoute llm-api"}},
		// The snippet's tokengate.internal is a placeholder for a remote host.
		"plain-envoy/tokengate-snippet.yaml": {checked: []string{"bootstrap"}, warnings: []string{RuleGRPCTLS}},
		"rls/envoy.yaml":                     {checked: []string{"bootstrap"}},
		"rls/istio-envoyfilter.yaml":         {checked: []string{"EnvoyFilter tokengate-ratelimit"}},
		"rls/envoy-gateway.yaml":             {checked: []string{"BackendTrafficPolicy llm-token-budget"}, skipped: []string{"ConfigMap envoy-gateway-config"}},
		"rls/ai-gateway-quota.yaml":          {checked: []string{"QuotaPolicy openai-quota"}},
		"rls/agentgateway.yaml":              {checked: []string{"agentgateway configuration"}},
	}
	seen := 0
	err := filepath.WalkDir(examplesDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || (filepath.Ext(path) != ".yaml" && filepath.Ext(path) != ".yml") {
			return err
		}
		rel, err := filepath.Rel(examplesDir, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		w, envoyFile := wants[rel]
		if got := LooksLikeEnvoy(data); got != envoyFile {
			t.Errorf("%s: LooksLikeEnvoy = %v, want %v", rel, got, envoyFile)
			return nil
		}
		if !envoyFile {
			return nil
		}
		seen++
		r := Check(rel, data, Options{})
		var warnings []string
		for _, p := range r.Problems {
			if p.Severity == Error {
				t.Errorf("%v", p)
			}
			warnings = append(warnings, p.Rule)
		}
		if diff := cmp.Diff(w, want{r.Checked, r.Skipped, warnings}, cmp.AllowUnexported(want{})); diff != "" {
			t.Errorf("%s (-want +got):\n%s\n%s", rel, diff, problemList(r.Problems))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen != len(wants) {
		t.Errorf("checked %d example files, want %d", seen, len(wants))
	}
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
				Mode            string   `json:"mode"`
				CredentialName  string   `json:"credentialName"`
				SNI             string   `json:"sni"`
				SubjectAltNames []string `json:"subjectAltNames"`
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
	// tokengate outside the mesh, on a routable address, accepts only
	// clients with a certificate (mTLS): the gateway must present one, and
	// name the host it verifies: Istio's automatic SNI would take the gRPC
	// :authority, which Envoy sets to the cluster name.
	if tls := dr.Spec.TrafficPolicy.TLS; tls.Mode != "MUTUAL" || tls.CredentialName == "" || tls.SNI != host || !slices.Contains(tls.SubjectAltNames, host) {
		t.Errorf("DestinationRule tls = %+v, want MUTUAL with a credentialName, sni and subjectAltNames %s", tls, host)
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
