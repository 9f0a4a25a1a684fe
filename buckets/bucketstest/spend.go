package bucketstest

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// RunAddSpend checks AddSpend: what a gateway spent while the store was
// down is added to the quota windows it was spent in, whatever their
// limit, so the window refuses what it would have refused had the store
// admitted it (S21); invalid spends are refused whole. The stores open
// returns must be SpendAdders and Inspectors.
func RunAddSpend(t *testing.T, open Open) {
	clock := NewClock()
	store := open(t, clock, 1)[0]
	add, ok := store.(buckets.SpendAdder)
	in, ok2 := store.(Inspector)
	if !ok || !ok2 {
		t.Fatalf("%T does not implement AddSpend and Inspect", store)
	}
	ctx := context.Background()
	month, err := buckets.ParseWindow("month", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	tokens := buckets.Quota{Name: "tokens", Key: "spend-tokens", Window: month, Unit: buckets.Tokens, Limit: 1000}
	money := buckets.Quota{Name: "money", Key: "spend-money", Window: month, Unit: buckets.Money, Limit: 5e6}
	span := month.Span(clock.Now())
	spent := func() []float64 {
		t.Helper()
		_, qs, err := in.Inspect(ctx, nil, []buckets.Quota{tokens, money})
		if err != nil {
			t.Fatal(err)
		}
		return []float64{qs[0].Spent, qs[1].Spent}
	}
	if err := add.AddSpend(ctx, "s1", []buckets.Spend{{Quota: tokens, Window: span, Amount: 300}, {Quota: money, Window: span, Amount: 2.5}}); err != nil {
		t.Fatal(err)
	}
	if got := spent(); got[0] != 300 || got[1] != 2.5 {
		t.Fatalf("spent %v after adding 300 tokens and 2.5 micro-units, want [300 2.5]", got)
	}
	// Beyond the limit: the money is spent.
	if err := add.AddSpend(ctx, "s2", []buckets.Spend{{Quota: tokens, Window: span, Amount: 800}}); err != nil {
		t.Fatal(err)
	}
	if got := spent(); got[0] != 1100 {
		t.Fatalf("spent %v tokens after adding 800 more, want 1100", got[0])
	}
	d, err := store.Reserve(ctx, buckets.Request{Cost: 1, Quotas: []buckets.Quota{tokens}})
	if err != nil {
		t.Fatal(err)
	}
	if d.OK || d.Reason != buckets.OverQuota {
		t.Errorf("Reserve in an overspent window = %v, want refused over quota", d.Reason)
	}
	// A window long gone is left alone.
	old := month.Span(clock.Now().Add(-90 * 24 * time.Hour))
	if err := add.AddSpend(ctx, "s3", []buckets.Spend{{Quota: tokens, Window: old, Amount: 5}}); err != nil {
		t.Errorf("AddSpend to a window that ended long ago: %v", err)
	}
	// Invalid spends change nothing.
	for _, bad := range [][]buckets.Spend{
		{{Quota: tokens, Window: span, Amount: 1}, {Quota: tokens, Window: span, Amount: -1}},
		{{Quota: tokens, Window: span, Amount: math.NaN()}},
		{{Quota: tokens, Amount: 1}},
		{{Quota: buckets.Quota{Name: "bad", Key: "k", Window: month, Limit: -1}, Window: span, Amount: 1}},
	} {
		if err := add.AddSpend(ctx, "s4", bad); !errors.Is(err, buckets.ErrInvalidRequest) && !errors.Is(err, buckets.ErrInvalidLimit) {
			t.Errorf("AddSpend(%+v) = %v, want an invalid request", bad, err)
		}
	}
	if got := spent(); got[0] != 1100 || got[1] != 2.5 {
		t.Errorf("spent %v after invalid spends, want [1100 2.5]", got)
	}
}
