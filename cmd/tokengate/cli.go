package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// A command is one subcommand of tokengate. Every command parses its flags
// with parseArgs, so `tokengate CMD -h`, `tokengate help CMD` and flags
// after positional arguments behave the same for all of them.
type command struct {
	name     string
	synopsis string // arguments, as in "usage: tokengate NAME SYNOPSIS"
	summary  string // one line, for the command list
	help     string // paragraphs printed by --help, before the flags
	run      func(ctx context.Context, args []string, io stdio) error
}

// stdio is a command's standard streams.
type stdio struct {
	in          io.Reader
	out, errOut io.Writer
}

// commands lists every subcommand in the order `tokengate --help` shows.
// It is filled in init because help refers back to it.
var commands []command

func init() {
	commands = []command{
		{"serve", "[--config FILE] [--log-level LEVEL] [--grpc ADDR] [--admin ADDR]",
			"run the ext_proc server (embedded defaults without --config)", serveHelp,
			func(ctx context.Context, args []string, s stdio) error { return runServe(ctx, args, s.out, s.errOut) }},
		{"ratelimit", "[--print-config]",
			"serve as envoyproxy/ratelimit, configured by its environment variables (the image's /bin/ratelimit)", ratelimitHelp,
			func(ctx context.Context, args []string, s stdio) error {
				return runRatelimit(ctx, args, os.Getenv, s.out, s.errOut)
			}},
		{"validate", "[--strict] FILE...",
			"check tokengate configurations and Envoy YAML", validateHelp,
			func(ctx context.Context, args []string, s stdio) error {
				return runValidate(ctx, args, s.out, s.errOut)
			}},
		{"import", "ratelimit [--merge-domains] FILE...", "print the tokengate configuration equal to envoyproxy/ratelimit's", importHelp,
			func(ctx context.Context, args []string, s stdio) error { return runImport(ctx, args, s.out, s.errOut) }},
		{"count", "[--config FILE] [--policy NAME] [flags] FILE|-",
			"print what a request body reserves: input tokens, output allowance, total", countHelp,
			func(ctx context.Context, args []string, s stdio) error {
				return runCount(ctx, args, s.in, s.out, s.errOut)
			}},
		{"demo", "[--serve] [--listen ADDR] [--admin ADDR]",
			"a scripted tour in one process: mock LLM, Envoy stand-in, tokengate", demoHelp,
			func(ctx context.Context, args []string, s stdio) error { return runDemo(ctx, args, s.out, s.errOut) }},
		{"health", "[--url URL] [--timeout DURATION]",
			"probe a running tokengate's /readyz; exit 0 when ready (container health checks)", healthHelp,
			func(ctx context.Context, args []string, s stdio) error { return runHealth(ctx, args, s.out, s.errOut) }},
		{"limits", "set|get|rm [--url URL] [--token-env NAME] [--hashed] [POLICY RULE IDENTITY [FIELD=VALUE...]]",
			"read and change per-identity limits through a running tokengate's admin API", limitsHelp,
			func(ctx context.Context, args []string, s stdio) error { return runLimits(ctx, args, s.out) }},
		{"usage", "[--url URL] [--policy NAME] [--model MODEL] [--tier TIER] IDENTITY...",
			"print one identity's limits, what remains and when it resets, per rule", usageHelp,
			func(ctx context.Context, args []string, s stdio) error { return runUsage(ctx, args, s.out) }},
		{"mock-llm", "[--listen ADDR] [--tokens N] [--token-delay DURATION]",
			"serve the mock OpenAI/Anthropic upstream of the demo stack", mockLLMHelp,
			func(ctx context.Context, args []string, s stdio) error { return runMockLLM(ctx, args, s.out, s.errOut) }},
		{"version", "",
			"print the version and the commit this binary was built from", versionHelp,
			func(ctx context.Context, args []string, s stdio) error { return runVersion(ctx, args, s.out) }},
		{"help", "[COMMAND]",
			"print help for tokengate or one command", "Prints the list of commands, or the usage of one command.",
			runHelp},
	}
}

