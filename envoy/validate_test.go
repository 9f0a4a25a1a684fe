package envoy

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

// finding is the part of a Problem a fixture pins: how bad, which rule,
// where in the file, which field.
type finding struct {
	Severity     Severity
	Rule         string
	Line, Column int
	Path         string
}

// expectation is one "# want: RULE at LINE:COL PATH: MESSAGE" (an error)
// or "# warn: ..." (a warning) line at the top of a fixture; PATH "-" is
// the whole document. MESSAGE is a substring of the problem's message.
type expectation struct {
	finding
	message string
}

// fixture is a test file with its expectations and, from a
// "# policies: a, b" line, the policies of a tokengate configuration to
// check it against.
type fixture struct {
	wants    []expectation
	policies []string
	domains  []string
}

var expectationRE = regexp.MustCompile(`^# (want|warn): (\S+) at (\d+):(\d+) (\S+): (.+)$`)

func readFixture(t *testing.T, data []byte) fixture {
	t.Helper()
	var out fixture
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "#") {
			break
		}
		if names, ok := strings.CutPrefix(line, "# policies:"); ok {
			for _, n := range strings.Split(names, ",") {
				out.policies = append(out.policies, strings.TrimSpace(n))
			}
			continue
		}
		if names, ok := strings.CutPrefix(line, "# domains:"); ok {
			for _, n := range strings.Split(names, ",") {
				out.domains = append(out.domains, strings.TrimSpace(n))
			}
			continue
		}
		if !strings.HasPrefix(line, "# want:") && !strings.HasPrefix(line, "# warn:") {
			continue
		}
		m := expectationRE.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("malformed expectation %q: want \"# want: RULE at LINE:COL PATH: MESSAGE\"", line)
		}
		sev := Error
		if m[1] == "warn" {
			sev = Warning
		}
		l, _ := strconv.Atoi(m[3]) // the pattern admits digits only
		c, _ := strconv.Atoi(m[4])
		path := m[5]
		if path == "-" {
			path = ""
		}
		out.wants = append(out.wants, expectation{finding{sev, m[2], l, c, path}, m[6]})
	}
	return out
}

func findings(ps []Problem) []finding {
	var out []finding
	for _, p := range ps {
		out = append(out, finding{p.Severity, p.Rule, p.Line, p.Column, p.Path})
	}
	return out
}

// TestValidateInvalid runs one fixture per class of problem; each names the
// problems it must produce, with severity, rule, line, column and field
// path, and no others.
func TestValidateInvalid(t *testing.T) {
	files, err := filepath.Glob("testdata/invalid/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no fixtures in testdata/invalid: %v", err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			fx := readFixture(t, data)
			if len(fx.wants) == 0 {
				t.Fatalf("fixture has no \"# want:\" or \"# warn:\" line")
			}
			var opts Options
			if fx.policies != nil || fx.domains != nil {
				opts.Policies = []PolicySet{{File: "tokengate.yaml", Names: fx.policies, Domains: fx.domains}}
			}
			got := Check(file, data, opts).Problems
			var want []finding
			for _, w := range fx.wants {
				want = append(want, w.finding)
			}
			if diff := cmp.Diff(want, findings(got)); diff != "" {
				t.Fatalf("Validate(%s) findings (-want +got):\n%s\nproblems:\n%s", file, diff, problemList(got))
			}
			for i, w := range fx.wants {
				p := got[i]
				if !strings.Contains(p.Message, w.message) {
					t.Errorf("problem %d message = %q, want it to contain %q", i, p.Message, w.message)
				}
				if p.File != file {
					t.Errorf("problem %d File = %q, want %q", i, p.File, file)
				}
			}
			wantFail := false
			for _, w := range fx.wants {
				wantFail = wantFail || w.Severity == Error
			}
			if HasErrors(got) != wantFail {
				t.Errorf("HasErrors = %v, want %v", HasErrors(got), wantFail)
			}
		})
	}
}

func problemList(ps []Problem) string {
	var b strings.Builder
	for _, p := range ps {
		b.WriteString("  " + p.Error() + "\n")
	}
	return b.String()
}

// TestValidateValid: documents tokengate accepts produce no problem at all.
func TestValidateValid(t *testing.T) {
	files, err := filepath.Glob("testdata/valid/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no fixtures in testdata/valid: %v", err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			if got := Validate(file, data); len(got) != 0 {
				t.Errorf("Validate(%s) problems:\n%s", file, problemList(got))
			}
		})
	}
}

// at returns the 1-based line and column where needle starts in data,
// found by plain text search, to cross-check positions found through YAML.
func at(t *testing.T, data []byte, needle string) (int, int) {
	t.Helper()
	i := bytes.Index(data, []byte(needle))
	if i < 0 {
		t.Fatalf("%q not found", needle)
	}
	line := bytes.Count(data[:i], []byte("\n")) + 1
	col := i - bytes.LastIndexByte(data[:i], '\n')
	return line, col
}

