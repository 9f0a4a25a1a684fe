package buckets

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"
)

// Errors that cross package lines. Stores wrap them with a specific message.
var (
	// ErrInvalidLimit: a limit or bucket setting is out of range (S1).
	ErrInvalidLimit = errors.New("invalid bucket limit")
	// ErrInvalidRequest: a request, reservation or amount cannot be applied.
	ErrInvalidRequest = errors.New("invalid bucket request")
	// ErrStore: the store could not be reached or answered unexpectedly
	// (S21). The caller applies its configured failure mode.
	ErrStore = errors.New("bucket store unavailable")
)

// Renewer is implemented by stores whose concurrency slots and reservations
// can be renewed: a gateway streaming a response longer than a slot's Lease
// or the reservation's Lifetime renews it (within it) so that the slot
// keeps counting and the reservation stays settleable.
type Renewer interface {
	Renew(ctx context.Context, r *Reservation) error
}

// AsyncSettler is implemented by stores that can settle without the caller
// waiting: the settlement joins the store's next call, which costs the
// store a call less per request. A caller that has nothing left to do
// with the results (a finished response) wants SettleAsync.
type AsyncSettler interface {
	// SettleAsync settles r as Settle does, later: it returns at once, and
	// done, if not nil, is called with Settle's results once the settlement
	// is written (or failed), from another goroutine — or before
	// SettleAsync returns, for invalid input. r must not be used by the
	// caller afterwards.
	SettleAsync(r *Reservation, actual float64, done func([]BucketState, error))
	// Flush writes every queued settlement and returns once all are done,
	// or when ctx ends: call it before shutting down.
	Flush(ctx context.Context) error
}

// DefaultSettleWindow is how long a settlement queued by SettleAsync waits,
// unless a store is told otherwise, for a call to the store to join before
// it goes on its own.
const DefaultSettleWindow = 2 * time.Millisecond

// DefaultSlotLease is the lease of a concurrency slot whose Lease is zero.
// A stream that outlives its lease no longer counts against the limit, so the
// lease should exceed the longest expected response.
const DefaultSlotLease = 10 * time.Minute

// DefaultLifetime is the Lifetime of a reservation whose request sets none.
// Settlement deletes a reservation's record, so the lifetime only bounds
// how long a reservation that is never settled (its gateway died) is
// remembered.
const DefaultLifetime = time.Hour

// Validate reports whether the bucket can be used: Key is set, the limit is
// valid (S1), MaxDebt is not negative, Headroom leaves room below the
// capacity (S19) and a Lease is valid. The error names the field.
func (b Bucket) Validate() error {
	if b.Key == "" {
		return fmt.Errorf("%w: bucket %q: key is empty", ErrInvalidLimit, b.Name)
	}
	if err := b.Limit.Validate(); err != nil {
		return fmt.Errorf("bucket %q: %w", b.Name, err)
	}
	if !(b.MaxDebt >= 0) || math.IsInf(b.MaxDebt, 0) {
		return fmt.Errorf("%w: bucket %q: max_debt must be zero or positive, got %v", ErrInvalidLimit, b.Name, b.MaxDebt)
	}
	if !(b.Headroom >= 0 && b.Headroom < b.Limit.Capacity) {
		return fmt.Errorf("%w: bucket %q: headroom must be in [0, capacity), got %v", ErrInvalidLimit, b.Name, b.Headroom)
	}
	if b.Lease != nil {
		if err := b.Lease.Validate(); err != nil {
			return fmt.Errorf("bucket %q: %w", b.Name, err)
		}
	}
	return nil
}

// Floor is the lowest level settlement may drive the bucket to (S9, S14):
// zero for a hard bucket, -MaxDebt for a soft one with MaxDebt set, and no
// floor at all (-Inf) by default. What a settlement would take below the
// floor is forgiven (BucketState.Forgiven).
//
// Why no floor by default: a floor bounds what one request can escape, not
// how many requests are in flight. A client whose requests reserve R tokens
// but use U > R + D (D = MaxDebt), one at a time, each lasting L, gets
// U / (D + R + r·L) times the rate r; with D = Capacity = 10,000, R = 1,024
// and U = 32,768 that is 2.97×. With k requests in flight the factor is
// about k·U / (D + k·R + r·L), which tends to U / (2R) — 16× here — however
// large D is, since k grows with L. Without a floor nothing is forgiven:
// every token used is charged, the debt is repaid by refill before the next
// admission, and over any run a client gets at most the configured rate,
// Capacity + r·T in T seconds, plus what its requests still in flight use
// beyond their reservations. Implausible usage is for the caller to bound
// before it settles; the floor is not the place for it.
func (b Bucket) Floor() float64 {
	switch {
	case b.Hard:
		return 0
	case b.MaxDebt > 0:
		return -b.MaxDebt
	default:
		return math.Inf(-1)
	}
}

// Reserve is the level a request must leave in the bucket to be admitted
// (S19): the headroom for ordinary requests, zero for priority ones.
func (b Bucket) Reserve(priority bool) float64 {
	if priority {
		return 0
	}
	return b.Headroom
}

