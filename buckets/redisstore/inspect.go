package redisstore

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// inUseLua reads buckets and concurrency limits without writing: a usage
// report's view. KEYS: nb bucket keys, then slot keys. ARGV: now, nb, then
// capacity and rate per bucket. Returns the packed level and hold (µs) of
// every bucket, and per slot key the leases not yet expired.
const inUseLua = luaPrelude + `
local nb = tonumber(ARGV[2])
local levels, held = {}, {}
for i = 1, nb do
  local l, t = get(KEYS[i], tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i]))
  local h = 0
  if t > now then h = t - now end
  levels[#levels + 1] = struct.pack('<dd', l, h)
end
for i = nb + 1, #KEYS do
  held[#held + 1] = redis.call('ZCOUNT', KEYS[i], '(' .. string.format('%d', now), '+inf')
end
return {table.concat(levels), held}
`

var inUseScript = newScript(inUseLua)

// InUse reports how many slots of each concurrency limit are held now:
// leases neither released nor expired. It writes nothing.
func (s *Store) InUse(ctx context.Context, ss []buckets.Slot) ([]int, error) {
	_, held, err := s.inspect(ctx, nil, ss)
	return held, err
}

func (s *Store) inspect(ctx context.Context, bs []buckets.Bucket, ss []buckets.Slot) ([]buckets.BucketState, []int, error) {
	for _, b := range bs {
		if err := b.Validate(); err != nil {
			return nil, nil, err
		}
	}
	for _, sl := range ss {
		if err := sl.Validate(); err != nil {
			return nil, nil, err
		}
	}
	ctx, cancel, err := s.start(ctx, "inspect")
	if err != nil {
		return nil, nil, err
	}
	defer cancel()
	states, held := make([]buckets.BucketState, len(bs)), make([]int, len(ss))
	gs := s.groups(bs, ss, nil)
	errs := make([]error, len(gs))
	eachGroup(len(gs), func(k int) {
		g := gs[k]
		keys := make([]string, 0, len(g.buckets)+len(g.slots))
		args := []any{s.nowArg(), len(g.buckets)}
		for _, i := range g.buckets {
			keys = append(keys, s.bucketKey(bs[i].Key))
			args = append(args, num(bs[i].Limit.Capacity), num(bs[i].Limit.Rate))
		}
		for _, j := range g.slots {
			keys = append(keys, s.slotKey(ss[j].Key))
		}
		out, err := s.run(ctx, inUseScript, keys, args)
		if err != nil {
			errs[k] = err
			return
		}
		packed, _ := out[0].(string)
		counts, _ := out[1].([]any)
		if len(packed) != 16*len(g.buckets) || len(counts) != len(g.slots) {
			errs[k] = fmt.Errorf("%w: inspect: unexpected reply %v", buckets.ErrStore, out)
			return
		}
		for n, i := range g.buckets {
			level := math.Float64frombits(binary.LittleEndian.Uint64([]byte(packed[16*n:])))
			hold := math.Float64frombits(binary.LittleEndian.Uint64([]byte(packed[16*n+8:])))
			states[i] = buckets.NewState(bs[i], buckets.Observation{Level: level, Hold: time.Duration(hold) * time.Microsecond})
		}
		for n, j := range g.slots {
			c, _ := counts[n].(int64)
			held[j] = int(c)
		}
	})
	for _, err := range errs {
		if err != nil {
			return nil, nil, fmt.Errorf("redisstore: inspect: %w", err)
		}
	}
	return states, held, nil
}
