package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/tokenizer"
)

// mockLLMHelp documents `tokengate mock-llm`.
const mockLLMHelp = `
Serves a mock of the OpenAI chat completions and Anthropic messages APIs,
streamed or not, with usage, for the docker-compose stack: POST
/v1/chat/completions and /v1/messages; GET /healthz answers ok. Prompt
usage is counted with tokengate's own tokenizer, so what it reports matches
what tokengate counted.`

// runMockLLM serves the mock OpenAI/Anthropic upstream of the compose stack
// until ctx ends. Prompt usage is counted with tokengate's own tokenizer, so
// settled and counted tokens agree.
func runMockLLM(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("mock-llm")
	addr := fs.String("listen", "127.0.0.1:9000", "listen `ADDR`ess")
	tokens := fs.Int("tokens", 200, "output tokens (`N`) when a request sets no max_tokens")
	delay := fs.Duration("token-delay", 20*time.Millisecond, "delay before each streamed token (`DURATION`)")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Sprintf("mock-llm: takes no arguments, got %q", rest)}
	}
	if *tokens < 1 || *delay < 0 {
		return usageError{"mock-llm: --tokens must be at least 1 and --token-delay not negative"}
	}
	counter, err := tokenizer.New(tokenizer.Options{FallbackEncoding: "o200k_base"})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	mux.Handle("/", mockllm.New(mockllm.Config{
		DefaultTokens: *tokens,
		TokenDelay:    *delay,
		PromptTokens: func(body []byte) int {
			c, err := counter.Count(tokenizer.Request{Body: body})
			if err != nil {
				return mockllm.EstimatePrompt(body)
			}
			return c.InputTokens
		},
	}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintf(stdout, "mock LLM listening on %s (POST /v1/chat/completions, /v1/messages; GET /healthz)\n", ln.Addr())
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
