package main

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/openai/openai-go/packages/ssestream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/tokenizer"
)

//go:embed demo.yaml
var demoYAML []byte

// demoClock is real time plus an offset the tour can advance, so refill can
// be shown without waiting for it.
type demoClock struct{ offset atomic.Int64 }

func (c *demoClock) Now() time.Time          { return time.Now().Add(time.Duration(c.offset.Load())) }
func (c *demoClock) Advance(d time.Duration) { c.offset.Add(int64(d)) }

// demoEnv is the whole stack in one process: the mock LLM, tokengate on the
// memory store, and the Envoy stand-in in front.
type demoEnv struct {
	base     string // the stand-in's URL
	admin    string // the admin listener's URL, when there is one
	token    string // the admin token, made at start, when there is an admin listener
	mock     *mockllm.Server
	proxy    *standin.Proxy
	clock    *demoClock
	outcomes chan extproc.Outcome
	closers  []func()
}

func (e *demoEnv) close() {
	for i := len(e.closers) - 1; i >= 0; i-- {
		e.closers[i]()
	}
}

type demoOptions struct {
	listen     string // the stand-in's address
	admin      string // the admin listener's address; empty runs none
	tokenDelay time.Duration
	logger     *slog.Logger
}

// startDemo runs tokengate with serve's own wiring (build) on the demo's
// configuration, behind the Envoy stand-in and in front of the mock LLM.
func startDemo(ctx context.Context, opts demoOptions) (*demoEnv, error) {
	cfg, err := config.Parse("demo.yaml", demoYAML)
	if err != nil {
		return nil, err
	}
	env := &demoEnv{clock: &demoClock{}, outcomes: make(chan extproc.Outcome, 64)}
	if opts.admin != "" {
		// A token of this run only, printed for a person to sign in to
		// the budget page with.
		var b [16]byte
		_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
		env.token = hex.EncodeToString(b[:])
	}
	ok := false
	defer func() {
		if !ok {
			env.close()
		}
	}()

	parts, err := build(ctx, cfg, opts.logger, buildOptions{
		now:        env.clock.Now,
		adminToken: env.token,
		onFinish: func(o extproc.Outcome) {
			select {
			case env.outcomes <- o:
			default:
			}
		},
	})
	if err != nil {
		return nil, err
	}
	env.closers = append(env.closers, parts.close)
	counter := parts.counter

	// The mock LLM. The demo's second route, /capped, reaches the same mock.
	env.mock = mockllm.New(mockllm.Config{
		Model:         "gpt-4o-mini",
		DefaultTokens: 600,
		TokenDelay:    opts.tokenDelay,
		PromptTokens: func(body []byte) int {
			c, err := counter.Count(tokenizer.Request{Path: "/v1/chat/completions", Body: body})
			if err != nil {
				return mockllm.EstimatePrompt(body)
			}
			return c.InputTokens
		},
	})
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.URL.Path = strings.TrimPrefix(r.URL.Path, "/capped")
		env.mock.ServeHTTP(w, r)
	})
	upLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	upSrv := &http.Server{Handler: upstream, ReadHeaderTimeout: 5 * time.Second}
	go upSrv.Serve(upLis)
	env.closers = append(env.closers, func() { upSrv.Close() })

	gLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	gs := grpc.NewServer(parts.server.ServerOptions()...)
	parts.server.Register(gs)
	go gs.Serve(gLis)
	env.closers = append(env.closers, gs.Stop)
	// As serve does: settle what is still open and write every queued
	// settlement before the gRPC server stops.
	env.closers = append(env.closers, func() {
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := parts.server.Shutdown(sctx); err != nil {
			opts.logger.Warn("shutdown: streams still open at the deadline were settled", "err", err)
		}
	})
	if opts.admin != "" {
		aLis, err := net.Listen("tcp", opts.admin)
		if err != nil {
			return nil, fmt.Errorf("--admin: %w", err)
		}
		as := &http.Server{Handler: parts.admin.Handler(), ReadHeaderTimeout: 5 * time.Second}
		go as.Serve(aLis)
		env.closers = append(env.closers, func() { as.Close() })
		env.admin = "http://" + aLis.Addr().String()
	}
	conn, err := grpc.NewClient(gLis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	env.closers = append(env.closers, func() { conn.Close() })

	// The Envoy stand-in: two routes, each naming its policy the way
	// ExtProcPerRoute.overrides.grpc_initial_metadata does in Envoy.
	u := &url.URL{Scheme: "http", Host: upLis.Addr().String()}
	env.proxy, err = standin.New(standin.Config{
		ExtProc:             conn,
		Upstream:            u,
		MessageTimeout:      10 * time.Second,
		ReceivingNamespaces: []string{cfg.Namespace},
		Routes: []standin.Route{
			{Prefix: "/capped/", InitialMetadata: map[string]string{cfg.PolicyMetadataKey: "capped"}},
			{Prefix: "/", InitialMetadata: map[string]string{cfg.PolicyMetadataKey: "demo"}},
		},
	})
	if err != nil {
		return nil, err
	}
	env.closers = append(env.closers, env.proxy.Close)
	pLis, err := net.Listen("tcp", opts.listen)
	if err != nil {
		return nil, fmt.Errorf("--listen: %w", err)
	}
	ps := env.proxy.Server()
	go ps.Serve(pLis)
	env.closers = append(env.closers, func() { ps.Close() })
	env.base = "http://" + pLis.Addr().String()
	ok = true
	return env, nil
}

