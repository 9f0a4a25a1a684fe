package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// The monitoring example: a Prometheus configuration and the Grafana
// dashboard that reads what it scrapes.
const (
	dashboardFile      = "examples/monitoring/tokengate-dashboard.json"
	prometheusFile     = "examples/monitoring/prometheus.yaml"
	dashboardRateRange = "30s" // what $__rate_interval stands for in the test
)

// dashboardConfig is the tokengate the dashboard test watches: a Redis
// fleet failing open with a leased bucket, per-user buckets and quotas of
// tokens and money, a per-request output cap that cuts streams, and a quota
// small enough to refuse. Every panel's metric has something to show.
func dashboardConfig(redisAddr string) string {
	return `
store:
  type: redis
  redis: {addrs: ["` + redisAddr + `"], timeout: 250ms, dial_timeout: 250ms}
  on_failure: open
  fallback: {tokens_per_minute: 600000, burst: 600000}
  fleet: {heartbeat: 200ms}
pricing: {defaults: none, unknown_models: fallback, fallback: {input: "1.00", output: "2.00"}}
tokenizer: {fallback_encoding: o200k_base}
default_policy: chat
policies:
  - name: chat
    identities: [{name: user, header: x-user}]
    buckets:
      - {name: user, per: user, tokens_per_minute: 600, burst: 1500}
      - {name: global, tokens_per_minute: 6000000, burst: 6000000, lease: {size: 100000}}
    quotas:
      - {name: user-daily, per: user, window: day, timezone: UTC, tokens: 1000000}
      - {name: user-monthly, per: user, window: month, timezone: UTC, cost: "100"}
    max_output_tokens: 30
  - name: plain
    identities: [{name: user, header: x-user}]
    buckets:
      - {name: user, per: user, tokens_per_minute: 600, burst: 1500}
  - name: metered
    identities: [{name: user, header: x-user}]
    buckets:
      - {name: global, tokens_per_minute: 6000000}
    quotas:
      - {name: tiny, per: user, window: day, timezone: UTC, tokens: 200}
`
}

// prometheusBinary is Debian's prometheus. Without it the test is skipped,
// except in CI, where .ci/run installs it and its absence is a failure.
func prometheusBinary(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("prometheus is not installed (apt-get install prometheus; .ci/run and make test install it)")
		}
		t.Skip("prometheus is not installed: apt-get install prometheus, or run make test")
	}
	return bin
}

// freeAddr is a loopback address with a port free a moment ago, for a
// program that cannot report the port it bound.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// startPrometheus runs prometheus on the shipped configuration, scraping
// target every 500ms instead of the shipped interval and targets, and
// returns its URL once it is ready.
func startPrometheus(t *testing.T, target string) string {
	t.Helper()
	bin := prometheusBinary(t)
	data, err := os.ReadFile(filepath.Join(repoRoot, prometheusFile))
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["global"].(map[string]any)["scrape_interval"] = "500ms"
	jobs := cfg["scrape_configs"].([]any)
	if len(jobs) != 1 {
		t.Fatalf("%s has %d scrape jobs, want the one for tokengate", prometheusFile, len(jobs))
	}
	jobs[0].(map[string]any)["static_configs"] = []any{map[string]any{"targets": []any{target}}}
	out, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "prometheus.yaml")
	if err := os.WriteFile(file, out, 0o644); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	var logs syncBuffer
	cmd := exec.Command(bin, "--config.file="+file, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		if err := cmd.Process.Kill(); err != nil {
			t.Errorf("kill prometheus: %v", err)
		}
		<-done
	})
	base := "http://" + addr
	deadline := time.Now().Add(30 * time.Second)
	for getOK(base+"/-/ready") != nil {
		select {
		case err := <-done:
			t.Fatalf("prometheus exited: %v\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond): // polling its readiness, with the deadline below
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready within 30s:\n%s", logs.String())
		}
	}
	return base
}

// promSeries is one series of an instant query's answer.
type promSeries struct {
	Metric map[string]string
	Value  float64
}

