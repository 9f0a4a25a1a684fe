package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
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

	"github.com/tokengate/tokengate/admin"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/redistest"
)

// The tests in this file run the real binary: limits changed through the
// admin API and the CLI, usage, reloads of the configuration file, and one
// override seen by two gateways sharing Redis.

const adminToken = "test-admin-token"

// liveConfig is the configuration of these tests (store is the store's
// YAML): per team a bucket of teamBurst tokens, $100 a month and two
// slots, per hashed API key a large bucket and eight slots, and a large
// global bucket, so that a team's bucket is the most limiting one and its
// limit is what x-ratelimit-limit-tokens shows. Every model costs $1 per
// million input tokens and $2 per million output tokens.
func liveConfig(store string, teamBurst int) string {
	return store + `
admin_api: {token_env: TG_TEST_ADMIN_TOKEN}
pricing: {defaults: none, unknown_models: fallback, fallback: {input: "1.00", output: "2.00"}}
policies:
  - name: default
    identities:
      - {name: apikey, header: authorization, hash: true}
      - {name: team, header: x-team}
    tier: {header: x-tier}
    tiers:
      - name: gold
        limits: [{rule: team, tokens_per_minute: 60000, burst: 3000}, {rule: team-monthly, cost: "500"}]
    quotas:
      - {name: team-monthly, per: team, window: month, timezone: Europe/Amsterdam, cost: "100"}
    buckets:
      - {name: team, per: team, tokens_per_minute: 60000, burst: ` + strconv.Itoa(teamBurst) + `}
      - {name: apikey, per: apikey, tokens_per_minute: 6000000}
      - {name: global, tokens_per_minute: 60000000}
    concurrency:
      - {name: team, per: team, max: 2}
      - {name: apikey, per: apikey, max: 8}
`
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// chat sends a small chat request through front with the given headers and
// returns its status and the limit header (S17).
func chat(t *testing.T, front string, hdr map[string]string) (int, string) {
	t.Helper()
	st, h := chatHeaders(t, front, hdr)
	return st, h.Get("x-ratelimit-limit-tokens")
}

// chatHeaders sends a small chat request through front with the given
// headers and returns its status and response headers.
func chatHeaders(t *testing.T, front string, hdr map[string]string) (int, http.Header) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, front+"/v1/chat/completions",
		strings.NewReader(`{"model":"gpt-4o-mini","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	req.Header.Set("x-test-policy", "default")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header
}

// adminCall calls the admin API with the token (or another authorization).
func adminCall(t *testing.T, method, u, auth, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, u, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// cli runs the binary with the admin token in its environment.
func cli(t *testing.T, bin string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "TOKENGATE_ADMIN_TOKEN="+adminToken)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// The admin API and the CLI set, read and remove per-identity limits; a
// request of that identity gets them at once, others keep the rule's.
// Hashed identities are stored and shown hashed, never raw, nor logged.
func TestLimitsAPIAndCLI(t *testing.T) {
	bin := tokengateBinary(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, liveConfig("store: {type: memory}", 1000))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}, "--config", file)
	front := standInFor(t, p.grpc, cfg)
	bearer := "Bearer " + adminToken
	acme := map[string]string{"x-team": "acme", "authorization": "Bearer sk-acme"}

	if st, lim := chat(t, front, acme); st != 200 || lim != "1000" {
		t.Fatalf("before any override: %d, limit %q; want 200 and the rule's 1000", st, lim)
	}
	for _, tt := range []struct {
		method, path, auth, body string
		status                   int
		want                     string
	}{
		{"PUT", "/v1/limits/default/team/acme", "", `{"max":3}`, 401, `"code": "unauthorized"`},
		{"PUT", "/v1/limits/default/team/acme", "Bearer wrong", `{"max":3}`, 401, `"code": "unauthorized"`},
		{"GET", "/v1/usage?identity=team=acme", "", "", 401, `"code": "unauthorized"`},
		{"PUT", "/v1/limits/nope/team/acme", bearer, `{"max":3}`, 404, `policy \"nope\" is not defined`},
		{"PUT", "/v1/limits/default/nope/acme", bearer, `{"max":3}`, 404, `no bucket, quota or concurrency limit named \"nope\"`},
		{"PUT", "/v1/limits/default/global/acme", bearer, `{"tokens_per_minute":3}`, 400, `\"global\" is global`},
		{"PUT", "/v1/limits/default/team/acme", bearer, `{"tpm":3}`, 400, `unknown key \"tpm\" (known: burst, cost, max, tokens, tokens_per_minute)`},
		{"PUT", "/v1/limits/default/team/acme", bearer, `{"burst":-3}`, 400, `"field": "tokens_per_minute"`},
		{"PUT", "/v1/limits/default/team/acme", bearer, `{}`, 400, `sets no limit`},
		{"PUT", "/v1/limits/default/team/acme", bearer, strings.Repeat(" ", 20000), 413, `"code": "body_too_large"`},
		{"PUT", "/v1/limits/default/apikey/h.nothex?hashed=true", bearer, `{"max":1}`, 400, `"code": "invalid_identity"`},
		{"PUT", "/v1/limits/default/team/%20", bearer, `{"max":1}`, 400, `the identity is blank`},
		{"GET", "/v1/limits/default/team/nobody", bearer, "", 404, `no stored override`},
		{"DELETE", "/v1/limits/default/team/nobody", bearer, "", 404, `no stored override`},
	} {
		st, body := adminCall(t, tt.method, p.admin+tt.path, tt.auth, tt.body)
		if st != tt.status || !strings.Contains(body, tt.want) {
			t.Errorf("%s %s %.30q: %d %s; want %d with %s", tt.method, tt.path, tt.body, st, body, tt.status, tt.want)
		}
	}

	// The CLI sets acme's team bucket; it applies to acme's next request
	// only.
	out, err := cli(t, bin, "limits", "set", "--url", p.admin, "default", "team", "acme", "tokens_per_minute=120000", "burst=5000", "max=4")
	if err != nil || !strings.Contains(out, `default/team/acme: {"tokens_per_minute":120000,"burst":5000,"max":4}`) {
		t.Fatalf("limits set: %v\n%s", err, out)
	}
	if st, lim := chat(t, front, acme); st != 200 || lim != "5000" {
		t.Errorf("acme after the override: %d, limit %q; want 5000", st, lim)
	}
	if st, lim := chat(t, front, map[string]string{"x-team": "other", "authorization": "Bearer sk-other"}); st != 200 || lim != "1000" {
		t.Errorf("another team: %d, limit %q; want the rule's 1000", st, lim)
	}
	if st, lim := chat(t, front, map[string]string{"x-team": "other", "x-tier": "gold", "authorization": "Bearer sk-other"}); st != 200 || lim != "3000" {
		t.Errorf("another team of the gold tier: %d, limit %q; want the tier's 3000", st, lim)
	}

	// A hashed identity: the API takes the raw key, stores its hash.
	st, body := adminCall(t, "PUT", p.admin+"/v1/limits/default/apikey/sk-secret-key", bearer, `{"max":1}`)
	var put admin.LimitBody
	if err := json.Unmarshal([]byte(body), &put); err != nil || st != 200 || !config.ValidIdentityKey(put.Identity) {
		t.Fatalf("PUT of a hashed identity: %d %s", st, body)
	}
	out, err = cli(t, bin, "limits", "get", "--url", p.admin)
	if err != nil || !strings.Contains(out, put.Identity) || !strings.Contains(out, "acme") {
		t.Errorf("limits get: %v\n%s", err, out)
	}
	out, err = cli(t, bin, "limits", "get", "--url", p.admin, "--hashed", "default", "apikey", put.Identity)
	if err != nil || !strings.Contains(out, `{"max":1}`) {
		t.Errorf("limits get --hashed: %v\n%s", err, out)
	}

	// Usage shows acme's limits in force, where they come from, and what
	// its two requests left.
	out, err = cli(t, bin, "usage", "--url", p.admin, "--json", "team=acme")
	if err != nil {
		t.Fatalf("usage: %v\n%s", err, out)
	}
	var rep admin.UsageReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("usage --json: %v\n%s", err, out)
	}
	if len(rep.Rules) != 4 {
		t.Fatalf("usage of team=acme: %d rules, want team, global, team-monthly and the team's concurrency:\n%s", len(rep.Rules), out)
	}
	team, global, monthly, slots := rep.Rules[0], rep.Rules[1], rep.Rules[2], rep.Rules[3]
	if team.Rule != "team" || team.Source != "override" || team.Limit.Burst != 5000 || team.Limit.TokensPerMinute != 120000 ||
		!(team.Remaining < 5000) || team.Reset == nil || !(*team.ResetSeconds > 0) {
		t.Errorf("team bucket: %+v", team)
	}
	if global.Rule != "global" || global.Source != "rule" || global.Limit.TokensPerMinute != 60000000 {
		t.Errorf("global bucket: %+v", global)
	}
	if slots.Kind != "concurrency" || slots.Source != "override" || slots.Limit.Max != 4 || slots.InUse == nil || *slots.InUse != 0 || slots.Remaining != 4 {
		t.Errorf("team slots: %+v", slots)
	}
	// acme's requests so far spent a few micro-units of its $100 month.
	if monthly.Rule != "team-monthly" || monthly.Kind != "quota" || monthly.Source != "rule" || monthly.Limit.Cost != "100.00" || monthly.Unit != "USD" ||
		monthly.Spent == nil || !(*monthly.Spent > 0 && *monthly.Spent < 0.001) || math.Abs(monthly.Remaining+*monthly.Spent-100) > 1e-9 ||
		!regexp.MustCompile(`^\d{4}-\d{2}$`).MatchString(monthly.Window) || monthly.Reset == nil || !(*monthly.ResetSeconds > 0) {
		t.Errorf("team-monthly quota: %+v", monthly)
	}
	ams, err := time.LoadLocation("Europe/Amsterdam")
	if err != nil {
		t.Fatal(err)
	}
	if end := monthly.Reset.In(ams); end.Day() != 1 || end.Hour() != 0 || end.Minute() != 0 || end.Second() != 0 || end.Nanosecond() != 0 {
		t.Errorf("team-monthly resets at %v; want the first of a month at midnight in Amsterdam", end)
	}

	// A quota override: acme gets $2,000 a month, which its requests'
	// budget headers show; a team with a cent's millionth can never be
	// admitted; the gold tier gets $500.
	out, err = cli(t, bin, "limits", "set", "--url", p.admin, "default", "team-monthly", "acme", "cost=2000")
	if err != nil || !strings.Contains(out, `default/team-monthly/acme: {"cost":"2000"}`) {
		t.Fatalf("limits set cost: %v\n%s", err, out)
	}
	budget := func(hdr map[string]string) (int, string) {
		st, h := chatHeaders(t, front, hdr)
		return st, h.Get("x-ratelimit-limit-budget") + " " + h.Get("x-ratelimit-unit-budget")
	}
	if st, b := budget(acme); st != 200 || b != "2000.00 USD" {
		t.Errorf("acme after the quota override: %d, budget %q; want 2000.00 USD", st, b)
	}
	if st, b := budget(map[string]string{"x-team": "other", "x-tier": "gold"}); st != 200 || b != "500.00 USD" {
		t.Errorf("a team of the gold tier: %d, budget %q; want the tier's 500.00 USD", st, b)
	}
	if out, err := cli(t, bin, "limits", "set", "--url", p.admin, "default", "team-monthly", "poor", "cost=0.000001"); err != nil {
		t.Fatalf("limits set cost: %v\n%s", err, out)
	}
	if st, b := budget(map[string]string{"x-team": "poor", "x-tier": "gold"}); st != 413 || b != "0.000001 USD" {
		t.Errorf("a team whose override is a millionth: %d, budget %q; want 413 (never admissible) under its own budget", st, b)
	}
	for _, tt := range []struct{ body, want string }{
		{`{"tokens":5}`, `not a quota of tokens: set cost`},
		{`{"cost":"$5"}`, `write the number without a currency sign`},
		{`{"cost":true}`, `want an amount such as \"2000.50\"`},
	} {
		if st, body := adminCall(t, "PUT", p.admin+"/v1/limits/default/team-monthly/acme", bearer, tt.body); st != 400 || !strings.Contains(body, tt.want) {
			t.Errorf("PUT %s: %d %s; want 400 with %s", tt.body, st, body, tt.want)
		}
	}
	out, err = cli(t, bin, "usage", "--url", p.admin, "team=acme")
	if err != nil || !regexp.MustCompile(`(?m)^team-monthly\s+quota\s+override\s+2000\.00 USD in \d{4}-\d{2}\s+[0-9.]+ USD \([0-9.]+ USD spent\)\s+in `).MatchString(out) {
		t.Errorf("usage table with a quota: %v\n%s", err, out)
	}
	out, err = cli(t, bin, "usage", "--url", p.admin, "team=acme", "apikey=Bearer sk-secret-key")
	if err != nil || !regexp.MustCompile(`(?m)^apikey\s+concurrency\s+override\s+max 1\s+1 free \(0 in use\)`).MatchString(out) ||
		!regexp.MustCompile(`(?m)^team\s+bucket\s+override\s+120000/min, burst 5000\s+\d+`).MatchString(out) {
		t.Errorf("usage table: %v\n%s", err, out)
	}

	// rm: the rule's limit applies again.
	out, err = cli(t, bin, "limits", "rm", "--url", p.admin, "default", "team", "acme")
	if err != nil || !strings.Contains(out, "default/team/acme: removed") {
		t.Errorf("limits rm: %v\n%s", err, out)
	}
	if st, lim := chat(t, front, acme); st != 200 || lim != "1000" {
		t.Errorf("acme after rm: %d, limit %q; want the rule's 1000", st, lim)
	}
	if out, err := cli(t, bin, "limits", "rm", "--url", p.admin, "default", "team", "acme"); err == nil || !strings.Contains(out, "no stored override") {
		t.Errorf("limits rm of nothing: %v\n%s", err, out)
	}
	m, err := getBody(p.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(m, "\ntokengate_limit_overrides{source=\"store\"} 3\n") {
		t.Errorf("metrics: %s", grepLines(m, "tokengate_limit_overrides"))
	}
	p.stop(t)
	if strings.Contains(p.stderr.String(), "sk-secret-key") || strings.Contains(p.stderr.String(), "sk-acme") {
		t.Errorf("a raw API key reached the logs:\n%s", p.stderr.String())
	}
}