// lastUpstream waits until the mock LLM has finished its n-th request and
// returns that request's record.
func (e *demoEnv) lastUpstream(ctx context.Context, n int) (mockllm.Record, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	recs, err := e.mock.WaitRequests(ctx, n)
	if err != nil {
		return mockllm.Record{}, fmt.Errorf("the mock LLM did not finish request %d: %w", n, err)
	}
	return recs[n-1], nil
}

// outcome waits for the next request's outcome and requires its decision:
// every request the tour makes is read in turn, so the next step's outcome
// is its own.
func (e *demoEnv) outcome(ctx context.Context, decision string) (extproc.Outcome, error) {
	o, err := e.nextOutcome(ctx)
	if err == nil && o.Decision != decision {
		err = fmt.Errorf("the request's outcome is %q, want %q", o.Decision, decision)
	}
	return o, err
}

// nextOutcome waits for the next settled request.
func (e *demoEnv) nextOutcome(ctx context.Context) (extproc.Outcome, error) {
	select {
	case o := <-e.outcomes:
		return o, nil
	case <-time.After(10 * time.Second):
		return extproc.Outcome{}, errors.New("no settlement reported within 10s")
	case <-ctx.Done():
		return extproc.Outcome{}, ctx.Err()
	}
}

// demoHelp documents `tokengate demo`.
const demoHelp = `
Runs the mock LLM, the Envoy stand-in and tokengate (memory store, the
demo's small buckets) in one process, and walks through admission, a 429
with Retry-After, a 413, a stream cut with finish_reason "length", and debt,
with the OpenAI Go SDK as the client. It exits 0 when every step behaved.

With --serve the stack stays up on --listen (default 127.0.0.1:8080) for
curl or an SDK, logs JSON lines to stderr, and serves /metrics, /healthz,
/readyz, the admin API and the budget page (/budget) on --admin, like
serve. It prints an admin token made for this run, to sign in to the page
with and to give the limits and usage commands (TOKENGATE_ADMIN_TOKEN).`

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo")
	serveMode := fs.Bool("serve", false, "keep the stack listening and print curl and SDK lines to try")
	listen := fs.String("listen", "", "`ADDR`ess of the Envoy stand-in (default 127.0.0.1:8080 with --serve, a free port without)")
	admin := fs.String("admin", "127.0.0.1:9090", "`ADDR`ess of /metrics, /healthz, /readyz, the admin API and the budget page with --serve")
	delay := fs.Duration("token-delay", 4*time.Millisecond, "the mock LLM's `DELAY` per output token")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Sprintf("demo: takes no arguments, got %q", rest)}
	}
	opts := demoOptions{listen: *listen, tokenDelay: *delay, logger: slog.New(slog.DiscardHandler)}
	if *serveMode {
		if opts.listen == "" {
			opts.listen = "127.0.0.1:8080"
		}
		opts.admin = *admin
		opts.logger = slog.New(slog.NewJSONHandler(stderr, nil))
	} else if opts.listen == "" {
		opts.listen = "127.0.0.1:0"
	}
	env, err := startDemo(ctx, opts)
	if err != nil {
		return err
	}
	defer env.close()
	if *serveMode {
		opts.logger.Info("tokengate demo stack listening", "envoy_standin", env.base, "admin", env.admin)
		printServeHelp(stdout, env.base, env.admin, env.token)
		<-ctx.Done()
		return nil
	}
	return tour(ctx, env, stdout)
}

