package buckets

import (
	"context"
	"fmt"
)

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