// TestShippedConfigs: the shipped bootstraps have no error. Both carry the
// warning that the compose stack's hop to tokengate is plaintext; the
// STREAMED fallback also the documented warning about its cut-off.
func TestShippedConfigs(t *testing.T) {
	const filter = "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0].typed_config"
	tlsWarning := func(data []byte) finding {
		l, c := at(t, data, "name: tokengate\n    type: STRICT_DNS")
		return finding{Warning, RuleGRPCTLS, l, c, "static_resources.clusters[1].transport_socket"}
	}
	rec, fallback := Recommended(), StreamedFallback()
	l, c := at(t, fallback, "response_body_mode: STREAMED")
	tests := []struct {
		name string
		data []byte
		want []finding
	}{
		{RecommendedFile, rec, []finding{tlsWarning(rec)}},
		{StreamedFallbackFile, fallback, []finding{
			{Warning, RuleStreamedResp, l, c, filter + ".processing_mode.response_body_mode"},
			tlsWarning(fallback),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if len(tt.data) == 0 {
				t.Fatal("embedded file is empty")
			}
			got := Validate(tt.name, tt.data)
			if diff := cmp.Diff(tt.want, findings(got)); diff != "" {
				t.Errorf("findings (-want +got):\n%s\nproblems:\n%s", diff, problemList(got))
			}
		})
	}
}

// TestShippedConfigContents pins the choices docs/envoy.md documents, so the
// file and its documentation cannot drift apart silently.
func TestShippedConfigContents(t *testing.T) {
	rec := string(Recommended())
	for _, want := range []string{
		"response_body_mode: FULL_DUPLEX_STREAMED",
		"response_trailer_mode: SEND",
		"request_body_mode: BUFFERED",
		"failure_mode_allow: false",
		"message_timeout: 10s",
		"request_body_buffer_limit:",
		"per_connection_buffer_limit_bytes: 52428800",
		"key: x-tokengate-policy",
		"value: batch",
		"%DYNAMIC_METADATA(tokengate:input_tokens)%",
		"%DYNAMIC_METADATA(tokengate:output_tokens)%",
		"%DYNAMIC_METADATA(tokengate:reserved_tokens)%",
		"%DYNAMIC_METADATA(tokengate:settled_tokens)%",
		"grpc_health_check",
		"address: tokengate, port_value: 50051",
		"address: mockllm, port_value: 9000",
		"port_value: 10000",
	} {
		if !strings.Contains(rec, want) {
			t.Errorf("%s lacks %q", RecommendedFile, want)
		}
	}
	fallback := string(StreamedFallback())
	for _, absent := range []string{"request_body_buffer_limit:", "status_on_error:", "FULL_DUPLEX_STREAMED\n"} {
		if strings.Contains(fallback, absent) {
			t.Errorf("%s contains %q, which Envoy 1.33 rejects or which defeats the fallback", StreamedFallbackFile, absent)
		}
	}
}

