package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/extproc"
)

// providersDir holds the recorded provider traffic (testdata/providers at
// the repository root; never edited).
const providersDir = "../../testdata/providers"

func countJSON(t *testing.T, args []string, stdin string) (countResult, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := runCount(context.Background(), append([]string{"--json"}, args...), strings.NewReader(stdin), &out, &errOut)
	if err != nil {
		return countResult{}, err
	}
	var r countResult
	dec := json.NewDecoder(&out)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("count --json printed %q: %v", out.String(), err)
	}
	return r, nil
}

// TestCountRecordedGroundTruth runs `tokengate count` on every recorded
// request whose prompt_tokens is marked exact and requires the provider's
// number (S7), for every model a request-only case was reported for.
func TestCountRecordedGroundTruth(t *testing.T) {
	metas, err := filepath.Glob(filepath.Join(providersDir, "*", "*", "meta.json"))
	if err != nil || len(metas) == 0 {
		t.Fatalf("no recorded cases under %s (err %v)", providersDir, err)
	}
	sort.Strings(metas)
	checked := 0
	for _, f := range metas {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var m struct {
			Case        string         `json:"case"`
			Path        string         `json:"path"`
			ByModel     map[string]int `json:"reported_prompt_tokens_by_model"`
			GroundTruth *struct {
				Reported *int   `json:"reported_prompt_tokens"`
				Expected string `json:"expected_match"`
			} `json:"prompt_token_ground_truth"`
		}
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if m.GroundTruth == nil || m.GroundTruth.Expected != "exact" || m.GroundTruth.Reported == nil {
			continue
		}
		models := m.ByModel
		if len(models) == 0 {
			models = map[string]int{"": *m.GroundTruth.Reported}
		}
		req := filepath.Join(filepath.Dir(f), "request.json")
		for model, want := range models {
			args := []string{"--path", m.Path}
			if model != "" {
				args = append(args, "--model", model)
			}
			got, err := countJSON(t, append(args, req), "")
			if err != nil {
				t.Errorf("%s %s: %v", m.Case, model, err)
				continue
			}
			checked++
			if got.InputTokens != want {
				t.Errorf("%s %s: input_tokens = %d, provider reported %d", m.Case, model, got.InputTokens, want)
			}
			if got.Reservation != got.InputTokens+got.OutputAllowance {
				t.Errorf("%s: reservation %d != input %d + allowance %d", m.Case, got.Reservation, got.InputTokens, got.OutputAllowance)
			}
		}
	}
	if checked < 25 {
		t.Errorf("checked %d exact counts, want at least 25", checked)
	}
}

