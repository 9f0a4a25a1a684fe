package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/admin"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/internal/redistest"
)

// The tests in this file run the real binary through the exits a client
// causes (docs/budgets.md, "Every exit of a request"): hanging up, and a
// gateway that shuts down while a request is open. Each runs on the memory
// store and on Redis, with the official OpenAI SDK as the client.

// exitsConfig is the configuration of these tests (store is the store's
// YAML): per team a day's quota of tokens and one of money, and one
// concurrency slot, so that what an exit charged and left held is read
// exactly; every model costs $1 per million input tokens and $2 per
// million output tokens.
func exitsConfig(store string) string {
	return store + `
admin_api: {token_env: TG_TEST_ADMIN_TOKEN}
shutdown_grace: 100ms
pricing: {defaults: none, unknown_models: fallback, fallback: {input: "1.00", output: "2.00"}}
policies:
  - name: default
    identities: [{name: team, header: x-team}]
    buckets: [{name: team, per: team, tokens_per_minute: 60000000}]
    quotas:
      - {name: tokens, per: team, window: day, timezone: UTC, tokens: 1000000}
      - {name: spend, per: team, window: day, timezone: UTC, cost: "100"}
    concurrency: [{name: slot, per: team, max: 1}]
`
}

// exitStores are the stores these tests run on, by name: each one's YAML,
// with Redis started for the test.
var exitStores = []struct {
	name string
	yaml func(t *testing.T) string
}{
	{"memory", func(*testing.T) string { return "store: {type: memory}" }},
	{"redis", func(t *testing.T) string {
		return fmt.Sprintf("store: {type: redis, redis: {addrs: [%s]}}", redistest.Start(t).Addr)
	}},
}

// heldLLM reads each request and answers nothing until it is cancelled:
// a provider still at work when the client goes.
type heldLLM struct{ received chan struct{} }

func (h heldLLM) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		return
	}
	h.received <- struct{}{}
	<-r.Context().Done()
}

// wait waits until the provider has a request.
func (h heldLLM) wait(t *testing.T) {
	t.Helper()
	select {
	case <-h.received:
	case <-time.After(10 * time.Second):
		t.Fatal("the provider got no request within 10s")
	}
}

// heldFront puts the Envoy stand-in, in front of a held provider, before
// the served tokengate at grpcAddr, and returns the OpenAI client of team
// acme through it.
func heldFront(t *testing.T, grpcAddr string) (openai.Client, heldLLM) {
	t.Helper()
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := conn.Close(); err != nil {
			t.Error(err)
		}
	})
	llm := heldLLM{received: make(chan struct{}, 4)}
	up, err := url.Parse(httptestServer(t, llm))
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := standin.New(standin.Config{ExtProc: conn, Upstream: up, MessageTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	front := httptestServer(t, proxy.Handler())
	client := openai.NewClient(option.WithBaseURL(front+"/v1/"), option.WithAPIKey("sk-acme"),
		option.WithHeader("x-team", "acme"), option.WithMaxRetries(0))
	return client, llm
}

// exitParams is a chat request of the SDK with an output cap of 500.
func exitParams() openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model:     "gpt-4o-mini",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Write a long story about a lighthouse keeper.")},
		MaxTokens: openai.Int(500),
	}
}

// finished is a "request finished" log line.
type finished struct {
	Msg      string `json:"msg"`
	Outcome  string `json:"outcome"`
	Input    int    `json:"input_tokens"`
	Reserved int    `json:"reserved"`
	Settled  int    `json:"settled"`
}

// awaitFinished polls the served tokengate's log until the n-th request
// (from 1) finished with outcome, and returns its line.
func awaitFinished(t *testing.T, p *served, outcome string, n int) finished {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		seen := 0
		for _, line := range strings.Split(p.stderr.String(), "\n") {
			var f finished
			if json.Unmarshal([]byte(line), &f) == nil && f.Msg == "request finished" && f.Outcome == outcome {
				if seen++; seen == n {
					return f
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no request finished as %s within 10s:\n%s", outcome, lastLines(p.stderr.String(), 20))
		}
		time.Sleep(20 * time.Millisecond) // polling the log, with the deadline above
	}
}

// checkCharged reads acme's usage from the served tokengate at adminURL and
// checks that the day's quotas hold exactly tokens and money (in USD), and
// that acme's slot is free.
func checkCharged(t *testing.T, bin, adminURL string, tokens int, money float64) {
	t.Helper()
	out, err := cli(t, bin, "usage", "--url", adminURL, "--json", "team=acme")
	if err != nil {
		t.Fatalf("usage: %v\n%s", err, out)
	}
	var rep admin.UsageReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("usage --json: %v\n%s", err, out)
	}
	seen := 0
	value := func(p *float64) float64 {
		if p == nil {
			return math.NaN()
		}
		return *p
	}
	for _, r := range rep.Rules {
		switch r.Rule {
		case "tokens":
			seen++
			if got := value(r.Spent); got != float64(tokens) {
				t.Errorf("quota of tokens: %v spent, want %d", got, tokens)
			}
		case "spend":
			seen++
			if got := value(r.Spent); !(math.Abs(got-money) <= 1e-9) {
				t.Errorf("quota of money: %.6f USD spent, want %.6f", got, money)
			}
		case "slot":
			seen++
			if r.InUse == nil || *r.InUse != 0 {
				t.Errorf("concurrency: %v slots held, want none", r.InUse)
			}
		}
	}
	if seen != 3 {
		t.Errorf("usage shows %d of the quotas of tokens and money and the slot:\n%s", seen, out)
	}
}

