package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/tokenizer"
)

// countHelp documents `tokengate count`.
const countHelp = `
Prints what a request body reserves when serve admits it: its input tokens,
its output allowance (the request's largest output cap, else the
configured default, lowered to the policy's max_output_tokens) and their
sum, the reservation, with the encoding that counted it. It counts with the
configuration serve would run on (--config, else the embedded defaults) and
the policy a route names (--policy, else default_policy), so unknown models
and caps are treated as serve treats them. Learned output estimates (S7)
exist only in a running server; count shows a first request. FILE - reads
the body from stdin. The API is detected from --path or the body's shape
unless --api is given.`

// countResult is the --json output of `tokengate count`.
type countResult struct {
	Policy          string `json:"policy"`
	InputTokens     int    `json:"input_tokens"`
	OutputAllowance int    `json:"output_allowance"`
	Reservation     int    `json:"reservation"`
	Encoding        string `json:"encoding"`
}

// runCount implements `tokengate count`.
func runCount(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := newFlagSet("count")
	path := fs.String("config", "", "tokengate configuration `FILE` to count with (embedded defaults when empty)")
	policyName := fs.String("policy", "", "the `NAME` of the policy the route selects (default: the configuration's default_policy)")
	model := fs.String("model", "", "`MODEL` to count for, overriding the body's model")
	api := fs.String("api", "", "body shape (`API`): chat, completions, embeddings, responses, messages or gemini (default: detect)")
	reqPath := fs.String("path", "", "HTTP `PATH` of the request, e.g. /v1/chat/completions; names the model for Azure and Gemini")
	asJSON := fs.Bool("json", false, "print one JSON object: policy, input_tokens, output_allowance, reservation, encoding")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) != 1 {
		return usageError{fmt.Sprintf("count: want exactly one FILE or -, got %d arguments (see tokengate count --help)", len(rest))}
	}
	var apiName tokenizer.API
	if *api != "" {
		apiName = tokenizer.API(strings.ToLower(*api))
		switch apiName {
		case tokenizer.ChatCompletions, tokenizer.Completions, tokenizer.Embeddings,
			tokenizer.Responses, tokenizer.Messages, tokenizer.Gemini:
		default:
			return usageError{fmt.Sprintf("count: --api %q: want chat, completions, embeddings, responses, messages or gemini", *api)}
		}
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	// The policies and the counter are made exactly as serve makes them.
	pols, err := policies(cfg)
	if err != nil {
		return err
	}
	name := *policyName
	if name == "" {
		name = cfg.DefaultPolicy
	}
	i := slices.IndexFunc(pols, func(p extproc.Policy) bool { return p.Name == name })
	if i < 0 {
		return usageError{fmt.Sprintf("count: --policy %q: the configuration has no such policy", name)}
	}
	pol := &pols[i]
	counter, err := newCounter(cfg)
	if err != nil {
		return err
	}
	body, input, err := readCountInput(ctx, rest[0], stdin)
	if err != nil {
		return err
	}
	c, err := counter.Count(tokenizer.Request{API: apiName, Path: *reqPath, Model: *model, Policy: pol.Name, Body: body})
	if err != nil {
		return fmt.Errorf("count %s: %w", input, err)
	}
	allowance := pol.Allowance(c)
	if *asJSON {
		return json.NewEncoder(stdout).Encode(countResult{
			Policy:          pol.Name,
			InputTokens:     c.InputTokens,
			OutputAllowance: allowance,
			Reservation:     c.InputTokens + allowance,
			Encoding:        c.Encoding,
		})
	}
	exact := ""
	if !c.Exact {
		exact = " (estimate: this model family's tokenizer is not public)"
	}
	source := string(c.AllowanceSource)
	if allowance < c.OutputAllowance {
		source = fmt.Sprintf("policy max_output_tokens; the %s gave %d", c.AllowanceSource, c.OutputAllowance)
	}
	encoding := ""
	if c.Fallback {
		encoding = " (fallback: unknown model)"
	}
	_, err = fmt.Fprintf(stdout, "policy            %s\napi               %s\nmodel             %s\ninput_tokens      %d%s\noutput_allowance  %d (%s)\nreservation       %d\nencoding          %s%s\n",
		pol.Name, c.API, c.Model, c.InputTokens, exact, allowance, source, c.InputTokens+allowance, c.Encoding, encoding)
	return err
}

// maxCountInput bounds what count reads, so a mistaken argument (a device,
// a huge file) fails clearly instead of exhausting memory.
const maxCountInput = 64 << 20

// readCountInput reads the body from a file or, for "-", from stdin.
func readCountInput(ctx context.Context, arg string, stdin io.Reader) ([]byte, string, error) {
	if err := ctx.Err(); err != nil {
		return nil, "", err
	}
	r, name := stdin, "stdin"
	if arg != "-" {
		f, err := os.Open(arg)
		if err != nil {
			return nil, "", fmt.Errorf("count: %w", err)
		}
		defer f.Close()
		r, name = f, arg
	}
	body, err := io.ReadAll(io.LimitReader(r, maxCountInput+1))
	if err != nil {
		return nil, "", fmt.Errorf("count: read %s: %w", name, err)
	}
	if len(body) > maxCountInput {
		return nil, "", fmt.Errorf("count: %s is larger than %d MiB", name, maxCountInput>>20)
	}
	return body, name, nil
}
