package redisstore

import (
	"context"
	"fmt"
	"strconv"

	"github.com/tokengate/tokengate/buckets"
)

// addSpendLua adds an amount to a quota window's spend, whatever its
// limit. It needs no clock: the caller passes the window's TTL.
//
// KEYS: the quota key. ARGV: the amount as a packed double, the TTL (ms)
// of a write (until the window's end and the slack; zero or less writes
// nothing).
// Returns the spend after the addition, as a packed double, or 0 when it
// wrote nothing.
const addSpendLua = `
if tonumber(ARGV[2]) <= 0 then return 0 end
local v = redis.call('GET', KEYS[1])
local s = struct.unpack('<d', ARGV[1])
if v then
  s = s + struct.unpack('<d', v)
  redis.call('SET', KEYS[1], struct.pack('<d', s), 'KEEPTTL')
else
  redis.call('SET', KEYS[1], struct.pack('<d', s), 'PX', ARGV[2])
end
return struct.pack('<d', s)
`

var addSpendScript = newScript(addSpendLua)

var _ buckets.SpendAdder = (*Store)(nil)

// AddSpend implements buckets.SpendAdder: one script call per spend, as
// the windows of different quotas may live in different cluster slots.
func (s *Store) AddSpend(ctx context.Context, ss []buckets.Spend) error {
	if err := buckets.ValidateSpend(ss); err != nil {
		return err
	}
	ctx, cancel, err := s.start(ctx, "add spend")
	if err != nil {
		return err
	}
	defer cancel()
	now := s.now()
	for _, sp := range ss {
		ttl := strconv.FormatFloat(quotaTTL(sp.Window, now), 'f', 0, 64)
		key := s.quotaKey(sp.Quota.Key, sp.Window.ID)
		if _, err := s.run(ctx, addSpendScript, []string{key}, []any{string(pack(nil, sp.Amount)), ttl}); err != nil {
			return fmt.Errorf("redisstore: add spend to %q: %w", sp.Quota.Name, err)
		}
	}
	return nil
}
