package tokenizer

import (
	"fmt"
	"math"
	"sync"
)

// EstimatorOptions configures the learned output allowance (S7) of requests
// that carry no cap. The zero value uses the defaults given per field.
type EstimatorOptions struct {
	// Quantile of recent completion lengths used as the allowance, in
	// (0, 1]. Zero means 0.95: a high quantile, so that few requests
	// settle above their reservation.
	Quantile float64
	// HalfLife is the number of observations after which a completion
	// weighs half as much as a new one. Zero means 256.
	HalfLife int
	// MinSamples is how many completions a policy and model need before
	// the learned estimate replaces the default. Zero means 16.
	MinSamples int
	// MaxKeys bounds the number of policy+model pairs learned; further
	// pairs use the default. Zero means 4096.
	MaxKeys int
}

// histogram bounds: completion lengths are bucketed geometrically from 1 to
// about 2^24 tokens, each bucket 1/8 of a doubling wide (~9% apart), so
// memory per key is fixed and quantiles err upwards by at most one bucket.
const (
	histPerDoubling = 8
	histBuckets     = 24 * histPerDoubling
)

// bucketOf returns the histogram bucket of n >= 0.
func bucketOf(n int) int {
	if n <= 1 {
		return 0
	}
	b := int(math.Ceil(math.Log2(float64(n)) * histPerDoubling))
	return min(b, histBuckets-1)
}

// bucketUpper is the largest value of bucket b, rounded up.
func bucketUpper(b int) int {
	return int(math.Ceil(math.Exp2(float64(b) / histPerDoubling)))
}

// estimator learns a decaying histogram of completion lengths per policy and
// model. It is safe for concurrent use.
type estimator struct {
	opts  EstimatorOptions
	grow  float64 // weight factor per observation: 2^(1/HalfLife)
	mu    sync.RWMutex
	hists map[estKey]*hist
}

type estKey struct{ policy, model string }

type hist struct {
	mu     sync.Mutex
	scale  float64 // weight of the next observation
	total  float64
	n      int
	weight [histBuckets]float64
}

func newEstimator(o EstimatorOptions) (*estimator, error) {
	if o.Quantile < 0 || o.Quantile > 1 || math.IsNaN(o.Quantile) {
		return nil, fmt.Errorf("tokenizer: estimator quantile %v: want a value in (0, 1]", o.Quantile)
	}
	if o.HalfLife < 0 || o.MinSamples < 0 || o.MaxKeys < 0 {
		return nil, fmt.Errorf("tokenizer: estimator half-life, min samples and max keys must not be negative")
	}
	if o.Quantile == 0 {
		o.Quantile = 0.95
	}
	if o.HalfLife == 0 {
		o.HalfLife = 256
	}
	if o.MinSamples == 0 {
		o.MinSamples = 16
	}
	if o.MaxKeys == 0 {
		o.MaxKeys = 4096
	}
	return &estimator{
		opts:  o,
		grow:  math.Exp2(1 / float64(o.HalfLife)),
		hists: make(map[estKey]*hist),
	}, nil
}

// Observe feeds back what a settled request generated, so that later
// requests without a cap reserve what comparable requests really used
// (S7). n is the request's Count; outputTokens is its whole output as the
// provider reported it (or as counted live), over all its choices.
//
// The estimate is kept per policy and n.ModelKey, per choice: outputTokens
// is divided by n.Choices (rounded up), because Count multiplies the
// estimate by the choices of the next request. Only requests that carried
// no cap of their own teach the estimate (a capped output is cut at the
// client's cap, which says nothing about the length of uncapped ones, and
// embeddings have no output); negative lengths and requests without a
// model are ignored.
func (c *Counter) Observe(policy string, n Count, outputTokens int) {
	if outputTokens < 0 || n.ModelKey == "" || n.AllowanceSource == FromRequest {
		return
	}
	choices := max(n.Choices, 1)
	c.est.observe(estKey{policy, n.ModelKey}, (outputTokens+choices-1)/choices)
}

func (e *estimator) observe(k estKey, n int) {
	e.mu.RLock()
	h := e.hists[k]
	e.mu.RUnlock()
	if h == nil {
		e.mu.Lock()
		if h = e.hists[k]; h == nil {
			if len(e.hists) >= e.opts.MaxKeys {
				e.mu.Unlock()
				return
			}
			h = &hist{scale: 1}
			e.hists[k] = h
		}
		e.mu.Unlock()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.weight[bucketOf(n)] += h.scale
	h.total += h.scale
	h.n++
	// Growing the weight of new observations is the same as decaying the
	// old ones; renormalise before the numbers get large.
	h.scale *= e.grow
	if h.scale > 1e100 {
		for i := range h.weight {
			h.weight[i] /= h.scale
		}
		h.total /= h.scale
		h.scale = 1
	}
}

// estimate returns the learned allowance for k, or ok == false when too
// few completions have been seen.
func (e *estimator) estimate(k estKey) (int, bool) {
	e.mu.RLock()
	h := e.hists[k]
	e.mu.RUnlock()
	if h == nil {
		return 0, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n < e.opts.MinSamples || h.total <= 0 {
		return 0, false
	}
	want := e.opts.Quantile * h.total
	var cum float64
	for b, w := range h.weight {
		cum += w
		if cum >= want*(1-1e-12) {
			return bucketUpper(b), true
		}
	}
	return bucketUpper(histBuckets - 1), true
}
