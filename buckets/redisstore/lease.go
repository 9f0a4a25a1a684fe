package redisstore

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// leaseLua applies lease ops (buckets.LeaseOp), each to its own bucket,
// each in the one atomic step buckets.LeaseStep describes: refill (S2),
// give back, then take need — all or nothing, as a reserve of that cost
// would be decided (S3–S5, S12, S14, S19) — and as much more as the bucket
// holds above its headroom, up to want in all. A step that neither gives
// nor grants leaves the bucket alone (S9); every write keeps its records
// (see lua.go). Each op applies once: its marker key keeps its result for
// the repeat window, and a copy of the op that runs later (the call's
// reply was lost and it was sent again) answers that result, so a take
// sent again returns the grant of the first.
//
// KEYS: one bucket key per op (a key may repeat: ops apply in order), then
// one marker key per op. ARGV: now, struct format, packed numbers: per op
// capacity, rate, low, TTL from low (ms), floor, reserve (the headroom
// need must leave: zero for priority), headroom, hard (1/0), give, need,
// want, max wait (s); then the markers' TTL (ms).
//
// Returns one packed string of doubles, per op: ok (1/0), granted, level
// after the step, hold (µs), forgiven.
const leaseLua = luaPrelude + `
local p = {struct.unpack(ARGV[2], ARGV[3])}
local vals, nv = {}, 0
local nk = #KEYS / 2
for i = 1, nk do
  local done = redis.call('GET', KEYS[nk + i])
  if done then
    vals[nv + 1], vals[nv + 2], vals[nv + 3], vals[nv + 4], vals[nv + 5] = struct.unpack('<ddddd', done)
    nv = nv + 5
  else
    local q = 12 * (i - 1) + 1
    local cap, rate, low, ttl = p[q], p[q + 1], p[q + 2], p[q + 3]
    local floor, res, head, hard = p[q + 4], p[q + 5], p[q + 6], p[q + 7]
    local give, need, want, maxwait = p[q + 8], p[q + 9], p[q + 10], p[q + 11]
    local l, t, r, m = get(KEYS[i], cap, rate)
    local forgiven = 0
    if give > 0 then
      l = l + give
      if l > cap then l = cap end
    elseif give < 0 then
      if l + give >= floor then
        l = l + give
      elseif l > floor then
        forgiven = floor - (l + give)
        l = floor
      else
        forgiven = -give
      end
    end
    local ok, granted = 0, 0
    if need <= cap - res then
      local w = 0
      if l < need + res or t > now then
        local short = need + res - l
        if short < 0 then short = 0 end
        w = (t - now) / 1e6 + short / rate
      end
      if w <= 0 then
        local extra = want - need
        if l - need - head < extra then extra = l - need - head end
        if extra < 0 then extra = 0 end
        ok, granted = 1, need + extra
      elseif hard == 0 and w <= maxwait then
        ok, granted = 1, need
      end
    end
    l = l - granted
    if give ~= 0 or granted > 0 then put(KEYS[i], l, t, r, m, cap, rate, low, ttl) end
    local hold = 0
    if t > now then hold = t - now end
    vals[nv + 1], vals[nv + 2], vals[nv + 3], vals[nv + 4], vals[nv + 5] = ok, granted, l, hold, forgiven
    nv = nv + 5
    redis.call('SET', KEYS[nk + i], struct.pack('<ddddd', ok, granted, l, hold, forgiven), 'PX', ARGV[4])
  end
end
return struct.pack('<' .. string.rep('d', nv), unpack(vals, 1, nv))
`

var leaseScript = newScript(leaseLua)

// leaseNumbers is how many numbers leaseLua takes per op; maxLeaseOps
// bounds the ops of one call, as Lua unpacks the numbers onto its stack,
// which holds 8000 values.
const (
	leaseNumbers = 12
	maxLeaseOps  = 256
)

// Lease implements the lending interface of package lease: each op in one
// atomic step (see buckets.LeaseOp), one script call per hash slot (and
// per maxLeaseOps ops), the calls made concurrently. Ops of a slot whose call fails
// are not Done; the error is the first failure.
func (s *Store) Lease(ctx context.Context, ops []buckets.LeaseOp) error {
	for i := range ops {
		if err := ops[i].Validate(); err != nil {
			return err
		}
	}
	if len(ops) == 0 {
		return nil
	}
	ctx, cancel, err := s.start(ctx, "lease")
	if err != nil {
		return err
	}
	defer cancel()
	bs := make([]buckets.Bucket, len(ops))
	for i := range ops {
		bs[i] = ops[i].Bucket
	}
	var calls [][]int
	for _, g := range s.groups(bs, nil, nil) {
		for len(g.buckets) > maxLeaseOps {
			calls = append(calls, g.buckets[:maxLeaseOps])
			g.buckets = g.buckets[maxLeaseOps:]
		}
		calls = append(calls, g.buckets)
	}
	errs := make([]error, len(calls))
	eachGroup(len(calls), func(k int) { errs[k] = s.lease(ctx, ops, calls[k]) })
	for _, err := range errs {
		if err != nil {
			return fmt.Errorf("redisstore: lease: %w", err)
		}
	}
	return nil
}

// lease runs the ops at index in one script call.
func (s *Store) lease(ctx context.Context, ops []buckets.LeaseOp, index []int) error {
	n := len(index)
	keys := make([]string, 2*n)
	packed := make([]byte, 0, 8*leaseNumbers*n)
	call := newID()[:16]
	for j, i := range index {
		op := &ops[i]
		b := op.Bucket
		keys[j] = s.bucketKey(b.Key)
		keys[n+j] = s.prefix + "l:{" + keyPart(b.Key) + "}:" + call + ":" + strconv.Itoa(j)
		low := ttlLow(b)
		hard := 0.0
		if b.Hard {
			hard = 1
		}
		packed = pack(packed, b.Limit.Capacity, b.Limit.Rate, low, ttlFrom(b, low), b.Floor(),
			b.Reserve(op.Priority), b.Headroom, hard, op.Give, op.Need, max(op.Need, op.Want), op.MaxWait.Seconds())
	}
	out, err := s.run(ctx, leaseScript, keys, []any{s.nowArg(), structFormat(leaseNumbers * n), string(packed), repeatMS})
	if err != nil {
		return err
	}
	p, _ := out[0].(string)
	if len(out) != 1 || len(p) != 8*5*n {
		return fmt.Errorf("%w: unexpected lease reply %q", buckets.ErrStore, out)
	}
	f := func(i int) float64 { return math.Float64frombits(binary.LittleEndian.Uint64([]byte(p[8*i:]))) }
	for j, i := range index {
		op := &ops[i]
		op.OK, op.Granted = f(5*j) == 1, f(5*j+1)
		op.Observation = buckets.Observation{Level: f(5*j + 2), Hold: time.Duration(f(5*j+3)) * time.Microsecond, Forgiven: f(5*j + 4)}
		op.Done = true
	}
	return nil
}
