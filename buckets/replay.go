package buckets

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// RepeatWindow is how long a store remembers a call it applied, so that a
// copy of it that reaches the store later applies nothing: the copies of a
// call whose reply was lost wait in the store's connections and run when
// it answers again, within moments of each other. A Reserve cancelled by
// Replayer.Cancel is refused for that long.
const RepeatWindow = time.Minute

// IncompleteError is the error of a Reserve or a Settle that failed after
// the store may have written part of it, or all of it: its reply was lost.
// It wraps ErrStore.
//
// For a Reserve, Rest is the reservation the store may have made (the
// request's, with the windows its quotas would be charged in): whoever
// keeps it must Cancel it once the store answers again, or it stays
// charged. For a Settle, Rest is the part of the reservation (its buckets,
// slots and quotas) that the store did not settle, to Replay; Sent tells
// whether a call for Rest may have reached the store (false: it certainly
// wrote nothing, the store could not be reached).
type IncompleteError struct {
	Rest *Reservation
	Sent bool
	Err  error
}

func (e *IncompleteError) Error() string {
	return fmt.Sprintf("%v (reservation %.16q left unfinished)", e.Err, e.Rest.ID)
}

func (e *IncompleteError) Unwrap() error { return e.Err }

// Replayer is implemented by stores whose missed writes can be made good
// later: what a failover layer keeps while the store cannot be reached,
// replayed once it answers again (package failover). Both apply once per
// reservation ID, however often they are called, and write nothing for a
// reservation settled already.
type Replayer interface {
	// Replay settles r with actual as Settle does, and also when r's
	// record has expired meanwhile (an outage longer than its Lifetime):
	// then the usage replaces the reservation all the same. sent tells
	// that an earlier Settle of r may have reached the store (its reply
	// was lost, see IncompleteError): a missing record may then mean that
	// it settled already, and Replay applies only what charges more — the
	// usage beyond the reservation, never a refund — so that a settlement
	// is never less than what was used.
	Replay(ctx context.Context, r *Reservation, actual float64, sent bool) ([]BucketState, error)
	// Cancel undoes a reservation whose Reserve failed with an
	// *IncompleteError: if the store made it, it is settled at zero usage;
	// either way a copy of that Reserve that reaches the store later,
	// within RepeatWindow, takes nothing.
	Cancel(ctx context.Context, r *Reservation) error
}

// Charger is implemented by stores that charge what no reservation was
// taken for: the hits of Envoy's rate-limit service (package rls), each a
// debit or a refund of its own, applied even when it drives a bucket into
// debt. It is a Replay of a settlement that never reached the store
// (Replayer.Replay with sent false): r needs no record. A copy of the
// store's call sent again after a lost reply applies nothing, and a
// Charge that failed with an *IncompleteError is made good by a Replay of
// its Rest, which applies what the lost call did not, once. Each Charge
// call is a charge of its own: the caller draws a new ID for each.
type Charger interface {
	// Charge applies r as a settlement of actual tokens (and r.Spent of
	// money) of a reservation that was never taken: each bucket moves by
	// r.Charged(b) − actual (a debit at most down to its floor, a refund
	// at most up to its capacity), each quota by what settling it would
	// charge, in the windows of r.Windows. When r.Windows is nil, Charge
	// sets it to the windows that hold now on the store's clock, before
	// anything is sent, so that a Replay of it charges the same windows.
	// It applies once however often the store sends it,
	// writes nothing when ctx is already done (an error wrapping
	// ctx.Err()), and returns each bucket's state after the charge:
	// BucketState.Remaining − BucketState.Forgiven is the level the charge
	// left before the floor, below zero when the bucket held less than it
	// took.
	Charge(ctx context.Context, r *Reservation, actual float64) ([]BucketState, error)
}

// ChargeWindows sets r.Windows, when nil, to the windows of r's quotas
// that hold at now.
func ChargeWindows(r *Reservation, now time.Time) {
	if r.Windows != nil || len(r.Quotas) == 0 {
		return
	}
	r.Windows = make([]Span, len(r.Quotas))
	for j, q := range r.Quotas {
		r.Windows[j] = q.Window.Span(now)
	}
}

// AsyncCharger is implemented by chargers that can charge without the
// caller waiting, as an AsyncSettler settles: the charge joins the store's
// next call, or goes within its settle window. A caller with no use for
// the states (a rate-limit call whose answer Envoy ignores) wants
// ChargeAsync; AsyncSettler's Flush writes the charges it queued.
type AsyncCharger interface {
	// ChargeAsync charges r as Charge does, later: it returns at once, and
	// done, if not nil, is called with Charge's results once the charge is
	// written (or failed), from another goroutine, or before ChargeAsync
	// returns (for invalid input, and in a store that has no call to
	// save). r must not be used by the caller afterwards.
	ChargeAsync(r *Reservation, actual float64, done func([]BucketState, error))
}

// ChargeLater charges r through store: queued when store is an
// AsyncCharger, else with Charge before ChargeLater returns; a store that
// is neither answers done an error wrapping errors.ErrUnsupported. done
// may be nil.
func ChargeLater(store any, r *Reservation, actual float64, done func([]BucketState, error)) {
	if ac, ok := store.(AsyncCharger); ok {
		ac.ChargeAsync(r, actual, done)
		return
	}
	var st []BucketState
	err := fmt.Errorf("charge: %T: %w", store, errors.ErrUnsupported)
	if ch, ok := store.(Charger); ok {
		st, err = ch.Charge(context.Background(), r, actual)
	}
	if done != nil {
		done(st, err)
	}
}