// promQuery runs expr through Prometheus's HTTP query API.
func promQuery(base, expr string) ([]promSeries, error) {
	resp, err := http.Get(base + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var answer struct {
		Status string
		Error  string
		Data   struct {
			ResultType string
			Result     []struct {
				Metric map[string]string
				Value  [2]any
			}
		}
	}
	if err := json.Unmarshal(body, &answer); err != nil {
		return nil, fmt.Errorf("%s: %w", body, err)
	}
	if answer.Status != "success" || answer.Data.ResultType != "vector" {
		return nil, fmt.Errorf("status %q, result type %q: %s", answer.Status, answer.Data.ResultType, answer.Error)
	}
	var out []promSeries
	for _, r := range answer.Data.Result {
		s, _ := r.Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return nil, fmt.Errorf("value %v: %w", r.Value, err)
		}
		out = append(out, promSeries{r.Metric, v})
	}
	return out, nil
}

// dashboardQuery is one query of one panel, with the labels the panel
// shows: those it aggregates by and those its legend names.
type dashboardQuery struct {
	panel, expr string
	labels      []string
}

var (
	byClause     = regexp.MustCompile(`\bby \(([^)]*)\)`)
	legendLabels = regexp.MustCompile(`\{\{\s*([a-z_]+)\s*\}\}`)
)

// dashboardQueries reads every query of the shipped dashboard.
func dashboardQueries(t *testing.T) []dashboardQuery {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Type, Title string
			Datasource  struct{ Type, UID string }
			Targets     []struct {
				Expr, LegendFormat string
				Datasource         struct{ Type, UID string }
			}
		}
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatal(err)
	}
	var out []dashboardQuery
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource.Type != "prometheus" || tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: data source %+v, want the dashboard's Prometheus variable", p.Title, tg.Datasource)
			}
			q := dashboardQuery{panel: p.Title, expr: strings.ReplaceAll(tg.Expr, "$__rate_interval", dashboardRateRange)}
			if strings.Contains(q.expr, "$") {
				t.Errorf("panel %q: a variable the test does not know in %s", p.Title, tg.Expr)
			}
			var labels []string
			for _, m := range byClause.FindAllStringSubmatch(tg.Expr, -1) {
				for _, l := range strings.Split(m[1], ",") {
					labels = append(labels, strings.TrimSpace(l))
				}
			}
			for _, m := range legendLabels.FindAllStringSubmatch(tg.LegendFormat, -1) {
				labels = append(labels, m[1])
			}
			slices.Sort(labels)
			q.labels = slices.DeleteFunc(slices.Compact(labels), func(l string) bool { return l == "le" })
			out = append(out, q)
		}
	}
	return out
}

// check reports what is wrong with a panel's answer: no series, a series
// without a label the panel shows, or no finite value.
func (q dashboardQuery) check(series []promSeries) error {
	if len(series) == 0 {
		return fmt.Errorf("no series")
	}
	finite := false
	for _, s := range series {
		for _, l := range q.labels {
			if s.Metric[l] == "" {
				return fmt.Errorf("series %v lacks label %s", s.Metric, l)
			}
		}
		finite = finite || !math.IsNaN(s.Value) && !math.IsInf(s.Value, 0)
	}
	if !finite {
		return fmt.Errorf("no finite value in %v", series)
	}
	return nil
}

// dashboardRequest sends one chat completion as user on the route of
// policy and returns the status.
func dashboardRequest(t *testing.T, front, policy, user, body string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, front+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	req.Header.Set("x-test-policy", policy)
	req.Header.Set("x-user", user)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode
}