// Without admin_api.token_env the admin API is disabled, and says how to
// enable it.
func TestAdminAPIDisabled(t *testing.T) {
	bin := tokengateBinary(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, strings.Replace(liveConfig("store: {type: memory}", 1000), "admin_api: {token_env: TG_TEST_ADMIN_TOKEN}\n", "", 1))
	p := startServe(t, bin, nil, "--config", file)
	st, body := adminCall(t, "PUT", p.admin+"/v1/limits/default/team/acme", "Bearer "+adminToken, `{"max":3}`)
	if st != 403 || !strings.Contains(body, `"code": "admin_api_disabled"`) || !strings.Contains(body, "admin_api.token_env") {
		t.Errorf("admin API without a token: %d %s", st, body)
	}
	p.stop(t)
	// A token variable named but not set refuses to start.
	writeFile(t, file, liveConfig("store: {type: memory}", 1000))
	out, err := exec.Command(bin, "serve", "--config", file, "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "admin_api.token_env: environment variable TG_TEST_ADMIN_TOKEN is not set") {
		t.Errorf("serve without the token's variable: %v\n%s", err, out)
	}
}

// metricValue polls /metrics until the sample line has the value.
func waitMetric(t *testing.T, admin, sample string, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	line := sample + " " + strconv.Itoa(want)
	for {
		m, err := getBody(admin + "/metrics")
		if err == nil && strings.Contains(m, "\n"+line+"\n") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q within 10s:\n%s", line, grepLines(m, strings.SplitN(sample, "{", 2)[0]))
		}
		time.Sleep(20 * time.Millisecond) // polling the metric, with the deadline above
	}
}

