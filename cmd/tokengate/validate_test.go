package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// validate runs "tokengate validate ARGS..." in-process.
func validate(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), append([]string{"validate"}, args...), nil, &out, &errOut)
	if err != nil {
		code = exitCode(err)
	}
	return out.String(), errOut.String(), code
}

const (
	recommended = "../../envoy/envoy.yaml"
	composeCfg  = "../../examples/compose/tokengate.yaml"
)

// TestValidateStrict: warnings print and pass; --strict, before or after
// the file, makes them fail.
func TestValidateStrict(t *testing.T) {
	out, errOut, code := validate(t, recommended)
	if code != 0 || !strings.Contains(errOut, ": warning: static_resources.clusters[1].transport_socket:") ||
		!strings.Contains(out, recommended+": valid Envoy configuration (bootstrap), 1 warning") {
		t.Fatalf("without --strict: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	for _, args := range [][]string{{recommended, "--strict"}, {"--strict", recommended}, {"-strict=true", recommended}} {
		out, errOut, code := validate(t, args...)
		if code != 1 || !strings.Contains(errOut, "(grpc-cluster-tls)") ||
			!strings.Contains(errOut, "1 of 1 files failed validation (--strict: warnings count as errors)") ||
			strings.Contains(out, ": valid ") {
			t.Errorf("validate %q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
	}
}

// TestValidateRequestDuplex: envoy.yaml switched to duplex request bodies
// is valid, and validate says which Envoy the modes need.
func TestValidateRequestDuplex(t *testing.T) {
	data, err := os.ReadFile(recommended)
	if err != nil {
		t.Fatal(err)
	}
	duplex := strings.NewReplacer(
		"request_body_mode: BUFFERED", "request_body_mode: FULL_DUPLEX_STREAMED",
		"request_trailer_mode: SKIP", "request_trailer_mode: SEND",
	).Replace(string(data))
	if duplex == string(data) {
		t.Fatal("envoy.yaml no longer has the modes this test switches")
	}
	file := filepath.Join(t.TempDir(), "envoy-duplex.yaml")
	if err := os.WriteFile(file, []byte(duplex), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := validate(t, composeCfg, file)
	if code != 0 || strings.Contains(errOut, "failed") {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	for _, want := range []string{
		file + ": valid Envoy configuration (bootstrap)",
		"body modes request FULL_DUPLEX_STREAMED, response FULL_DUPLEX_STREAMED (Envoy ≥ 1.34): recommended on Envoy ≥ 1.36",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
}

// TestValidatePolicies: with a tokengate configuration, every policy the
// Envoy file names must exist in it, whichever order the files come in.
func TestValidatePolicies(t *testing.T) {
	for _, args := range [][]string{{composeCfg, recommended}, {recommended, composeCfg}} {
		if out, errOut, code := validate(t, args...); code != 0 {
			t.Errorf("validate %q: exit %d\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
	}
	// interactive-and-batch.yaml names its policies chat and batch; the
	// filter's default policy is "default", named on line 76 and on the /v1/
	// route.
	other := "../../examples/configs/interactive-and-batch.yaml"
	for _, args := range [][]string{{other, recommended}, {recommended, other}} {
		out, errOut, code := validate(t, args...)
		if code != 1 {
			t.Errorf("validate %q: exit %d, want 1\nstdout:\n%s\nstderr:\n%s", args, code, out, errOut)
		}
		for _, want := range []string{
			recommended + ":76:19: static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0].typed_config.grpc_service.initial_metadata[0].value: policy \"default\" is not defined in " + other,
			`.routes[2].typed_per_filter_config["envoy.filters.http.ext_proc"].overrides.grpc_initial_metadata[0].value: policy "default"`,
			"(policy-exists)",
		} {
			if !strings.Contains(errOut, want) {
				t.Errorf("validate %q: stderr lacks %q:\n%s", args, want, errOut)
			}
		}
		if strings.Contains(errOut, `policy "batch"`) {
			t.Errorf("batch exists in %s but was reported:\n%s", other, errOut)
		}
	}
}

// TestValidateManifests: Kubernetes manifests are recognised by apiVersion
// and kind, their Envoy configuration checked, never read as tokengate
// configuration.
func TestValidateManifests(t *testing.T) {
	out, errOut, code := validate(t, "../../examples/istio/envoyfilter.yaml", "../../examples/istio/tokengate-mesh.yaml",
		"../../examples/envoy-gateway/tokengate-policy.yaml")
	if code != 0 || errOut != "" {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	for _, want := range []string{
		"envoyfilter.yaml: valid Envoy configuration (EnvoyFilter tokengate)",
		"tokengate-mesh.yaml: nothing to check: ServiceEntry tokengate, DestinationRule tokengate carry no Envoy configuration",
		"tokengate-policy.yaml: valid Envoy configuration (EnvoyExtensionPolicy tokengate; Backend tokengate",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q:\n%s", want, out)
		}
	}
	_, errOut, code = validate(t, "../../envoy/testdata/invalid/istio-add-after-router.yaml")
	want := "istio-add-after-router.yaml:18:7: spec.configPatches[0].patch.operation: the ext_proc filter"
	if code != 1 || !strings.Contains(errOut, want) || strings.Contains(errOut, "unknown key") {
		t.Errorf("exit %d, stderr lacks %q:\n%s", code, want, errOut)
	}
}

// TestValidatePositions: an Envoy error names file:line:column of the
// user's YAML and the field.
func TestValidatePositions(t *testing.T) {
	_, errOut, code := validate(t, "../../envoy/testdata/invalid/decode-camel-case.yaml")
	want := "decode-camel-case.yaml:11:3: typed_config.message_timeout: invalid google.protobuf.Duration value \"ten seconds\" (decode)\n"
	if code != 1 || !strings.Contains(errOut, want) {
		t.Errorf("exit %d, stderr lacks %q:\n%s", code, want, errOut)
	}
}

func TestValidateUsage(t *testing.T) {
	out, _, code := validate(t, "-h")
	if code != 0 || !strings.Contains(out, "usage: tokengate validate [--strict] FILE...") || !strings.Contains(out, "-strict") {
		t.Errorf("-h: exit %d\n%s", code, out)
	}
	for _, args := range [][]string{nil, {"--strict"}, {recommended, "--frobnicate"}} {
		var errOut bytes.Buffer
		err := run(context.Background(), append([]string{"validate"}, args...), nil, &bytes.Buffer{}, &errOut)
		if exitCode(err) != 2 || errOut.Len() != 0 {
			t.Errorf("validate %q: exit %d (%v), stderr %q; want 2 and one line from main", args, exitCode(err), err, errOut.String())
		}
	}
}
