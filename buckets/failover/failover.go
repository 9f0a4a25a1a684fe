// Package failover decides what happens while the shared bucket store is
// unreachable (S21): fail closed (every admission answers ErrStore, which the
// ext_proc server turns into a 503) or fail open (admit against a local
// fallback limit held in memory, per bucket, on this gateway only).
//
// A Store wraps the primary (Redis) store. After a failed call it stops
// calling the primary for a short back-off, so a dead Redis does not make
// every request wait for a timeout and goroutines do not pile up on it; the
// first call after the back-off probes the primary again, and its success
// ends the outage — as does a heartbeat or a probe of Run, so that an
// outage ends when the primary answers, not with the next request. State
// changes are logged once each, not per request.
//
// A caller's cancellation or deadline is never an outage: an error from a
// call whose own context has ended passes through unchanged, without
// marking the primary down or answering from the fallback.
//
// # The fallback limit
//
// Failing open, each bucket of a request is checked against a local bucket
// with the same key and the fallback limit — capped at the bucket's own
// limit, so an outage never grants more than the shared bucket would. A
// bucket's priority headroom and max debt keep their share of its capacity
// (a provider bucket with 10 % headroom keeps 10 % of the fallback
// capacity). A request that the shared buckets could admit but that is
// larger than the local ones is not refused as never admissible: it is
// admitted once the local buckets are full, reserving what they can hold,
// and settlement charges its real usage, so the fallback rate still holds
// over time. Such a reservation's Cost is what was reserved locally.
//
// # A fleet
//
// Every gateway of a fleet failing open with its own fallback would admit
// the fallback once per gateway: the quota multiplied (S20). With
// Options.Fleet, gateways announce themselves in the shared store with a
// heartbeat (Run), and Options.Fallback is the fleet's: each gateway
// falls back to Fallback divided by the gateways it last saw alive, never
// below Options.FallbackFloor. The fleet then admits about Fallback during
// an outage — more only by a gateway that joined within the last heartbeat,
// or when the floor is above the share. A concurrency limit's maximum is
// divided likewise, rounded down and never below one: a fleet of more
// gateways than a limit's maximum admits one request per gateway.
//
// # Quotas during an outage
//
// A quota's window spend lives in the shared store. Failing open from
// zero, every gateway could spend the whole budget again: a team at $990
// of $1,000 could spend another $1,000 on each gateway. Instead the store
// remembers, per quota window, the spend the primary last reported to this
// gateway, and failing open a gateway may spend only its share of what was
// left then: (limit − last spend) divided by the gateways it last saw
// alive (with Options.Fleet; all of it without). It charges the local
// store the rest of the budget as spent, once per outage and window, so
// the local store refuses as the shared one would: over quota, with
// Retry-After to the window's end. A window this gateway has not been told
// about since it started counts as unspent. What the local store spent is
// added to the shared windows once the primary answers again (queued with
// the settlements, within MaxPending), once: by the ID of the local
// reservation, however often the replay is sent.
//
// # What the primary missed
//
// Every write the primary may have missed is kept and replayed once it
// answers again — found by the heartbeat or a probe (Run), not only by the
// next request — and each applies once however often it is sent
// (buckets.Replayer, buckets.SpendAdder):
//
//   - a settlement it could not take, replayed also after the
//     reservation's record has expired, so the window is charged the
//     usage and not the reservation;
//   - a reservation whose reply was lost (buckets.IncompleteError),
//     cancelled: settled at zero if it was made, and a late copy of it
//     takes nothing;
//   - the quota spend of what the local store admitted (see above).
//
// A gateway that stops replays what it can within its shutdown grace
// (Drain), and can save the rest for its next start (SavePending,
// LoadPending).
package failover

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// Mode is the configured behaviour while the primary store is down.
type Mode int

const (
	// Closed refuses every admission with buckets.ErrStore.
	Closed Mode = iota
	// Open admits against Options.Fallback, per bucket, locally.
	Open
)

