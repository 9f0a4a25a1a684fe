package pricing_test

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"

	"github.com/tokengate/tokengate/pricing"
)

func mustPrice(t testing.TB, model string) pricing.Price {
	t.Helper()
	p, ok := pricing.Defaults().Price(model)
	if !ok {
		t.Fatalf("the shipped table has no %s", model)
	}
	return p
}

// reasoningApart is a price that bills reasoning apart from output, as
// Gemini 2.5 Flash previews did, to show the Reasoning rate is applied.
var reasoningApart = pricing.Price{Model: "thinking-model", Rates: pricing.Rates{
	Input: 300_000, CachedInput: 75_000, CacheWrite: 300_000, CacheWriteExtended: 300_000,
	Output: 2_500_000, Reasoning: 3_500_000,
}}

func TestCost(t *testing.T) {
	sol := mustPrice(t, "gpt-6.2-sol")
	luna := mustPrice(t, "gpt-5.6-luna")
	opus := mustPrice(t, "claude-opus-5-5")
	tests := []struct {
		name  string
		price pricing.Price
		usage pricing.Usage
		want  pricing.Micros
	}{
		{"nothing", sol, pricing.Usage{}, 0},
		{"one uncached input token", sol, pricing.Usage{InputTokens: 1}, 2},
		// OpenAI: prompt_tokens 1000 with cached_tokens 400; completion_tokens
		// 500 with reasoning_tokens 300, billed as output.
		// 600×2.00 + 400×0.10 + 500×10.00 per million = 6240 micros.
		{"openai cached and reasoning", sol, pricing.Usage{InputTokens: 1000, CachedInputTokens: 400, OutputTokens: 500, ReasoningTokens: 300}, 6240},
		// 0.2 micros rounds up to 1.
		{"a fraction of a micro-unit rounds up", luna, pricing.Usage{InputTokens: 1}, 1},
		{"seven cached tokens at 0.02", luna, pricing.Usage{InputTokens: 7, CachedInputTokens: 7}, 1},
		// 3 × 0.20 + 2 × 1.20 = 3.0 micros exactly: no rounding.
		{"an exact micro-unit is not rounded", luna, pricing.Usage{InputTokens: 3, OutputTokens: 2}, 3},
		// The long-context tier starts above 272,000 input tokens and prices
		// the whole request, output included.
		{"at the long-context threshold", sol, pricing.Usage{InputTokens: 272_000, OutputTokens: 1000}, 554_000},
		{"one token above it", sol, pricing.Usage{InputTokens: 272_001, OutputTokens: 1000}, 1_103_004},
		{"long context with cache", sol, pricing.Usage{InputTokens: 300_000, CachedInputTokens: 200_000, CacheCreationInputTokens: 50_000, CacheCreationExtendedInputTokens: 10_000, OutputTokens: 100},
			// 50,000×4.00 + 200,000×0.20 + 40,000×5.00 + 10,000×10.00 + 100×15.00
			200_000 + 40_000 + 200_000 + 100_000 + 1_500},
		// Anthropic, as extproc/provider normalises it: input_tokens 100,
		// cache_read_input_tokens 5000, cache_creation_input_tokens 2000 (500
		// of them with a 1-hour TTL) make InputTokens 7100; output 300.
		// 100×4.00 + 5000×0.20 + 1500×5.00 + 500×8.00 + 300×20.00 = 18900.
		{"anthropic cache reads and both cache writes", opus, pricing.Usage{InputTokens: 7100, CachedInputTokens: 5000, CacheCreationInputTokens: 2000, CacheCreationExtendedInputTokens: 500, OutputTokens: 300}, 18_900},
		// Without the TTL split every write is billed at the 5-minute rate.
		{"anthropic cache writes without the TTL split", opus, pricing.Usage{InputTokens: 2000, CacheCreationInputTokens: 2000}, 10_000},
		// Gemini-shaped: candidates 200 + thoughts 800 are OutputTokens 1000.
		// 1000×0.30 + 200×2.50 + 800×3.50 = 3600.
		{"reasoning billed apart", reasoningApart, pricing.Usage{InputTokens: 1000, OutputTokens: 1000, ReasoningTokens: 800}, 3600},
		// Inconsistent usage is billed by its parts, capped by the totals.
		{"cached beyond input", sol, pricing.Usage{InputTokens: 100, CachedInputTokens: 150}, 10},                                                     // 100×0.10
		{"writes beyond what cache reads leave", sol, pricing.Usage{InputTokens: 100, CachedInputTokens: 60, CacheCreationInputTokens: 80}, 106},      // 60×0.10 + 40×2.50
		{"extended writes beyond writes", opus, pricing.Usage{InputTokens: 10, CacheCreationInputTokens: 4, CacheCreationExtendedInputTokens: 9}, 56}, // 6×4.00 + 4×8.00
		{"reasoning beyond output", reasoningApart, pricing.Usage{OutputTokens: 5, ReasoningTokens: 10}, 18},                                          // 5×3.50 = 17.5
		{"negative counts are zero", sol, pricing.Usage{InputTokens: -5, OutputTokens: -1, CachedInputTokens: -3, ReasoningTokens: -2}, 0},
		{"negative parts of positive totals are zero", sol, pricing.Usage{InputTokens: 10, CachedInputTokens: -3, OutputTokens: 1, ReasoningTokens: -2}, 30},
		// 161945531535 × 113907089 = 2^64 - 1 fills the low word; one more
		// unit carries into the high word: 2^64 millionths round up to
		// 18446744073710 micros.
		{"carry into the high word", pricing.Price{Rates: pricing.Rates{Input: 113_907_089, Output: 1}}, pricing.Usage{InputTokens: 161_945_531_535, OutputTokens: 1}, 18_446_744_073_710},
		// 2^50 × 16384000000 = 10^6 × 2^64 millionths: the first quotient
		// that needs 65 bits.
		{"a quotient beyond 64 bits saturates", pricing.Price{Rates: pricing.Rates{Input: 16_384_000_000}}, pricing.Usage{InputTokens: 1 << 50}, math.MaxInt64},
		{"saturates", pricing.Price{Rates: pricing.Rates{Input: pricing.MaxRate}}, pricing.Usage{InputTokens: math.MaxInt}, math.MaxInt64},
		{"just below saturation", pricing.Price{Rates: pricing.Rates{Input: 1_000_000}}, pricing.Usage{InputTokens: math.MaxInt}, math.MaxInt64},
	}
	for _, tt := range tests {
		if got := tt.price.Cost(tt.usage); got != tt.want {
			t.Errorf("%s: Cost(%+v) = %d; want %d", tt.name, tt.usage, got, tt.want)
		}
	}
}

