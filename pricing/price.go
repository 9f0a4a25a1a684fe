package pricing

import (
	"math"
	"math/bits"

	"github.com/tokengate/tokengate/internal/billing"
)

// Rates are the prices per million tokens of one model, one for each way a
// provider bills a token. In a Price every rate is set: the ones a price
// entry leaves out are filled in as Entry describes.
type Rates struct {
	// Input is an input token read neither from nor into the prompt cache.
	Input Rate
	// CachedInput is an input token read from the prompt cache (OpenAI
	// cached input, Anthropic cache hits, Gemini cached content).
	CachedInput Rate
	// CacheWrite is an input token written to the prompt cache with the
	// default retention (Anthropic 5-minute cache writes, OpenAI 30-minute).
	CacheWrite Rate
	// CacheWriteExtended is an input token written to the prompt cache with
	// the longer retention (Anthropic 1-hour; OpenAI's, which its pages
	// call 12-hour and requests name prompt_cache_retention "24h").
	CacheWriteExtended Rate
	// Output is an output token that is not reasoning.
	Output Rate
	// Reasoning is a reasoning (thinking) token. Every provider priced today
	// bills these as output.
	Reasoning Rate
	// AudioInput and AudioOutput are audio tokens of the prompt and of the
	// answer (OpenAI's audio models bill them apart from text).
	AudioInput  Rate
	AudioOutput Rate
}

// maxInput is the highest rate an input token can be billed at.
func (r Rates) maxInput() Rate {
	return max(r.Input, r.CachedInput, r.CacheWrite, r.CacheWriteExtended, r.AudioInput)
}

// maxOutput is the highest rate an output token can be billed at.
func (r Rates) maxOutput() Rate {
	return max(r.Output, r.Reasoning, r.AudioOutput)
}

// atLeast reports whether every rate of r is at least the same rate of o.
func (r Rates) atLeast(o Rates) bool {
	return r.Input >= o.Input && r.CachedInput >= o.CachedInput && r.CacheWrite >= o.CacheWrite &&
		r.CacheWriteExtended >= o.CacheWriteExtended && r.Output >= o.Output && r.Reasoning >= o.Reasoning &&
		r.AudioInput >= o.AudioInput && r.AudioOutput >= o.AudioOutput
}

// LongContext is the higher price a provider charges for a whole request
// whose prompt is long: OpenAI above 272K input tokens, Gemini's Pro models
// above 200K. Its rates are never lower than the base rates.
type LongContext struct {
	// AboveInputTokens: a request with more input tokens than this (cached
	// and cache writes included) is billed at these rates, output included.
	AboveInputTokens int
	Rates
}

// Tier is a service tier, as the price table names it: Standard, Fast or
// Flex.
type Tier = billing.Tier

// The service tiers an entry prices (Entry.ServiceTier).
const (
	Standard = billing.Standard
	Fast     = billing.Fast
	Flex     = billing.Flex
)

// Price is what one model costs at one service tier, resolved from a table
// entry: every rate set, and an optional long-context tier. Cost and
// MaxCost are the methods most callers want; AtTier finds the price of the
// same model at another service tier.
//
// The zero Price charges nothing. A Price is a plain value, safe to copy
// and to share between goroutines.
type Price struct {
	// Model is the name of the table entry the price came from.
	Model string
	// Tier is the service tier the rates are for; "" in a Price not built
	// from a table entry, which prices every tier alike.
	Tier Tier
	Rates
	// LongContext is nil when the model costs the same at every prompt
	// length.
	LongContext *LongContext
	// ContextWindow and MaxOutputTokens are what the model can do, from
	// the standard entry (Entry.ContextWindow); 0 when the table does not
	// say.
	ContextWindow, MaxOutputTokens int
	// Source and Date say where and when the price was read.
	Source string
	Date   string

	tiers map[Tier]Price // every tier of the model, this one included; nil for a Price of one tier
}

// AtTier returns the price of the same model at service tier t, and
// whether the table prices the model there. A flex request the table has
// no flex price for is priced at the standard rates, never less than flex
// is billed; a fast one has no price (ok false): fast rates are dearer
// than any the table has. A Price not built from a table entry prices
// every tier alike, and so does Standard, Auto or "" (no tier named).
func (p Price) AtTier(t Tier) (Price, bool) {
	if p.tiers == nil {
		return p, true
	}
	switch t {
	case "", billing.Auto:
		t = Standard
	case billing.Unknown:
		t = Fast
	}
	if tp, ok := p.tiers[t]; ok {
		return tp, true
	}
	if t == Flex {
		return p.tiers[Standard], true
	}
	return Price{}, false
}