// Options configures a Store. Only Mode (and, for Open, Fallback and
// Fleet) matter to most callers.
type Options struct {
	Mode Mode
	// Fallback is the limit each bucket gets locally while failing open;
	// with a Fleet, the limit of the whole fleet, which each gateway
	// divides by the gateways alive (see Fleet).
	Fallback buckets.Limit
	// Fleet, when set, counts the gateways sharing the store: each gateway
	// announces itself every HeartbeatEvery (Run), and while the
	// store is down its fallback is Fallback divided by the gateways it
	// last saw alive, so the fleet admits about Fallback in all, not
	// Fallback per gateway. A gateway that has not yet reached the store
	// uses all of Fallback.
	Fleet Fleet
	// FallbackFloor is the least a gateway's share may be, so that a large
	// fleet still admits requests of a useful size; with it the fleet may
	// admit up to gateways × FallbackFloor when that is more than Fallback.
	FallbackFloor buckets.Limit
	// HeartbeatEvery is how often Run beats, or probes the primary while it
	// is down; a heartbeat lives three times as long. Zero means one
	// second.
	HeartbeatEvery time.Duration
	// GatewayID names this gateway in the fleet; empty means a random one.
	GatewayID string
	// OnShare, if set, is called when the gateways alive, and so this
	// gateway's fallback limit, change (for metrics).
	OnShare func(gateways int, fallback buckets.Limit)
	// Probe, when set, is what Run asks while the primary is down whether
	// it answers again, when there is no Fleet to beat; nil uses the
	// primary when it is a Pinger.
	Probe Pinger
	// Backoff is how long the primary is left alone after a failure before
	// it is probed again; zero means one second.
	Backoff time.Duration
	// Now is the clock for back-off and the fallback store; nil means
	// time.Now.
	Now func() time.Time
	// Currency is the currency of quotas of money (buckets.Quota.Currency)
	// for the writes LoadPending reads: a release before quotas recorded
	// their unit with the spend saved quotas of money without one, which
	// meant the currency configured then. LoadPending gives it to every
	// quota of money that has none, so that its replay charges the window
	// in that currency instead of in none.
	Currency string
	// Logger receives one line per outage start and end.
	Logger *slog.Logger
	// OnFallback, if set, is called for every operation answered while the
	// primary is down (for metrics).
	OnFallback func(op string)
	// OnState, if set, is called when the primary goes down or answers
	// again, and when the writes waiting for replay change in number (for
	// metrics: replays wait only while the primary is down).
	OnState func(up bool, pending int)
	// MaxPending bounds the writes kept for replay while the primary is
	// down; zero means 100000. Beyond it the oldest are dropped: their
	// reservations stay charged and their slots expire with their lease.
	MaxPending int
}

// Store is a buckets.Store that survives an unreachable primary. It is safe
// for concurrent use. Use New.
type Store struct {
	primary  buckets.Store
	local    *buckets.Memory // nil when failing closed
	opts     Options
	downTill atomic.Int64 // unix nanos until which the primary is skipped
	down     atomic.Bool
	// fallbackIDs remembers the reservations the local store made, so they
	// settle where they were taken.
	fallbackIDs sync.Map
	// localExtended holds, per ID of a primary reservation extended against
	// the fallback during an outage, how much of its Extended the fallback
	// debited (float64): the primary never took it, so it is not settled
	// there.
	localExtended sync.Map

	mu        sync.Mutex
	pending   []pendingOp // writes the primary missed, oldest first
	replaying bool
	replayed  chan struct{} // closed when the running replay ends
	// inflight is set while the replay applies a write it took from
	// pending, current: the write is not on the primary yet, and Pending
	// counts it, and SavePending saves it.
	inflight bool
	current  pendingOp

	gateways atomic.Int64 // alive at the last heartbeat, see Fleet

	quotas  quotaMemo    // see quota.go
	outages atomic.Int64 // outages begun, the first is 1
}

