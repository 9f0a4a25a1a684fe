package failover

import (
	"context"
	"fmt"
	"sync"

	"github.com/tokengate/tokengate/buckets"
)

// maxQuotaMemo bounds the quota windows a Store remembers; past it, the
// memory starts again (windows it forgot count as unspent).
const maxQuotaMemo = 100_000

// quotaMemo holds what the store knows of the shared quota windows.
type quotaMemo struct {
	mu sync.Mutex
	// spent is, per quota key, window ID and unit, the spend the primary last
	// reported.
	spent map[quotaWindow]float64
	// charged is, per quota key, window ID and unit, the outage (see
	// Store.outages) in which the local store was charged the rest.
	charged map[quotaWindow]int64
}

// quotaWindow names a quota's window in the quota's unit: a quota switched
// to another unit (or currency) has a spend of its own (Quota.Tag).
type quotaWindow struct {
	key, window string
	unit        buckets.Unit
	currency    string
}

// noteSpend remembers the spend of each quota window of a decision of the
// primary.
func (s *Store) noteSpend(req buckets.Request, d buckets.Decision) {
	if s.local == nil || len(req.Quotas) == 0 || len(d.Quotas) != len(req.Quotas) {
		return
	}
	m := &s.quotas
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.spent == nil {
		m.spent = make(map[quotaWindow]float64, len(req.Quotas))
	}
	for j, q := range req.Quotas {
		k := quotaWindow{q.Key, d.Quotas[j].Window, q.Unit, q.Currency}
		if _, ok := m.spent[k]; !ok && len(m.spent) >= maxQuotaMemo {
			clear(m.spent)
		}
		m.spent[k] = d.Quotas[j].Spent
	}
}

// chargeRest charges the local store, for each quota of qs not yet charged
// in this outage, what this gateway may not spend of its window: all but
// its share of what the primary last reported left (see the package
// documentation).
func (s *Store) chargeRest(ctx context.Context, qs []buckets.Quota) error {
	if len(qs) == 0 {
		return nil
	}
	now, outage := s.opts.Now(), s.outages.Load()
	n := 1.0
	if g := s.gateways.Load(); s.opts.Fleet != nil && g > 1 {
		n = float64(g)
	}
	m := &s.quotas
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.charged == nil {
		m.charged = make(map[quotaWindow]int64, len(qs))
	}
	for _, q := range qs {
		k := quotaWindow{q.Key, q.Window.ID(now), q.Unit, q.Currency}
		if m.charged[k] == outage {
			continue
		}
		share := max(0, q.Limit-m.spent[k]) / n
		_, st, err := s.local.Inspect(ctx, nil, []buckets.Quota{q})
		if err != nil {
			return fmt.Errorf("failover: quota %q: %w", q.Name, err)
		}
		if rest := q.Limit - share - st[0].Spent; rest > 0 {
			req := buckets.Request{Quotas: []buckets.Quota{q}}
			if q.Unit == buckets.Money {
				req.Money = rest
			} else {
				req.Cost = rest
			}
			// A refusal means a settlement made the local spend larger
			// since it was read: the window is already spent as far as it
			// should be.
			if _, err := s.local.Reserve(ctx, req); err != nil {
				return fmt.Errorf("failover: quota %q: %w", q.Name, err)
			}
		}
		if _, ok := m.charged[k]; !ok && len(m.charged) >= maxQuotaMemo {
			clear(m.charged)
		}
		m.charged[k] = outage
	}
	return nil
}

// keepSpend queues for the shared windows the quota spend of a reservation
// the local store took and has settled with actual, and replays it at once
// when the primary answers again by then.
func (s *Store) keepSpend(r *buckets.Reservation, actual float64) {
	if _, ok := s.primary.(buckets.SpendAdder); !ok || len(r.Quotas) == 0 {
		return
	}
	var ss []buckets.Spend
	for j, q := range r.Quotas {
		if a := r.UsedQuota(q, actual); a > 0 && j < len(r.Windows) {
			ss = append(ss, buckets.Spend{Quota: q, Window: r.Windows[j], Amount: a})
		}
	}
	if len(ss) == 0 {
		return
	}
	s.queue(pendingOp{Kind: spendOp, ID: r.ID, Spends: ss})
	if !s.down.Load() {
		s.startReplay()
	}
}
