package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
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

// TestCountOutput covers the flags and the stdin form.
func TestCountOutput(t *testing.T) {
	body := `{"model":"gpt-4o","messages":[{"role":"user","content":"Hello, world!"}],"max_tokens":100,"max_completion_tokens":300}`
	tests := []struct {
		name string
		args []string
		in   string
		want countResult
	}{
		{
			name: "chat from stdin, largest cap wins (S7)",
			args: []string{"-"}, in: body,
			want: countResult{InputTokens: 11, OutputAllowance: 300, Reservation: 311, Encoding: "o200k_base"},
		},
		{
			name: "model override changes the encoding",
			args: []string{"--model", "gpt-3.5-turbo", "-"}, in: body,
			want: countResult{InputTokens: 11, OutputAllowance: 300, Reservation: 311, Encoding: "cl100k_base"},
		},
		{
			name: "embeddings without a cap reserve no output",
			args: []string{"--api", "embeddings", "-"}, in: `{"model":"text-embedding-3-small","input":["a b","c"]}`,
			want: countResult{InputTokens: 3, OutputAllowance: 0, Reservation: 3, Encoding: "cl100k_base"},
		},
		{
			name: "default allowance is configurable",
			args: []string{"--default-output", "50", "-"}, in: `{"model":"gpt-4o","messages":[]}`,
			want: countResult{InputTokens: 3, OutputAllowance: 50, Reservation: 53, Encoding: "o200k_base"},
		},
		{
			name: "unknown model with a fallback encoding",
			args: []string{"--fallback-encoding", "cl100k_base", "-"}, in: `{"model":"my-model","prompt":"hi there","max_tokens":5}`,
			want: countResult{InputTokens: 2, OutputAllowance: 5, Reservation: 7, Encoding: "cl100k_base"},
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
	tests := []struct {
		name string
		args []string
		in   string
		want string
	}{
		{"no file", []string{}, "", "exactly one FILE"},
		{"missing file", []string{"does-not-exist.json"}, "", "no such file"},
		{"bad api", []string{"--api", "soap", "-"}, "{}", `--api "soap"`},
		{"malformed json", []string{"-"}, `{"model":`, "malformed request body"},
		{"unknown shape", []string{"-"}, `{"model":"gpt-4o"}`, "unknown API shape"},
		{"unknown model", []string{"-"}, `{"model":"mystery-1","messages":[]}`, "unknown model and no fallback encoding configured: the model named by model at byte 9"},
		{"negative cap", []string{"-"}, `{"model":"gpt-4o","messages":[],"max_tokens":-5}`, "max_tokens: want a whole number from 1 to 1048576, got a number below 1 at byte 45"},
		{"absurd cap", []string{"-"}, `{"model":"gpt-4o","messages":[],"max_tokens":1e12}`, "max_tokens: want a whole number from 1 to 1048576, got a number with a fraction or an exponent at byte 45"},
		{"bad fallback", []string{"--fallback-encoding", "p50k", "-"}, `{}`, `fallback encoding "p50k"`},
		{"unknown flag", []string{"--frobnicate", "-"}, `{}`, "flag provided but not defined"},
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
		})
	}
}
