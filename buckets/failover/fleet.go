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

// Pinger is a primary store that can be asked whether it answers, writing
// nothing: Run probes it while it is down, when there is no Fleet to beat.
// The Redis store implements it.
type Pinger interface {
	Ping(ctx context.Context) error
}

// Beat sends one heartbeat and, when it is answered, divides the fleet's
// fallback by the gateways alive, and ends an outage (replaying what the
// primary missed). During an outage the last count stands.
func (s *Store) Beat(ctx context.Context) error {
	if s.opts.Fleet == nil {
		return nil
	}
	n, err := s.opts.Fleet.Heartbeat(ctx, s.opts.GatewayID, 3*s.opts.HeartbeatEvery)
	if err != nil {
		s.failed(ctx, err)
		return fmt.Errorf("failover: heartbeat: %w", err)
	}
	s.succeeded()
	if old := s.gateways.Swap(int64(n)); old != int64(n) {
		if s.opts.OnShare != nil {
			s.opts.OnShare(n, s.share())
		}
		s.opts.Logger.Info("gateways sharing the store", "gateways", n, "fallback_tokens_per_minute", s.share().Rate*60)
	}
	return nil
}

// Run does the store's background work until ctx ends. Every
// Options.HeartbeatEvery it beats (with a Fleet) or, while the primary is
// down or writes wait for replay, probes the primary (a Pinger); either
// answered ends the outage, so what the primary missed is replayed as soon
// as it answers, not with the next request. When ctx ends it takes the
// gateway out of the fleet, so the others' shares grow at once. Run it in
// its own goroutine for as long as the gateway serves; call Drain after it
// returns.
func (s *Store) Run(ctx context.Context) {
	t := time.NewTicker(s.opts.HeartbeatEvery)
	defer t.Stop()
	for {
		s.tick(ctx)
		select {
		case <-ctx.Done():
			if s.opts.Fleet == nil {
				return
			}
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

// probe is what Run asks whether the primary answers: Options.Probe, or
// the primary itself.
func (s *Store) probe() Pinger {
	if s.opts.Probe != nil {
		return s.opts.Probe
	}
	p, _ := s.primary.(Pinger)
	return p
}

// tick is one round of Run's work.
func (s *Store) tick(ctx context.Context) {
	if s.opts.Fleet != nil {
		if err := s.Beat(ctx); err != nil && ctx.Err() == nil {
			s.opts.Logger.Debug("heartbeat not answered", "err", err)
		}
	} else if p := s.probe(); p != nil && (s.down.Load() || s.Pending() > 0) {
		err := p.Ping(ctx)
		if !s.failed(ctx, err) && err == nil {
			s.succeeded()
		}
	}
	if !s.down.Load() {
		s.startReplay()
	}
}

func newGatewayID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
