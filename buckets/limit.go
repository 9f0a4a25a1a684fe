package buckets

import (
	"fmt"
	"math"
)

// Limit is a bucket's capacity B (burst, in tokens) and refill rate r (tokens
// per second), S1. The zero value is invalid: Validate refuses it, and every
// store refuses a request that carries it.
type Limit struct {
	Capacity float64
	Rate     float64
}

// PerMinute returns the limit that refills tokensPerMinute each minute with a
// burst of burst tokens; a zero burst means one minute's worth.
func PerMinute(tokensPerMinute, burst float64) Limit {
	if burst == 0 {
		burst = tokensPerMinute
	}
	return Limit{Capacity: burst, Rate: tokensPerMinute / 60}
}

// Validate reports whether the limit can be used (S1): capacity and rate must
// be positive and finite. The error names the field and wraps ErrInvalidLimit.
func (l Limit) Validate() error {
	if err := positive("capacity", l.Capacity); err != nil {
		return err
	}
	return positive("rate", l.Rate)
}

func positive(field string, v float64) error {
	if !(v > 0) || math.IsInf(v, 0) {
		return fmt.Errorf("%w: %s must be a positive finite number, got %v", ErrInvalidLimit, field, v)
	}
	return nil
}

// DefaultSafetyFactor is the share of a provider's published limit that a
// provider bucket uses when ProviderLimit.SafetyFactor is zero (S19).
const DefaultSafetyFactor = 0.9

// ProviderLimit derives a provider bucket from the limit the provider
// publishes for the organisation's account (S19). The gateway keeps a safety
// margin below the provider's own limit, because the provider counts tokens
// its own way and other clients may share the account, and it may keep
// headroom that only priority traffic can use.
//
// The zero value is invalid (TokensPerMinute is required). A ProviderLimit
// is a plain value, safe to copy and to share.
type ProviderLimit struct {
	// TokensPerMinute is the provider's published TPM limit.
	TokensPerMinute float64
	// Burst is the provider's burst in tokens; zero means one minute's worth.
	Burst float64
	// SafetyFactor scales both burst and rate, in (0, 1]; zero means
	// DefaultSafetyFactor.
	SafetyFactor float64
	// PriorityHeadroom is the share of the capacity, in [0, 1), that only
	// priority requests may use.
	PriorityHeadroom float64
}

// Bucket returns the provider bucket named name with the store key key.
// Invalid values are refused with an error naming the field.
func (p ProviderLimit) Bucket(name, key string) (Bucket, error) {
	if err := positive("tokens_per_minute", p.TokensPerMinute); err != nil {
		return Bucket{}, err
	}
	if p.Burst < 0 || math.IsNaN(p.Burst) || math.IsInf(p.Burst, 0) {
		return Bucket{}, fmt.Errorf("%w: burst must be zero or a positive finite number, got %v", ErrInvalidLimit, p.Burst)
	}
	f := p.SafetyFactor
	if f == 0 {
		f = DefaultSafetyFactor
	}
	if !(f > 0 && f <= 1) {
		return Bucket{}, fmt.Errorf("%w: safety_factor must be in (0, 1], got %v", ErrInvalidLimit, p.SafetyFactor)
	}
	if !(p.PriorityHeadroom >= 0 && p.PriorityHeadroom < 1) {
		return Bucket{}, fmt.Errorf("%w: priority_headroom must be in [0, 1), got %v", ErrInvalidLimit, p.PriorityHeadroom)
	}
	l := PerMinute(p.TokensPerMinute, p.Burst)
	l.Capacity *= f
	l.Rate *= f
	b := Bucket{Name: name, Key: key, Limit: l, Headroom: l.Capacity * p.PriorityHeadroom}
	return b, b.Validate()
}