// dashboardLoad is one round of traffic: answers, a stream cut at the
// output cap, a prompt above a bucket's capacity, a user run out of tokens
// and one out of quota. It returns the requests sent.
func dashboardLoad(t *testing.T, front, round string) int {
	t.Helper()
	const (
		small  = `{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"What is a token bucket?"}]}`
		stream = `{"model":"gpt-4o-mini","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"Write a poem."}]}`
		large  = `{"model":"gpt-4o-mini","max_tokens":600,"messages":[{"role":"user","content":"Write an essay."}]}`
		quota  = `{"model":"gpt-4o-mini","max_tokens":150,"messages":[{"role":"user","content":"hi"}]}`
	)
	sent := 0
	want := func(policy, user, body string, status int) {
		t.Helper()
		sent++
		if got := dashboardRequest(t, front, policy, user, body); got != status {
			t.Errorf("round %s, %s as %s: status %d, want %d", round, policy, user, got, status)
		}
	}
	for range 3 {
		want("chat", "ann-"+round, small, http.StatusOK)
	}
	want("chat", "ann-"+round, stream, http.StatusOK)
	prompt := strings.Repeat(" hello", 2000)
	want("chat", "bob-"+round, `{"model":"gpt-4o-mini","max_tokens":1,"messages":[{"role":"user","content":"`+prompt+`"}]}`, http.StatusRequestEntityTooLarge)
	want("plain", "cat-"+round, large, http.StatusOK)
	want("plain", "cat-"+round, large, http.StatusOK)
	want("plain", "cat-"+round, large, http.StatusTooManyRequests)
	want("metered", "dan-"+round, quota, http.StatusOK)
	want("metered", "dan-"+round, quota, http.StatusTooManyRequests)
	return sent
}

// TestDashboardPanelsOnPrometheus proves the shipped dashboard: a real
// Prometheus, run on the shipped configuration, scrapes the real binary
// under two rounds of traffic (the second through a Redis outage, answered
// by the fail-open fallback, and followed by a reload), and every panel's
// query returns series carrying the labels the panel shows.
func TestDashboardPanelsOnPrometheus(t *testing.T) {
	prometheusBinary(t)
	queries := dashboardQueries(t)
	bin := tokengateBinary(t)
	redis := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, dashboardConfig(redis.Addr))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, nil, "--config", file)
	prom := startPrometheus(t, strings.TrimPrefix(p.admin, "http://"))
	front := standInFor(t, p.grpc, cfg)

	sent := dashboardLoad(t, front, "1")
	// Rates need two samples: the second round comes after Prometheus has
	// scraped the first.
	waitProm(t, prom, fmt.Sprintf("sum(tokengate_requests_total) >= %d", sent))

	redis.Kill()
	for i := range 3 {
		if got := dashboardRequest(t, front, "chat", fmt.Sprintf("eve-%d", i), `{"model":"gpt-4o-mini","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`); got != http.StatusOK {
			t.Errorf("request %d during the Redis outage: %d, want 200 from the fail-open fallback", i, got)
		}
		sent++
	}
	waitProm(t, prom, "tokengate_store_up == 0")
	redis.Restart()
	// The first call after the failover's back-off finds Redis again.
	poll(t, func() error {
		sent++
		if got := dashboardRequest(t, front, "chat", "fay", `{"model":"gpt-4o-mini","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`); got != http.StatusOK {
			return fmt.Errorf("status %d", got)
		}
		m, err := getBody(p.admin + "/metrics")
		if err != nil || !strings.Contains(m, "\ntokengate_store_up 1\n") {
			return fmt.Errorf("the store is not back: %v\n%s", err, grepLines(m, "tokengate_store_up"))
		}
		return nil
	})
	sent += dashboardLoad(t, front, "2")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitProm(t, prom, fmt.Sprintf(`sum(tokengate_requests_total) >= %d and on() tokengate_store_up == 1 and on() tokengate_config_reload_total{result="applied"} >= 1`, sent))

	// Every panel, polled until it shows what it should or the deadline.
	failing := map[string]error{}
	deadline := time.Now().Add(20 * time.Second)
	for {
		clear(failing)
		for _, q := range queries {
			series, err := promQuery(prom, q.expr)
			if err == nil {
				err = q.check(series)
			}
			if err != nil {
				failing[q.panel+": "+q.expr] = err
			}
		}
		if len(failing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(250 * time.Millisecond) // the next scrape, polled with the deadline above
	}
	for q, err := range failing {
		t.Errorf("%s: %v", q, err)
	}
	t.Logf("%d panel queries returned data", len(queries)-len(failing))
	p.stop(t)
}

// waitProm polls Prometheus until expr returns a series.
func waitProm(t *testing.T, base, expr string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		series, err := promQuery(base, expr)
		if err == nil && len(series) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("Prometheus: %s returned nothing within 20s (%v)", expr, err)
		}
		time.Sleep(100 * time.Millisecond) // the next scrape, polled with the deadline above
	}
}
