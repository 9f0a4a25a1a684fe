package pricing_test

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/pricing"
)

// TestShippedTable checks the embedded prices.yaml: it parses strictly,
// every entry names an https source and the day it was read, and the
// header comment lists every source an entry uses.
func TestShippedTable(t *testing.T) {
	d := pricing.Defaults()
	if d.Currency() != "USD" {
		t.Errorf("currency %s", d.Currency())
	}
	models := d.Models()
	want := []string{"claude-opus-5", "claude-opus-5-5", "claude-sonnet-5", "gpt-5.6-luna", "gpt-5.6-terra", "gpt-6.1-terra", "gpt-6.2-sol"}
	if diff := cmp.Diff(want, models); diff != "" {
		t.Errorf("shipped models (-want +got):\n%s", diff)
	}
	raw, err := os.ReadFile("prices.yaml")
	if err != nil {
		t.Fatal(err)
	}
	header, _, _ := strings.Cut(string(raw), "\ncurrency:")
	for _, m := range models {
		p, _ := d.Price(m)
		if !strings.HasPrefix(p.Source, "https://") {
			t.Errorf("%s: source %q", m, p.Source)
		}
		if _, err := time.Parse(time.DateOnly, p.Date); err != nil {
			t.Errorf("%s: date %q: %v", m, p.Date, err)
		}
		if !strings.Contains(header, p.Source) {
			t.Errorf("%s: the header comment does not list its source %s", m, p.Source)
		}
		if p.Input <= 0 || p.Output <= 0 {
			t.Errorf("%s: input %s, output %s", m, p.Input, p.Output)
		}
	}
}

// TestShippedRates pins a few shipped rates to what their pages say, so an
// edit of prices.yaml that slips a digit fails.
func TestShippedRates(t *testing.T) {
	tests := []struct {
		model string
		want  pricing.Rates
		long  *pricing.LongContext
	}{
		{"gpt-6.2-sol", pricing.Rates{Input: 2_000_000, CachedInput: 100_000, CacheWrite: 2_500_000, CacheWriteExtended: 5_000_000, Output: 10_000_000, Reasoning: 10_000_000, AudioInput: 2_000_000, AudioOutput: 10_000_000},
			&pricing.LongContext{AboveInputTokens: 272_000, Rates: pricing.Rates{Input: 4_000_000, CachedInput: 200_000, CacheWrite: 5_000_000, CacheWriteExtended: 10_000_000, Output: 15_000_000, Reasoning: 15_000_000, AudioInput: 4_000_000, AudioOutput: 15_000_000}}},
		// No 12-hour price on the page: extended writes default to the
		// 30-minute rate.
		{"gpt-5.6-luna", pricing.Rates{Input: 200_000, CachedInput: 20_000, CacheWrite: 250_000, CacheWriteExtended: 250_000, Output: 1_200_000, Reasoning: 1_200_000, AudioInput: 200_000, AudioOutput: 1_200_000},
			&pricing.LongContext{AboveInputTokens: 272_000, Rates: pricing.Rates{Input: 400_000, CachedInput: 40_000, CacheWrite: 500_000, CacheWriteExtended: 500_000, Output: 1_800_000, Reasoning: 1_800_000, AudioInput: 400_000, AudioOutput: 1_800_000}}},
		{"claude-opus-5-5", pricing.Rates{Input: 4_000_000, CachedInput: 200_000, CacheWrite: 5_000_000, CacheWriteExtended: 8_000_000, Output: 20_000_000, Reasoning: 20_000_000, AudioInput: 4_000_000, AudioOutput: 20_000_000}, nil},
	}
	for _, tt := range tests {
		p := mustPrice(t, tt.model)
		if diff := cmp.Diff(tt.want, p.Rates); diff != "" {
			t.Errorf("%s rates (-want +got):\n%s", tt.model, diff)
		}
		if diff := cmp.Diff(tt.long, p.LongContext); diff != "" {
			t.Errorf("%s long context (-want +got):\n%s", tt.model, diff)
		}
	}
}