// pendingOp is a write the primary missed, to replay once it answers
// again. Each kind applies once per reservation ID however often it is
// replayed, so a replay whose reply is lost can be sent again.
type pendingOp struct {
	Kind pendingKind `json:"kind"`
	// R is the reservation to settle (Actual its usage) or to cancel.
	R      *buckets.Reservation `json:"reservation,omitempty"`
	Actual float64              `json:"actual,omitempty"`
	// Sent: an earlier Settle of R may have reached the primary, which
	// then cannot tell a record it settled from one that expired.
	Sent bool `json:"sent,omitempty"`
	// ID and Spends: the quota spend of a reservation the local store
	// took during an outage, for the shared windows (see quota.go).
	ID     string          `json:"id,omitempty"`
	Spends []buckets.Spend `json:"spends,omitempty"`
}

type pendingKind string

const (
	settleOp pendingKind = "settle"
	cancelOp pendingKind = "cancel"
	spendOp  pendingKind = "spend"
)

var _ buckets.Store = (*Store)(nil)

// New wraps primary.
func New(primary buckets.Store, opts Options) *Store {
	if opts.Backoff <= 0 {
		opts.Backoff = time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.MaxPending <= 0 {
		opts.MaxPending = 100000
	}
	if opts.HeartbeatEvery <= 0 {
		opts.HeartbeatEvery = time.Second
	}
	if opts.GatewayID == "" {
		opts.GatewayID = newGatewayID()
	}
	s := &Store{primary: primary, opts: opts}
	if opts.Mode == Open {
		s.local = buckets.NewMemory(buckets.MemoryOptions{Now: opts.Now})
	}
	return s
}

// FailsOpen reports whether the store admits locally during an outage.
func (s *Store) FailsOpen() bool { return s.opts.Mode == Open }

// Healthy reports whether the primary answered its last call.
func (s *Store) Healthy() bool { return !s.down.Load() }

func (s *Store) skipPrimary() bool {
	return s.down.Load() && s.opts.Now().UnixNano() < s.downTill.Load()
}

// failed records a primary failure; it reports whether err is a store
// failure (as opposed to invalid input, or the end of the caller's own
// context, which pass through).
func (s *Store) failed(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil || !isOutage(err) {
		return false
	}
	s.downTill.Store(s.opts.Now().Add(s.opts.Backoff).UnixNano())
	if !s.down.Swap(true) {
		s.outages.Add(1)
		mode := "closed: admissions answer 503"
		if s.opts.Mode == Open {
			mode = "open: admitting against the local fallback limit"
		}
		s.opts.Logger.Error("bucket store unreachable; failing "+mode, "err", err)
		s.state()
	}
	return true
}

func (s *Store) succeeded() {
	if s.down.Swap(false) {
		s.opts.Logger.Info("bucket store reachable again; shared limits apply")
		s.state()
		s.startReplay()
	}
}

// state tells OnState how things stand.
func (s *Store) state() {
	if s.opts.OnState != nil {
		s.opts.OnState(!s.down.Load(), s.Pending())
	}
}

// keep queues a settlement the primary could not take: r, or, when err
// says which part of it the primary did not settle, that part.
func (s *Store) keep(r *buckets.Reservation, actual float64, err error) {
	p := pendingOp{Kind: settleOp, R: r, Actual: actual, Sent: err != nil}
	var inc *buckets.IncompleteError
	if errors.As(err, &inc) {
		p.R, p.Sent = inc.Rest, inc.Sent
	}
	rc := *p.R
	p.R = &rc
	s.queue(p)
}

// keepCancel queues the cancellation of a reservation the primary may
// have made although its Reserve failed.
func (s *Store) keepCancel(err error) {
	var inc *buckets.IncompleteError
	if errors.As(err, &inc) {
		rc := *inc.Rest
		s.queue(pendingOp{Kind: cancelOp, R: &rc})
	}
}

// queue adds p to the replay queue, dropping the oldest beyond MaxPending.
func (s *Store) queue(p pendingOp) {
	s.mu.Lock()
	if len(s.pending) >= s.opts.MaxPending {
		switch s.pending[0].Kind {
		case spendOp:
			s.fallback("spend_dropped")
		case cancelOp:
			s.fallback("cancel_dropped")
		default:
			s.fallback("settle_dropped")
		}
		s.pending = s.pending[1:]
	}
	s.pending = append(s.pending, p)
	s.mu.Unlock()
	s.state()
}

// Pending is the number of writes the primary missed and does not have
// yet: those waiting for replay and the one being replayed.
func (s *Store) Pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inflight {
		return len(s.pending) + 1
	}
	return len(s.pending)
}

