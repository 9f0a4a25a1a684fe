// Command tokengate is an Envoy external-processing server that rate-limits
// LLM traffic by tokens.
//
//	tokengate serve [--config FILE]     run the ext_proc server
//	tokengate ratelimit                 serve as envoyproxy/ratelimit, configured by its environment
//	tokengate validate [--strict] FILE...  check tokengate configs and Envoy YAML
//	tokengate count [flags] FILE|-      what a request body reserves
//	tokengate demo [--serve]            a scripted tour, no Envoy, Docker or keys needed
//	tokengate health [--url URL]        probe a running tokengate's /readyz
//	tokengate limits set|get|rm ...     per-identity limits, through the admin API
//	tokengate usage IDENTITY...         one identity's limits and what remains
//	tokengate mock-llm [--listen ADDR]  the mock LLM upstream of the demo stack
//	tokengate version                   the version and commit of this binary
//
// `tokengate help COMMAND` or `tokengate COMMAND --help` prints a command's
// flags. Usage mistakes exit with status 2, other failures with 1.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	// The IANA time zone database, embedded (about 450 KB): quota windows
	// name their time zone (buckets.ParseWindow), and a zone must load —
	// and validate — the same on every host, including scratch images and
	// hosts without /usr/share/zoneinfo. The system's database is still
	// used when there is one.
	_ "time/tzdata"

	"github.com/tokengate/tokengate/config"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, commandArgs(os.Args), os.Stdin, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		report(os.Stderr, err)
		os.Exit(exitCode(err))
	}
}

// commandArgs is the command line run reads: the arguments after the
// program's name, with "ratelimit" first when the program is called
// ratelimit (the image's /bin/ratelimit, which Envoy Gateway's Deployment
// runs as envoyproxy/ratelimit's binary).
func commandArgs(argv []string) []string {
	if len(argv) == 0 {
		return nil
	}
	if filepath.Base(argv[0]) == "ratelimit" {
		return append([]string{"ratelimit"}, argv[1:]...)
	}
	return argv[1:]
}

// report prints err for the user: configuration problems one per line as
// validate prints them (file:line: field: message), anything else on one
// line after "tokengate: ".
func report(w io.Writer, err error) {
	var ps config.Problems
	switch {
	case errors.Is(err, errReported):
	case errors.As(err, &ps):
		fmt.Fprintln(w, ps.Error())
	default:
		fmt.Fprintln(w, "tokengate:", err)
	}
}

// errReported marks an error whose details were already printed.
var errReported = errors.New("failed")

// usageError is a mistake in the command line; it exits with status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func exitCode(err error) int {
	var u usageError
	if errors.As(err, &u) {
		return 2
	}
	return 1
}

// run is the whole program behind main, testable in-process.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	s := stdio{in: stdin, out: stdout, errOut: stderr}
	if len(args) == 0 {
		printUsage(stderr)
		return usageError{"no command given (see tokengate --help)"}
	}
	name, rest := args[0], args[1:]
	switch name {
	case "-h", "-help", "--help":
		printUsage(stdout)
		return nil
	case "--version", "-version":
		name = "version"
	}
	c, ok := lookup(name)
	if !ok {
		return usageError{fmt.Sprintf("unknown command %q (see tokengate --help)", name)}
	}
	err := c.run(ctx, rest, s)
	if errors.Is(err, errHelp) {
		return nil
	}
	return err
}
