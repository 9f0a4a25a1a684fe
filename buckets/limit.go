package buckets

// Limit is a bucket's capacity B (burst, in tokens) and refill rate r (tokens
// per second), S1.
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