// S8: a client that hangs up once its request was forwarded, before any
// answer, pays for what the provider has: a stream its prompt, a
// non-streamed request its whole reservation (the provider finishes the
// answer and bills it). The settlement lands although the client is gone,
// and the slot is free again.
func TestClientHangsUpAfterForwardingPaysThePrompt(t *testing.T) {
	bin := tokengateBinary(t)
	for _, store := range exitStores {
		t.Run(store.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "tokengate.yaml")
			writeFile(t, file, exitsConfig(store.yaml(t)))
			p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}, "--config", file)
			client, llm := heldFront(t, p.grpc)

			// A stream: the client leaves while the provider works on it.
			ctx, leave := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() {
				s := client.Chat.Completions.NewStreaming(ctx, exitParams())
				for s.Next() {
				}
				done <- s.Err()
			}()
			llm.wait(t)
			leave()
			if err := <-done; err == nil {
				t.Error("the stream ended without an error although its client left")
			}
			stream := awaitFinished(t, p, "no_response", 1)
			if stream.Settled != stream.Input || stream.Input == 0 {
				t.Errorf("stream: %+v, want its prompt settled", stream)
			}
			checkCharged(t, bin, p.admin, stream.Input, float64(stream.Input)*1e-6)

			// A non-streamed request: its reservation stands.
			ctx, leave = context.WithCancel(context.Background())
			go func() {
				_, err := client.Chat.Completions.New(ctx, exitParams())
				done <- err
			}()
			llm.wait(t)
			leave()
			if err := <-done; err == nil {
				t.Error("the request succeeded although its client left")
			}
			whole := awaitFinished(t, p, "no_response", 2)
			if whole.Reserved != whole.Input+500 || whole.Settled != whole.Reserved {
				t.Errorf("not streamed: %+v, want its reservation (prompt + 500) settled", whole)
			}
			checkCharged(t, bin, p.admin, stream.Settled+whole.Settled, float64(stream.Input+whole.Input)*1e-6+500*2e-6)
		})
	}
}

// S8: a gateway that shuts down while a request waits for its
// non-streamed answer settles it at its reservation, as a hang-up: the
// provider has the request and bills the answer it finishes. On Redis the
// charge is there once serve has returned.
func TestShutdownChargesInFlightNonStreamedTheReservation(t *testing.T) {
	bin := tokengateBinary(t)
	for _, store := range exitStores {
		t.Run(store.name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "tokengate.yaml")
			writeFile(t, file, exitsConfig(store.yaml(t)))
			env := []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}
			p := startServe(t, bin, env, "--config", file)
			client, llm := heldFront(t, p.grpc)
			done := make(chan error, 1)
			go func() {
				_, err := client.Chat.Completions.New(context.Background(), exitParams())
				done <- err
			}()
			llm.wait(t)
			p.stop(t)
			if err := <-done; err == nil {
				t.Error("the request succeeded although its gateway stopped")
			}
			f := awaitFinished(t, p, "shutdown", 1)
			if f.Reserved != f.Input+500 || f.Settled != f.Reserved {
				t.Errorf("%+v, want its reservation (prompt + 500) settled at shutdown", f)
			}
			if store.name == "redis" {
				again := startServe(t, bin, env, "--config", file)
				checkCharged(t, bin, again.admin, f.Settled, float64(f.Input)*1e-6+500*2e-6)
			}
		})
	}
}

// Every row of docs/budgets.md's table of exits names the tests that prove
// its rule, and every test it names exists, so the table cannot outlive
// them.
func TestExitsTableNamesExistingTests(t *testing.T) {
	section := readMarkdown(t, filepath.Join(repoRoot, "docs", "budgets.md")).sections["Every exit of a request"]
	tests := repoTests(t)
	rows := 0
	for line := range strings.Lines(section) {
		if !strings.HasPrefix(line, "| ") || strings.HasPrefix(line, "| exit ") || strings.HasPrefix(line, "| ---") {
			continue
		}
		rows++
		cells := strings.Split(strings.TrimSpace(line), " | ")
		names := testNameRE.FindAllStringSubmatch(cells[len(cells)-1], -1)
		if len(names) == 0 {
			t.Errorf("row names no test: %s", line)
		}
		for _, n := range names {
			if !tests[n[1]] {
				t.Errorf("row names %s, which no test file defines: %s", n[1], line)
			}
		}
	}
	if rows < 20 {
		t.Errorf("the table of exits has %d rows, want every exit", rows)
	}
}

var (
	testNameRE = regexp.MustCompile("`(Test[A-Za-z0-9_]+)`")
	testFuncRE = regexp.MustCompile(`(?m)^func (Test[A-Za-z0-9_]+)\(t \*testing\.T\)`)
)

// repoTests is the set of test functions the repository's _test.go files
// define.
func repoTests(t *testing.T) map[string]bool {
	t.Helper()
	tests := map[string]bool{}
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata"):
			return filepath.SkipDir
		case d.IsDir() || !strings.HasSuffix(path, "_test.go"):
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range testFuncRE.FindAllStringSubmatch(string(b), -1) {
			tests[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return tests
}