func TestPriceResolvesModelNames(t *testing.T) {
	table, err := pricing.Defaults().Merge([]pricing.Entry{
		{Model: "gpt-4o", Snapshots: []string{"gpt-4o-2024-08-06"}, Input: "2.50", CachedInput: "1.25", Output: "10.00"},
		{Model: "claude-opus-4-5", SharesSnapshots: true, Input: "5", Output: "25"},
		{Model: "my-gpt", Aliases: []string{"Prod-Deployment-EU"}, Input: "1", Output: "2"},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct{ name, want string }{
		{"gpt-4o", "gpt-4o"},
		{"GPT-4o", "gpt-4o"},
		{"  gpt-4o\n", "gpt-4o"},
		{"openai/gpt-4o", "gpt-4o"},                     // router prefix
		{"gpt-4o-2024-08-06", "gpt-4o"},                 // OpenAI dated snapshot the entry names
		{"openai/gpt-4o-2024-08-06", "gpt-4o"},          // both
		{"claude-opus-4-5-20251101", "claude-opus-4-5"}, // Anthropic snapshot
		{"claude-opus-4-5@20251101", "claude-opus-4-5"}, // Vertex AI spelling
		{"models/claude-opus-5-5", "claude-opus-5-5"},
		{"prod-deployment-eu", "my-gpt"}, // an alias, case-insensitive
		{"gpt-6.2-sol", "gpt-6.2-sol"},
		// Not resolvable: a different price or an unknown name.
		{"gpt-6.2-sol-fast", ""},             // fast mode costs twice as much
		{"gpt-4o-mini", ""},                  // not a snapshot of gpt-4o
		{"gpt-4o-2024-05-13", ""},            // a snapshot the entry does not name
		{"ft:gpt-4o:acme::abc123", ""},       // fine-tunes are priced apart
		{"gpt-4o-2024-08", ""},               // not a date
		{"gpt-4o-12345678", ""},              // not a date
		{"anthropic.claude-opus-5-v1:0", ""}, // Bedrock IDs need an alias
		{"", ""},
	}
	for _, tt := range tests {
		p, ok := table.Price(tt.name)
		if tt.want == "" {
			if ok {
				t.Errorf("Price(%q) = %s; want no price", tt.name, p.Model)
			}
			continue
		}
		if !ok || p.Model != tt.want {
			t.Errorf("Price(%q) = %q, %v; want %s", tt.name, p.Model, ok, tt.want)
		}
	}
}

func TestResolveRefusesOrFallsBack(t *testing.T) {
	d := pricing.Defaults()
	_, err := d.Resolve("gpt-unknown")
	if !errors.Is(err, pricing.ErrUnpriced) || err.Error() != `no price for model "gpt-unknown"` {
		t.Errorf("Resolve(unknown) error = %v", err)
	}
	if _, err := d.Resolve(""); err == nil || err.Error() != "no price for model: the request names no model" {
		t.Errorf("Resolve(\"\") error = %v", err)
	}
	if _, err := d.Cost("gpt-unknown", pricing.Usage{InputTokens: 1}); !errors.Is(err, pricing.ErrUnpriced) {
		t.Errorf("Cost(unknown) error = %v", err)
	}
	if _, err := d.MaxCost("gpt-unknown", 1, 1); !errors.Is(err, pricing.ErrUnpriced) {
		t.Errorf("MaxCost(unknown) error = %v", err)
	}
	fallback := pricing.Price{Model: pricing.FallbackModel, Rates: pricing.Rates{Input: 10_000_000, Output: 30_000_000}}
	withFallback := d.WithFallback(fallback)
	c, err := withFallback.Cost("gpt-unknown", pricing.Usage{InputTokens: 1000, OutputTokens: 100})
	if err != nil || c != 13_000 {
		t.Errorf("fallback Cost = %d, %v; want 13000", c, err)
	}
	// A known model keeps its own price; the original table still refuses.
	if p, err := withFallback.Resolve("gpt-6.2-sol"); err != nil || p.Model != "gpt-6.2-sol" {
		t.Errorf("Resolve(known) with a fallback = %v, %v", p.Model, err)
	}
	if _, err := d.Resolve("gpt-unknown"); err == nil {
		t.Error("WithFallback changed the receiver")
	}
	var zero pricing.Table
	if _, err := zero.Resolve("gpt-6.2-sol"); !errors.Is(err, pricing.ErrUnpriced) {
		t.Errorf("the zero Table priced a model: %v", err)
	}
}

func TestMergeReplacesWholeEntries(t *testing.T) {
	d := pricing.Defaults()
	merged, err := d.Merge([]pricing.Entry{
		// A negotiated price: the shipped long-context tier goes with the
		// replaced entry.
		{Model: "GPT-6.2-SOL", Input: "1.80", Output: "9.00"},
		{Model: "gemini-3.5-flash", Input: "1.50", Output: "9.00"},
	})
	if err != nil {
		t.Fatal(err)
	}
	sol, _ := merged.Price("gpt-6.2-sol")
	want := pricing.Price{Model: "gpt-6.2-sol", Tier: pricing.Standard, Rates: pricing.Rates{Input: 1_800_000, CachedInput: 1_800_000, CacheWrite: 1_800_000,
		CacheWriteExtended: 1_800_000, Output: 9_000_000, Reasoning: 9_000_000, AudioInput: 1_800_000, AudioOutput: 9_000_000}}
	if diff := cmp.Diff(want, sol, cmpopts.IgnoreUnexported(pricing.Price{})); diff != "" {
		t.Errorf("merged gpt-6.2-sol (-want +got):\n%s", diff)
	}
	if _, ok := merged.Price("gemini-3.5-flash"); !ok {
		t.Error("Merge did not add gemini-3.5-flash")
	}
	if _, ok := merged.Price("claude-opus-5"); !ok {
		t.Error("Merge lost an entry it did not override")
	}
	if orig, _ := d.Price("gpt-6.2-sol"); orig.Input != 2_000_000 || orig.LongContext == nil {
		t.Errorf("Merge changed the receiver: %+v", orig)
	}
}

// TestTableProblems checks that every problem of a price table is reported
// at once, each at its field.
func TestTableProblems(t *testing.T) {
	_, err := pricing.Defaults().Merge([]pricing.Entry{
		{Model: "a", Input: "2.5000001", Output: "-1"},
		{Model: "b", CachedInput: "0.1"},
		{Model: "A", Input: "1", Output: "1"},
		{Model: "c", Aliases: []string{"claude-opus-5", ""}, Input: "1", Output: "1"},
		{Model: "d", Input: "2", Output: "8", LongContext: &pricing.LongContextEntry{Input: "1", Output: "8"}},
		{Model: "e", Input: "1", Output: "1", Source: "http://example.com", Date: "1 Dec 2026"},
		{Input: "1", Output: "1"},
	})
	want := []string{
		`models[0].input: "2.5000001": more than 6 decimal places: the smallest unit is a millionth`,
		`models[0].output: "-1": must not be negative`,
		`models[1].input: required: the price per million tokens, such as 2.50`,
		`models[1].output: required: the price per million tokens, such as 2.50`,
		`models[2].model: "a" is already priced by models[0]`,
		`models[3].aliases[1]: empty alias`,
		`models[4].long_context.above_input_tokens: required: the prompt length in tokens above which these rates apply, such as 200000`,
		`models[4].long_context: a long-context rate is lower than the base rate it replaces; a longer prompt never costs less per token`,
		`models[5].source: "http://example.com": want the https address of the page the prices were read from`,
		`models[5].date: "1 Dec 2026": want the day the prices were read, as YYYY-MM-DD`,
		`models[6].model: required: the model name requests use, such as gpt-4o`,
		`models[3].aliases[0]: "claude-opus-5" names an entry of the table merged into; replace that entry by giving its model name instead`,
	}
	if !errors.Is(err, pricing.ErrInvalidPrice) {
		t.Fatalf("error %v does not wrap ErrInvalidPrice", err)
	}
	var got []string
	for _, fe := range pricing.FieldErrors(err) {
		got = append(got, fe.Error())
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("problems (-want +got):\n%s", diff)
	}
}

func TestNewTable(t *testing.T) {
	table, err := pricing.NewTable("EUR", []pricing.Entry{{Model: "m", Input: "1", Output: "2"}})
	if err != nil || table.Currency() != "EUR" {
		t.Fatalf("NewTable = %v, %v", table, err)
	}
	if _, err := pricing.NewTable("euro", nil); err == nil || pricing.FieldErrors(err)[0].Field != "currency" {
		t.Errorf("NewTable(euro) error = %v", err)
	}
}

func decodeConfig(t *testing.T, src string) pricing.Config {
	t.Helper()
	var c pricing.Config
	dec := yaml.NewDecoder(strings.NewReader(src))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestConfigFromYAML decodes the pricing section as the configuration
// file has it. Prices written as YAML numbers reach the parser as their
// text, so no float is involved: 0.1 is exactly 100,000 micros.
func TestConfigFromYAML(t *testing.T) {
	c := decodeConfig(t, `
unknown_models: fallback
fallback:
  input: 5
  output: 25.00
models:
  - model: gpt-6.2-sol
    input: 0.1
    output: "9.00"
  - model: my-azure-gpt
    aliases: [prod-eu]
    input: 2.00
    cached_input: 0.5
    output: 10
    long_context: {above_input_tokens: 200000, input: 4, output: 15}
`)
	table, err := c.Table()
	if err != nil {
		t.Fatal(err)
	}
	sol, _ := table.Price("gpt-6.2-sol")
	if sol.Input != 100_000 || sol.Output != 9_000_000 || sol.LongContext != nil {
		t.Errorf("gpt-6.2-sol = %+v", sol)
	}
	az, ok := table.Price("PROD-EU")
	if !ok || az.Model != "my-azure-gpt" || az.CachedInput != 500_000 || az.LongContext.AboveInputTokens != 200_000 {
		t.Errorf("prod-eu = %+v, %v", az, ok)
	}
	// The long-context tier's unset cached rate defaults to its own input.
	if az.LongContext.CachedInput != 4_000_000 {
		t.Errorf("long-context cached input = %s", az.LongContext.CachedInput)
	}
	fb, err := table.Resolve("some-new-model")
	if err != nil || fb.Model != pricing.FallbackModel || fb.Input != 5_000_000 || fb.Output != 25_000_000 {
		t.Errorf("fallback = %+v, %v", fb, err)
	}
	if _, ok := table.Price("claude-opus-5"); !ok {
		t.Error("the shipped defaults are missing")
	}
}

func TestConfigZeroValueIsTheShippedTable(t *testing.T) {
	table, err := pricing.Config{}.Table()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(pricing.Defaults().Models(), table.Models()); diff != "" {
		t.Errorf("models (-shipped +got):\n%s", diff)
	}
	if _, err := table.Resolve("unknown"); !errors.Is(err, pricing.ErrUnpriced) {
		t.Errorf("unknown model: %v", err)
	}
}

func TestConfigWithoutDefaults(t *testing.T) {
	table, err := decodeConfig(t, `
currency: EUR
defaults: none
models: [{model: m, input: "1", output: "2"}]
`).Table()
	if err != nil {
		t.Fatal(err)
	}
	if table.Currency() != "EUR" || len(table.Models()) != 1 {
		t.Errorf("currency %s, models %v", table.Currency(), table.Models())
	}
}

func TestConfigProblems(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string
	}{
		{"currency without defaults: none", `currency: EUR`,
			[]string{"defaults: the shipped prices are in USD, not EUR: set defaults: none and price every model in EUR"}},
		{"bad words", `{currency: usd, defaults: some, unknown_models: allow}`, []string{
			`currency: "usd": want an ISO 4217 code such as USD or EUR`,
			`defaults: "some": want shipped or none`,
			`unknown_models: "allow": want refuse or fallback`,
		}},
		{"fallback without the policy", `fallback: {input: "1", output: "1"}`,
			[]string{"fallback: set, but unknown_models is refuse: set unknown_models: fallback to use it"}},
		{"policy without the fallback", `unknown_models: fallback`,
			[]string{"fallback: required when unknown_models is fallback: the price of every model without an entry"}},
		{"a fallback that names a model", `{unknown_models: fallback, fallback: {model: x, aliases: [y], input: "1", output: "x"}}`, []string{
			`fallback.model: "x": leave it out; the fallback prices every model without an entry`,
			"fallback.aliases: leave them out; the fallback prices every model without an entry",
			`fallback.output: "x": not a plain decimal: digits with an optional decimal point, such as 2.50 (no exponent, separators or spaces)`,
		}},
		{"a model entry", `models: [{model: m, input: "1e3", output: "1"}]`,
			[]string{`models[0].input: "1e3": not a plain decimal: digits with an optional decimal point, such as 2.50 (no exponent, separators or spaces)`}},
	}
	for _, tt := range tests {
		_, err := decodeConfig(t, tt.yaml).Table()
		var got []string
		for _, fe := range pricing.FieldErrors(err) {
			got = append(got, fe.Error())
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("%s: problems (-want +got):\n%s", tt.name, diff)
		}
	}
}