// replayingNow reports whether a replay is running.
func (s *Store) replayingNow() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.replaying
}

// startReplay replays, in the background, what the primary missed while
// it was down. One replay runs at a time; it stops at the next failure and
// resumes when the primary answers again.
func (s *Store) startReplay() {
	if s.claimReplay() {
		go s.replay(context.Background())
	}
}

// claimReplay makes the caller the one replayer, if there is something to
// replay and no other.
func (s *Store) claimReplay() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.replaying || len(s.pending) == 0 {
		return false
	}
	s.replaying, s.replayed = true, make(chan struct{})
	return true
}

// replay, run by the claimant of claimReplay, replays the queue in order
// until it is empty, the primary fails, or ctx ends. It reports whether
// the queue is empty.
func (s *Store) replay(ctx context.Context) bool {
	replayed := 0
	defer func() {
		s.mu.Lock()
		s.replaying = false
		close(s.replayed)
		s.mu.Unlock()
		if replayed > 0 {
			s.opts.Logger.Info("writes missed during the outage were replayed", "count", replayed)
			s.state()
		}
	}()
	for ctx.Err() == nil {
		s.mu.Lock()
		if len(s.pending) == 0 {
			s.mu.Unlock()
			return true
		}
		p := s.pending[0]
		s.pending = s.pending[1:]
		s.inflight, s.current = true, p
		s.mu.Unlock()
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := s.replayOne(cctx, p)
		cancel()
		// The replay's context is the store's own: its end is the
		// primary's failure, or the end of Drain, not a caller going away.
		if err != nil && (isOutage(err) || ctx.Err() != nil) {
			s.failed(context.Background(), err)
			s.mu.Lock()
			s.pending = append([]pendingOp{p}, s.pending...)
			s.inflight = false
			s.mu.Unlock()
			return false
		}
		s.mu.Lock()
		s.inflight = false
		s.mu.Unlock()
		if err != nil {
			s.opts.Logger.Warn("a write missed during the outage could not be replayed", "kind", string(p.Kind), "err", err)
		}
		replayed++
	}
	return false
}

// replayOne applies p on the primary, once whatever came before: through
// buckets.Replayer where the primary is one (a plain Settle otherwise,
// once through its record while that lives).
func (s *Store) replayOne(ctx context.Context, p pendingOp) error {
	rp, replayer := s.primary.(buckets.Replayer)
	switch {
	case p.Kind == spendOp:
		add, ok := s.primary.(buckets.SpendAdder)
		if !ok {
			return nil
		}
		return add.AddSpend(ctx, p.ID, p.Spends)
	case p.Kind == cancelOp && replayer:
		return rp.Cancel(ctx, p.R)
	case p.Kind == cancelOp:
		r := *p.R
		r.Spent = 0
		_, err := s.primary.Settle(ctx, &r, 0)
		return err
	case replayer:
		_, err := rp.Replay(ctx, p.R, p.Actual, p.Sent)
		return err
	}
	_, err := s.primary.Settle(ctx, p.R, p.Actual)
	return err
}

