package pricing_test

import (
	"testing"

	"github.com/tokengate/tokengate/pricing"
)

// TestLongContextReservedWithinMarginOfThreshold: the long-context band is
// chosen from the prompt's own count only to reserve, and a count within 5 %
// below the threshold (above 258,400 of gpt-6.2-sol's 272,000) reserves at
// the long-context rates: the provider's count of the same prompt may be
// over the threshold, and it then bills every token of the request at them.
// Settlement prices by the provider's count.
func TestLongContextReservedWithinMarginOfThreshold(t *testing.T) {
	sol := mustPrice(t, "gpt-6.2-sol")
	// The dearest input rate: cache writes with the longer retention, $5
	// per million at base rates, $10 above 272K; output $10, and $15.
	tests := []struct {
		counted    int
		in, out    pricing.Micros
		longReason string
	}{
		{200_000, 200_000 * 5, 1000 * 10, "far below the threshold"},
		{258_400, 258_400 * 5, 1000 * 10, "5 % below: the margin's edge"},
		{258_401, 258_401 * 10, 1000 * 15, "within 5 % below"},
		{271_999, 271_999 * 10, 1000 * 15, "one token below"},
		{272_001, 272_001 * 10, 1000 * 15, "above"},
	}
	for _, tt := range tests {
		if got, want := sol.MaxCost(tt.counted, 1000), tt.in+tt.out; got != want {
			t.Errorf("%s: MaxCost(%d, 1000) = %d; want %d", tt.longReason, tt.counted, got, want)
		}
	}
	// Settled by the provider's count: a prompt the provider counts under
	// the threshold is billed at base rates, whatever was reserved.
	if got := sol.Cost(pricing.Usage{InputTokens: 271_000, OutputTokens: 1000}); got != 271_000*2+1000*10 {
		t.Errorf("Cost below the threshold = %d", got)
	}
	if got := sol.Cost(pricing.Usage{InputTokens: 272_001, OutputTokens: 1000}); got != 272_001*4+1000*15 {
		t.Errorf("Cost above the threshold = %d", got)
	}
}