func TestMaxCost(t *testing.T) {
	sol := mustPrice(t, "gpt-6.2-sol")
	opus := mustPrice(t, "claude-opus-5-5")
	tests := []struct {
		name    string
		price   pricing.Price
		in, out int
		want    pricing.Micros
	}{
		// Every input token at the dearest input rate, the 1-hour cache write
		// (8.00): 1000×8.00 + 500×20.00.
		{"anthropic", opus, 1000, 500, 18_000},
		// The 12-hour cache write (5.00) is OpenAI's dearest input rate.
		{"openai", sol, 1000, 500, 10_000},
		// Long context: 300,000×10.00 + 1000×15.00.
		{"openai long context", sol, 300_000, 1000, 3_015_000},
		{"reasoning dearer than output", reasoningApart, 0, 10, 35},
		{"nothing", sol, 0, 0, 0},
		{"negative counts are zero", sol, -10, -10, 0},
	}
	for _, tt := range tests {
		if got := tt.price.MaxCost(tt.in, tt.out); got != tt.want {
			t.Errorf("%s: MaxCost(%d, %d) = %d; want %d", tt.name, tt.in, tt.out, got, tt.want)
		}
	}
}

// TestMaxCostBoundsCost splits random token counts every way a provider can
// bill them and checks the reservation always covers the bill, whichever
// tier the real prompt lands in.
func TestMaxCostBoundsCost(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	prices := []pricing.Price{reasoningApart}
	for _, m := range pricing.Defaults().Models() {
		prices = append(prices, mustPrice(t, m))
	}
	for range 200_000 {
		p := prices[rng.IntN(len(prices))]
		reservedIn, reservedOut := rng.IntN(400_000), rng.IntN(100_000)
		in, out := rng.IntN(reservedIn+1), rng.IntN(reservedOut+1)
		cached := rng.IntN(in + 1)
		written := rng.IntN(in - cached + 1)
		u := pricing.Usage{
			InputTokens: in, CachedInputTokens: cached,
			CacheCreationInputTokens: written, CacheCreationExtendedInputTokens: rng.IntN(written + 1),
			OutputTokens: out, ReasoningTokens: rng.IntN(out + 1),
		}
		if c, m := p.Cost(u), p.MaxCost(reservedIn, reservedOut); c > m {
			t.Fatalf("%s: Cost(%+v) = %d > MaxCost(%d, %d) = %d", p.Model, u, c, reservedIn, reservedOut, m)
		}
	}
}