func TestLooksLikeEnvoy(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want bool
	}{
		{"bootstrap", "static_resources: {}\n", true},
		{"admin only", "admin: {address: {socket_address: {address: 0.0.0.0, port_value: 9901}}}\n", true},
		{"listener", "name: l\nfilter_chains: []\n", true},
		{"route config", "virtual_hosts: []\n", true},
		{"http filter", "name: envoy.filters.http.ext_proc\ntyped_config: {}\n", true},
		{"typed envoy", "\"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n", true},
		{"typed other", "\"@type\": type.googleapis.com/acme.Config\n", false},
		{"non-envoy filter name", "name: my.filter\ntyped_config: {}\n", false},
		{"tokengate config", "listen: :50051\nredis:\n  addr: redis:6379\npolicies: {}\n", false},
		{"list", "- a\n- b\n", false},
		{"broken", "a: [\n", false},
		{"empty", "", false},
		{"istio manifest", "apiVersion: networking.istio.io/v1alpha3\nkind: EnvoyFilter\n", true},
		{"any manifest", "apiVersion: v1\nkind: ConfigMap\n", true},
		{"apiVersion alone", "apiVersion: v1\npolicies: []\n", false},
		{"second document", "policies: []\n---\nname: l\nfilter_chains: []\n", true},
		{"after a syntax error", "name: l\nfilter_chains: []\n---\na: [\n", true},
		{"comments only", "# nothing\n---\n# here\n", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := LooksLikeEnvoy([]byte(tt.in)); got != tt.want {
				t.Errorf("LooksLikeEnvoy(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}

func TestProblemError(t *testing.T) {
	tests := []struct {
		p    Problem
		want string
	}{
		{Problem{File: "e.yaml", Path: "a.b[0]", Rule: "r", Message: "m"}, "e.yaml: a.b[0]: m (r)"},
		{Problem{File: "e.yaml", Line: 3, Column: 7, Path: "a.b[0]", Rule: "r", Message: "m"}, "e.yaml:3:7: a.b[0]: m (r)"},
		{Problem{File: "e.yaml", Line: 3, Rule: "r", Message: "m"}, "e.yaml:3: m (r)"},
		{Problem{File: "e.yaml", Rule: "r", Message: "m"}, "e.yaml: m (r)"},
		{Problem{File: "e.yaml", Line: 9, Column: 2, Path: "p", Rule: "r", Message: "m", Severity: Warning}, "e.yaml:9:2: warning: p: m (r)"},
		{Problem{Rule: "r", Message: "m"}, "m (r)"},
	}
	for _, tt := range tests {
		if got := tt.p.Error(); got != tt.want {
			t.Errorf("%+v.Error() = %q, want %q", tt.p, got, tt.want)
		}
	}
}

func TestPGVField(t *testing.T) {
	tests := map[string]string{
		"HttpFilters[1]":                   "http_filters[1]",
		"MessageTimeout":                   "message_timeout",
		`TypedPerFilterConfig["x.y"]`:      `typed_per_filter_config["x.y"]`,
		"TypedPerFilterConfig[x.y]":        `typed_per_filter_config["x.y"]`,
		"Http2ProtocolOptions":             "http2_protocol_options",
		"Name":                             "name",
		"PerConnectionBufferLimitBytes[0]": "per_connection_buffer_limit_bytes[0]",
		"":                                 "",
	}
	for in, want := range tests {
		if got := pgvField(in); got != want {
			t.Errorf("pgvField(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzValidate: any input yields problems, never a panic, and every problem
// says where it comes from and which rule it breaks.
func FuzzValidate(f *testing.F) {
	f.Add(Recommended())
	f.Add(StreamedFallback())
	for _, pattern := range []string{"testdata/valid/*.yaml", "testdata/invalid/*.yaml"} {
		files, _ := filepath.Glob(pattern)
		for _, file := range files {
			if data, err := os.ReadFile(file); err == nil {
				f.Add(data)
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		lines := bytes.Count(data, []byte("\n")) + 1
		r := Check("fuzz.yaml", data, Options{Policies: []PolicySet{{File: "t.yaml", Names: []string{"default"}}}})
		for _, p := range r.Problems {
			if p.File != "fuzz.yaml" || p.Rule == "" || p.Message == "" {
				t.Fatalf("problem without file, rule or message: %+v", p)
			}
			if p.Line < 0 || p.Line > lines || p.Column < 0 {
				t.Fatalf("problem outside the %d-line input: %+v", lines, p)
			}
		}
		_ = LooksLikeEnvoy(data) // must not panic; any answer is fine
	})
}

func BenchmarkValidateRecommended(b *testing.B) {
	data := Recommended()
	b.ReportAllocs()
	for b.Loop() {
		if ps := Validate(RecommendedFile, data); HasErrors(ps) {
			b.Fatalf("unexpected problems: %v", ps)
		}
	}
}

// BenchmarkDecodeOnly is the floor Validate builds on: YAML to JSON and a
// protojson decode of the same bootstrap, without any check.
func BenchmarkDecodeOnly(b *testing.B) {
	data := Recommended()
	b.ReportAllocs()
	for b.Loop() {
		js, err := yaml.YAMLToJSON(data)
		if err != nil {
			b.Fatal(err)
		}
		var bs bootstrapv3.Bootstrap
		if err := protojson.Unmarshal(js, &bs); err != nil {
			b.Fatal(err)
		}
	}
}

// TestShippedTLSExample: the mTLS transport_socket the shipped files show,
// commented out, is valid and silences the plaintext warning.
func TestShippedTLSExample(t *testing.T) {
	for name, data := range map[string][]byte{RecommendedFile: Recommended(), StreamedFallbackFile: StreamedFallback()} {
		t.Run(name, func(t *testing.T) {
			var uncommented []string
			n := 0
			for _, line := range strings.Split(string(data), "\n") {
				if rest, ok := strings.CutPrefix(line, "    #"); ok && (strings.HasPrefix(rest, "transport_socket:") || strings.HasPrefix(rest, "  ")) {
					line = "    " + rest
					n++
				}
				uncommented = append(uncommented, line)
			}
			if n != 12 {
				t.Fatalf("found %d commented transport_socket lines, want 12", n)
			}
			got := Validate(name, []byte(strings.Join(uncommented, "\n")))
			for _, p := range got {
				if p.Rule == RuleGRPCTLS || p.Severity == Error {
					t.Errorf("%v", p)
				}
			}
		})
	}
}