// A changed configuration file is reloaded: a valid one applies to the
// next request, one with problems or one that needs a restart is refused
// and counted while the configuration in force keeps serving; SIGHUP
// reloads too.
func TestConfigReload(t *testing.T) {
	bin := tokengateBinary(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "tokengate.yaml")
	writeFile(t, file, liveConfig("store: {type: memory}", 1000))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}, "--config", file)
	front := standInFor(t, p.grpc, cfg)
	team := map[string]string{"x-team": "acme", "authorization": "Bearer sk-1"}
	if st, lim := chat(t, front, team); st != 200 || lim != "1000" {
		t.Fatalf("before: %d, limit %q", st, lim)
	}
	const applied, invalid, restart = `tokengate_config_reload_total{result="applied"}`,
		`tokengate_config_reload_total{result="invalid"}`, `tokengate_config_reload_total{result="restart_required"}`

	// A valid change applies to the next request.
	writeFile(t, file, liveConfig("store: {type: memory}", 400))
	waitMetric(t, p.admin, applied, 1)
	if st, lim := chat(t, front, team); st != 200 || lim != "400" {
		t.Errorf("after a valid change: %d, limit %q; want 400", st, lim)
	}

	// Problems: refused, counted, the configuration in force serves on.
	writeFile(t, file, liveConfig("store: {type: memory}", 400)+"typo: 1\n")
	waitMetric(t, p.admin, invalid, 1)
	if st, lim := chat(t, front, team); st != 200 || lim != "400" {
		t.Errorf("after an invalid change: %d, limit %q; want the 400 in force", st, lim)
	}
	writeFile(t, file, liveConfig("store: {type: memory}\ntokenizer: {default_output_tokens: 7}", 50))
	waitMetric(t, p.admin, restart, 1)
	if st, lim := chat(t, front, team); st != 200 || lim != "400" {
		t.Errorf("after a change that needs a restart: %d, limit %q; want the 400 in force", st, lim)
	}

	// SIGHUP: the file is replaced by one of the same size and modification
	// time, which the file poll cannot tell apart, so only the signal
	// reloads it.
	writeFile(t, file, liveConfig("store: {type: memory}", 400))
	waitMetric(t, p.admin, applied, 2)
	fi, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	next := filepath.Join(dir, "next.yaml")
	writeFile(t, next, liveConfig("store: {type: memory}", 300))
	if err := os.Chtimes(next, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(next, file); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitMetric(t, p.admin, applied, 3)
	if st, lim := chat(t, front, team); st != 200 || lim != "300" {
		t.Errorf("after SIGHUP: %d, limit %q; want 300", st, lim)
	}
	p.stop(t)
	logs := p.stderr.String()
	for _, want := range []string{
		`"msg":"configuration not reloaded: it is invalid; the configuration in force keeps serving","trigger":"file"`,
		`typo: unknown key \"typo\"`,
		`"keys":["tokenizer"]`,
		`"msg":"configuration reloaded: new requests follow it","trigger":"sighup"`,
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %s:\n%s", want, logs)
		}
	}
}

