package pricing_test

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// TestEveryPricedModelIsKnownToTheTokenizer walks every model of the
// shipped table through the tokenizer's rules, without a fallback
// encoding: a model that can be priced must be one that can be counted,
// or a request for it is refused (400 unknown_model) before its price
// matters.
func TestEveryPricedModelIsKnownToTheTokenizer(t *testing.T) {
	c, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	d := pricing.Defaults()
	for _, m := range d.Models() {
		if _, fallback, err := c.EncodingFor(m); err != nil || fallback {
			t.Errorf("%s is priced, but the tokenizer does not know it: fallback %v, %v", m, fallback, err)
		}
	}
}

// TestSnapshotTakesTheFamilyPriceOnlyWhereTheTableSharesIt: a dated
// snapshot is priced by its own entry first; its family's entry prices it
// only where that entry says the snapshot shares its price. gpt-4o-2024-05-13
// costs about twice what gpt-4o does.
func TestSnapshotTakesTheFamilyPriceOnlyWhereTheTableSharesIt(t *testing.T) {
	table, err := pricing.NewTable("USD", []pricing.Entry{
		{Model: "gpt-4o", Snapshots: []string{"gpt-4o-2024-08-06", "GPT-4o-2024-11-20"}, Input: "2.50", Output: "10.00"},
		{Model: "gpt-4o-2024-05-13", Input: "5.00", Output: "15.00"},
		{Model: "gpt-4.1", Input: "2", Output: "8"},
		{Model: "claude-opus-4-5", SharesSnapshots: true, Input: "5", Output: "25"},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct{ name, want string }{
		{"gpt-4o-2024-08-06", "gpt-4o"},            // listed
		{"openai/gpt-4o-2024-11-20", "gpt-4o"},     // listed, any spelling
		{"gpt-4o-2024-05-13", "gpt-4o-2024-05-13"}, // its own entry wins
		{"gpt-4o-2025-03-01", ""},                  // not listed: unpriced
		{"gpt-4.1-2025-04-14", ""},                 // the entry shares nothing
		{"claude-opus-4-5-20251101", "claude-opus-4-5"},
		{"claude-opus-4-5@20251101", "claude-opus-4-5"},
	}
	for _, tt := range tests {
		p, ok := table.Price(tt.name)
		switch {
		case tt.want == "" && ok:
			t.Errorf("Price(%q) = %s; want no price: the table does not say the snapshot shares its family's price", tt.name, p.Model)
		case tt.want != "" && (!ok || p.Model != tt.want):
			t.Errorf("Price(%q) = %q, %v; want %s", tt.name, p.Model, ok, tt.want)
		}
	}
	if _, err := table.Resolve("gpt-4o-2025-03-01"); !errors.Is(err, pricing.ErrUnpriced) {
		t.Errorf("Resolve(an unlisted snapshot) = %v; want ErrUnpriced", err)
	}

	_, err = pricing.NewTable("USD", []pricing.Entry{
		{Model: "gpt-4o", Snapshots: []string{"gpt-4o-mini", "gpt-4.1-2025-04-14"}, Input: "1", Output: "1"},
	})
	var got []string
	for _, fe := range pricing.FieldErrors(err) {
		got = append(got, fe.Error())
	}
	want := []string{
		`models[0].snapshots[0]: "gpt-4o-mini" is not a dated snapshot of "gpt-4o" (such as gpt-4o-2025-01-31); name other models in aliases`,
		`models[0].snapshots[1]: "gpt-4.1-2025-04-14" is not a dated snapshot of "gpt-4o" (such as gpt-4o-2025-01-31); name other models in aliases`,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("problems (-want +got):\n%s", diff)
	}
}

// TestServiceTierPrices: an entry with a service_tier prices its model at
// that tier, beside the standard entry whose names and limits it shares.
// The shipped fast and flex entries are pinned to their pages. A flex
// request without a flex price is priced at standard rates (never less
// than flex is billed); a fast one without a fast price has none.
func TestServiceTierPrices(t *testing.T) {
	d := pricing.Defaults()
	raw, err := os.ReadFile("prices.yaml")
	if err != nil {
		t.Fatal(err)
	}
	header, _, _ := strings.Cut(string(raw), "\ncurrency:")
	for _, m := range d.Models() {
		std, _ := d.Price(m)
		for _, tier := range []pricing.Tier{pricing.Fast, pricing.Flex} {
			p, ok := std.AtTier(tier)
			if !ok || p.Tier != tier {
				continue
			}
			if !strings.Contains(header, p.Source) || p.Date == "" {
				t.Errorf("%s at %s: source %q (in the header comment: %v), date %q", m, tier, p.Source, strings.Contains(header, p.Source), p.Date)
			}
			if p.ContextWindow != std.ContextWindow || p.MaxOutputTokens != std.MaxOutputTokens {
				t.Errorf("%s at %s: limits %d/%d, want the standard entry's %d/%d", m, tier, p.ContextWindow, p.MaxOutputTokens, std.ContextWindow, std.MaxOutputTokens)
			}
			if !atLeastHalf(p.Rates, std.Rates) {
				t.Errorf("%s at %s: rates %+v below half the standard ones", m, tier, p.Rates)
			}
		}
	}

	terra := mustPrice(t, "gpt-5.6-terra")
	fast, ok := terra.AtTier(pricing.Fast)
	want := pricing.Rates{Input: 4_000_000, CachedInput: 400_000, CacheWrite: 5_000_000, CacheWriteExtended: 5_000_000, Output: 24_000_000, Reasoning: 24_000_000, AudioInput: 4_000_000, AudioOutput: 24_000_000}
	if diff := cmp.Diff(want, fast.Rates); !ok || fast.Tier != pricing.Fast || diff != "" {
		t.Errorf("gpt-5.6-terra fast: %v %s (-want +got):\n%s", ok, fast.Tier, diff)
	}
	if fast.LongContext == nil || fast.LongContext.Input != 8_000_000 || fast.LongContext.Output != 36_000_000 {
		t.Errorf("gpt-5.6-terra fast long context %+v", fast.LongContext)
	}
	// From the fast price, the standard one is one step away too.
	if std, ok := fast.AtTier(pricing.Standard); !ok || std.Input != 2_000_000 {
		t.Errorf("gpt-5.6-terra fast → standard: %v %s", ok, std.Input)
	}
	if flex, ok := mustPrice(t, "gpt-6.1-terra").AtTier(pricing.Flex); !ok || flex.Tier != pricing.Flex || flex.Input != 500_000 || flex.Output != 2_500_000 {
		t.Errorf("gpt-6.1-terra flex: %v %+v", ok, flex)
	}
	if flex, ok := mustPrice(t, "gpt-6.2-sol").AtTier(pricing.Flex); !ok || flex.Tier != pricing.Standard || flex.Input != 2_000_000 {
		t.Errorf("gpt-6.2-sol flex without a flex price: %v %s %s; want the standard price", ok, flex.Tier, flex.Input)
	}
	if _, ok := mustPrice(t, "claude-opus-5").AtTier(pricing.Fast); ok {
		t.Error("claude-opus-5 has a fast price; none is shipped")
	}

	// Tiers a request asks for, and what it is reserved at.
	if tier := d.TierFor("auto"); tier != pricing.Standard {
		t.Errorf("auto on a standard project: %s", tier)
	}
	if tier := d.TierFor("unknown"); tier != pricing.Fast {
		t.Errorf("an unknown tier: %s, want the dearest", tier)
	}
	onFast, err := pricing.Config{ProjectServiceTier: "fast"}.Table()
	if err != nil || onFast.TierFor("auto") != pricing.Fast || onFast.TierFor(pricing.Standard) != pricing.Standard {
		t.Errorf("project on fast: %v", err)
	}
	c, err := onFast.Cost("gpt-5.6-terra", pricing.Usage{InputTokens: 1000, OutputTokens: 10, ServiceTier: pricing.Fast})
	if err != nil || c != 1000*4+10*24 {
		t.Errorf("Cost at fast = %d, %v", c, err)
	}
	if _, err := d.Cost("claude-opus-5", pricing.Usage{InputTokens: 1, ServiceTier: pricing.Fast}); !errors.Is(err, pricing.ErrUnpriced) {
		t.Errorf("Cost at an unpriced tier: %v", err)
	}

	_, err = pricing.Config{ProjectServiceTier: "priority", Models: []pricing.Entry{
		{Model: "m", Input: "1", Output: "1"},
		{Model: "m", ServiceTier: "fast", Aliases: []string{"x"}, ContextWindow: 5, Input: "2", Output: "2"},
		{Model: "m", ServiceTier: "fast", Input: "2", Output: "2"},
		{Model: "n", ServiceTier: "fast", Input: "2", Output: "2"},
		{Model: "o", ServiceTier: "turbo", Input: "2", Output: "2"},
		{Model: "p", ContextWindow: -1, MaxOutputTokens: -2, Input: "2", Output: "2"},
	}}.Table()
	var got []string
	for _, fe := range pricing.FieldErrors(err) {
		got = append(got, fe.Error())
	}
	wantProblems := []string{
		`project_service_tier: "priority": want standard, fast or flex, as the OpenAI project's Service Tier setting is`,
		`models[1].aliases: set it on the model's standard entry: a fast entry shares the standard entry's names and limits`,
		`models[1].context_window: set it on the model's standard entry: a fast entry shares the standard entry's names and limits`,
		`models[2].model: "m" is already priced at tier fast by models[1]`,
		`models[4].service_tier: "turbo": want standard, fast or flex`,
		`models[5].context_window: -1: want the model's context window in tokens, such as 1000000`,
		`models[5].max_output_tokens: -2: want the most tokens the model generates in one call, such as 128000`,
		`models[3].service_tier: fast prices for "n", which has no standard entry: price its standard tier too`,
	}
	if diff := cmp.Diff(wantProblems, got); diff != "" {
		t.Errorf("problems (-want +got):\n%s", diff)
	}
}

// atLeastHalf reports whether every rate of r is at least half the same
// rate of o: no tier priced here is cheaper than that.
func atLeastHalf(r, o pricing.Rates) bool {
	return 2*r.Input >= o.Input && 2*r.CachedInput >= o.CachedInput && 2*r.CacheWrite >= o.CacheWrite &&
		2*r.CacheWriteExtended >= o.CacheWriteExtended && 2*r.Output >= o.Output && 2*r.Reasoning >= o.Reasoning
}

// TestAudioTokensAtAudioRates: audio tokens are billed at the audio rates
// of the entry (defaulting to the text rates), and a reservation prices
// every token at the dearest rate it can be billed at, audio included.
func TestAudioTokensAtAudioRates(t *testing.T) {
	table, err := pricing.NewTable("USD", []pricing.Entry{{Model: "m", Input: "1", CachedInput: "0.5", Output: "2", AudioInput: "10", AudioOutput: "20"}})
	if err != nil {
		t.Fatal(err)
	}
	u := pricing.Usage{InputTokens: 100, CachedInputTokens: 30, AudioInputTokens: 50, OutputTokens: 40, AudioOutputTokens: 25, ReasoningTokens: 5}
	// Input: 20 text, 50 audio, 30 cached; output: 10 text, 25 audio, 5 reasoning.
	if c, err := table.Cost("m", u); err != nil || c != 20*1+50*10+30/2+10*2+25*20+5*2 {
		t.Errorf("Cost = %d, %v", c, err)
	}
	if c, _ := table.MaxCost("m", 100, 40); c != 100*10+40*20 {
		t.Errorf("MaxCost = %d; want every token at the audio rates", c)
	}
}
