package envoy

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
)

// modeFilter is an ext_proc filter that is clean apart from its modes.
func modeFilter(req, resp, reqTrailers, respTrailers string) []byte {
	return fmt.Appendf(nil, `name: envoy.filters.http.ext_proc
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
  grpc_service: {envoy_grpc: {cluster_name: tokengate}}
  failure_mode_allow: false
  processing_mode:
    request_header_mode: SEND
    request_body_mode: %s
    request_trailer_mode: %s
    response_header_mode: SEND
    response_body_mode: %s
    response_trailer_mode: %s
  message_timeout: 10s
  metadata_options: {receiving_namespaces: {untyped: [tokengate]}}
`, req, reqTrailers, resp, respTrailers)
}

// TestModeMatrix: of every request × response body mode Envoy has,
// Validate accepts exactly the six tokengate supports, and reports each
// accepted one as supported with its advice.
func TestModeMatrix(t *testing.T) {
	supported := map[[2]BodyMode]bool{}
	for _, m := range Modes {
		supported[[2]BodyMode{m.Request, m.Response}] = true
	}
	if len(supported) != 6 {
		t.Fatalf("Modes lists %d distinct combinations, want 6", len(supported))
	}
	values := extprocv3.ProcessingMode_BodySendMode(0).Descriptor().Values()
	accepted := 0
	for i := range values.Len() {
		for j := range values.Len() {
			req, resp := BodyMode(values.Get(i).Number()), BodyMode(values.Get(j).Number())
			name := req.String() + "×" + resp.String()
			t.Run(name, func(t *testing.T) {
				r := Check(name, modeFilter(req.String(), resp.String(), "SEND", "SEND"), Options{})
				want := supported[[2]BodyMode{req, resp}]
				if HasErrors(r.Problems) == want {
					t.Fatalf("HasErrors = %v, want %v:\n%s", HasErrors(r.Problems), !want, problemList(r.Problems))
				}
				if len(r.Modes) != 1 {
					t.Fatalf("%d modes reported, want 1", len(r.Modes))
				}
				m := r.Modes[0]
				if m.Supported != want || m.Request != req || m.Response != resp {
					t.Errorf("mode = %+v, want supported=%v %v×%v", m, want, req, resp)
				}
				if want && m.Mode.Recommended == "" {
					t.Errorf("no advice for a supported combination")
				}
				for _, p := range r.Problems {
					if p.Severity == Error && p.Rule != RuleProcessingMode {
						t.Errorf("unexpected error: %v", p)
					}
				}
			})
			if supported[[2]BodyMode{req, resp}] {
				accepted++
			}
		}
	}
	if accepted != 6 {
		t.Errorf("%d combinations accepted, want 6", accepted)
	}
}