func lookup(name string) (command, bool) {
	for _, c := range commands {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

// printUsage prints the top-level usage.
func printUsage(w io.Writer) {
	fmt.Fprint(w, "tokengate rate-limits LLM traffic by tokens, as an Envoy external processor.\n\nusage: tokengate COMMAND [arguments]\n\ncommands:\n")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-9s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, "\nRun 'tokengate help COMMAND' or 'tokengate COMMAND --help' for a command's flags.\n")
}

func runHelp(_ context.Context, args []string, s stdio) error {
	fs := newFlagSet("help")
	rest, err := parseArgs(fs, args, s.out)
	if err != nil {
		return err
	}
	switch len(rest) {
	case 0:
		printUsage(s.out)
		return nil
	case 1:
		c, ok := lookup(rest[0])
		if !ok {
			return usageError{fmt.Sprintf("help: unknown command %q (see tokengate --help)", rest[0])}
		}
		return c.run(context.Background(), []string{"--help"}, s)
	}
	return usageError{fmt.Sprintf("help: want at most one COMMAND, got %q", rest)}
}

// errHelp is returned by parseArgs after it printed the usage that -h or
// --help asked for; run turns it into exit status 0.
var errHelp = errors.New("help printed")

// newFlagSet returns the flag set of the named command. Its errors and
// usage are printed by parseArgs and run, not by package flag.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parseArgs parses a command's flags wherever they are among its positional
// arguments (`validate a.yaml --strict`), up to a "--" after which
// everything is positional, and returns the positional arguments. -h and
// --help print the command's usage to out and return errHelp; any other
// mistake is a usageError naming the command.
func parseArgs(fs *flag.FlagSet, args []string, out io.Writer) ([]string, error) {
	var rest []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				printCommandUsage(out, fs)
				return nil, errHelp
			}
			return nil, usageError{fmt.Sprintf("%s: %v (see tokengate %s --help)", fs.Name(), err, fs.Name())}
		}
		left := fs.Args()
		if len(left) == 0 {
			return rest, nil
		}
		// Parse stops at the first positional argument, or consumes a "--"
		// and stops after it.
		if used := len(args) - len(left); used > 0 && args[used-1] == "--" {
			return append(rest, left...), nil
		}
		rest = append(rest, left[0])
		args = left[1:]
	}
}

// printCommandUsage prints "usage: tokengate NAME SYNOPSIS", the command's
// help and its flags, GNU style (--name VALUE).
func printCommandUsage(w io.Writer, fs *flag.FlagSet) {
	c, _ := lookup(fs.Name())
	fmt.Fprintf(w, "usage: tokengate %s %s\n", c.name, c.synopsis)
	if c.help != "" {
		fmt.Fprintf(w, "\n%s\n", strings.TrimSpace(c.help))
	}
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		if n == 0 {
			fmt.Fprint(w, "\nflags:\n")
		}
		n++
		name, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if name != "" {
			line += " " + name
		}
		fmt.Fprintf(w, "%s\n      %s", line, usage)
		if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" {
			fmt.Fprintf(w, " (default %s)", f.DefValue)
		}
		fmt.Fprintln(w)
	})
}

// validateHelp documents `tokengate validate`.
const validateHelp = `
Checks tokengate configuration files (strict: unknown keys, wrong types and
invalid values are errors, all reported at once; what validate accepts, serve
starts with) and Envoy configuration: bootstrap files, bare listener, route,
cluster or filter snippets, Kubernetes manifests that carry Envoy
configuration (Istio EnvoyFilter, Envoy Gateway EnvoyExtensionPolicy and
BackendTrafficPolicy, Envoy AI Gateway QuotaPolicy) and agentgateway
configuration files (their remoteRateLimit policies). Files
may hold several YAML documents. Given a tokengate configuration and Envoy
files together, every policy the Envoy files name must exist in it.

Problems print as FILE:LINE:COLUMN: [warning:] FIELD: MESSAGE (RULE).
Errors (Envoy would reject the file, or tokengate cannot work with it) exit 1;
warnings (it works, but loses something) print and exit 0 unless --strict.`
