package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/tokengate/tokengate/tokenizer"
)

// countUsage documents `tokengate count`.
const countUsage = `usage: tokengate count [flags] FILE|-

Prints what a request body will cost before it is forwarded: its input
tokens, output allowance, reservation (input + allowance) and encoding.
The API is detected from --path or the body's shape unless --api is given.

flags:
`

// countResult is the --json output of `tokengate count`.
type countResult struct {
	InputTokens     int    `json:"input_tokens"`
	OutputAllowance int    `json:"output_allowance"`
	Reservation     int    `json:"reservation"`
	Encoding        string `json:"encoding"`
}

// runCount implements `tokengate count [--model M] [--api API] [--path P]
// [--fallback-encoding E] [--default-output N] [--json] FILE|-`.
func runCount(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("count", flag.ContinueOnError)
	fs.SetOutput(stderr)
	model := fs.String("model", "", "model to count for, overriding the body's `model`")
	api := fs.String("api", "", "body shape: chat, completions, embeddings, responses, messages or gemini (default: detect)")
	path := fs.String("path", "", "HTTP path of the request, e.g. /v1/chat/completions; names the model for Azure and Gemini")
	fallback := fs.String("fallback-encoding", "", "encoding for unknown models (o200k_base or cl100k_base); default: refuse them")
	defaultOut := fs.Int("default-output", 0, "output allowance of a request without a cap (default 4096)")
	asJSON := fs.Bool("json", false, "print one JSON object: input_tokens, output_allowance, reservation, encoding")
	fs.Usage = func() {
		fmt.Fprint(stderr, countUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return usageError{fmt.Sprintf("count: %v", err)}
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return usageError{fmt.Sprintf("count: want exactly one FILE or -, got %d arguments", fs.NArg())}
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
	body, name, err := readCountInput(ctx, fs.Arg(0), stdin)
	if err != nil {
		return err
	}
	counter, err := tokenizer.New(tokenizer.Options{
		FallbackEncoding:    *fallback,
		DefaultOutputTokens: *defaultOut,
	})
	if err != nil {
		return fmt.Errorf("count: %w", err)
	}
	c, err := counter.Count(tokenizer.Request{API: apiName, Path: *path, Model: *model, Body: body})
	if err != nil {
		return fmt.Errorf("count %s: %w", name, err)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		return enc.Encode(countResult{
			InputTokens:     c.InputTokens,
			OutputAllowance: c.OutputAllowance,
			Reservation:     c.Reservation(),
			Encoding:        c.Encoding,
		})
	}
	input := ""
	if !c.Exact {
		input = " (estimate: this model family's tokenizer is not public)"
	}
	encoding := ""
	if c.Fallback {
		encoding = " (fallback: unknown model)"
	}
	_, err = fmt.Fprintf(stdout, "api               %s\nmodel             %s\ninput_tokens      %d%s\noutput_allowance  %d (%s)\nreservation       %d\nencoding          %s%s\n",
		c.API, c.Model, c.InputTokens, input, c.OutputAllowance, c.AllowanceSource, c.Reservation(), c.Encoding, encoding)
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
