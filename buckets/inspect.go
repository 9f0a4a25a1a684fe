package buckets

import (
	"context"
	"fmt"
)

// Inspect reports each bucket's state now — its remaining tokens and the
// time until it is full again — without changing anything: what a usage
// report shows. A bucket never used (or refilled and swept) is full.
func (m *Memory) Inspect(ctx context.Context, bs []Bucket) ([]BucketState, error) {
	for _, b := range bs {
		if err := b.Validate(); err != nil {
			return nil, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("inspect: %w", err)
	}
	out := make([]BucketState, len(bs))
	for i, b := range bs {
		sh := &m.shards[m.shardOf(b.Key)]
		sh.mu.Lock()
		now := m.nowNS()
		tokens, last, _ := sh.peek(b, now)
		sh.mu.Unlock()
		out[i] = NewState(b, Observation{Level: tokens, Hold: hold(last, now)})
	}
	return out, nil
}

// InUse reports how many slots of each concurrency limit are held now
// (leases not released and not expired), without changing anything.
func (m *Memory) InUse(ctx context.Context, ss []Slot) ([]int, error) {
	for _, s := range ss {
		if err := s.Validate(); err != nil {
			return nil, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("in use: %w", err)
	}
	out := make([]int, len(ss))
	for i, s := range ss {
		sh := &m.shards[m.shardOf(s.Key)]
		sh.mu.Lock()
		now := m.nowNS()
		for _, exp := range sh.slots[s.Key] {
			if exp > now {
				out[i]++
			}
		}
		sh.mu.Unlock()
	}
	return out, nil
}