// TestDuplexNeedsTrailers: each duplex direction without its trailer mode
// SEND is an error at that trailer mode, which Envoy would reject.
func TestDuplexNeedsTrailers(t *testing.T) {
	const pm = "typed_config.processing_mode."
	tests := []struct {
		req, resp, reqTr, respTr string
		want                     []finding
	}{
		{"FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND", "SEND", nil},
		{"FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SKIP", "SEND", []finding{{Error, RuleDuplexTrailers, 9, 5, pm + "request_trailer_mode"}}},
		{"FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "DEFAULT", "SEND", []finding{{Error, RuleDuplexTrailers, 9, 5, pm + "request_trailer_mode"}}},
		{"BUFFERED", "FULL_DUPLEX_STREAMED", "SKIP", "SKIP", []finding{{Error, RuleDuplexTrailers, 12, 5, pm + "response_trailer_mode"}}},
		{"BUFFERED", "STREAMED", "SKIP", "SKIP", []finding{{Warning, RuleStreamedResp, 11, 5, pm + "response_body_mode"}}},
	}
	for _, tt := range tests {
		name := strings.Join([]string{tt.req, tt.resp, tt.reqTr, tt.respTr}, "/")
		t.Run(name, func(t *testing.T) {
			got := Validate(name, modeFilter(tt.req, tt.resp, tt.reqTr, tt.respTr))
			if diff := cmp.Diff(tt.want, findings(got)); diff != "" {
				t.Errorf("findings (-want +got):\n%s\n%s", diff, problemList(got))
			}
		})
	}
}

// TestRecommendedWithRequestDuplex: envoy.yaml switched to duplex request
// bodies (request_trailer_mode SEND) is as valid as envoy.yaml itself.
func TestRecommendedWithRequestDuplex(t *testing.T) {
	rec := string(Recommended())
	duplex := strings.NewReplacer(
		"request_body_mode: BUFFERED", "request_body_mode: FULL_DUPLEX_STREAMED",
		"request_trailer_mode: SKIP", "request_trailer_mode: SEND",
	).Replace(rec)
	if strings.Count(duplex, "FULL_DUPLEX_STREAMED") != strings.Count(rec, "FULL_DUPLEX_STREAMED")+1 ||
		!strings.Contains(duplex, "request_trailer_mode: SEND") {
		t.Fatalf("%s no longer has the request modes this test switches", RecommendedFile)
	}
	r := Check("envoy-duplex.yaml", []byte(duplex), Options{})
	if HasErrors(r.Problems) {
		t.Fatalf("errors:\n%s", problemList(r.Problems))
	}
	base := Validate(RecommendedFile, []byte(rec))
	if diff := cmp.Diff(findings(base), findings(r.Problems)); diff != "" {
		t.Errorf("findings differ from %s's (-%s +duplex):\n%s", RecommendedFile, RecommendedFile, diff)
	}
	if len(r.Modes) != 1 || !r.Modes[0].Supported || r.Modes[0].Request != FullDuplex || r.Modes[0].Response != FullDuplex {
		t.Errorf("modes = %+v, want one supported FULL_DUPLEX_STREAMED × FULL_DUPLEX_STREAMED", r.Modes)
	}
}

// TestPolicies: every policy a route or the filter names must exist in the
// tokengate configuration given; other metadata keys are not policies.
func TestPolicies(t *testing.T) {
	rec := Recommended()
	batchLine, batchCol := at(t, rec, "value: batch")
	const route = "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes[1]"
	tests := []struct {
		name string
		set  PolicySet
		want []finding
	}{
		{"all defined", PolicySet{File: "t.yaml", Names: []string{"default", "batch"}}, nil},
		{"batch missing", PolicySet{File: "t.yaml", Names: []string{"default", "interactive"}}, []finding{{
			Error, RulePolicy, batchLine, batchCol,
			route + `.typed_per_filter_config["envoy.filters.http.ext_proc"].overrides.grpc_initial_metadata[0].value`,
		}}},
		{"other key", PolicySet{File: "t.yaml", Key: "x-llm-policy", Names: []string{"none"}}, nil},
		{"key case", PolicySet{File: "t.yaml", Key: "X-Tokengate-Policy", Names: []string{"default", "batch"}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Check(RecommendedFile, rec, Options{Policies: []PolicySet{tt.set}})
			var got []Problem
			for _, p := range r.Problems {
				if p.Rule == RulePolicy {
					got = append(got, p)
				}
			}
			if diff := cmp.Diff(tt.want, findings(got)); diff != "" {
				t.Errorf("findings (-want +got):\n%s\n%s", diff, problemList(got))
			}
			for _, p := range got {
				if !strings.Contains(p.Message, `"batch" is not defined in t.yaml`) {
					t.Errorf("message %q does not name the policy and the file", p.Message)
				}
			}
		})
	}
	// Several configurations: a policy must be defined in one of them.
	two := []PolicySet{{File: "a.yaml", Names: []string{"default"}}, {File: "b.yaml", Names: []string{"batch", "default"}}}
	if r := Check(RecommendedFile, rec, Options{Policies: two}); HasErrors(r.Problems) {
		t.Errorf("batch is defined in b.yaml:\n%s", problemList(r.Problems))
	}
	two[1].Names = []string{"default"}
	r := Check(RecommendedFile, rec, Options{Policies: two})
	if !HasErrors(r.Problems) || !strings.Contains(problemList(r.Problems), `policy "batch" is not defined in any of a.yaml, b.yaml (defined: "default")`) {
		t.Errorf("batch is defined in neither:\n%s", problemList(r.Problems))
	}

	// The filter's own default counts too.
	r = Check(RecommendedFile, rec, Options{Policies: []PolicySet{{File: "t.yaml", Names: []string{"batch"}}}})
	var missing []string
	for _, p := range r.Problems {
		if p.Rule == RulePolicy {
			missing = append(missing, p.Message[:strings.Index(p.Message, " is not")])
		}
	}
	slices.Sort(missing)
	if diff := cmp.Diff([]string{`policy "default"`, `policy "default"`}, missing); diff != "" {
		t.Errorf("missing policies (-want +got):\n%s", diff)
	}
}

// TestIstioMergeIsPartial: a MERGE value may leave out required fields; the
// same value added whole (ADD) may not.
func TestIstioMergeIsPartial(t *testing.T) {
	data, err := os.ReadFile("testdata/valid/istio-merge.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if ps := Validate("merge.yaml", data); len(ps) != 0 {
		t.Fatalf("MERGE:\n%s", problemList(ps))
	}
	add := strings.Replace(string(data), "applyTo: HTTP_ROUTE\n    match:\n      routeConfiguration: {vhost: {route: {name: batch}}}\n    patch:\n      operation: MERGE",
		"applyTo: HTTP_ROUTE\n    match:\n      routeConfiguration: {vhost: {route: {name: batch}}}\n    patch:\n      operation: ADD", 1)
	if add == string(data) {
		t.Fatal("the fixture no longer has the HTTP_ROUTE MERGE this test changes")
	}
	got := findings(Validate("add.yaml", []byte(add)))
	l, c := at(t, []byte(add), "value:\n        route: {timeout: 0s}")
	rl, rc := at(t, []byte(add), "route: {timeout: 0s}")
	want := []finding{
		{Error, RuleEnvoy, l, c, "spec.configPatches[1].patch.value.match"},
		{Error, RuleEnvoy, rl, rc, "spec.configPatches[1].patch.value.route.cluster_specifier"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ADD findings (-want +got):\n%s", diff)
	}
}
