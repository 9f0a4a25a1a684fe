package pricing_test

import (
	"errors"
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