// TestCostNoDrift prices a million requests and checks that the sum of
// their costs is exactly the sum of each request's exact cost rounded up,
// computed independently in plain int64 arithmetic, and exceeds the exact
// total by less than one micro-unit per request. Float accumulation of the
// same bill would drift.
func TestCostNoDrift(t *testing.T) {
	luna := mustPrice(t, "gpt-5.6-luna") // fractional micro-units per token
	rng := rand.New(rand.NewPCG(3, 4))
	const requests = 1_000_000
	var sum, reference, exactTotal int64 // exactTotal in millionths of a micro-unit
	for range requests {
		in, out := rng.IntN(5000), rng.IntN(2000)
		cached, reasoning := rng.IntN(in+1), rng.IntN(out+1)
		u := pricing.Usage{InputTokens: in, CachedInputTokens: cached, OutputTokens: out, ReasoningTokens: reasoning}
		sum += int64(luna.Cost(u))
		exact := int64(in-cached)*int64(luna.Input) + int64(cached)*int64(luna.CachedInput) + int64(out)*int64(luna.Output)
		reference += (exact + 999_999) / 1_000_000
		exactTotal += exact
	}
	if sum != reference {
		t.Fatalf("sum of costs %d micros; reference %d", sum, reference)
	}
	over := sum*1_000_000 - exactTotal
	if over < 0 || over >= requests*1_000_000 {
		t.Fatalf("sum of costs %d micros is %d millionths of a micro off the exact %d", sum, over, exactTotal)
	}
	t.Logf("%d requests: %s charged, %.6f micro-units above the exact bill", requests, pricing.Micros(sum), float64(over)/1e6)
}

// TestCostMatchesBigArithmetic checks the 128-bit arithmetic against
// math/big on counts and rates up to the limits.
func TestCostMatchesBigArithmetic(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	million := big.NewInt(1_000_000)
	maxInt64 := big.NewInt(math.MaxInt64)
	for i := range 20_000 {
		bitsN := 1 + rng.IntN(62) // token counts of every magnitude
		in := int(rng.Int64N(1 << bitsN))
		cached := int(rng.Int64N(int64(in) + 1))
		out := int(rng.Int64N(1 << (1 + rng.IntN(62))))
		p := pricing.Price{Rates: pricing.Rates{
			Input:       pricing.Rate(rng.Int64N(int64(pricing.MaxRate) + 1)),
			CachedInput: pricing.Rate(rng.Int64N(int64(pricing.MaxRate) + 1)),
			Output:      pricing.Rate(rng.Int64N(int64(pricing.MaxRate) + 1)),
		}}
		if i%4 == 0 { // small values, where the result does not saturate
			in, cached, out = rng.IntN(1<<30), 0, rng.IntN(1<<30)
		}
		u := pricing.Usage{InputTokens: in, CachedInputTokens: cached, OutputTokens: out}
		exact := new(big.Int).Mul(big.NewInt(int64(in-cached)), big.NewInt(int64(p.Input)))
		exact.Add(exact, new(big.Int).Mul(big.NewInt(int64(cached)), big.NewInt(int64(p.CachedInput))))
		exact.Add(exact, new(big.Int).Mul(big.NewInt(int64(out)), big.NewInt(int64(p.Output))))
		q, r := new(big.Int).QuoRem(exact, million, new(big.Int))
		if r.Sign() != 0 {
			q.Add(q, big.NewInt(1))
		}
		if q.Cmp(maxInt64) > 0 {
			q = maxInt64
		}
		if got := p.Cost(u); int64(got) != q.Int64() {
			t.Fatalf("Cost(%+v) at %+v = %d; math/big says %s", u, p.Rates, got, q)
		}
	}
}

func TestRatesFor(t *testing.T) {
	sol := mustPrice(t, "gpt-6.2-sol")
	if got := sol.RatesFor(272_000); got != sol.Rates {
		t.Errorf("RatesFor(272000) = %+v; want the base rates", got)
	}
	if got := sol.RatesFor(272_001); got != sol.LongContext.Rates {
		t.Errorf("RatesFor(272001) = %+v; want the long-context rates", got)
	}
	opus := mustPrice(t, "claude-opus-5-5")
	if got := opus.RatesFor(900_000); got != opus.Rates {
		t.Errorf("a price without a long-context tier: RatesFor = %+v", got)
	}
}

func BenchmarkCost(b *testing.B) {
	sol := mustPrice(b, "gpt-6.2-sol")
	u := pricing.Usage{InputTokens: 1000, CachedInputTokens: 400, OutputTokens: 500, ReasoningTokens: 300}
	var sink pricing.Micros
	for b.Loop() {
		sink += sol.Cost(u)
	}
	if sink == 0 {
		b.Fatal("no cost")
	}
}