// Drain replays what the primary missed, for a gateway that stops: until
// the queue is empty or ctx ends, probing the primary every Backoff while
// it fails. It returns how many writes are still unreplayed; save them
// with SavePending, or they are lost (their reservations stay charged).
func (s *Store) Drain(ctx context.Context) int {
	for {
		if s.claimReplay() {
			if s.replay(ctx) {
				return s.Pending()
			}
		} else {
			s.mu.Lock()
			n, running, done := len(s.pending), s.replaying, s.replayed
			s.mu.Unlock()
			if n == 0 && !running {
				return 0
			}
			if running { // its write in flight may yet fail and come back
				select {
				case <-done:
					continue
				case <-ctx.Done():
					return s.Pending()
				}
			}
		}
		t := time.NewTimer(s.opts.Backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return s.Pending()
		}
	}
}

// isOutage reports whether err, from a call whose caller still waits, is
// the primary's failure: ErrStore, or a deadline of the primary's own.
func isOutage(err error) bool {
	return errors.Is(err, buckets.ErrStore) || errors.Is(err, context.DeadlineExceeded)
}

func (s *Store) fallback(op string) {
	if s.opts.OnFallback != nil {
		s.opts.OnFallback(op)
	}
}

// localBucket is b as the fallback checks it: this gateway's fallback limit
// (its share of the fleet's), capped at b's own, with b's headroom and max
// debt scaled to it.
func (s *Store) localBucket(b buckets.Bucket) buckets.Bucket {
	f := s.share()
	l := buckets.Limit{
		Capacity: min(f.Capacity, b.Limit.Capacity),
		Rate:     min(f.Rate, b.Limit.Rate),
	}
	scale := l.Capacity / b.Limit.Capacity
	if b.Headroom > 0 {
		b.Headroom = min(b.Headroom*scale, math.Nextafter(l.Capacity, 0))
	}
	b.MaxDebt *= scale
	b.Limit = l
	return b
}

// localReservation is a copy of r with its buckets mapped by localBucket.
func (s *Store) localReservation(r *buckets.Reservation) *buckets.Reservation {
	lr := *r
	lr.Buckets = make([]buckets.Bucket, len(r.Buckets))
	for i, b := range r.Buckets {
		lr.Buckets[i] = s.localBucket(b)
	}
	return &lr
}

// localSlot is sl as the fallback checks it: with a Fleet, its maximum
// divided by the gateways alive (S20, as the buckets' fallback is), rounded
// down so that the fleet admits at most Max, but never below one.
func (s *Store) localSlot(sl buckets.Slot) buckets.Slot {
	if n := int(s.gateways.Load()); s.opts.Fleet != nil && n > 1 {
		sl.Max = max(1, sl.Max/n)
	}
	return sl
}

// localRequest maps the request's buckets with localBucket and its
// concurrency limits with localSlot and, when the shared buckets could
// admit its cost but the local ones cannot hold it, lowers its cost to
// what they can hold.
func (s *Store) localRequest(req buckets.Request) buckets.Request {
	bs := make([]buckets.Bucket, len(req.Buckets))
	fits := true
	most := math.Inf(1)
	for i, b := range req.Buckets {
		fits = fits && buckets.Fits(b, req.Cost, req.Priority)
		bs[i] = s.localBucket(b)
		most = min(most, bs[i].Limit.Capacity-bs[i].Reserve(req.Priority))
	}
	if fits && req.Cost > most {
		req.Cost = most
	}
	req.Buckets = bs
	if len(req.Slots) > 0 {
		ss := make([]buckets.Slot, len(req.Slots))
		for j, sl := range req.Slots {
			ss[j] = s.localSlot(sl)
		}
		req.Slots = ss
	}
	return req
}

