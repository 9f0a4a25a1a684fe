package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/tokenizer"
)

// runMockLLM serves the mock OpenAI/Anthropic upstream of the compose stack
// until ctx ends. Prompt usage is counted with tokengate's own tokenizer, so
// settled and counted tokens agree.
func runMockLLM(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("mock-llm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("listen", "127.0.0.1:9000", "listen address")
	tokens := fs.Int("tokens", 200, "output tokens when a request sets no max_tokens")
	delay := fs.Duration("token-delay", 20*time.Millisecond, "delay before each streamed token")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("mock-llm takes no arguments, got %q", fs.Args())}
	}
	if *tokens < 1 || *delay < 0 {
		return usageError{"--tokens must be at least 1 and --token-delay not negative"}
	}
	counter, err := tokenizer.New(tokenizer.Options{FallbackEncoding: "o200k_base"})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{
		Handler: mockllm.New(mockllm.Config{
			DefaultTokens: *tokens,
			TokenDelay:    *delay,
			PromptTokens: func(body []byte) int {
				c, err := counter.Count(tokenizer.Request{Body: body})
				if err != nil {
					return mockllm.EstimatePrompt(body)
				}
				return c.InputTokens
			},
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	fmt.Fprintf(stdout, "mock LLM listening on %s (POST /v1/chat/completions, /v1/messages)\n", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}
