package failover

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// Fleet is the part of the shared store that tells a gateway how many
// gateways share it: each announces itself with a heartbeat that lives for
// ttl. The Redis store implements it.
type Fleet interface {
	Heartbeat(ctx context.Context, gateway string, ttl time.Duration) (alive int, err error)
	Leave(ctx context.Context, gateway string) error
}

// share is the fallback limit of this gateway: with a Fleet, the fleet's
// fallback divided by the gateways alive at the last heartbeat (S20: the
// fleet must not multiply the quota), but not below FallbackFloor; without
// one, Fallback itself.
func (s *Store) share() buckets.Limit {
	n := s.gateways.Load()
	if s.opts.Fleet == nil || n <= 1 {
		return s.opts.Fallback
	}
	return buckets.Limit{
		Capacity: max(s.opts.Fallback.Capacity/float64(n), s.opts.FallbackFloor.Capacity),
		Rate:     max(s.opts.Fallback.Rate/float64(n), s.opts.FallbackFloor.Rate),
	}
}

// Gateways is how many gateways, this one included, were alive at the last
// heartbeat that reached the store; zero before the first.
func (s *Store) Gateways() int { return int(s.gateways.Load()) }

// Beat sends one heartbeat and, when it is answered, divides the fleet's
// fallback by the gateways alive. During an outage the last count stands.
func (s *Store) Beat(ctx context.Context) error {
	if s.opts.Fleet == nil {
		return nil
	}
	n, err := s.opts.Fleet.Heartbeat(ctx, s.opts.GatewayID, 3*s.opts.HeartbeatEvery)
	if err != nil {
		return fmt.Errorf("failover: heartbeat: %w", err)
	}
	if old := s.gateways.Swap(int64(n)); old != int64(n) {
		if s.opts.OnShare != nil {
			s.opts.OnShare(n, s.share())
		}
		s.opts.Logger.Info("gateways sharing the store", "gateways", n, "fallback_tokens_per_minute", s.share().Rate*60)
	}
	return nil
}

// Heartbeats beats every Options.HeartbeatEvery until ctx ends, then takes
// the gateway out of the fleet, so the others' shares grow at once. Run it
// in its own goroutine for as long as the gateway serves.
func (s *Store) Heartbeats(ctx context.Context) {
	if s.opts.Fleet == nil {
		return
	}
	t := time.NewTicker(s.opts.HeartbeatEvery)
	defer t.Stop()
	for {
		if err := s.Beat(ctx); err != nil && ctx.Err() == nil {
			s.opts.Logger.Debug("heartbeat not answered", "err", err)
		}
		select {
		case <-ctx.Done():
			lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			if err := s.opts.Fleet.Leave(lctx, s.opts.GatewayID); err != nil {
				s.opts.Logger.Warn("gateway could not leave the fleet; it counts until its heartbeat expires", "err", err)
			}
			return
		case <-t.C:
		}
	}
}

func newGatewayID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
