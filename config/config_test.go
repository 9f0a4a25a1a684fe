package config

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/pricing"
)

// Every fixture under testdata/invalid names, in "# want:" lines, the
// problems it must produce: one fixture per class of configuration error.
func TestInvalidFixtures(t *testing.T) {
	files, err := filepath.Glob("testdata/invalid/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no fixtures: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var wants []string
			sc := bufio.NewScanner(bytes.NewReader(data))
			for sc.Scan() {
				if w, ok := strings.CutPrefix(sc.Text(), "# want: "); ok {
					wants = append(wants, w)
				}
			}
			if len(wants) == 0 {
				t.Fatal("fixture has no '# want:' line")
			}
			_, err = Parse(filepath.Base(f), data)
			var ps Problems
			if !errors.As(err, &ps) {
				t.Fatalf("Parse error = %v, want Problems", err)
			}
			if len(ps) != len(wants) {
				t.Errorf("got %d problems, want %d:\n%v", len(ps), len(wants), err)
			}
			for _, w := range wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("problems do not contain %q:\n%v", w, err)
				}
			}
		})
	}
}

// All problems of a file are reported at once, not only the first.
func TestAllProblemsAtOnce(t *testing.T) {
	_, err := Parse("x.yaml", []byte(`
store: {type: redis, on_failure: sideways, typo: 1}
policies:
  - name: Bad Name
    buckets:
      - {name: b, tokens_per_minute: -1}
    concurrency:
      - {name: c, max: 0}
`))
	var ps Problems
	if !errors.As(err, &ps) {
		t.Fatalf("err = %v", err)
	}
	var fields []string
	for _, p := range ps {
		fields = append(fields, p.Field)
	}
	want := []string{"store.typo", "store.redis.addrs", "store.on_failure", "policies[0].name", "policies[0].buckets[0].tokens_per_minute", "policies[0].concurrency[0].max"}
	for _, w := range want {
		if !contains(fields, w) {
			t.Errorf("no problem for %s in:\n%v", w, err)
		}
	}
}

func contains(s []string, x string) bool {
	for _, v := range s {
		if v == x {
			return true
		}
	}
	return false
}

func TestDefault(t *testing.T) {
	c := Default()
	if c.Store.Type != "memory" {
		t.Errorf("default store = %q, want memory", c.Store.Type)
	}
	p, ok := c.Policy(c.DefaultPolicy)
	if !ok {
		t.Fatalf("default policy %q not defined", c.DefaultPolicy)
	}
	if len(p.Buckets) == 0 || p.Identities[0].Hash != true {
		t.Errorf("default policy = %+v, want buckets and a hashed API key identity", p)
	}
}

func TestDefaultsApplied(t *testing.T) {
	c, err := Parse("x.yaml", []byte(`
policies:
  - name: only
    buckets:
      - {name: global, tokens_per_minute: 600}
    concurrency:
      - {name: slots, max: 2}
`))
	if err != nil {
		t.Fatal(err)
	}
	got := struct {
		Default, Store, OnFailure, NS, Key string
		Lease, SettleWindow                time.Duration
		MaxModels                          int
	}{c.DefaultPolicy, c.Store.Type, c.Store.OnFailure, c.Namespace, c.PolicyMetadataKey, c.Policies[0].Concurrency[0].Lease, c.Store.Redis.SettleWindow, *c.Metrics.MaxModels}
	want := struct {
		Default, Store, OnFailure, NS, Key string
		Lease, SettleWindow                time.Duration
		MaxModels                          int
	}{"only", "memory", "closed", "tokengate", "x-tokengate-policy", 10 * time.Minute, 2 * time.Millisecond, DefaultMaxModels}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("defaults (-want +got):\n%s", d)
	}
}

// Every valid fixture and shipped example config loads.
func TestValidFixtures(t *testing.T) {
	var files []string
	for _, pattern := range []string{"testdata/valid/*.yaml", "../examples/configs/*.yaml", "../examples/compose/tokengate.yaml", "../examples/rls/tokengate.yaml", "default.yaml"} {
		m, err := filepath.Glob(pattern)
		if err != nil || len(m) == 0 {
			t.Fatalf("%s: %v %v", pattern, m, err)
		}
		files = append(files, m...)
	}
	for _, f := range files {
		if _, err := Load(f); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add(DefaultYAML())
	files, err := filepath.Glob("testdata/*/*.yaml")
	if err != nil {
		f.Fatal(err)
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("fuzz.yaml", data)
		if (c == nil) == (err == nil) {
			t.Fatalf("Parse returned config %v and error %v", c != nil, err)
		}
		if err != nil && err.Error() == "" {
			t.Fatal("empty error message")
		}
	})
}

// A quota's budget reaches the store in its units: tokens as written, money
// in micro-units of the pricing currency, read exactly; the price table is
// built once, with the file's overrides and fallback.
func TestQuotaBudgetsAndPrices(t *testing.T) {
	c, err := Load("testdata/valid/quotas.yaml")
	if err != nil {
		t.Fatal(err)
	}
	type budget struct {
		Window string
		Unit   buckets.Unit
		Limit  float64
		Hard   bool
	}
	var got []budget
	for _, q := range c.Policies[0].Quotas {
		w, unit, limit, err := q.Budget()
		if err != nil {
			t.Fatalf("%s: %v", q.Name, err)
		}
		got = append(got, budget{w.String(), unit, limit, q.Hard})
	}
	want := []budget{
		{"month in Europe/Amsterdam", buckets.Money, 500_000_000, true},
		{"day in UTC", buckets.Tokens, 2_000_000, false},
		{"week in America/New_York", buckets.Money, 2_000_500_000, false},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("budgets (-want +got):\n%s", d)
	}
	prices := c.Prices()
	if prices == nil || prices.Currency() != "USD" {
		t.Fatalf("Prices() = %v; want the USD table", prices)
	}
	// The override by alias, and the fallback for a model nobody priced.
	if m, err := prices.Cost("prod-deployment-eu", pricing.Usage{InputTokens: 100_000, OutputTokens: 100_000}); err != nil || m != 1_000_000 {
		t.Errorf("cost of the aliased override = %v, %v; want 1000000 micro-units", m, err)
	}
	if m, err := prices.Cost("nobody-prices-this", pricing.Usage{InputTokens: 1000, OutputTokens: 1000}); err != nil || m != 30_000 {
		t.Errorf("fallback cost = %v, %v; want 30000 micro-units", m, err)
	}
}