func printServeHelp(w io.Writer, base, admin, token string) {
	fmt.Fprintf(w, `tokengate demo stack listening on %[1]s (Envoy stand-in → tokengate → mock LLM)
metrics on %[2]s/metrics
budget page on %[2]s/budget (sign in with the admin token %[3]s)
policies: "demo" on %[1]s/v1/… (1000-token burst, 600 tokens/min per x-user-id; 5000 tokens a day)
          "capped" on %[1]s/capped/v1/… (a stream is cut at 80 output tokens; an answer that is not
          streamed is not: it arrives whole and is charged whole, as clamp_output: true would prevent)

try:
  curl -s %[1]s/v1/chat/completions -H 'x-user-id: me' -H 'content-type: application/json' \
    -d '{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}' -i
  curl -sN %[1]s/capped/v1/chat/completions -H 'x-user-id: me' -H 'content-type: application/json' \
    -d '{"model":"gpt-4o-mini","max_tokens":300,"stream":true,"messages":[{"role":"user","content":"hi"}]}'

with the OpenAI Python SDK:
  OpenAI(base_url="%[1]s/v1", api_key="demo", default_headers={"x-user-id": "me"})

what each user has spent today:
  TOKENGATE_ADMIN_TOKEN=%[3]s tokengate usage --url %[2]s --policy demo user=me

Ctrl-C stops it.
`, base, admin, token)
}