// Validate reports whether the slot can be used: Key is set, Max is positive
// and Lease is not negative.
func (s Slot) Validate() error {
	switch {
	case s.Key == "":
		return fmt.Errorf("%w: slot %q: key is empty", ErrInvalidLimit, s.Name)
	case s.Max <= 0:
		return fmt.Errorf("%w: slot %q: max must be positive, got %d", ErrInvalidLimit, s.Name, s.Max)
	case s.Lease < 0:
		return fmt.Errorf("%w: slot %q: lease must not be negative, got %v", ErrInvalidLimit, s.Name, s.Lease)
	}
	return nil
}

// LifetimeOrDefault is how long a reservation of the request stays
// settleable: its Lifetime, DefaultLifetime when zero, and at least the
// longest lease of its slots.
func (r Request) LifetimeOrDefault() time.Duration { return lifetime(r.Lifetime, r.Slots) }

// LifetimeOrDefault is how long the reservation stays settleable after it
// is taken or renewed; see Request.LifetimeOrDefault.
func (r *Reservation) LifetimeOrDefault() time.Duration { return lifetime(r.Lifetime, r.Slots) }

func lifetime(d time.Duration, slots []Slot) time.Duration {
	if d <= 0 {
		d = DefaultLifetime
	}
	for _, s := range slots {
		d = max(d, s.LeaseOrDefault())
	}
	return d
}

// LeaseOrDefault is the slot's lease, DefaultSlotLease when Lease is zero.
func (s Slot) LeaseOrDefault() time.Duration {
	if s.Lease == 0 {
		return DefaultSlotLease
	}
	return s.Lease
}

// Validate reports whether the request can be submitted to a store: a
// finite, non-negative cost, money and money per token, a non-negative
// MaxWait, and valid buckets, slots and quotas, no two of a kind sharing a
// key.
func (r Request) Validate() error {
	if err := amount("cost", r.Cost); err != nil {
		return err
	}
	if err := amount("money", r.Money); err != nil {
		return err
	}
	if err := amount("money per token", r.MoneyPerToken); err != nil {
		return err
	}
	if r.MaxWait < 0 {
		return fmt.Errorf("%w: max_wait must not be negative, got %v", ErrInvalidRequest, r.MaxWait)
	}
	if r.Lifetime < 0 {
		return fmt.Errorf("%w: lifetime must not be negative, got %v", ErrInvalidRequest, r.Lifetime)
	}
	for i, b := range r.Buckets {
		if err := b.Validate(); err != nil {
			return err
		}
		for _, o := range r.Buckets[:i] {
			if o.Key == b.Key {
				return fmt.Errorf("%w: buckets %q and %q share the key %q", ErrInvalidRequest, o.Name, b.Name, b.Key)
			}
		}
	}
	for i, s := range r.Slots {
		if err := s.Validate(); err != nil {
			return err
		}
		for _, o := range r.Slots[:i] {
			if o.Key == s.Key {
				return fmt.Errorf("%w: slots %q and %q share the key %q", ErrInvalidRequest, o.Name, s.Name, s.Key)
			}
		}
	}
	for i, q := range r.Quotas {
		if err := q.Validate(); err != nil {
			return err
		}
		for _, o := range r.Quotas[:i] {
			if o.Key == q.Key {
				return fmt.Errorf("%w: quotas %q and %q share the key %q", ErrInvalidRequest, o.Name, q.Name, q.Key)
			}
		}
	}
	return nil
}

func amount(what string, v float64) error {
	if !(v >= 0) || math.IsInf(v, 0) {
		return fmt.Errorf("%w: %s must be a finite number >= 0, got %v", ErrInvalidRequest, what, v)
	}
	return nil
}

// ValidateAmount checks an Extend or Settle amount: finite and not negative.
func ValidateAmount(what string, v float64) error { return amount(what, v) }

// Charged is what the reservation has taken from bucket b so far: its cost,
// plus what Extend debited when b is hard.
func (r *Reservation) Charged(b Bucket) float64 {
	if b.Hard {
		return r.Cost + r.Extended
	}
	return r.Cost
}

// HasHard reports whether any bucket or quota of the reservation is hard.
func (r *Reservation) HasHard() bool {
	for _, b := range r.Buckets {
		if b.Hard {
			return true
		}
	}
	for _, q := range r.Quotas {
		if q.Hard {
			return true
		}
	}
	return false
}

// Observation is what a store saw of one bucket in the atomic step of an
// operation: the level after the step (for a refused request, the level the
// request met), and Hold, the time until refill resumes — non-zero only
// while the bucket is paused (S18). Stores report observations and let
// NewDecision and NewState derive everything else, so that every store
// answers identically.
type Observation struct {
	Level float64
	Hold  time.Duration
	// Forgiven is what a settlement did not charge because the floor
	// stopped it; zero for every other operation.
	Forgiven float64
}

// NewState returns the state of bucket b observed as o: its remaining tokens
// and the time until it is full again.
func NewState(b Bucket, o Observation) BucketState {
	reset := o.Hold
	if o.Level < b.Limit.Capacity {
		reset += Seconds((b.Limit.Capacity - o.Level) / b.Limit.Rate)
	}
	return BucketState{Name: b.Name, Limit: b.Limit, Remaining: o.Level, Reset: reset, Forgiven: o.Forgiven}
}