// TestCountOutput covers the flags and the stdin form, on the embedded
// defaults (fallback o200k_base, default output allowance 1024).
func TestCountOutput(t *testing.T) {
	body := `{"model":"gpt-4o","messages":[{"role":"user","content":"Hello, world!"}],"max_tokens":100,"max_completion_tokens":300}`
	noFallback := writeConfig(t, `
tokenizer: {default_output_tokens: 50}
policies:
  - name: capped
    buckets: [{name: global, tokens_per_minute: 6000}]
    max_output_tokens: 200
`)
	tests := []struct {
		name string
		args []string
		in   string
		want countResult
	}{
		{
			name: "chat from stdin, largest cap wins (S7)",
			args: []string{"-"}, in: body,
			want: countResult{Policy: "default", InputTokens: 11, OutputAllowance: 300, Reservation: 311, Encoding: "o200k_base"},
		},
		{
			name: "model override changes the encoding",
			args: []string{"--model", "gpt-3.5-turbo", "-"}, in: body,
			want: countResult{Policy: "default", InputTokens: 11, OutputAllowance: 300, Reservation: 311, Encoding: "cl100k_base"},
		},
		{
			name: "embeddings without a cap reserve no output",
			args: []string{"--api", "embeddings", "-"}, in: `{"model":"text-embedding-3-small","input":["a b","c"]}`,
			want: countResult{Policy: "default", InputTokens: 3, OutputAllowance: 0, Reservation: 3, Encoding: "cl100k_base"},
		},
		{
			name: "no cap: serve's default allowance, 1024 on the embedded defaults",
			args: []string{"-"}, in: `{"model":"gpt-4o","messages":[]}`,
			want: countResult{Policy: "default", InputTokens: 3, OutputAllowance: 1024, Reservation: 1027, Encoding: "o200k_base"},
		},
		{
			name: "unknown model: the defaults' fallback encoding, as serve",
			args: []string{"-"}, in: `{"model":"my-model","prompt":"hi there","max_tokens":5}`,
			want: countResult{Policy: "default", InputTokens: 2, OutputAllowance: 5, Reservation: 7, Encoding: "o200k_base"},
		},
		{
			name: "a configuration's default allowance",
			args: []string{"--config", noFallback, "-"}, in: `{"model":"gpt-4o","messages":[]}`,
			want: countResult{Policy: "capped", InputTokens: 3, OutputAllowance: 50, Reservation: 53, Encoding: "o200k_base"},
		},
		{
			name: "the policy's max_output_tokens lowers the request's cap (S14)",
			args: []string{"-", "--config", noFallback, "--policy", "capped"}, in: body,
			want: countResult{Policy: "capped", InputTokens: 11, OutputAllowance: 200, Reservation: 211, Encoding: "o200k_base"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := countJSON(t, tt.args, tt.in)
			if err != nil {
				t.Fatalf("count: %v", err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("count (-want +got):\n%s", diff)
			}
		})
	}
}

// writeConfig writes a tokengate configuration into the test's directory.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tokengate.yaml")
	if err := os.WriteFile(p, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestCountText checks the human-readable form names every quantity.
func TestCountText(t *testing.T) {
	var out bytes.Buffer
	body := `{"model":"claude-sonnet-4-5","max_tokens":1000,"messages":[{"role":"user","content":"Hi"}]}`
	if err := runCount(context.Background(), []string{"-"}, strings.NewReader(body), &out, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"input_tokens", "estimate", "output_allowance  1000 (request)", "reservation", "encoding", "api               messages"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

// TestCountErrors checks that bad input gets a specific error (S23).
func TestCountErrors(t *testing.T) {
	noFallback := writeConfig(t, "policies: [{name: p, buckets: [{name: g, tokens_per_minute: 60}]}]\n")
	tests := []struct {
		name  string
		args  []string
		in    string
		want  string
		usage bool // exit status 2
	}{
		{"no file", []string{}, "", "exactly one FILE", true},
		{"missing file", []string{"does-not-exist.json"}, "", "no such file", false},
		{"bad api", []string{"--api", "soap", "-"}, "{}", `--api "soap"`, true},
		{"unknown policy", []string{"--policy", "gold", "-"}, "{}", `--policy "gold": the configuration has no such policy`, true},
		{"broken config", []string{"--config", "../../config/testdata/invalid/unknown-key.yaml", "-"}, "{}", `unknown key "typo"`, false},
		{"malformed json", []string{"-"}, `{"model":`, "malformed request body", false},
		{"unknown shape", []string{"-"}, `{"model":"gpt-4o"}`, "unknown API shape", false},
		{"unknown model without a fallback, as serve", []string{"--config", noFallback, "-"}, `{"model":"mystery-1","messages":[]}`, "unknown model and no fallback encoding configured: the model named by model at byte 9", false},
		{"cap of a wrong type", []string{"-"}, `{"model":"gpt-4o","messages":[],"max_tokens":"lots"}`, "max_tokens: want a number no larger than 1048576, got a string at byte 45", false},
		{"absurd cap", []string{"-"}, `{"model":"gpt-4o","messages":[],"max_tokens":1e12}`, "max_tokens: want a number no larger than 1048576, got a number above 1048576 at byte 45", false},
		{"unknown flag", []string{"--frobnicate", "-"}, `{}`, "flag provided but not defined", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := runCount(context.Background(), tt.args, strings.NewReader(tt.in), &out, &errOut)
			if err == nil {
				t.Fatalf("count succeeded, printed %q; want an error containing %q", out.String(), tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
			if want := map[bool]int{true: 2, false: 1}[tt.usage]; exitCode(err) != want {
				t.Errorf("exit status %d, want %d", exitCode(err), want)
			}
		})
	}
}

// count reserves exactly what serve reserves: the same configuration, the
// same counter and the same policy cap, for every shipped configuration and
// each of its policies. Serve's side is read from the reservation a real
// request takes from the store (a bucket that only this request touches).
func TestCountReservesWhatServeReserves(t *testing.T) {
	bodies := []string{
		`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Tell me about token buckets."}]}`,
		`{"model":"gpt-4o-mini","max_tokens":900,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"some-new-model","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`,
	}
	for _, file := range []string{"../../config/default.yaml", "demo.yaml", "../../examples/configs/interactive-and-batch.yaml", "../../examples/configs/provider-safety.yaml"} {
		cfg, err := loadConfig(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, pol := range cfg.Policies {
			for i, body := range bodies {
				t.Run(fmt.Sprintf("%s/%s/%d", filepath.Base(file), pol.Name, i), func(t *testing.T) {
					got, err := countJSON(t, []string{"--config", file, "--policy", pol.Name, "-"}, body)
					if err != nil {
						t.Fatal(err)
					}
					if want := servedReservation(t, cfg, pol.Name, body); got.Reservation != want {
						t.Errorf("count reserves %d, serve reserved %d", got.Reservation, want)
					}
				})
			}
		}
	}
}

// servedReservation sends body through the Envoy stand-in to tokengate built
// by serve's wiring from cfg, on the route of policy, and returns what was
// reserved for it.
func servedReservation(t *testing.T, cfg *config.Config, policy, body string) int {
	t.Helper()
	ctx := context.Background()
	outcomes := make(chan extproc.Outcome, 1)
	p, err := build(ctx, cfg, slog.New(slog.DiscardHandler), buildOptions{onFinish: func(o extproc.Outcome) { outcomes <- o }})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	p.server.Register(gs)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(lis) }()
	defer func() {
		gs.Stop()
		if err := <-served; err != nil {
			t.Error(err)
		}
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	up, err := url.Parse(httptestServer(t, mockllm.New(mockllm.Config{})))
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := standin.New(standin.Config{
		ExtProc: conn, Upstream: up, MessageTimeout: 5 * time.Second,
		Routes: []standin.Route{{Prefix: "/", InitialMetadata: map[string]string{cfg.PolicyMetadataKey: policy}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	req, err := http.NewRequest(http.MethodPost, httptestServer(t, proxy.Handler())+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	pol, ok := cfg.Policy(policy)
	if !ok {
		t.Fatalf("no policy %q", policy)
	}
	for _, id := range pol.Identities {
		if id.Header != "" {
			req.Header.Set(id.Header, "user-1")
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	answer, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("serve answered %d: %s", resp.StatusCode, answer)
	}
	select {
	case o := <-outcomes:
		return o.Reserved
	case <-time.After(10 * time.Second):
		t.Fatal("no outcome within 10s")
	}
	return 0
}
