package buckets

import (
	"context"
	"fmt"
	"math"
	"time"
)

// Lease lets each gateway take a slice of a shared bucket in one call and
// admit requests against it locally (S20: a local sub-budget is allowed
// only as an explicit lease taken from the shared bucket). Tokens in a
// lease are already debited from the shared bucket, so a fleet never admits
// more than the bucket; the price is that tokens one gateway holds are not
// available to another until they are used or returned. Package lease
// implements it over any store that can lend (Memory, the Redis store).
//
// A Bucket without a Lease (nil) is metered request by request in the
// store. The zero Lease sizes each lease from the rate this gateway admits
// and returns unused tokens after DefaultLeaseTTL. A Lease is plain data,
// shared by every request of its rule: do not modify it.
type Lease struct {
	// Size is how many tokens one lease call takes at most: the cost of the
	// request that made the call, and what is left for the next requests.
	// Zero sizes it from the rate this gateway admits against the bucket
	// (see package lease). A size below a request's cost takes just the
	// cost, so Size 1 meters every request in the store.
	Size float64
	// TTL is how long unused tokens of a lease stay on the gateway before
	// they are returned to the shared bucket; zero means DefaultLeaseTTL.
	TTL time.Duration
}

// DefaultLeaseTTL is the TTL of a Lease whose TTL is zero.
const DefaultLeaseTTL = time.Second

// Validate reports whether the lease can be used: a finite Size, not
// negative, and a TTL not negative.
func (l *Lease) Validate() error {
	if !(l.Size >= 0) || math.IsInf(l.Size, 0) {
		return fmt.Errorf("%w: lease size must be a finite number >= 0, got %v", ErrInvalidLimit, l.Size)
	}
	if l.TTL < 0 {
		return fmt.Errorf("%w: lease ttl must not be negative, got %v", ErrInvalidLimit, l.TTL)
	}
	return nil
}

// TTLOrDefault is the lease's TTL, DefaultLeaseTTL when zero.
func (l *Lease) TTLOrDefault() time.Duration {
	if l.TTL <= 0 {
		return DefaultLeaseTTL
	}
	return l.TTL
}

// LeaseOp is one bucket's part of a lease call: in one atomic step the
// store brings the bucket up to date (S2), applies Give, and then takes
// Need — all or nothing, as a Reserve of cost Need would (S3–S5, S12,
// S14, S19) — plus as much more as the bucket holds above its headroom, up
// to Want in all. The fields above Granted are the input; the store writes
// the others. A LeaseOp is a plain value owned by its caller.
type LeaseOp struct {
	Bucket Bucket
	// Give goes back to the bucket first: unused tokens of an earlier
	// lease and the settlement differences of requests admitted against it
	// (refunds positive, usage beyond the reservation negative). A refund
	// fills at most to capacity; a debit stops at the bucket's floor, and
	// what the floor kept from being charged is Observation.Forgiven (S8,
	// S9, S14).
	Give float64
	// Need is the cost of the request that made the call; zero for a call
	// that only returns tokens or only takes a lease.
	Need float64
	// Want is the most the call takes in all; below Need it is Need.
	Want float64
	// Priority lets Need use the bucket's headroom (S19); what is taken
	// beyond Need never does.
	Priority bool
	// MaxWait admits Need ahead of time when the tokens will be there
	// within it (S12), for soft buckets; nothing beyond Need is taken then.
	MaxWait time.Duration

	// OK reports whether the bucket admitted Need: taken now, or ahead of
	// time within MaxWait.
	OK bool
	// Granted is what was taken: Need plus what the lease holds for later,
	// or zero when Need was refused.
	Granted float64
	// Observation is the bucket after the step: its level (for a refused
	// Need, the level the request met, after Give), its hold (S18), and
	// what the floor forgave of Give.
	Observation Observation
	// Done is true once the store has written the step (or found nothing
	// to write). After an error, an op not Done may or may not have been
	// applied: its caller must assume the worst of each (see package
	// lease).
	Done bool
}

// want is the most op takes in all.
func (op *LeaseOp) want() float64 { return max(op.Need, op.Want) }

// Validate reports whether op can be applied: a valid bucket, finite
// amounts, Need and Want not negative, MaxWait not negative.
func (op *LeaseOp) Validate() error {
	if err := op.Bucket.Validate(); err != nil {
		return err
	}
	if math.IsNaN(op.Give) || math.IsInf(op.Give, 0) {
		return fmt.Errorf("%w: lease give must be finite, got %v", ErrInvalidRequest, op.Give)
	}
	if err := amount("lease need", op.Need); err != nil {
		return err
	}
	if err := amount("lease want", op.Want); err != nil {
		return err
	}
	if op.MaxWait < 0 {
		return fmt.Errorf("%w: lease max_wait must not be negative, got %v", ErrInvalidRequest, op.MaxWait)
	}
	return nil
}

// LeaseStep applies op to a bucket observed (brought up to now) at level
// with refill held for hold, and returns the new level. It writes op's
// results. It is the whole arithmetic of a lease call; every store that
// lends does exactly this, so that they answer identically.
func LeaseStep(op *LeaseOp, level float64, hold time.Duration) float64 {
	b := op.Bucket
	var forgiven float64
	if op.Give != 0 {
		level, forgiven = Apply(b, level, op.Give)
	}
	op.OK, op.Granted = false, 0
	if Fits(b, op.Need, op.Priority) {
		switch w := WaitFor(b, level, hold, op.Need, op.Priority); {
		case w <= 0:
			// What the lease holds for later stays above the headroom: the
			// headroom is for priority requests (S19), not for leases.
			extra := min(op.want()-op.Need, level-op.Need-b.Headroom)
			op.OK, op.Granted = true, op.Need+max(0, extra)
		case !b.Hard && w <= op.MaxWait:
			op.OK, op.Granted = true, op.Need
		}
	}
	level -= op.Granted
	op.Observation = Observation{Level: level, Hold: hold, Forgiven: forgiven}
	op.Done = true
	return level
}

// Lease applies each op, in order, each in one atomic step (see LeaseOp);
// ops do not depend on each other. A step that neither gives nor grants
// writes nothing. It implements the lending interface of package lease.
func (m *Memory) Lease(ctx context.Context, ops []LeaseOp) error {
	for i := range ops {
		if err := ops[i].Validate(); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("lease: %w", err)
	}
	var ls lockSet
	for i := range ops {
		ls.add(m.shardOf(ops[i].Bucket.Key))
	}
	m.lock(&ls)
	defer m.unlock(&ls)
	now := m.nowNS()
	for i := range ops {
		op := &ops[i]
		sh := &m.shards[m.shardOf(op.Bucket.Key)]
		tokens, last, p := sh.peek(op.Bucket, now)
		level := LeaseStep(op, tokens, hold(last, now))
		if op.Give != 0 || op.Granted > 0 {
			sh.put(op.Bucket, p, level, last, now)
		}
	}
	return nil
}
