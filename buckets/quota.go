package buckets

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"
)

// Unit is what a quota counts.
type Unit int

const (
	// Tokens: a quota of tokens is charged the request's Cost, the tokens
	// its buckets take.
	Tokens Unit = iota
	// Money: a quota of money is charged the request's Money, in
	// micro-units of a currency (1 USD = 1,000,000).
	Money
)

// String returns the unit's name, as in logs: "tokens" or "money".
func (u Unit) String() string {
	switch u {
	case Tokens:
		return "tokens"
	case Money:
		return "money"
	}
	return fmt.Sprintf("Unit(%d)", int(u))
}

// Quota is a budget over a calendar window ("2 M tokens a day", "$500 a
// month"): at most Limit may be spent in each window, and the spend starts
// again from zero when the window ends, at its calendar boundary in its
// time zone. Unlike a bucket a quota does not refill.
//
// A request is charged against its quotas in the same atomic step as its
// buckets and slots, all or none (S3): its maximum cost at admission, which
// settlement replaces with the real cost. A request is charged to the
// window it was admitted in, also for what it settles or extends after that
// window has ended. Every token or micro-unit used is recorded: a quota has
// no floor, and a request that used more than it reserved leaves the
// window overspent, which refuses further requests until the window ends.
//
// A hard quota is metered live as a hard bucket is (S14): Extend debits it
// and refuses when the spend would pass Limit, and the caller cuts the
// stream, so a stream overruns the budget by at most what it used beyond
// its last successful Extend.
//
// The zero value is not usable: Key, Window and a positive Limit are
// required. A Quota is a plain value.
type Quota struct {
	// Name is the configuration name of the quota, used in decisions,
	// response headers and metric labels, never as a store key.
	Name string
	// Key identifies the quota in the store, as Bucket.Key does; the store
	// keys the spend by Key and the window's ID, so that each window
	// starts from zero.
	Key    string
	Window Window
	Unit   Unit
	// Currency is the ISO 4217 code of a quota of money ("USD"): its
	// spend is micro-units of it. A quota of tokens has none.
	Currency string
	// Limit is the budget per window: tokens, or micro-units of money.
	Limit float64
	Hard  bool
}

// Tag is the quota's unit as a store records it with every spend: "t" for
// tokens, "$" and the currency for money ("$USD"). A store reads a spend
// recorded with another tag as nothing spent in the window (see
// ReadsTag), so a quota switched between tokens and money, or to another
// currency, never reads the old unit's spend as the new one's.
func (q Quota) Tag() string { return unitTag(q.Unit, q.Currency) }

// ReadsTag reports whether a spend a store recorded with tag is the
// quota's: tag is the quota's own (Tag), or empty, as a store wrote spend
// before it recorded the unit, which meant the quota's configured unit.
// It allocates nothing.
func (q Quota) ReadsTag(tag string) bool { return readsTag(q.Unit, q.Currency, tag) }

// The tags of the units: a spend recorded without one was written before
// stores recorded units, and reads as the configured unit.
const (
	tokensTag = "t"
	moneyTag  = "$"
)

func unitTag(u Unit, currency string) string {
	if u == Money {
		return moneyTag + currency
	}
	return tokensTag
}

func readsTag(u Unit, currency, tag string) bool {
	if tag == "" {
		return true
	}
	if u == Money {
		return len(tag) == len(moneyTag)+len(currency) && tag[:len(moneyTag)] == moneyTag && tag[len(moneyTag):] == currency
	}
	return tag == tokensTag
}

// MaxCurrency bounds the length of a quota's Currency, and so of its Tag,
// which a store keeps with every spend.
const MaxCurrency = 16

