// Command tokengate is an Envoy external-processing server that rate-limits
// LLM traffic by tokens.
//
//	tokengate serve [--config FILE]   run the ext_proc server
//	tokengate validate FILE...        check tokengate configs and Envoy YAML
//	tokengate demo [--serve]          a scripted tour, no Envoy, Docker or keys needed
//	tokengate count [flags] FILE|-    what a request body will cost
//	tokengate mock-llm --listen ADDR  the mock LLM upstream of the demo stack
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if !errors.Is(err, errReported) {
			fmt.Fprintln(os.Stderr, "tokengate:", err)
		}
		os.Exit(exitCode(err))
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

const usage = `usage: tokengate <command> [arguments]

commands:
  serve [--config FILE]     run the ext_proc server (embedded defaults without --config)
  validate FILE...          validate tokengate configs and Envoy YAML
  demo [--serve]            run a scripted tour in one process: mock LLM, Envoy stand-in, tokengate
  count [flags] FILE|-      print the input tokens, output allowance and reservation of a request body
  mock-llm --listen ADDR    serve the mock OpenAI/Anthropic upstream used by the demo stack
`

// run is the whole program behind main, testable in-process.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return usageError{"no command given"}
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "serve":
		return runServe(ctx, rest, stdout, stderr)
	case "validate":
		return runValidate(ctx, rest, stdout, stderr)
	case "demo":
		return runDemo(ctx, rest, stdout, stderr)
	case "count":
		return runCount(ctx, rest, stdin, stdout, stderr)
	case "mock-llm":
		return runMockLLM(ctx, rest, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		fmt.Fprint(stderr, usage)
		return usageError{fmt.Sprintf("unknown command %q", cmd)}
	}
}
