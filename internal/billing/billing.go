// Package billing reads the request and answer fields by which a provider
// chooses the rates a request is billed at, beyond its model and its token
// counts: the service tier it is processed in and the retention of its
// prompt-cache writes. The request is read to reserve (at the dearest
// rates the request can be billed at), the answer to settle (it says what
// the provider did).
//
// The package imports nothing of tokengate, so package tokenizer (request
// fields), package extproc/provider (answer fields) and package pricing
// (tier names in the price table) share one reading.
package billing

// Tier is a service tier: how a provider processes a request, and so the
// rates it bills it at. The zero Tier is none named: a request or answer
// that does not say.
type Tier string

// The tiers the price table prices. OpenAI's "priority" (renamed "fast")
// and Anthropic's fast mode (speed "fast") are Fast; OpenAI's "default"
// and Anthropic's standard and Priority Tier (a capacity commitment billed
// at the standard rates) are Standard.
const (
	Standard Tier = "standard"
	Fast     Tier = "fast"
	Flex     Tier = "flex"
)

// Request-only readings: Auto leaves the tier to the account (an OpenAI
// request without service_tier, or "auto": the project's service tier
// setting decides), Unknown is a value this package does not know, which a
// reservation reads as the dearest tier.
const (
	Auto    Tier = "auto"
	Unknown Tier = "unknown"
)

// Parse reads a tier as configuration names it: standard, fast or flex.
func Parse(name string) (Tier, bool) {
	switch t := Tier(name); t {
	case Standard, Fast, Flex:
		return t, true
	}
	return "", false
}

// OpenAI reads an OpenAI service_tier, as a request sends it or an answer
// reports it: absent (""), "auto" is Auto; "default" and "standard" are
// Standard; "priority" and "fast" are Fast; "flex" is Flex; "scale" (Scale
// Tier units, paid for in advance) is Standard, the most a token of it can
// cost on demand.
func OpenAI(v string) Tier {
	switch v {
	case "", "auto":
		return Auto
	case "default", "standard", "scale":
		return Standard
	case "priority", "fast":
		return Fast
	case "flex":
		return Flex
	}
	return Unknown
}

// Anthropic reads an Anthropic request's or answer's speed: "fast" is fast
// mode, billed at its own rates; absent or "standard" is Standard. The
// service_tier field (auto, standard_only; answered standard, priority,
// batch) does not change the per-token rates: Priority Tier capacity is
// committed to in advance at standard rates.
func Anthropic(speed string) Tier {
	switch speed {
	case "", "standard":
		return Standard
	case "fast":
		return Fast
	}
	return Unknown
}

// ExtendedRetention reports whether an OpenAI prompt_cache_retention value
// asks for the longer retention, whose cache writes cost more: anything but
// the default "in_memory" (absent, null and "" are the default). A value
// this package does not know is read as the dearer retention.
func ExtendedRetention(v string) bool {
	return v != "" && v != "in_memory"
}