// Validate reports whether the quota can be used: Key is set, the window
// has a period, the unit is known (with a currency of at most MaxCurrency
// bytes for money, none for tokens) and Limit is positive and finite. The
// error names the field and wraps ErrInvalidLimit.
func (q Quota) Validate() error {
	switch {
	case q.Key == "":
		return fmt.Errorf("%w: quota %q: key is empty", ErrInvalidLimit, q.Name)
	case q.Window.Period < Day || q.Window.Period > Month:
		return fmt.Errorf("%w: quota %q: window period must be day, week or month, got %v", ErrInvalidLimit, q.Name, q.Window.Period)
	case q.Unit != Tokens && q.Unit != Money:
		return fmt.Errorf("%w: quota %q: unknown unit %v", ErrInvalidLimit, q.Name, q.Unit)
	case q.Unit == Tokens && q.Currency != "":
		return fmt.Errorf("%w: quota %q: a quota of tokens has no currency, got %q", ErrInvalidLimit, q.Name, q.Currency)
	case len(q.Currency) > MaxCurrency:
		return fmt.Errorf("%w: quota %q: currency %q is longer than %d bytes", ErrInvalidLimit, q.Name, q.Currency[:MaxCurrency], MaxCurrency)
	case !(q.Limit > 0) || math.IsInf(q.Limit, 0):
		return fmt.Errorf("%w: quota %q: limit must be a positive finite number, got %v", ErrInvalidLimit, q.Name, q.Limit)
	}
	return nil
}

// QuotaSlack is how long a store keeps a window's spend after the window
// has ended: settlements of requests admitted in it still land there, and
// then it vanishes.
const QuotaSlack = 24 * time.Hour

// QuotaState is one quota's view after a decision: the window the request
// met and what was spent in it.
type QuotaState struct {
	Name  string
	Unit  Unit
	Limit float64
	// Spent is the window's spend after the step (for a refused request,
	// the spend the request met), this request's reservation included.
	Spent float64
	// Remaining is Limit - Spent; below zero when a window is overspent.
	Remaining float64
	// Window is the ID of the window (see Window.ID).
	Window string
	// Reset is the time until the window ends and the spend starts again
	// from zero.
	Reset time.Duration
}

// Span is one window of a calendar period: its ID (Window.ID) and bounds,
// Start <= t < End. The zero value is no window.
type Span struct {
	ID         string
	Start, End time.Time
}

// Span returns the window that contains now.
func (w Window) Span(now time.Time) Span {
	first, start, end := w.span(now)
	return Span{ID: w.idOf(first), Start: start, End: end}
}

// Contains reports whether t lies in the span.
func (s Span) Contains(t time.Time) bool { return !t.Before(s.Start) && t.Before(s.End) }

// Spans remembers the current span of each window it is asked about, so
// that a store does not compute calendar arithmetic for every request: the
// windows in use are the few that configuration names, and a span changes
// once a day at most. The zero value is ready to use; it is safe for
// concurrent use.
type Spans struct {
	mu sync.RWMutex
	m  map[spanKey]*Span
}

type spanKey struct {
	period Period
	zone   string
}

// maxSpans bounds what a Spans remembers; past it, it starts afresh.
const maxSpans = 1024

// Span returns w.Span(now), from memory when now lies in the span last
// computed for w.
func (c *Spans) Span(w Window, now time.Time) Span {
	k := spanKey{w.Period, w.location().String()}
	c.mu.RLock()
	s := c.m[k]
	c.mu.RUnlock()
	if s != nil && s.Contains(now) {
		return *s
	}
	n := w.Span(now)
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxSpans {
		c.m = make(map[spanKey]*Span)
	}
	c.m[k] = &n
	c.mu.Unlock()
	return n
}

// NewQuotaState returns the state of quota q whose window span held spent
// at now.
func NewQuotaState(q Quota, span Span, spent float64, now time.Time) QuotaState {
	return QuotaState{
		Name: q.Name, Unit: q.Unit, Limit: q.Limit, Spent: spent, Remaining: q.Limit - spent,
		Window: span.ID, Reset: max(0, span.End.Sub(now)),
	}
}

// QuotaCost is what the request takes from quota q at admission: its Cost
// for a quota of tokens, its Money for one of money.
func (r Request) QuotaCost(q Quota) float64 {
	if q.Unit == Money {
		return r.Money
	}
	return r.Cost
}