// Reserve implements buckets.Store.
func (s *Store) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if !s.skipPrimary() {
		d, err := s.primary.Reserve(ctx, req)
		if !s.failed(ctx, err) {
			if err == nil {
				s.succeeded()
				s.noteSpend(req, d)
			}
			return d, err
		}
		// The primary may have made the reservation and lost the reply:
		// it is cancelled once the primary answers again, so the request,
		// refused or admitted locally now, is not charged twice.
		s.keepCancel(err)
	}
	if err := ctx.Err(); err != nil {
		return buckets.Decision{}, fmt.Errorf("failover: reserve: %w", err)
	}
	s.fallback("reserve")
	if s.local == nil {
		return buckets.Decision{}, fmt.Errorf("failover: reserve: failing closed: %w", buckets.ErrStore)
	}
	if err := s.chargeRest(ctx, req.Quotas); err != nil {
		return buckets.Decision{}, err
	}
	d, err := s.local.Reserve(ctx, s.localRequest(req))
	if err == nil && d.Reservation != nil {
		s.fallbackIDs.Store(d.Reservation.ID, struct{}{})
	}
	return d, err
}

// Extend implements buckets.Store. During an outage a reservation taken
// locally extends locally; one the primary took extends against the
// fallback limit when failing open (hard budgets still hold, at the
// fallback's scale), and failing closed answers an error wrapping
// buckets.ErrStore: the caller cuts the stream, since a hard budget can no
// longer be checked.
func (s *Store) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if _, ok := s.fallbackIDs.Load(r.ID); ok {
		// At the fallback's limits, as it was reserved (localBucket keeps
		// a bucket mapped already as it is): a caller may hand back the
		// shared buckets (the lease store's demoted part does).
		lr := s.localReservation(r)
		ok, err := s.local.Extend(ctx, lr, n)
		r.Extended = lr.Extended
		return ok, err
	}
	if !s.skipPrimary() {
		ok, err := s.primary.Extend(ctx, r, n)
		if !s.failed(ctx, err) {
			if err == nil {
				s.succeeded()
			}
			return ok, err
		}
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("failover: extend: %w", err)
	}
	s.fallback("extend")
	if s.local == nil {
		return false, fmt.Errorf("failover: extend: failing closed, hard budget cannot be checked: %w", buckets.ErrStore)
	}
	if err := s.chargeRest(ctx, r.Quotas); err != nil {
		return false, err
	}
	ok, err := s.local.Extend(ctx, s.localReservation(r), n)
	if err != nil || !ok {
		return ok, err
	}
	r.Extended += n
	for {
		v, loaded := s.localExtended.LoadOrStore(r.ID, n)
		if !loaded || s.localExtended.CompareAndSwap(r.ID, v, v.(float64)+n) {
			return true, nil
		}
	}
}

// primaryPart is r without the local part of its extensions: what the
// primary took of Extended, never below nothing. A caller that extends
// one reservation in parts (the lease store's demoted buckets, then the
// rest) has each part noted locally, while only the last raised the
// Extended it settles with.
func primaryPart(r *buckets.Reservation, local float64) *buckets.Reservation {
	pr := *r
	pr.Extended = max(0, pr.Extended-local)
	return &pr
}

// Settle implements buckets.Store. Reservations taken locally settle
// locally. A settlement the primary cannot take during an outage is kept
// (bounded by MaxPending) and replayed when the primary answers again, so
// refunds and slot releases are not lost to an outage, however long; until
// then the reservation stays charged (the safe side).
//
// The part of Extended that the fallback debited during an outage is not
// settled on the primary, which never took it.
func (s *Store) Settle(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	if _, ok := s.fallbackIDs.LoadAndDelete(r.ID); ok {
		st, err := s.local.Settle(ctx, r, actual)
		if err == nil {
			s.keepSpend(r, actual)
		}
		return st, err
	}
	if v, ok := s.localExtended.LoadAndDelete(r.ID); ok {
		r = primaryPart(r, v.(float64))
	}
	if s.skipPrimary() {
		s.fallback("settle")
		s.keep(r, actual, nil)
		return nil, fmt.Errorf("failover: settle: kept for replay: %w", buckets.ErrStore)
	}
	st, err := s.primary.Settle(ctx, r, actual)
	s.settledOn(context.WithoutCancel(ctx), r, actual, err)
	return st, err
}

