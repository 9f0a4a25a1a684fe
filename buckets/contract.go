package buckets

import (
	"context"
	"time"
)

// Bucket names one token bucket of a request's chain (S10): the store key of
// the identity it belongs to and the rules it follows. The zero value is not
// usable: Key and Limit are required.
type Bucket struct {
	// Name is the configuration name of the bucket ("user", "team",
	// "provider"). It is used in decisions, response headers and metric
	// labels, never as a store key.
	Name string
	// Key identifies the bucket in the store. It is derived from an
	// authenticated identity (S9a) and must not contain raw API keys.
	Key string
	// Limit is the capacity and refill rate (S1).
	Limit Limit
	// Hard buckets never go below zero (S14): settlement clamps at zero and
	// an incremental debit that would cross zero is refused.
	Hard bool
	// MaxDebt is how far below zero settlement may drive a soft bucket (S9);
	// debt beyond it is forgiven, and reported as BucketState.Forgiven.
	// Zero means the default: no limit, so every token used is charged (see
	// Bucket.Floor for why).
	MaxDebt float64
	// Headroom is the part of the capacity that only priority requests may
	// use (S19): a non-priority request is admitted only if the level stays
	// at or above Headroom after taking its cost.
	Headroom float64
	// Lease, when set, lets a gateway take a slice of the bucket from a
	// shared store and admit against it locally (see Lease and package
	// lease); stores themselves ignore it. Nil meters every request.
	Lease *Lease
}

// Slot names a concurrency limit (S11): at most Max requests in flight per
// Key. Slots are leases that expire after Lease unless released, so a gateway
// that dies does not leak them forever. The zero value is not usable: Key
// and Max are required; a zero Lease means DefaultSlotLease.
type Slot struct {
	Name  string
	Key   string
	Max   int
	Lease time.Duration
}

// Request is one admission attempt: take Cost tokens from every bucket, a
// slot from every concurrency limit and the request's cost from every
// quota, all or none (S3). The zero value is a valid request that costs
// nothing and passes no bucket. A Request is a plain value; stores do not
// keep it, but a Reservation shares its Buckets, Slots and Quotas slices, so
// do not modify them while the request is in flight.
type Request struct {
	// ID identifies the request for idempotent settlement. Empty means the
	// store assigns one (see Reservation.ID).
	ID       string
	Cost     float64
	Buckets  []Bucket
	Slots    []Slot
	Priority bool
	// MaxWait, when positive, lets the request be admitted ahead of time
	// (S12): if the tokens will be there within MaxWait, they are taken now
	// and Decision.Wait tells how long to hold the request before forwarding.
	MaxWait time.Duration
	// Lifetime is how long the reservation stays settleable: at least the
	// longest the request may take, plus the time a settlement may be
	// retried. A reservation not settled (or renewed, see Renewer) within
	// it expires: its tokens stay charged and Settle changes nothing. Zero
	// means DefaultLifetime; it is never shorter than a slot's lease.
	Lifetime time.Duration
	// Quotas are the calendar budgets the request is charged against (see
	// Quota): Cost for quotas of tokens, Money for quotas of money.
	Quotas []Quota
	// Money is the most the request can cost, in micro-units of the
	// currency, reserved from quotas of money (a price's MaxCost).
	Money float64
	// MoneyPerToken is what Extend debits hard quotas of money per token,
	// in micro-units: the price of an output token.
	MoneyPerToken float64
}

// Reason says why a decision came out the way it did.
type Reason int

const (
	// Admitted: every bucket and slot admitted the request.
	Admitted Reason = iota
	// ShortOfTokens: some bucket has too few tokens now (S5).
	ShortOfTokens
	// ConcurrencyFull: some concurrency limit is at its maximum (S11).
	ConcurrencyFull
	// NeverAdmissible: the cost exceeds some bucket's capacity, or some
	// quota's whole budget (S4).
	NeverAdmissible
	// OverQuota: some quota's window has too little left for the request;
	// it fits again only in the next window.
	OverQuota
)

// BucketState is one bucket's view after a decision or a settlement.
type BucketState struct {
	Name      string
	Limit     Limit
	Remaining float64
	// Reset is the time until the bucket is full again.
	Reset time.Duration
	// Forgiven, after Settle, is the part of the usage this settlement did
	// not charge because the bucket reached its floor (S9, S14): Floor
	// stopped the debit. Always zero after Reserve.
	Forgiven float64
}

// Decision is the result of Reserve. Being over the limit is a Decision,
// never an error. The zero value is a refusal with no detail; a Decision is a
// plain value owned by its caller.
type Decision struct {
	OK     bool
	Reason Reason
	// Limiting is the Name of the most limiting bucket, slot or quota (S10);
	// for an admitted request, the bucket with the least remaining.
	Limiting string
	// Wait is, when refused for tokens, the earliest time until admission
	// (S5, the largest over short buckets); when refused by a quota, the
	// time until its window ends (the latest over quotas without room);
	// when admitted ahead of time (Request.MaxWait), how long to hold the
	// request.
	Wait time.Duration
	// Buckets holds the state of each bucket of the request, in order.
	Buckets []BucketState
	// Quotas holds the state of each quota of the request, in order.
	Quotas []QuotaState
	// Reservation is set when OK; it must be settled exactly once.
	Reservation *Reservation
}