// Usage is the tokens one request was billed for, in the shape
// extproc/provider normalises every provider's usage into: InputTokens
// counts every prompt token, cached and cache writes included (Anthropic's
// input_tokens excludes them, and the normalisation adds them back), and
// OutputTokens counts every completion token, reasoning included (Gemini's
// thoughtsTokenCount is added to candidatesTokenCount). The other fields
// say how many of those tokens were billed at another rate.
//
// The zero value is a request that used no tokens. Usage is a plain value,
// safe to copy and to share between goroutines.
type Usage struct {
	// InputTokens is every prompt token billed.
	InputTokens int
	// OutputTokens is every completion token billed, reasoning included.
	OutputTokens int
	// CachedInputTokens is the part of InputTokens read from the prompt
	// cache.
	CachedInputTokens int
	// CacheCreationInputTokens is the part of InputTokens written to the
	// prompt cache.
	CacheCreationInputTokens int
	// CacheCreationExtendedInputTokens is the part of
	// CacheCreationInputTokens written with the longer retention (Anthropic
	// cache_creation.ephemeral_1h_input_tokens; OpenAI writes of a request
	// with prompt_cache_retention "24h").
	CacheCreationExtendedInputTokens int
	// ReasoningTokens is the part of OutputTokens spent on reasoning.
	ReasoningTokens int
	// AudioInputTokens is the part of InputTokens that is audio, and
	// AudioOutputTokens the part of OutputTokens (OpenAI
	// prompt_tokens_details.audio_tokens, completion_tokens_details.
	// audio_tokens).
	AudioInputTokens, AudioOutputTokens int
	// ServiceTier is the tier the provider says it processed the request
	// in (OpenAI service_tier, Anthropic usage.speed); "" when it does not
	// say.
	ServiceTier Tier
}

// Total is input plus output tokens: what a bucket of tokens is charged.
// Cached, cache-write and reasoning tokens are already inside input and
// output.
func (u Usage) Total() int { return u.InputTokens + u.OutputTokens }

// RatesFor returns the rates a request with inputTokens input tokens is
// billed at: the long-context rates above the price's threshold, the base
// rates otherwise.
func (p Price) RatesFor(inputTokens int) Rates {
	if p.LongContext != nil && inputTokens > p.LongContext.AboveInputTokens {
		return p.LongContext.Rates
	}
	return p.Rates
}

// Cost is what the request that used u costs, as the provider bills it:
// uncached input, cached input, cache writes (default and extended
// retention), audio input, output, reasoning and audio output each at
// their rate, all at the long-context rates when the prompt is long. The
// price's own tier is applied; u.ServiceTier is for the caller to choose
// the price by (AtTier).
//
// Rounding: the exact cost is the sum of tokens × rate in millionths of a
// micro-unit, computed in 128-bit integers, so it is never rounded along the
// way; Cost rounds that sum up to whole Micros once, at the end of the
// request. A request is charged less than one micro-unit more than its exact
// cost, never less, and a sum of costs is exact: no drift however many
// requests are added up. A cost beyond the int64 range saturates at
// math.MaxInt64.
//
// Inconsistent usage is billed by its parts: counts below zero are zero,
// cached tokens beyond InputTokens, cache writes beyond what is left, and
// reasoning beyond OutputTokens are capped, so the provider's own split of
// the tokens wins over its total. Audio is counted among the uncached
// input and the output that is not reasoning.
func (p Price) Cost(u Usage) Micros {
	in := max(u.InputTokens, 0)
	cached := clamp(u.CachedInputTokens, in)
	written := clamp(u.CacheCreationInputTokens, in-cached)
	extended := clamp(u.CacheCreationExtendedInputTokens, written)
	audioIn := clamp(u.AudioInputTokens, in-cached-written)
	out := max(u.OutputTokens, 0)
	reasoning := clamp(u.ReasoningTokens, out)
	audioOut := clamp(u.AudioOutputTokens, out-reasoning)

	r := p.RatesFor(in)
	var sum exact
	sum.add(in-cached-written-audioIn, r.Input)
	sum.add(audioIn, r.AudioInput)
	sum.add(cached, r.CachedInput)
	sum.add(written-extended, r.CacheWrite)
	sum.add(extended, r.CacheWriteExtended)
	sum.add(out-reasoning-audioOut, r.Output)
	sum.add(audioOut, r.AudioOutput)
	sum.add(reasoning, r.Reasoning)
	return sum.micros()
}