var _ buckets.AsyncSettler = (*Store)(nil)

// settledOn follows a settlement or charge of r that the primary answered
// with err: kept for replay when the primary failed, counted as the
// primary answering when it did.
func (s *Store) settledOn(ctx context.Context, r *buckets.Reservation, actual float64, err error) {
	if s.failed(ctx, err) {
		s.keep(r, actual, err)
	} else if err == nil {
		s.succeeded()
	}
}

// SettleAsync implements buckets.AsyncSettler as Settle does: reservations
// taken locally settle locally, at once; the others go to the primary,
// queued there when it settles asynchronously, and are kept for replay when
// it fails.
func (s *Store) SettleAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	as, ok := s.primary.(buckets.AsyncSettler)
	_, local := s.fallbackIDs.Load(r.ID)
	if !ok || local || s.skipPrimary() {
		st, err := s.Settle(context.Background(), r, actual)
		if done != nil {
			done(st, err)
		}
		return
	}
	if v, ok := s.localExtended.LoadAndDelete(r.ID); ok {
		r = primaryPart(r, v.(float64))
	}
	kept := *r
	as.SettleAsync(r, actual, func(st []buckets.BucketState, err error) {
		s.settledOn(context.Background(), &kept, actual, err)
		if done != nil {
			done(st, err)
		}
	})
}

// Flush implements buckets.AsyncSettler: it flushes the primary's queue.
// Settlements kept for replay wait for the primary to answer again.
func (s *Store) Flush(ctx context.Context) error {
	if as, ok := s.primary.(buckets.AsyncSettler); ok {
		return as.Flush(ctx)
	}
	return nil
}

// Pause implements buckets.Store; during an outage the pause also applies
// to the local fallback bucket.
func (s *Store) Pause(ctx context.Context, b buckets.Bucket, until time.Time) error {
	if s.local != nil {
		if err := s.local.Pause(ctx, s.localBucket(b), until); err != nil {
			return fmt.Errorf("failover: pause: %w", err)
		}
	}
	if s.skipPrimary() {
		return fmt.Errorf("failover: pause: %w", buckets.ErrStore)
	}
	err := s.primary.Pause(ctx, b, until)
	if !s.failed(ctx, err) && err == nil {
		s.succeeded()
	}
	return err
}

// Renew implements buckets.Renewer: slots of reservations taken locally
// renew locally, the others on the primary when it is reachable.
func (s *Store) Renew(ctx context.Context, r *buckets.Reservation) error {
	if _, ok := s.fallbackIDs.Load(r.ID); ok {
		return s.local.Renew(ctx, r)
	}
	rn, ok := s.primary.(buckets.Renewer)
	if !ok {
		return nil
	}
	if s.skipPrimary() {
		return fmt.Errorf("failover: renew: %w", buckets.ErrStore)
	}
	err := rn.Renew(ctx, r)
	if !s.failed(ctx, err) && err == nil {
		s.succeeded()
	}
	return err
}

var _ buckets.Inspector = (*Store)(nil)

// Inspect implements buckets.Inspector through the primary: what the
// shared store holds. During an outage there is nothing shared to show,
// failing open or closed, and the error wraps buckets.ErrStore; a primary
// that cannot inspect answers an error wrapping errors.ErrUnsupported.
func (s *Store) Inspect(ctx context.Context, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState, error) {
	in, ok := s.primary.(buckets.Inspector)
	if !ok {
		return nil, nil, fmt.Errorf("failover: inspect: %T: %w", s.primary, errors.ErrUnsupported)
	}
	if s.skipPrimary() {
		return nil, nil, fmt.Errorf("failover: inspect: the store is unreachable: %w", buckets.ErrStore)
	}
	st, q, err := in.Inspect(ctx, bs, qs)
	if !s.failed(ctx, err) && err == nil {
		s.succeeded()
	}
	return st, q, err
}