// FitsQuota reports whether an amount can ever be admitted by quota q: it
// may not exceed the whole budget (S4).
func FitsQuota(q Quota, amount float64) bool { return amount <= q.Limit }

// ChargedQuota is what the reservation has taken from quota q so far: its
// cost in q's unit, plus, when q is hard, what Extend debited (tokens, or
// tokens × MoneyPerToken for money).
func (r *Reservation) ChargedQuota(q Quota) float64 {
	amount, extended := r.Cost, r.Extended
	if q.Unit == Money {
		amount, extended = r.Money, r.Extended*r.MoneyPerToken
	}
	if q.Hard {
		amount += extended
	}
	return amount
}

// UsedQuota is what settling the reservation with actual tokens charges
// quota q: actual for tokens, Spent for money.
func (r *Reservation) UsedQuota(q Quota, actual float64) float64 {
	if q.Unit == Money {
		return r.Spent
	}
	return actual
}

// ExtendQuota is what Extend of n tokens debits from quota q: n for
// tokens, n × MoneyPerToken for money.
func (r *Reservation) ExtendQuota(q Quota, n float64) float64 {
	if q.Unit == Money {
		return n * r.MoneyPerToken
	}
	return n
}

// Inspector is implemented by stores that can show the state of buckets,
// quotas and concurrency limits without changing them: what a usage page
// shows an identity. Inspect returns one BucketState per bucket (Remaining
// and Reset as a request would meet them now) and one QuotaState per quota
// (the window that holds now and what was spent in it), in order. InUse
// returns, per slot, how many of its leases are held now (neither released
// nor expired). Neither writes anything.
type Inspector interface {
	Inspect(ctx context.Context, bs []Bucket, qs []Quota) ([]BucketState, []QuotaState, error)
	InUse(ctx context.Context, ss []Slot) ([]int, error)
}

// ValidateInspect checks the buckets and quotas of an Inspect call.
func ValidateInspect(bs []Bucket, qs []Quota) error {
	for _, b := range bs {
		if err := b.Validate(); err != nil {
			return err
		}
	}
	for _, q := range qs {
		if err := q.Validate(); err != nil {
			return err
		}
	}
	return nil
}

// ValidateQuotas checks what a reservation brings to Extend and Settle for
// its quotas: the window each was charged in, and a finite Spent that is
// not negative.
func (r *Reservation) ValidateQuotas() error {
	if len(r.Windows) != len(r.Quotas) {
		return fmt.Errorf("%w: reservation has %d quotas but %d windows", ErrInvalidRequest, len(r.Quotas), len(r.Windows))
	}
	return amount("spent", r.Spent)
}

// Spend is an amount spent in one quota window outside the store: what a
// gateway admitted while the store was down (package failover).
type Spend struct {
	Quota  Quota
	Window Span
	Amount float64 // in the quota's unit; positive
}

// SpendAdder is implemented by stores that can add spend to quota windows
// without a reservation, so that what was spent during an outage counts
// against the shared windows afterwards. AddSpend adds each Spend to its
// window, whatever the window's limit (the money is spent); a window that
// has ended and passed QuotaSlack is left alone. It adds them once per id
// (the ID of the reservation that spent them): a call repeated with the
// same id, as a replay whose reply was lost is, adds nothing. Spends are
// independent: on an error, some may have been added.
type SpendAdder interface {
	AddSpend(ctx context.Context, id string, ss []Spend) error
}

func (s Spend) validate() error {
	if err := s.Quota.Validate(); err != nil {
		return err
	}
	if s.Window.ID == "" {
		return fmt.Errorf("%w: spend of quota %q without a window", ErrInvalidRequest, s.Quota.Name)
	}
	return amount("spend", s.Amount)
}

// ValidateSpend checks the ID and the spends of an AddSpend call.
func ValidateSpend(id string, ss []Spend) error {
	if id == "" {
		return fmt.Errorf("%w: spend without an ID", ErrInvalidRequest)
	}
	for _, s := range ss {
		if err := s.validate(); err != nil {
			return err
		}
	}
	return nil
}