// MaxCost is an upper bound of the cost of a request whose prompt was
// counted at inputTokens tokens and that may generate outputTokens output
// tokens, for a reservation made before the request is forwarded.
//
// Why it bounds Cost: every input token is billed at one of the input
// rates, every output token at the output, reasoning or audio rate, so
// pricing all input at the highest input rate (a cache write costs more
// than uncached input at Anthropic) and all output at the highest output
// rate bounds any split of the tokens. The band is chosen as ReserveRates
// chooses it: a prompt counted within LongContextMarginPercent below the
// long-context threshold reserves at the long-context rates, since the
// provider's own count of it may be above. A longer prompt is never billed
// at lower rates (long-context rates are at least the base rates), so fewer
// real tokens than reserved cannot cost more. The bound holds as long as
// the real counts do not exceed the ones reserved for; settlement replaces
// the reservation with Cost of the real usage either way, by the
// provider's count.
func (p Price) MaxCost(inputTokens, outputTokens int) Micros {
	in, out := max(inputTokens, 0), max(outputTokens, 0)
	r := p.ReserveRates(in)
	var sum exact
	sum.add(in, r.maxInput())
	sum.add(out, r.maxOutput())
	return sum.micros()
}

// MaxOutputRate is the dearest rate an output token of a request whose
// prompt was counted at inputTokens tokens can be billed at: what each
// token generated beyond a reservation costs at most.
func (p Price) MaxOutputRate(inputTokens int) Rate {
	return p.ReserveRates(inputTokens).maxOutput()
}

// LongContextMarginPercent is how far below a long-context threshold,
// in percent of it, a prompt's own count reserves at the long-context
// rates. Counts are estimates where the provider's tokenizer is not public
// or its rendering of a request is not documented: docs/tokenizer.md
// measures the gpt-5 family's framing and the Responses API within ±5 %,
// and the Anthropic and Gemini estimates under by at most 1 % on the
// recordings. A prompt counted 5 % under the threshold may be over it at
// the provider, which then bills the whole request at the higher rates.
const LongContextMarginPercent = 5

// ReserveRates returns the rates a request whose prompt was counted at
// inputTokens tokens is reserved at: the long-context rates when the count
// is above the threshold less LongContextMarginPercent of it, the base
// rates otherwise. Settlement prices by the provider's count (RatesFor).
func (p Price) ReserveRates(inputTokens int) Rates {
	if lc := p.LongContext; lc != nil && inputTokens > lc.AboveInputTokens-lc.AboveInputTokens*LongContextMarginPercent/100 {
		return lc.Rates
	}
	return p.Rates
}

func clamp(v, hi int) int {
	return min(max(v, 0), hi)
}

// exact is a non-negative sum of tokens × rate, in millionths of a
// micro-unit, as a 128-bit integer. With tokens below 2^63 and rates at
// most MaxRate (below 2^40) each product is below 2^103, so eight of them
// cannot overflow 128 bits.
type exact struct{ hi, lo uint64 }

func (e *exact) add(tokens int, rate Rate) {
	if tokens <= 0 || rate <= 0 {
		return
	}
	hi, lo := bits.Mul64(uint64(tokens), uint64(rate))
	var carry uint64
	e.lo, carry = bits.Add64(e.lo, lo, 0)
	e.hi, _ = bits.Add64(e.hi, hi, carry)
}

// micros rounds e up to whole Micros, saturating at math.MaxInt64.
func (e exact) micros() Micros {
	const perMicro = 1_000_000 // a rate is per million tokens
	if e.hi >= perMicro {
		return math.MaxInt64 // the quotient needs more than 64 bits
	}
	q, r := bits.Div64(e.hi, e.lo, perMicro)
	if q >= math.MaxInt64 {
		return math.MaxInt64
	}
	if r != 0 {
		q++
	}
	return Micros(q)
}
