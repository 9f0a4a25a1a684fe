package envoy

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

// finding is the part of a Problem a fixture pins: where, which rule, how bad.
type finding struct {
	Severity Severity
	Rule     string
	Path     string
}

// expectation is one "# want: RULE at PATH: MESSAGE" (an error) or
// "# warn: ..." (a warning) line at the top of a fixture. MESSAGE is a
// substring of the problem's message.
type expectation struct {
	finding
	message string
}

func readExpectations(t *testing.T, data []byte) []expectation {
	t.Helper()
	var out []expectation
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "#") {
			break
		}
		var sev Severity
		var rest string
		switch {
		case strings.HasPrefix(line, "# want: "):
			sev, rest = Error, strings.TrimPrefix(line, "# want: ")
		case strings.HasPrefix(line, "# warn: "):
			sev, rest = Warning, strings.TrimPrefix(line, "# warn: ")
		default:
			continue
		}
		rule, where, ok := strings.Cut(rest, " at ")
		if !ok {
			t.Fatalf("malformed expectation %q: want \"# want: RULE at PATH: MESSAGE\"", line)
		}
		path, msg, ok := strings.Cut(where, ": ")
		if !ok {
			t.Fatalf("malformed expectation %q: want \"# want: RULE at PATH: MESSAGE\"", line)
		}
		out = append(out, expectation{finding{sev, rule, path}, msg})
	}
	return out
}

func findings(ps []Problem) []finding {
	var out []finding
	for _, p := range ps {
		out = append(out, finding{p.Severity, p.Rule, p.Path})
	}
	return out
}

// TestValidateInvalid runs one fixture per class of problem; each names the
// problems it must produce, and no others.
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
			wants := readExpectations(t, data)
			if len(wants) == 0 {
				t.Fatalf("fixture has no \"# want:\" or \"# warn:\" line")
			}
			got := Validate(file, data)
			var want []finding
			for _, w := range wants {
				want = append(want, w.finding)
			}
			if diff := cmp.Diff(want, findings(got)); diff != "" {
				t.Fatalf("Validate(%s) findings (-want +got):\n%s\nproblems:\n%s", file, diff, problemList(got))
			}
			for i, w := range wants {
				p := got[i]
				if !strings.Contains(p.Message, w.message) {
					t.Errorf("problem %d message = %q, want it to contain %q", i, p.Message, w.message)
				}
				if p.File != file {
					t.Errorf("problem %d File = %q, want %q", i, p.File, file)
				}
			}
			wantFail := false
			for _, w := range wants {
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

// TestShippedConfigs: the recommended bootstrap is clean; the STREAMED
// fallback carries exactly the documented warning and no error.
func TestShippedConfigs(t *testing.T) {
	tests := []struct {
		name string
		data []byte
		want []finding
	}{
		{RecommendedFile, Recommended(), nil},
		{StreamedFallbackFile, StreamedFallback(), []finding{{
			Warning, RuleProcessingMode,
			"static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0].typed_config.processing_mode.response_body_mode",
		}}},
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

// TestShippedConfigContents pins the choices the repository README documents, so the
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
		{Problem{File: "e.yaml", Rule: "r", Message: "m"}, "e.yaml: m (r)"},
		{Problem{File: "e.yaml", Path: "p", Rule: "r", Message: "m", Severity: Warning}, "e.yaml: p: warning: m (r)"},
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
		for _, p := range Validate("fuzz.yaml", data) {
			if p.File != "fuzz.yaml" || p.Rule == "" || p.Message == "" {
				t.Fatalf("problem without file, rule or message: %+v", p)
			}
		}
		_ = LooksLikeEnvoy(data)
	})
}

func BenchmarkValidateRecommended(b *testing.B) {
	data := Recommended()
	b.ReportAllocs()
	for b.Loop() {
		if ps := Validate(RecommendedFile, data); len(ps) != 0 {
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