// shortWait is how long until bucket b, observed at level with refill held
// for hold, could give need tokens and keep its reserve: zero when it can now.
func shortWait(b Bucket, level float64, hold time.Duration, need float64) time.Duration {
	if level >= need && hold <= 0 {
		return 0
	}
	return hold + Seconds(max(0, need-level)/b.Limit.Rate)
}

// WaitFor is how long a request of cost c, priority or not, would wait for
// bucket b observed (before the request) as level and hold (S5, S9, S18).
func WaitFor(b Bucket, level float64, hold time.Duration, c float64, priority bool) time.Duration {
	return shortWait(b, level, hold, c+b.Reserve(priority))
}

// Fits reports whether cost c can ever be admitted by b (S4): c may not
// exceed the capacity, less the headroom for ordinary requests (S19).
func Fits(b Bucket, c float64, priority bool) bool {
	return c <= b.Limit.Capacity-b.Reserve(priority)
}

// Step is what a store saw in the atomic step of a Reserve.
type Step struct {
	// Reason is the outcome.
	Reason Reason
	// Buckets holds one Observation per bucket of the request: after the
	// take when admitted, before it otherwise.
	Buckets []Observation
	// Slot is the index of the full concurrency slot when Reason is
	// ConcurrencyFull.
	Slot int
	// Quotas holds, per quota of the request, the spend of its window
	// (after the take when admitted, before it otherwise), and Spans the
	// window, taken at Now.
	Quotas []float64
	Spans  []Span
	Now    time.Time
}

// NewDecision assembles the Decision for req from one store's atomic step.
// id is the reservation ID to use when admitted.
func NewDecision(req Request, id string, step Step) Decision {
	reason, obs, slot := step.Reason, step.Buckets, step.Slot
	d := Decision{OK: reason == Admitted, Reason: reason, Buckets: make([]BucketState, len(req.Buckets))}
	least := math.Inf(1)
	var worst time.Duration
	for i, b := range req.Buckets {
		o := obs[i]
		d.Buckets[i] = NewState(b, o)
		switch reason {
		case Admitted:
			// Admitted ahead of time (S12): the level is below the reserve
			// until the wait has passed.
			if w := shortWait(b, o.Level, o.Hold, b.Reserve(req.Priority)); w > d.Wait {
				d.Wait = w
			}
			if o.Level < least {
				least, d.Limiting = o.Level, b.Name
			}
		case ShortOfTokens:
			if w := WaitFor(b, o.Level, o.Hold, req.Cost, req.Priority); w > worst {
				worst, d.Limiting, d.Wait = w, b.Name, w
			}
		case NeverAdmissible:
			if d.Limiting == "" && !Fits(b, req.Cost, req.Priority) {
				d.Limiting = b.Name
			}
		}
	}
	if reason == ConcurrencyFull && slot >= 0 && slot < len(req.Slots) {
		d.Limiting = req.Slots[slot].Name
	}
	if len(req.Quotas) > 0 {
		d.Quotas = make([]QuotaState, len(req.Quotas))
		for i, q := range req.Quotas {
			st := NewQuotaState(q, step.Spans[i], step.Quotas[i], step.Now)
			d.Quotas[i] = st
			c := req.QuotaCost(q)
			switch {
			case reason == NeverAdmissible && d.Limiting == "" && !FitsQuota(q, c):
				d.Limiting = q.Name
			case reason == OverQuota && st.Spent+c > q.Limit && (d.Wait == 0 || st.Reset > d.Wait):
				d.Limiting, d.Wait = q.Name, st.Reset
			}
		}
	}
	if d.OK {
		d.Reservation = NewReservation(req, id, step.Spans)
	}
	return d
}

// NewReservation is the reservation that admitting req makes, with ID id,
// its quotas charged in windows.
func NewReservation(req Request, id string, windows []Span) *Reservation {
	return &Reservation{
		ID: id, Cost: req.Cost, Buckets: req.Buckets, Slots: req.Slots, Priority: req.Priority, Lifetime: req.Lifetime,
		Quotas: req.Quotas, Money: req.Money, MoneyPerToken: req.MoneyPerToken, Windows: windows,
	}
}

// Seconds converts a number of seconds to a Duration, rounding up to the
// nanosecond so that waiting that long is always enough, and saturating
// instead of overflowing.
func Seconds(s float64) time.Duration {
	if !(s > 0) {
		return 0
	}
	ns := math.Ceil(s * 1e9)
	if ns >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(ns)
}

// String returns the reason's name, as used in logs and metric labels.
func (r Reason) String() string {
	switch r {
	case Admitted:
		return "admitted"
	case ShortOfTokens:
		return "short_of_tokens"
	case ConcurrencyFull:
		return "concurrency_full"
	case NeverAdmissible:
		return "never_admissible"
	case OverQuota:
		return "over_quota"
	}
	return fmt.Sprintf("Reason(%d)", int(r))
}