// A limit changed through the admin API of one gateway applies on another
// sharing Redis within one second, without a restart; and so does its
// removal. So does a quota's budget, which decides admission.
func TestOverrideReachesTheFleet(t *testing.T) {
	bin := tokengateBinary(t)
	srv := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, liveConfig(fmt.Sprintf("store: {type: redis, redis: {addrs: [%s]}}", srv.Addr), 100000))
	cfg, err := config.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	env := []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}
	a, b := startServe(t, bin, env, "--config", file), startServe(t, bin, env, "--config", file)
	frontA, frontB := standInFor(t, a.grpc, cfg), standInFor(t, b.grpc, cfg)
	acme := map[string]string{"x-team": "acme", "authorization": "Bearer sk-1"}
	for _, front := range []string{frontA, frontB} {
		if st, lim := chat(t, front, acme); st != 200 || lim != "100000" {
			t.Fatalf("before: %d, limit %q", st, lim)
		}
	}
	// within polls front until acme's limit is want, and returns how long
	// that took from since; it fails the test past one second.
	within := func(front, want string, since time.Time) time.Duration {
		t.Helper()
		for {
			_, lim := chat(t, front, acme)
			took := time.Since(since)
			if lim == want {
				return took
			}
			if took > time.Second {
				t.Fatalf("limit %q still %q %v after the change", want, lim, took)
			}
			time.Sleep(5 * time.Millisecond) // polling the other gateway, with the deadline above
		}
	}
	// Several changes on A, each seen on B; then a removal on B, seen on A.
	var delays []time.Duration
	for i := range 5 {
		burst := strconv.Itoa(250000 + i)
		st, body := adminCall(t, "PUT", a.admin+"/v1/limits/default/team/acme", "Bearer "+adminToken, `{"tokens_per_minute":6000000,"burst":`+burst+`}`)
		changed := time.Now()
		if st != 200 {
			t.Fatalf("PUT on gateway A: %d %s", st, body)
		}
		if _, lim := chat(t, frontA, acme); lim != burst {
			t.Errorf("gateway A after its own PUT: limit %q, want %s at once", lim, burst)
		}
		delays = append(delays, within(frontB, burst, changed))
	}
	st, body := adminCall(t, "DELETE", b.admin+"/v1/limits/default/team/acme", "Bearer "+adminToken, "")
	changed := time.Now()
	if st != 200 {
		t.Fatalf("DELETE on gateway B: %d %s", st, body)
	}
	delays = append(delays, within(frontA, "100000", changed))

	// A quota override set on A changes admission on B: a budget of a
	// millionth refuses acme's requests (413, never admissible), and its
	// removal admits them again.
	admitted := func(front string, want bool, since time.Time) time.Duration {
		t.Helper()
		for {
			st, h := chatHeaders(t, front, acme)
			took := time.Since(since)
			if (st == 200) == want && (want || h.Get("x-ratelimit-limit-budget") == "0.000001") {
				return took
			}
			if took > time.Second {
				t.Fatalf("acme's request still %d (budget %q) %v after the quota change", st, h.Get("x-ratelimit-limit-budget"), took)
			}
			time.Sleep(5 * time.Millisecond) // polling the other gateway, with the deadline above
		}
	}
	st, body = adminCall(t, "PUT", a.admin+"/v1/limits/default/team-monthly/acme", "Bearer "+adminToken, `{"cost":"0.000001"}`)
	changed = time.Now()
	if st != 200 {
		t.Fatalf("PUT of a quota on gateway A: %d %s", st, body)
	}
	delays = append(delays, admitted(frontB, false, changed))
	st, body = adminCall(t, "DELETE", a.admin+"/v1/limits/default/team-monthly/acme", "Bearer "+adminToken, "")
	changed = time.Now()
	if st != 200 {
		t.Fatalf("DELETE of a quota on gateway A: %d %s", st, body)
	}
	delays = append(delays, admitted(frontB, true, changed))
	slices.Sort(delays)
	t.Logf("a change on one gateway applied on the other after %v (sorted; the store is polled every %v)", delays, admin.DefaultPoll)
	a.stop(t)
	b.stop(t)
}
