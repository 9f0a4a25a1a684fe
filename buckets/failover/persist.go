package failover

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/tokengate/tokengate/buckets"
)

// pendingFile is the form SavePending writes: a version, so that a later
// gateway can tell a file it cannot read, and the writes in order.
type pendingFile struct {
	Version int         `json:"version"`
	Pending []pendingOp `json:"pending"`
}

const pendingVersion = 1

// SavePending writes what still waits for replay to w, for a gateway that
// stops while the primary does not answer, and returns how many writes it
// saved; LoadPending at the next start queues them again. Each applies
// once however often it is replayed, so a file replayed twice (a gateway
// that dies before it has replayed what it loaded, and loads it again)
// charges nothing twice.
func (s *Store) SavePending(w io.Writer) (int, error) {
	s.mu.Lock()
	f := pendingFile{Version: pendingVersion}
	if s.inflight {
		// Being replayed, it may fail yet: saved too, as it applies once.
		f.Pending = append(f.Pending, s.current)
	}
	f.Pending = append(f.Pending, s.pending...)
	s.mu.Unlock()
	if err := json.NewEncoder(w).Encode(f); err != nil {
		return 0, fmt.Errorf("failover: save pending writes: %w", err)
	}
	return len(f.Pending), nil
}

// LoadPending queues the writes SavePending wrote to r, ahead of any
// queued since, and returns how many; they are replayed once the primary
// answers (Run, Drain).
func (s *Store) LoadPending(r io.Reader) (int, error) {
	var f pendingFile
	if err := json.NewDecoder(r).Decode(&f); err != nil {
		return 0, fmt.Errorf("failover: load pending writes: %w", err)
	}
	if f.Version != pendingVersion {
		return 0, fmt.Errorf("failover: load pending writes: version %d, want %d", f.Version, pendingVersion)
	}
	for i, p := range f.Pending {
		if err := p.validate(); err != nil {
			return 0, fmt.Errorf("failover: load pending writes: entry %d: %w", i, err)
		}
		p.withCurrency(s.opts.Currency)
	}
	s.mu.Lock()
	s.pending = append(f.Pending, s.pending...)
	s.mu.Unlock()
	s.state()
	return len(f.Pending), nil
}

// withCurrency gives currency to every quota of money of the write that
// has none (see Options.Currency).
func (p pendingOp) withCurrency(currency string) {
	fill := func(q *buckets.Quota) {
		if q.Unit == buckets.Money && q.Currency == "" {
			q.Currency = currency
		}
	}
	if p.R != nil {
		for j := range p.R.Quotas {
			fill(&p.R.Quotas[j])
		}
	}
	for j := range p.Spends {
		fill(&p.Spends[j].Quota)
	}
}

// validate checks a pending write read from a file.
func (p pendingOp) validate() error {
	switch p.Kind {
	case settleOp, cancelOp:
		if p.R == nil || p.R.ID == "" {
			return fmt.Errorf("%s without a reservation", p.Kind)
		}
		return p.R.ValidateQuotas()
	case spendOp:
		return buckets.ValidateSpend(p.ID, p.Spends)
	}
	return fmt.Errorf("unknown kind %q", p.Kind)
}