// Reservation is an admitted request's claim on its buckets and slots. It is
// owned by the goroutine handling the request: Extend updates it, so it is
// not safe for concurrent use. Only a store makes a valid one.
type Reservation struct {
	ID       string
	Cost     float64
	Buckets  []Bucket
	Slots    []Slot
	Priority bool
	// Lifetime is the request's, see Request.Lifetime.
	Lifetime time.Duration
	// Extended is what Extend debited from the hard buckets beyond Cost,
	// in tokens.
	Extended float64
	// Extends counts the Extend calls made on the reservation, whatever
	// their answer: the store numbers each call by it, so that a call it
	// sends again applies once.
	Extends int
	// Quotas, Money and MoneyPerToken are the request's.
	Quotas        []Quota
	Money         float64
	MoneyPerToken float64
	// Windows holds, per quota, the window the reservation was charged in:
	// Extend and Settle charge that window, even after it has ended.
	Windows []Span
	// Spent is what the request cost, in micro-units: the caller sets it
	// before Settle, which charges it to quotas of money instead of Money.
	// Zero means the request cost nothing.
	Spent float64
	// Unanswered is a store's note, on the Rest of an IncompleteError of a
	// Charge, of the calls that may have applied the charge although
	// their replies were lost: Replayer.Replay of Rest asks them whether
	// they ran. Callers keep it with the rest of Rest and never set it.
	Unanswered []string `json:",omitempty"`
}

// Store is the contract that the memory and Redis stores satisfy
// identically; the contract suite in package bucketstest holds them to it.
// All methods are safe for concurrent use. Errors mean invalid input
// (ErrInvalidLimit, ErrInvalidRequest), an unreachable store (ErrStore), or
// the caller's own context ending, never being over the limit.
//
// # The caller's context
//
// A caller that goes away — a client disconnecting, a deadline passing —
// says nothing about the store, and must never leave a write whose outcome
// is unknown:
//
//   - If ctx is already done when Reserve, Extend, Pause or Renew is called,
//     the store writes nothing and returns an error wrapping ctx.Err()
//     (context.Canceled or context.DeadlineExceeded), never ErrStore.
//   - Once the store has started an operation, it finishes it detached from
//     ctx's cancellation and deadline (keeping its values), bounded by the
//     store's own timeout, and returns its result: an admitted Decision must
//     then be settled as usual even though the caller is gone, and an
//     Extend that debited is recorded in Reservation.Extended. A reservation
//     the store may already have written is thus never lost to a
//     cancellation.
//   - Settle always runs, whatever the state of ctx: a settlement releases
//     slots and refunds tokens, and must land even when the caller is gone.
//
// So an error wrapping context.Canceled or context.DeadlineExceeded means
// the caller's context ended before anything was written; a failover layer
// must not count it as an outage.
//
// # Calls that are sent again
//
// A store on a network sends a call again when its reply is lost, and both
// copies may run, in either order. Every call that writes is therefore
// safe to repeat, by the reservation's ID:
//
//   - Reserve with the ID of an open reservation takes nothing and answers
//     admitted, with the levels as they are: a repeated Reserve takes
//     once. A reservation's ID must be unique (Request.ID); after the
//     reservation has settled, the ID is free again.
//   - Extend applies each call once, numbered by Reservation.Extends.
//   - Settle applies once, through the reservation's record.
//   - Pause and Renew set a state rather than add to one: a copy that runs
//     later sets it again (a pause then ends at most that much later).
//
// A call whose reply is lost for good may or may not have been written: a
// store that can tell says so with an *IncompleteError (see Replayer).
type Store interface {
	// Reserve attempts an admission (S3–S5, S11, S12). It writes nothing when
	// the request is refused.
	Reserve(ctx context.Context, req Request) (Decision, error)
	// Extend debits n more tokens from the reservation's hard buckets and
	// hard quotas (n × MoneyPerToken from quotas of money), all or none
	// (S14). ok is false when a hard bucket would go below zero (or is
	// paused) or a hard quota's window would be overspent; the caller then
	// cuts the stream off. Soft buckets and quotas are charged at Settle.
	// Each call is a new extension (it counts itself in r.Extends); Extend
	// must not follow Settle.
	Extend(ctx context.Context, r *Reservation, n float64) (ok bool, err error)
	// Settle replaces the reservation by the actual usage (S8, S9) — actual
	// tokens, and r.Spent for quotas of money — and releases its slots,
	// once: the store keeps a record of each open reservation, deleted at
	// settlement, so settling the same reservation ID twice, or after its
	// Lifetime, changes nothing, and a settled request leaves nothing
	// behind. It returns one state per bucket; each reports in Forgiven
	// what its bucket's floor kept this settlement from charging.
	Settle(ctx context.Context, r *Reservation, actual float64) ([]BucketState, error)
	// Pause marks the bucket empty until the given time (S18): its level
	// drops to zero (debt is kept) and refill resumes only then.
	Pause(ctx context.Context, b Bucket, until time.Time) error
}