// InUse implements buckets.Inspector through the primary, as Inspect does:
// the leases held across the fleet. During an outage the error wraps
// buckets.ErrStore.
func (s *Store) InUse(ctx context.Context, ss []buckets.Slot) ([]int, error) {
	in, ok := s.primary.(buckets.Inspector)
	if !ok {
		return nil, fmt.Errorf("failover: in use: %T: %w", s.primary, errors.ErrUnsupported)
	}
	if s.skipPrimary() {
		return nil, fmt.Errorf("failover: in use: the store is unreachable: %w", buckets.ErrStore)
	}
	n, err := in.InUse(ctx, ss)
	if !s.failed(ctx, err) && err == nil {
		s.succeeded()
	}
	return n, err
}

var _ buckets.SpendLister = (*Store)(nil)

// ListSpend implements buckets.SpendLister through the primary, as
// Inspect does: during an outage the error wraps buckets.ErrStore.
func (s *Store) ListSpend(ctx context.Context, q buckets.SpendQuery) (buckets.SpendList, error) {
	l, ok := s.primary.(buckets.SpendLister)
	if !ok {
		return buckets.SpendList{}, fmt.Errorf("failover: list spend: %T: %w", s.primary, errors.ErrUnsupported)
	}
	if s.skipPrimary() {
		return buckets.SpendList{}, fmt.Errorf("failover: list spend: the store is unreachable: %w", buckets.ErrStore)
	}
	list, err := l.ListSpend(ctx, q)
	if !s.failed(ctx, err) && err == nil {
		s.succeeded()
	}
	return list, err
}

var (
	_ buckets.Charger      = (*Store)(nil)
	_ buckets.AsyncCharger = (*Store)(nil)
)

// ChargeAsync implements buckets.AsyncCharger as Charge does: the charge
// is queued by the primary when it charges asynchronously, and kept for
// replay when that fails; during an outage, or with a primary that charges
// only while the caller waits, it is Charge, done before ChargeAsync
// returns.
func (s *Store) ChargeAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	ac, ok := s.primary.(buckets.AsyncCharger)
	if !ok || s.skipPrimary() || r == nil {
		st, err := s.Charge(context.Background(), r, actual)
		if done != nil {
			done(st, err)
		}
		return
	}
	buckets.ChargeWindows(r, s.opts.Now())
	kept := *r
	ac.ChargeAsync(r, actual, func(st []buckets.BucketState, err error) {
		s.settledOn(context.Background(), &kept, actual, err)
		if done != nil {
			done(st, err)
		}
	})
}

// Charge implements buckets.Charger through the primary: a charge is a
// write to the shared buckets, which the local fallback does not hold.
// During an outage, or when the primary fails, the charge is kept with the
// settlements (bounded by MaxPending) and replayed once the primary
// answers again, once by its ID, and the error wraps buckets.ErrStore: the
// caller answers as a rate-limit service without its store does (Envoy's
// failure mode decides). A primary that cannot charge answers an error
// wrapping errors.ErrUnsupported.
func (s *Store) Charge(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	ch, ok := s.primary.(buckets.Charger)
	if !ok {
		return nil, fmt.Errorf("failover: charge: %T: %w", s.primary, errors.ErrUnsupported)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("failover: charge: %w", err)
	}
	buckets.ChargeWindows(r, s.opts.Now())
	if s.skipPrimary() {
		s.fallback("charge")
		s.keep(r, actual, nil)
		return nil, fmt.Errorf("failover: charge: kept for replay: %w", buckets.ErrStore)
	}
	st, err := ch.Charge(ctx, r, actual)
	s.settledOn(context.WithoutCancel(ctx), r, actual, err)
	return st, err
}
