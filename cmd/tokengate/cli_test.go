package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
)

func runCLI(args ...string) (stdout, stderr string, err error) {
	var out, errOut bytes.Buffer
	err = run(context.Background(), args, strings.NewReader(""), &out, &errOut)
	return out.String(), errOut.String(), err
}

// tokengate --help, tokengate help CMD, CMD -h and CMD --help print usage
// to stdout and exit 0, for every command.
func TestHelpForEveryCommand(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}} {
		out, errOut, err := runCLI(args...)
		if err != nil || errOut != "" {
			t.Errorf("%q: err %v, stderr %q", args, err, errOut)
		}
		for _, c := range commands {
			if !strings.Contains(out, "\n  "+c.name+" ") {
				t.Errorf("%q does not list %s:\n%s", args, c.name, out)
			}
		}
	}
	for _, c := range commands {
		for _, args := range [][]string{{c.name, "-h"}, {c.name, "--help"}, {"help", c.name}} {
			out, errOut, err := runCLI(args...)
			if err != nil {
				t.Errorf("%q: %v", args, err)
			}
			if errOut != "" {
				t.Errorf("%q wrote to stderr: %q", args, errOut)
			}
			if want := "usage: tokengate " + c.name; !strings.HasPrefix(out, want) {
				t.Errorf("%q printed %q, want it to start with %q", args, out, want)
			}
		}
	}
}

// A usage mistake exits 2 with one line that says what was wrong and
// nothing else on stderr (main prints that line).
func TestUsageErrors(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"frobnicate"}, `unknown command "frobnicate" (see tokengate --help)`},
		{[]string{"help", "frobnicate"}, `help: unknown command "frobnicate"`},
		{[]string{"serve", "--frobnicate"}, "serve: flag provided but not defined: -frobnicate (see tokengate serve --help)"},
		{[]string{"serve", "extra.yaml"}, `serve: takes no arguments, got ["extra.yaml"]`},
		{[]string{"serve", "--log-level", "loud"}, `serve: --log-level "loud": want debug, info, warn or error`},
		{[]string{"serve", "--grpc", "nowhere"}, `listeners.grpc: "nowhere" is not host:port`},
		{[]string{"validate"}, "validate: needs at least one FILE"},
		{[]string{"count"}, "count: want exactly one FILE or -, got 0 arguments"},
		{[]string{"count", "--json"}, "count: want exactly one FILE or -"},
		{[]string{"demo", "now"}, `demo: takes no arguments, got ["now"]`},
		{[]string{"health", "--timeout", "-1s"}, "health: --timeout must be positive"},
		{[]string{"mock-llm", "--tokens", "0"}, "mock-llm: --tokens must be at least 1"},
		{[]string{"version", "--short"}, "version: flag provided but not defined: -short"},
		{[]string{"count", "--model"}, "count: flag needs an argument: -model"},
	} {
		_, errOut, err := runCLI(tt.args...)
		if exitCode(err) != 2 {
			t.Errorf("%q: exit %d (%v), want 2", tt.args, exitCode(err), err)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, tt.want) || strings.Contains(msg, "\n") {
			t.Errorf("%q: error %q, want one line containing %q", tt.args, msg, tt.want)
		}
		if errOut != "" {
			t.Errorf("%q wrote more than the error line to stderr: %q", tt.args, errOut)
		}
	}
	// No command at all: the command list, then the error line.
	_, errOut, err := runCLI()
	if exitCode(err) != 2 || !strings.Contains(errOut, "commands:") {
		t.Errorf("no command: exit %d, stderr %q", exitCode(err), errOut)
	}
}

// Flags may follow positional arguments; after "--" everything is
// positional.
func TestFlagsAfterArguments(t *testing.T) {
	out, errOut, err := runCLI("count", "../../testdata/providers/README.md", "--json")
	if err == nil || !strings.Contains(err.Error(), "malformed request body") {
		// The file is not a request: it was read as the body, and --json was
		// taken as a flag, not as a second file.
		t.Errorf("count FILE --json: %v\n%s%s", err, out, errOut)
	}
	out, _, err = runCLI("validate", "../../config/default.yaml", "demo.yaml")
	if err != nil || strings.Count(out, ": valid tokengate configuration") != 2 {
		t.Errorf("validate two files: %v\n%s", err, out)
	}
	_, _, err = runCLI("validate", "--", "--help")
	if err == nil || exitCode(err) != 1 {
		t.Errorf("validate -- --help: %v, want the file --help to be read (and missing)", err)
	}
	body := writeConfig(t, `{"model":"gpt-4o","messages":[],"max_tokens":7}`)
	out, _, err = runCLI("count", body, "--policy", "default", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var r countResult
	if err := json.Unmarshal([]byte(out), &r); err != nil || r.OutputAllowance != 7 {
		t.Errorf("count FILE --policy P --json printed %q (%v)", out, err)
	}
}

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}} {
		out, _, err := runCLI(args...)
		if err != nil || !strings.HasPrefix(out, "tokengate ") || !strings.Contains(out, " go1.") {
			t.Errorf("%q printed %q (%v), want tokengate VERSION (commit …) goVERSION", args, out, err)
		}
	}
}

// tokengate health exits 0 on a 200 and 1 with one line otherwise.
func TestHealth(t *testing.T) {
	var ready atomic.Bool
	ready.Store(true)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if !ready.Load() {
			http.Error(w, "not ready: shutting down", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ready\n"))
	})
	base := httptestServer(t, mux)
	out, _, err := runCLI("health", "--url", base+"/readyz")
	if err != nil || out != base+"/readyz: ready\n" {
		t.Errorf("ready: %q, %v", out, err)
	}
	ready.Store(false)
	_, _, err = runCLI("health", "--url", base+"/readyz")
	if exitCode(err) != 1 || !strings.Contains(err.Error(), "503 Service Unavailable: not ready: shutting down") {
		t.Errorf("not ready: %v (exit %d)", err, exitCode(err))
	}
	_, _, err = runCLI("health", "--url", "http://127.0.0.1:1/readyz")
	if exitCode(err) != 1 || !strings.Contains(err.Error(), "not healthy") {
		t.Errorf("nothing listening: %v (exit %d)", err, exitCode(err))
	}
}
