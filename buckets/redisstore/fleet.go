package redisstore

import (
	"context"
	"fmt"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// heartbeatLua records that a gateway is alive until now + ttl and counts
// the gateways alive, by Redis's clock (S2): the sorted set of gateway IDs
// scored by when their heartbeat expires.
//
// KEYS: the set. ARGV: now, gateway ID, TTL (µs).
const heartbeatLua = luaNow + `
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ms = ttl / 1000 + 1000
redis.call('PEXPIRE', KEYS[1], ms - ms % 1)
return redis.call('ZCARD', KEYS[1])
`

var heartbeatScript = newScript(heartbeatLua)

func (s *Store) fleetKey() string { return s.prefix + "gateways" }

// Heartbeat records that gateway is alive for ttl and returns how many
// gateways sharing this Redis are alive, itself included. A failover store
// divides its fleet's fallback limit by that number (failover.Fleet).
func (s *Store) Heartbeat(ctx context.Context, gateway string, ttl time.Duration) (int, error) {
	ctx, cancel, err := s.start(ctx, "heartbeat")
	if err != nil {
		return 0, err
	}
	defer cancel()
	out, err := s.run(ctx, heartbeatScript, []string{s.fleetKey()}, []any{s.nowArg(), idPart(gateway), ttl.Microseconds()})
	if err != nil {
		return 0, fmt.Errorf("redisstore: heartbeat: %w", err)
	}
	n, ok := out[0].(int64)
	if !ok {
		return 0, fmt.Errorf("redisstore: heartbeat: %w: unexpected reply %v", buckets.ErrStore, out)
	}
	return int(n), nil
}

// Leave removes gateway from the gateways alive, for a gateway that shuts
// down.
func (s *Store) Leave(ctx context.Context, gateway string) error {
	ctx, cancel, err := s.start(ctx, "leave")
	if err != nil {
		return err
	}
	defer cancel()
	if _, err := s.run(ctx, leaveScript, []string{s.fleetKey()}, []any{idPart(gateway)}); err != nil {
		return fmt.Errorf("redisstore: leave: %w", err)
	}
	return nil
}

var leaveScript = newScript(`return redis.call('ZREM', KEYS[1], ARGV[1])`)

var pingScript = newScript(`return 1`)

// Ping asks Redis whether it answers, writing nothing: failover.Store
// probes it while Redis is down (failover.Pinger).
func (s *Store) Ping(ctx context.Context) error {
	ctx, cancel, err := s.start(ctx, "ping")
	if err != nil {
		return err
	}
	defer cancel()
	if _, err := s.run(ctx, pingScript, nil, nil); err != nil {
		return fmt.Errorf("redisstore: ping: %w", err)
	}
	return nil
}
