package admin

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/metrics"
	"github.com/tokengate/tokengate/tokenizer"
)

const testToken = "test-admin-token"

// testConfig has a hashed per-key quota of tokens and a per-team quota of
// money, so that the page shows both units and a hashed identity.
const testConfig = `
store: {type: memory}
default_policy: teams
pricing: {defaults: none, unknown_models: fallback, fallback: {input: "1.00", output: "2.00"}}
policies:
  - name: teams
    identities:
      - {name: key, header: authorization, hash: true}
      - {name: team, header: x-team}
    buckets: [{name: global, tokens_per_minute: 60000000}]
    quotas:
      - {name: key-daily, per: key, window: day, timezone: UTC, tokens: 1000}
      - {name: team-monthly, per: team, window: month, timezone: Europe/Amsterdam, cost: "100"}
  - name: plain
    identities: [{name: user, header: x-user}]
    buckets: [{name: user, per: user, tokens_per_minute: 600}]
`

// fixture is an admin Server over a memory store, its gateway and its
// metrics, served by an httptest server.
type fixture struct {
	cfg     *config.Config
	store   *buckets.Memory
	gateway *extproc.Server
	metrics *metrics.Metrics
	admin   *Server
	srv     *httptest.Server
}

// newFixture serves an admin Server on the configuration yaml (testConfig
// unless a test needs another), with the admin token token ("" for none),
// over TLS when tls.
func newFixture(t *testing.T, yaml, token string, tls bool) *fixture {
	t.Helper()
	cfg, err := config.Parse("test.yaml", []byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{cfg: cfg, store: buckets.NewMemory(buckets.MemoryOptions{})}
	reg := prometheus.NewRegistry()
	f.metrics = metrics.New(reg, metrics.Options{Prices: cfg.Prices(), MaxModels: *cfg.Metrics.MaxModels})
	counter, err := tokenizer.New(tokenizer.Options{FallbackEncoding: cfg.Tokenizer.FallbackEncoding})
	if err != nil {
		t.Fatal(err)
	}
	f.gateway, err = extproc.NewServer(extproc.Config{
		Policies: gatewayPolicies(t, cfg), DefaultPolicy: cfg.DefaultPolicy, Store: f.store, Counter: counter,
		Prices: cfg.Prices(), Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	f.admin = New(context.Background(), Options{
		Config: cfg, Gateway: f.gateway, Overrides: &buckets.MemoryOverrides{}, Metrics: f.metrics, Gatherer: reg,
		Token: token, TokenSource: "the value of TG_TEST_TOKEN",
	})
	if tls {
		f.srv = httptest.NewTLSServer(f.admin.Handler())
	} else {
		f.srv = httptest.NewServer(f.admin.Handler())
	}
	t.Cleanup(f.srv.Close)
	return f
}

// gatewayPolicies maps cfg's policies onto the gateway's, as far as these
// tests use them (identities, buckets, quotas).
func gatewayPolicies(t *testing.T, cfg *config.Config) []extproc.Policy {
	t.Helper()
	var out []extproc.Policy
	for _, cp := range cfg.Policies {
		p := extproc.Policy{Name: cp.Name, Anonymous: cp.Anonymous}
		for _, id := range cp.Identities {
			p.Identities = append(p.Identities, extproc.Identity{Name: id.Name, Header: id.Header, Hash: id.Hash})
		}
		for _, b := range cp.Buckets {
			limit, _, err := b.Limit()
			if err != nil {
				t.Fatal(err)
			}
			p.Buckets = append(p.Buckets, extproc.BucketRule{Name: b.Name, Per: b.Per, Limit: limit})
		}
		for _, q := range cp.Quotas {
			w, unit, limit, err := q.Budget()
			if err != nil {
				t.Fatal(err)
			}
			p.Quotas = append(p.Quotas, extproc.QuotaRule{Name: q.Name, Per: q.Per, Window: w, Unit: unit, Limit: limit})
		}
		out = append(out, p)
	}
	return out
}

// spend adds amount to the current window of quota rule of policy
// "teams" for the identity whose key part is id (keys as extproc keys
// them: tg:<policy>:<rule>:<identity>, a quota of money's spend in USD).
func (f *fixture) spend(t *testing.T, rule, id string, amount float64) {
	t.Helper()
	p, _ := f.cfg.Policy("teams")
	for _, q := range p.Quotas {
		if q.Name != rule {
			continue
		}
		w, unit, limit, err := q.Budget()
		if err != nil {
			t.Fatal(err)
		}
		key := "tg:teams:" + rule + ":" + id
		bq := buckets.Quota{Name: rule, Key: key, Window: w, Unit: unit, Limit: limit}
		if unit == buckets.Money {
			bq.Currency = "USD"
		}
		if err := f.store.AddSpend(context.Background(), "seed-"+key, []buckets.Spend{{Quota: bq, Window: w.Span(time.Now()), Amount: amount}}); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Fatalf("no quota %q", rule)
}

// client is a browser's HTTP client: it keeps cookies and does not follow
// redirects, so that each answer can be read.
func (f *fixture) client(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	c := *f.srv.Client()
	c.Jar = jar
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return &c
}

type reply struct {
	status int
	header http.Header
	body   string
}

func do(t *testing.T, c *http.Client, req *http.Request) reply {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header, string(b)}
}

func (f *fixture) get(t *testing.T, c *http.Client, path, auth string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, f.srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("authorization", auth)
	}
	return do(t, c, req)
}

// signIn posts the sign-in form as a browser on the page's own origin
// does.
func (f *fixture) signIn(t *testing.T, c *http.Client, token string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, f.srv.URL+signInPath, strings.NewReader(url.Values{"token": {token}}.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/x-www-form-urlencoded")
	req.Header.Set("origin", f.srv.URL)
	req.Header.Set("sec-fetch-site", "same-origin")
	return do(t, c, req)
}

func (f *fixture) usage(t *testing.T, query string) UsageReport {
	t.Helper()
	a := f.get(t, f.srv.Client(), "/v1/usage?"+query, "Bearer "+testToken)
	if a.status != http.StatusOK {
		t.Fatalf("GET /v1/usage?%s: %d %s", query, a.status, a.body)
	}
	var rep UsageReport
	if err := json.Unmarshal([]byte(a.body), &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}

// metric is the value of the sample (a metric's name and labels, as
// /metrics writes them) in f's /metrics, or "" when there is none.
func (f *fixture) metric(t *testing.T, sample string) string {
	t.Helper()
	a := f.get(t, f.srv.Client(), "/metrics", "")
	if a.status != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", a.status, a.body)
	}
	for l := range strings.Lines(a.body) {
		if v, ok := strings.CutPrefix(strings.TrimSuffix(l, "\n"), sample+" "); ok {
			return v
		}
	}
	return ""
}

// tokengate_limit_overrides{source} counts the overrides in force (README,
// metrics) by where the one that applies comes from. A stored override of
// an identity beats the file's of the same identity and rule
// (docs/operations.md, Overrides in the store): while it is stored, the
// file's is not in force and not counted; once it is deleted, the file's
// applies again.
func TestOverridesInForceCountsWhatApplies(t *testing.T) {
	f := newFixture(t, `
store: {type: memory}
policies:
  - name: default
    identities: [{name: team, header: x-team}]
    buckets: [{name: team, per: team, tokens_per_minute: 6000}]
    overrides:
      - {rule: team, identity: acme, tokens_per_minute: 60000}
`, testToken, false)
	steps := []struct {
		method, path, body string
		file, store        string
	}{
		{"", "", "", "1", "0"},
		{http.MethodPut, "/v1/limits/default/team/acme", `{"tokens_per_minute":120000}`, "0", "1"},
		{http.MethodPut, "/v1/limits/default/team/globex", `{"tokens_per_minute":120000}`, "0", "2"},
		{http.MethodDelete, "/v1/limits/default/team/acme", "", "1", "1"},
	}
	for i, s := range steps {
		if s.method != "" {
			req, err := http.NewRequest(s.method, f.srv.URL+s.path, strings.NewReader(s.body))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("authorization", "Bearer "+testToken)
			if a := do(t, f.srv.Client(), req); a.status != http.StatusOK {
				t.Fatalf("step %d: %s %s: %d %s", i, s.method, s.path, a.status, a.body)
			}
		}
		file := f.metric(t, `tokengate_limit_overrides{source="file"}`)
		store := f.metric(t, `tokengate_limit_overrides{source="store"}`)
		if file != s.file || store != s.store {
			t.Errorf("step %d (%s %s): overrides in force from the file %q, from the store %q; want %s and %s",
				i, s.method, s.path, file, store, s.file, s.store)
		}
	}
}