// tour runs the scripted walk through admission, refusal, cut-off and debt.
func tour(ctx context.Context, env *demoEnv, w io.Writer) error {
	client := func(user string, opts ...option.RequestOption) *openai.Client {
		c := openai.NewClient(append([]option.RequestOption{
			option.WithBaseURL(env.base + "/v1/"),
			option.WithAPIKey("demo-key"),
			option.WithHeader("x-user-id", user),
			option.WithMaxRetries(0),
		}, opts...)...)
		return &c
	}
	ask := func(text string, maxTokens int64) openai.ChatCompletionNewParams {
		p := openai.ChatCompletionNewParams{
			Model:    "gpt-4o-mini",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(text)},
		}
		if maxTokens > 0 {
			p.MaxTokens = openai.Int(maxTokens)
		}
		return p
	}
	step := func(n int, title string) { fmt.Fprintf(w, "\n%d. %s\n", n, title) }
	say := func(format string, args ...any) { fmt.Fprintf(w, "   "+format+"\n", args...) }

	fmt.Fprintln(w, "tokengate demo: Envoy stand-in → tokengate (memory store) → mock LLM, all in this process.")
	fmt.Fprintln(w, "Policy \"demo\": per user (x-user-id) a bucket of 1000 tokens refilling 600 tokens/min (10/s).")

	// 1. Admission, reservation, settlement.
	step(1, "alice asks a question with max_tokens 50: reserved up front, settled with the real usage")
	var resp *http.Response
	c, err := client("alice").Chat.Completions.New(ctx, ask("What is a token bucket?", 50), option.WithResponseInto(&resp))
	if err != nil {
		return fmt.Errorf("step 1: %w", err)
	}
	o, err := env.outcome(ctx, "admitted")
	if err != nil {
		return err
	}
	say("admitted: reserved %d tokens (prompt %d + output allowance %d)", o.Reserved, o.InputTokens, o.Reserved-o.InputTokens)
	say("answer: %d output tokens, finish_reason %q; provider usage %d prompt + %d completion", countWords(c.Choices[0].Message.Content), c.Choices[0].FinishReason, c.Usage.PromptTokens, c.Usage.CompletionTokens)
	say("settled: %d tokens charged (%s); headers X-RateLimit-Remaining-Tokens: %s, X-RateLimit-Reset-Tokens: %s",
		o.Settled, o.SettleOutcome, resp.Header.Get("X-RateLimit-Remaining-Tokens"), resp.Header.Get("X-RateLimit-Reset-Tokens"))

	// 2. A stream, counted live, with usage injected upstream and hidden.
	step(2, "alice streams an answer (max_tokens 120): output is counted live as it passes")
	upstreamSeen := len(env.mock.Requests())
	n, finish, sawUsage, err := streamWithProgress(w, client("alice").Chat.Completions.NewStreaming(ctx, ask("Tell me a story.", 120)))
	if err != nil {
		return fmt.Errorf("step 2: %w", err)
	}
	o, err = env.outcome(ctx, "admitted")
	if err != nil {
		return err
	}
	last, err := env.lastUpstream(ctx, upstreamSeen+1)
	if err != nil {
		return err
	}
	say("%d chunks with content, finish_reason %q", n, finish)
	say("tokengate asked the upstream for usage (include_usage=%v) and the client, which did not ask, saw a usage chunk: %v", last.IncludeUsage, sawUsage)
	say("settled %d tokens from the provider's usage (reserved %d, counted live %d output)", o.Settled, o.Reserved, o.Output)

	// 3. A burst until refusal.
	step(3, "bob sends requests of ~320 tokens each until his 1000-token bucket refuses")
	for i := 1; i <= 5; i++ {
		var r *http.Response
		_, err := client("bob").Chat.Completions.New(ctx, ask("Summarise the news.", 300), option.WithResponseInto(&r))
		var apiErr *openai.Error
		if errors.As(err, &apiErr) {
			h := apiErr.Response.Header
			say("request %d: HTTP %d — the SDK would retry this by itself after Retry-After", i, apiErr.StatusCode)
			say("  Retry-After: %s   X-RateLimit-Limit-Tokens: %s   X-RateLimit-Remaining-Tokens: %s   X-RateLimit-Reset-Tokens: %s",
				h.Get("Retry-After"), h.Get("X-RateLimit-Limit-Tokens"), h.Get("X-RateLimit-Remaining-Tokens"), h.Get("X-RateLimit-Reset-Tokens"))
			say("  body: %s", strings.TrimSpace(apiErr.RawJSON()))
			if apiErr.StatusCode != http.StatusTooManyRequests || h.Get("Retry-After") == "" {
				return fmt.Errorf("step 3: expected a 429 with Retry-After, got %d", apiErr.StatusCode)
			}
			if _, err := env.outcome(ctx, "refused_tokens"); err != nil {
				return fmt.Errorf("step 3: %w", err)
			}
			break
		}
		if err != nil {
			return fmt.Errorf("step 3: %w", err)
		}
		o, err := env.outcome(ctx, "admitted")
		if err != nil {
			return err
		}
		say("request %d: admitted, reserved %d, settled %d, remaining %s", i, o.Reserved, o.Settled, r.Header.Get("X-RateLimit-Remaining-Tokens"))
		if i == 5 {
			return errors.New("step 3: bob was never refused")
		}
	}

	// 4. A request that can never fit.
	step(4, "erin pastes a document larger than her whole bucket: 413, and no SDK retries it")
	before := len(env.proxy.Log())
	doc := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 150)
	_, err = client("erin", option.WithMaxRetries(2)).Chat.Completions.New(ctx, ask(doc, 50))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusRequestEntityTooLarge {
		return fmt.Errorf("step 4: expected 413, got %v", err)
	}
	// The stand-in logs a request once its answer is written, just after
	// the SDK has it.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	logged, err := env.proxy.WaitLog(wctx, before+1)
	cancel()
	if err != nil {
		return fmt.Errorf("step 4: the stand-in logged no request: %w", err)
	}
	sent := len(logged) - before
	say("HTTP %d, no Retry-After (%q); requests sent by an SDK allowed 2 retries: %d", apiErr.StatusCode, apiErr.Response.Header.Get("Retry-After"), sent)
	say("body: %s", strings.TrimSpace(apiErr.RawJSON()))
	if _, err := env.outcome(ctx, "never_admissible"); err != nil {
		return fmt.Errorf("step 4: %w", err)
	}

	// 5. Cut-off at a hard budget.
	step(5, "dave streams on the \"capped\" route (a stream is cut at 80 output tokens) but asks for 300")
	capped := client("dave", option.WithBaseURL(env.base+"/capped/v1/"))
	upstreamSeen = len(env.mock.Requests())
	n, finish, _, err = streamWithProgress(w, capped.Chat.Completions.NewStreaming(ctx, ask("Write a long poem.", 300)))
	if err != nil {
		return fmt.Errorf("step 5: the SDK saw an unclean end: %w", err)
	}
	o, err = env.outcome(ctx, "admitted")
	if err != nil {
		return err
	}
	if last, err = env.lastUpstream(ctx, upstreamSeen+1); err != nil {
		return err
	}
	say("the stream ended cleanly for the SDK after %d content chunks with finish_reason %q", n, finish)
	say("the upstream was cancelled: %v (it had sent %d of %d planned tokens)", last.Cancelled, last.TokensSent, last.TokensPlanned)
	say("settled %d tokens for what was delivered (%s)", o.Settled, o.SettleOutcome)
	if finish != "length" {
		return fmt.Errorf("step 5: finish_reason %q, want length", finish)
	}

	// 6. Debt after an under-estimate, and recovery by refill.
	step(6, "carol asks without max_tokens: tokengate reserves an estimate, the answer is longer")
	if _, err := client("carol").Chat.Completions.New(ctx, ask("Draft an essay outline.", 400)); err != nil {
		return fmt.Errorf("step 6: %w", err)
	}
	o, err = env.outcome(ctx, "admitted")
	if err != nil {
		return err
	}
	say("first, a 400-token answer: settled %d", o.Settled)
	if _, err := client("carol").Chat.Completions.New(ctx, ask("Now write the whole essay.", 0)); err != nil {
		return fmt.Errorf("step 6: %w", err)
	}
	o, err = env.outcome(ctx, "admitted")
	if err != nil {
		return err
	}
	say("then no cap: reserved %d (prompt %d + estimated output %d); the model wrote %d tokens", o.Reserved, o.InputTokens, o.Reserved-o.InputTokens, o.Settled-o.InputTokens)
	say("settled %d: the %d tokens beyond the reservation are debited even below zero (S9)", o.Settled, o.Settled-o.Reserved)
	_, err = client("carol").Chat.Completions.New(ctx, ask("One more thing?", 50))
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusTooManyRequests {
		return fmt.Errorf("step 6: expected a 429 while in debt, got %v", err)
	}
	wait := apiErr.Response.Header.Get("Retry-After")
	say("while the bucket is negative carol is refused: HTTP 429, Retry-After %ss (counted from the negative level)", wait)
	d, _ := time.ParseDuration(wait + "s")
	env.clock.Advance(d)
	say("⏩ fast-forwarding the store's clock by %s (refill is lazy: nothing runs in between)", d)
	if _, err := client("carol").Chat.Completions.New(ctx, ask("One more thing?", 50), option.WithResponseInto(&resp)); err != nil {
		return fmt.Errorf("step 6: after refill: %w", err)
	}
	say("admitted again; X-RateLimit-Remaining-Tokens %s", resp.Header.Get("X-RateLimit-Remaining-Tokens"))

	fmt.Fprintln(w, "\nDone. Run `tokengate demo --serve` to try it with curl or an SDK.")
	return nil
}

// streamWithProgress reads a chat stream as the SDK delivers it, printing a
// mark every ten content chunks.
func streamWithProgress(w io.Writer, stream *ssestream.Stream[openai.ChatCompletionChunk]) (chunks int, finish string, sawUsage bool, err error) {
	fmt.Fprint(w, "   streaming ")
	defer fmt.Fprintln(w)
	for stream.Next() {
		ch := stream.Current()
		if ch.Usage.TotalTokens > 0 {
			sawUsage = true
		}
		for _, choice := range ch.Choices {
			if choice.Delta.Content != "" {
				chunks++
				if chunks%10 == 0 {
					fmt.Fprint(w, "▮")
				}
			}
			if choice.FinishReason != "" {
				finish = choice.FinishReason
			}
		}
	}
	return chunks, finish, sawUsage, stream.Err()
}

func countWords(s string) int { return len(strings.Fields(s)) }
