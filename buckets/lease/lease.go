// Package lease gives each gateway of a fleet allotted sub-budgets of the
// shared buckets (S20): for a bucket with a buckets.Lease, a gateway takes
// a slice of it from the shared store in one atomic call and admits
// requests against that slice locally, without a store call per request.
//
// Tokens in a lease are already debited from the shared bucket, so the
// fleet never admits more than the bucket. The price is that tokens one
// gateway holds are not available to another until they are used or
// returned: at the gateway's next lease call on the bucket, when the lease
// outlives its TTL, and when the gateway shuts down (Close). A lease is
// sized from the rate this gateway admits against the bucket, so that what
// a gateway holds stays about Options.Horizon of its traffic, and at most
// Horizon of the bucket's refill — or set per bucket (buckets.Lease.Size).
// Near an empty bucket leases shrink by themselves: a call takes beyond its
// own request only what the bucket holds above its headroom.
//
// # Semantics
//
// A request whose leased buckets all hold its cost locally is admitted at
// once; one that finds a lease short makes a lease call that first gives
// back everything this gateway holds of that bucket, so a refusal is
// decided on the shared bucket exactly as a Reserve would decide it (S3–S5,
// S12, S14, S19) — save for the tokens other gateways hold. The request's
// Retry-After (Decision.Wait) is computed from the shared bucket; tokens in
// other gateways' leases come back within their TTL (usually much sooner,
// at their next call), so a retry can be refused once more by at most what
// other gateways hold. Calls for one bucket are coalesced: while a call is
// on its way, other requests for that bucket wait for it and take from the
// new lease, or are refused by the level it found.
//
// Settlement (S8, S9) is local: refunds and usage beyond the reservation go
// back to the shared bucket with the next lease call of that bucket, where
// refunds fill it at most to capacity and debts stop at its floor. Debts
// count against the local lease at once; refunds are not admitted against
// locally, since the shared bucket may be full. The states Settle reports
// for leased buckets are estimates: the shared level last seen, refilled
// to now, plus what this gateway holds and owes.
//
// Requests mixing leased and other buckets take the leased part locally
// first, then reserve the rest (and every concurrency slot, S11) in the
// inner store, one call as before; if the inner store refuses, the local
// part is put back: all or none (S3).
//
// # What leases change
//
// While gateways hold leases, the shared bucket refills its own level as
// usual: the fleet's instant burst can exceed the capacity by what the
// gateways hold at that moment, while over any time from a full bucket it
// still admits at most the capacity plus the refill. A debt reaches the
// shared bucket with the next lease call or sweep (Options.SweepEvery);
// should the bucket refill to capacity meanwhile, the refill that debt
// would have been made up by is lost: the lease store charges more, never
// less. A pause (S18) empties this gateway's lease of the bucket; other
// gateways admit from theirs until their next call. A hard bucket (S14)
// may be leased: extensions take from the lease, and a stream is cut when
// neither the lease nor the shared bucket can cover them — which can
// happen while other gateways still hold leases.
//
// # Failure
//
// A lease call whose reply is lost is sent again by the Redis store, and
// applies once however many of its copies run: a take sent again answers
// the grant of the first. One that fails for good may or may not have been
// applied: what it gave back is taken as given, what it owed as still
// owed, and nothing as granted — the safe side each time. For Options.Backoff no lease call is
// made: requests take from the leases this gateway still holds, and what
// they cannot take is reserved in the inner store, whose failure mode (a
// failover store) decides. A gateway that dies loses what it held: those
// tokens stay debited, and come back to the bucket by refill, within
// lease / rate. The shared store cannot return them at the TTL because it
// cannot know how much of the lease the gateway had admitted: returning the
// whole lease would admit those tokens twice.
package lease

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"math"
	"math/bits"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// Lender is the shared store that lends slices of its buckets: the Redis
// store, and buckets.Memory. Lease applies each op in one atomic step (see
// buckets.LeaseOp).
type Lender interface {
	Lease(ctx context.Context, ops []buckets.LeaseOp) error
}

// Options configures a Store. The zero value gives the defaults.
type Options struct {
	// Horizon is how much of this gateway's traffic a lease sized from the
	// rate (buckets.Lease.Size zero) covers: the lease is the tokens per
	// second admitted against the bucket lately, times Horizon, and at
	// most the bucket's own refill over Horizon. Longer means fewer store
	// calls, and more tokens held away from other gateways. Zero means
	// 250ms.
	Horizon time.Duration
	// MaxShare bounds a lease sized from the rate to this share of the
	// bucket's capacity, so that small buckets stay metered per request.
	// Zero means 1/8.
	MaxShare float64
	// Backoff is how long no lease call is made after one failed. Zero
	// means one second.
	Backoff time.Duration
	// SweepEvery is how often leases past their TTL are returned and idle
	// state dropped. Zero means 250ms; negative means never (the leases
	// then go back only with the next call of their bucket, with
	// ReturnExpired and with Close).
	SweepEvery time.Duration
	// Now is the gateway's clock, for TTLs and the rate of each bucket;
	// nil means time.Now. The shared buckets run on the store's clock.
	Now func() time.Time
	// Logger receives one line when lease calls start failing and one when
	// they succeed again.
	Logger *slog.Logger
}

// Store is a buckets.Store that admits against local leases of the buckets
// that have a buckets.Lease and hands everything else to the inner store.
// It is safe for concurrent use. Use New; call Close when shutting down,
// after the last settlement, to return what it holds.
type Store struct {
	inner    buckets.Store
	lender   Lender
	horizon  time.Duration
	tau      float64 // seconds over which a bucket's rate is averaged
	maxShare float64
	backoff  time.Duration
	now      func() time.Time
	epoch    time.Time
	logger   *slog.Logger

	entries  sync.Map // bucket key → *entry
	seed     maphash.Seed
	open     [openShards]openShard
	downTill atomic.Int64 // ns since epoch until which no lease call is made
	down     atomic.Bool
	closed   atomic.Bool
	stop     chan struct{}
	stopped  chan struct{} // nil when there is no sweeper
}

var (
	_ buckets.Store        = (*Store)(nil)
	_ buckets.Renewer      = (*Store)(nil)
	_ buckets.AsyncSettler = (*Store)(nil)
	_ buckets.AsyncCharger = (*Store)(nil)
)

const openShards = 32

// openShard holds reservations admitted with a leased part, by ID.
type openShard struct {
	mu sync.Mutex
	m  map[string]*open
	_  [40]byte // keep hot mutexes on separate cache lines
}

// open is one admitted reservation with a leased part: which of its
// buckets were taken from leases, and the inner store's reservation of the
// rest.
type open struct {
	local   uint64
	inner   *buckets.Reservation // nil when nothing went to the inner store
	expires int64
}

// entry is this gateway's lease of one bucket.
type entry struct {
	mu     sync.Mutex
	bucket buckets.Bucket // as last used: returns go out with it
	// held is what the lease holds, not yet taken; below zero, usage
	// beyond reservations that the shared bucket is owed.
	held float64
	// refund is what settlements gave back, owed to the shared bucket. It
	// is never admitted against locally: the shared bucket may be full.
	refund  float64
	expires int64   // when held goes back (ns since epoch)
	flight  *flight // the lease call on its way, if any
	dead    bool    // dropped from Store.entries: look it up again

	rate float64 // tokens per second taken lately, see sample
	last int64   // the last lease call; 0 before the first
	used float64 // tokens taken since then

	known bool // the shared bucket as the last call found it:
	level float64
	hold  time.Duration
	seen  int64
}

// flight is a lease call on its way for one entry. Requests that find it
// wait for done, then read refused and obs.
type flight struct {
	done    chan struct{}
	refused bool
	obs     buckets.Observation
}

// New wraps inner: buckets with a Lease are leased from lender, which is
// normally the store under inner (Redis under a failover store), the rest
// go to inner.
func New(inner buckets.Store, lender Lender, opts Options) *Store {
	s := &Store{inner: inner, lender: lender, horizon: opts.Horizon, maxShare: opts.MaxShare,
		backoff: opts.Backoff, now: opts.Now, logger: opts.Logger, seed: maphash.MakeSeed()}
	if s.horizon <= 0 {
		s.horizon = 250 * time.Millisecond
	}
	s.tau = 2 * s.horizon.Seconds()
	if !(s.maxShare > 0 && s.maxShare <= 1) {
		s.maxShare = 1.0 / 8
	}
	if s.backoff <= 0 {
		s.backoff = time.Second
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.logger == nil {
		s.logger = slog.New(slog.DiscardHandler)
	}
	s.epoch = s.now()
	for i := range s.open {
		s.open[i].m = make(map[string]*open)
	}
	s.stop = make(chan struct{})
	if every := opts.SweepEvery; every >= 0 {
		if every == 0 {
			every = 250 * time.Millisecond
		}
		s.stopped = make(chan struct{})
		go s.sweeper(every)
	}
	return s
}

func (s *Store) nowNS() int64 { return int64(s.now().Sub(s.epoch)) }

// leasable reports whether a chain is this store's to handle: it has a
// leased bucket, and few enough buckets for a bit set. Other chains pass
// through to the inner store untouched.
func leasable(bs []buckets.Bucket) bool {
	if len(bs) > 64 {
		return false
	}
	for _, b := range bs {
		if b.Lease != nil {
			return true
		}
	}
	return false
}

// leased is the set of buckets of a leasable chain to take from leases:
// none once the store is closed.
func (s *Store) leased(bs []buckets.Bucket) uint64 {
	if s.closed.Load() {
		return 0
	}
	var m uint64
	for i, b := range bs {
		if b.Lease != nil {
			m |= 1 << i
		}
	}
	return m
}

// newID returns a random reservation ID.
func newID() string {
	var buf [24]byte
	return string(strconv.AppendUint(append(buf[:0], "lease-"...), rand.Uint64(), 36))
}

// spec is what a take asks of each leased bucket.
type spec struct {
	cost     float64
	priority bool
	maxWait  time.Duration
}

// refuses reports whether a bucket observed as o refuses sp.
func (sp spec) refuses(b buckets.Bucket, o buckets.Observation) bool {
	w := buckets.WaitFor(b, o.Level, o.Hold, sp.cost, sp.priority)
	return w > 0 && (b.Hard || w > sp.maxWait)
}

// part is one leased bucket of a take.
type part struct {
	i       int // index in the chain
	e       *entry
	taken   bool
	refused bool
	demoted bool // no lease call is made (the lender is down, or a lease would not pay): the inner store decides
	obs     buckets.Observation
	wait    time.Duration
	waited  *flight
}

// Reserve implements buckets.Store. A request with leased buckets takes its
// cost from their leases (a lease call where one is short), then reserves
// the rest in the inner store; requests without pass through.
func (s *Store) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if !leasable(req.Buckets) {
		return s.inner.Reserve(ctx, req)
	}
	if err := req.Validate(); err != nil {
		return buckets.Decision{}, err
	}
	if err := ctx.Err(); err != nil {
		return buckets.Decision{}, fmt.Errorf("lease: reserve: %w", err)
	}
	if req.ID == "" {
		req.ID = newID()
	}
	for _, b := range req.Buckets {
		if !buckets.Fits(b, req.Cost, req.Priority) {
			if len(req.Quotas) > 0 {
				// The inner store reports the quotas; it writes nothing
				// for a request it can never admit.
				return s.inner.Reserve(ctx, req)
			}
			return s.neverAdmissible(req), nil
		}
	}
	sp := spec{cost: req.Cost, priority: req.Priority, maxWait: req.MaxWait}
	parts, refused := s.take(req.Buckets, s.leased(req.Buckets), sp)
	if refused {
		return s.refusal(req, parts), nil
	}
	var local uint64
	for _, p := range parts {
		if p.taken {
			local |= 1 << p.i
		}
	}
	o := &open{local: local}
	d := buckets.Decision{OK: true, Reason: buckets.Admitted}
	if rest := s.rest(req, local); metered(rest) {
		var err error
		d, err = s.inner.Reserve(ctx, rest)
		if err != nil || !d.OK {
			s.undo(req.Buckets, parts, req.Cost)
			if err != nil {
				return buckets.Decision{}, err
			}
			return s.merge(req, parts, local, d), nil
		}
		o.inner = d.Reservation
	}
	d = s.merge(req, parts, local, d)
	o.expires = s.nowNS() + int64(req.LifetimeOrDefault())
	sh := s.openShard(req.ID)
	sh.mu.Lock()
	sh.m[req.ID] = o
	sh.mu.Unlock()
	res := buckets.Reservation{ID: req.ID, Priority: req.Priority, Lifetime: req.Lifetime}
	if o.inner != nil {
		res = *o.inner // whatever else the inner store keeps in it
	}
	res.Cost, res.Buckets, res.Slots = req.Cost, req.Buckets, req.Slots
	d.Reservation = &res
	return d, nil
}

// metered reports whether a request has anything for the inner store to
// meter: buckets, slots or quotas. Whatever else a request may carry for
// the inner store must count here too.
func metered(r buckets.Request) bool { return len(r.Buckets)+len(r.Slots)+len(r.Quotas) > 0 }

// rest is the part of req the inner store handles: the buckets not in
// local and every slot, under the same ID.
func (s *Store) rest(req buckets.Request, local uint64) buckets.Request {
	r := req
	r.Buckets = nil
	for i, b := range req.Buckets {
		if local&(1<<i) == 0 {
			r.Buckets = append(r.Buckets, b)
		}
	}
	return r
}

// take takes sp.cost from the lease of every bucket of bs in mask, all or
// none: from what the lease holds, or with a lease call (one call for all
// the buckets short at once, coalesced with calls already on their way).
// On refusal every part taken is put back. A part that no call could be
// made for is demoted: its bucket goes to the inner store.
func (s *Store) take(bs []buckets.Bucket, mask uint64, sp spec) (parts []part, refused bool) {
	parts = make([]part, 0, bits.OnesCount64(mask))
	for m := mask; m != 0; m &= m - 1 {
		parts = append(parts, part{i: bits.TrailingZeros64(m)})
	}
	for {
		now := s.nowNS()
		down := s.isDown(now)
		var ops []buckets.LeaseOp
		var mine, waits []*part
		for k := range parts {
			p := &parts[k]
			if p.taken || p.refused || p.demoted {
				continue
			}
			b := bs[p.i]
			e := s.lock(b)
			p.e = e
			switch {
			case e.held > 0 && e.held >= sp.cost:
				e.held -= sp.cost
				e.used += sp.cost
				p.taken, p.obs = true, e.observe(now)
			case p.waited != nil && p.waited.refused && sp.refuses(b, p.waited.obs):
				// The call this request waited for found the bucket too
				// low for it as well: refused as of that call.
				p.refused, p.obs = true, p.waited.obs
			case e.flight != nil:
				p.waited = e.flight
				waits = append(waits, p)
			case down:
				p.demoted = true
			default:
				e.sample(now, sp.cost, s.tau)
				want := s.want(e, b, sp.cost)
				if b.Lease.Size == 0 && want < minLeaseRequests*sp.cost {
					p.demoted = true // too rare here for a lease to pay: see minLeaseRequests
					break
				}
				e.flight = &flight{done: make(chan struct{})}
				ops = append(ops, buckets.LeaseOp{Bucket: b, Give: e.held + e.refund, Need: sp.cost,
					Want: want, Priority: sp.priority, MaxWait: sp.maxWait})
				e.held, e.refund = 0, 0
				mine = append(mine, p)
			}
			e.mu.Unlock()
		}
		if len(ops) > 0 {
			err := s.lend(ops)
			now := s.nowNS()
			for k, p := range mine {
				s.land(p, &ops[k], sp, err, now)
			}
		}
		for _, p := range waits {
			<-p.waited.done
		}
		done := true
		for k := range parts {
			p := &parts[k]
			refused = refused || p.refused
			done = done && (p.taken || p.refused || p.demoted)
		}
		if refused {
			s.undo(bs, parts, sp.cost)
			return parts, true
		}
		if done {
			return parts, false
		}
	}
}

// land records the result of a lease call for part p.
func (s *Store) land(p *part, op *buckets.LeaseOp, sp spec, err error, now int64) {
	e := p.e
	e.mu.Lock()
	defer e.mu.Unlock()
	f := e.flight
	e.flight = nil
	defer close(f.done)
	if err != nil && !op.Done {
		// It may or may not have been applied: what was given is gone,
		// what was owed is still owed, nothing was granted.
		e.held += min(0, op.Give)
		p.demoted = true
		return
	}
	o := op.Observation
	e.known, e.level, e.hold, e.seen = true, o.Level, o.Hold, now
	if !op.OK {
		p.refused, p.obs = true, o
		f.refused, f.obs = true, o
		return
	}
	e.held += op.Granted - op.Need
	if e.held > 0 {
		e.expires = now + int64(op.Bucket.Lease.TTLOrDefault())
	}
	p.taken = true
	// Admitted ahead of time (S12) when the level is short of the reserve.
	p.wait = buckets.WaitFor(op.Bucket, o.Level, o.Hold, 0, sp.priority)
	p.obs = e.observe(now)
}

// undo puts back what the parts took.
func (s *Store) undo(bs []buckets.Bucket, parts []part, cost float64) {
	for k := range parts {
		p := &parts[k]
		if !p.taken {
			continue
		}
		e := s.lock(bs[p.i])
		// Back to the shared bucket with the next call, not into the
		// lease: a bucket that refills to capacity meanwhile must not
		// hold these on top (nor tokens taken ahead of time, which it
		// does not have yet).
		e.refund += cost
		e.used -= cost
		e.mu.Unlock()
		p.taken = false
	}
}

// lock returns the live entry of bucket b, locked.
func (s *Store) lock(b buckets.Bucket) *entry {
	for {
		v, ok := s.entries.Load(b.Key)
		if !ok {
			v, _ = s.entries.LoadOrStore(b.Key, &entry{bucket: b})
		}
		e := v.(*entry)
		e.mu.Lock()
		if !e.dead {
			e.bucket = b
			return e
		}
		e.mu.Unlock()
	}
}

// minLeaseRequests is how many requests of its cost a lease sized from the
// rate (lease: auto) must cover for a lease call to be made. A smaller one
// costs more than it saves: the call and its marker are dearer to Redis
// than a reserve, which group commit shares with other requests, and what
// the lease keeps goes back in one more call at its TTL. Below it — a
// per-identity bucket among many, each seen now and then; a bucket too
// small for a lease of several requests — the request is reserved in the
// inner store, as without a lease, and the rate is kept up to date for when
// the bucket gets busy.
const minLeaseRequests = 4

// sample updates the entry's rate before a lease call that takes need, or
// a reserve of need in the inner store that the rate decided on: an
// average of the tokens taken per second over about tau seconds, which
// tends to the rate whatever the time between calls; the first interval
// sets it (want bounds what a burst can make of that).
func (e *entry) sample(now int64, need, tau float64) {
	used := e.used + need
	if e.last != 0 {
		switch dt := float64(now-e.last) / 1e9; {
		case dt <= 0:
			e.rate += used / tau
		case e.rate == 0:
			e.rate = used / dt
		default:
			a := -math.Expm1(-dt / tau)
			e.rate = e.rate*(1-a) + used*a/dt
		}
	}
	e.last, e.used = now, 0
}

// want is the size of a lease call for a request of cost: the bucket's
// Lease.Size, or this gateway's rate over the horizon — bounded by the
// bucket's own refill over the horizon, so that a gateway holds at most
// that much of a bucket at its limit, and by MaxShare of its capacity —
// never below the cost.
func (s *Store) want(e *entry, b buckets.Bucket, cost float64) float64 {
	if b.Lease.Size > 0 {
		return max(cost, b.Lease.Size)
	}
	h := s.horizon.Seconds()
	return max(cost, min(e.rate*h, b.Limit.Rate*h, b.Limit.Capacity*s.maxShare))
}

// observe is the entry's estimate of the shared bucket at now: the level
// the last call found, refilled since, with what this gateway holds and
// owes given back. The entry is locked.
func (e *entry) observe(now int64) buckets.Observation {
	b := e.bucket
	level, hold := b.Limit.Capacity, time.Duration(0)
	if e.known {
		level, hold = e.level, e.hold
		if d := time.Duration(now - e.seen); d > hold {
			if level < b.Limit.Capacity {
				level = min(b.Limit.Capacity, level+b.Limit.Rate*(d-hold).Seconds())
			}
			hold = 0
		} else {
			hold -= d
		}
	}
	level, _ = buckets.Apply(b, level, e.held+e.refund)
	return buckets.Observation{Level: level, Hold: hold}
}

// lend makes a lease call, detached from any caller: others may wait for
// it. A failure stops lease calls for the back-off.
func (s *Store) lend(ops []buckets.LeaseOp) error {
	err := s.lender.Lease(context.Background(), ops)
	if err == nil {
		if s.down.Swap(false) {
			s.logger.Info("lease calls succeed again: leased buckets admit locally")
		}
		return nil
	}
	if errors.Is(err, buckets.ErrStore) || errors.Is(err, context.DeadlineExceeded) {
		s.downTill.Store(s.nowNS() + int64(s.backoff))
		if !s.down.Swap(true) {
			s.logger.Warn("lease call failed: leased buckets use what this gateway holds, then the inner store", "err", err)
		}
	}
	return err
}

func (s *Store) isDown(now int64) bool { return s.down.Load() && now < s.downTill.Load() }

// neverAdmissible is the decision for a request some bucket can never
// admit (S4): decided without the store, which would write nothing.
// Buckets not leased here are reported full: they were not consulted.
func (s *Store) neverAdmissible(req buckets.Request) buckets.Decision {
	obs := s.observations(req.Buckets, nil)
	return buckets.NewDecision(req, req.ID, buckets.Step{Reason: buckets.NeverAdmissible, Buckets: obs, Slot: -1})
}

// observations returns, per bucket, the observation of its part, or for
// buckets without one the estimate of its lease, or a full bucket.
func (s *Store) observations(bs []buckets.Bucket, parts []part) []buckets.Observation {
	obs := make([]buckets.Observation, len(bs))
	var seen uint64
	for _, p := range parts {
		if p.taken || p.refused {
			obs[p.i] = p.obs
			seen |= 1 << p.i
		}
	}
	now := s.nowNS()
	for i, b := range bs {
		if seen&(1<<i) != 0 {
			continue
		}
		obs[i] = buckets.Observation{Level: b.Limit.Capacity}
		if b.Lease == nil {
			continue
		}
		if v, ok := s.entries.Load(b.Key); ok {
			e := v.(*entry)
			e.mu.Lock()
			obs[i] = e.observe(now)
			e.mu.Unlock()
		}
	}
	return obs
}

// refusal is the decision for a request a leased bucket refused (S5): the
// wait is the largest over the refusing buckets, measured on the shared
// bucket.
func (s *Store) refusal(req buckets.Request, parts []part) buckets.Decision {
	obs := s.observations(req.Buckets, parts)
	d := buckets.Decision{Reason: buckets.ShortOfTokens, Buckets: make([]buckets.BucketState, len(req.Buckets))}
	for i, b := range req.Buckets {
		d.Buckets[i] = buckets.NewState(b, obs[i])
	}
	for _, p := range parts {
		if !p.refused {
			continue
		}
		b := req.Buckets[p.i]
		if w := buckets.WaitFor(b, p.obs.Level, p.obs.Hold, req.Cost, req.Priority); d.Limiting == "" || w > d.Wait {
			d.Limiting, d.Wait = b.Name, w
		}
	}
	return d
}

// merge assembles the decision of a request whose leased part was taken
// (the buckets in local) from the inner store's decision on the rest.
func (s *Store) merge(req buckets.Request, parts []part, local uint64, inner buckets.Decision) buckets.Decision {
	obs := s.observations(req.Buckets, parts)
	d := inner
	d.Buckets = make([]buckets.BucketState, len(req.Buckets))
	d.Reservation = nil
	j := 0
	for i, b := range req.Buckets {
		if local&(1<<i) != 0 || j >= len(inner.Buckets) {
			d.Buckets[i] = buckets.NewState(b, obs[i])
			continue
		}
		d.Buckets[i] = inner.Buckets[j]
		j++
	}
	if !d.OK {
		return d
	}
	for _, p := range parts {
		d.Wait = max(d.Wait, p.wait)
	}
	least := math.Inf(1)
	for _, st := range d.Buckets {
		if st.Remaining < least {
			least, d.Limiting = st.Remaining, st.Name
		}
	}
	return d
}

func (s *Store) openShard(id string) *openShard {
	return &s.open[maphash.String(s.seed, id)%openShards]
}

// takeOpen removes and returns the open reservation id; nil when none.
func (s *Store) takeOpen(id string) *open {
	sh := s.openShard(id)
	sh.mu.Lock()
	o := sh.m[id]
	delete(sh.m, id)
	sh.mu.Unlock()
	return o
}

func (s *Store) getOpen(id string) *open {
	sh := s.openShard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.m[id]
}

// Extend implements buckets.Store (S14): n more from every hard bucket,
// from leases for the leased ones, all or none. A hard leased bucket whose
// lease call fails cannot be confirmed: Extend answers an error wrapping
// buckets.ErrStore, and the caller cuts the stream.
func (s *Store) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if r == nil {
		return false, fmt.Errorf("%w: extend: nil reservation", buckets.ErrInvalidRequest)
	}
	if !leasable(r.Buckets) {
		return s.inner.Extend(ctx, r, n)
	}
	if err := buckets.ValidateAmount("extend amount", n); err != nil {
		return false, err
	}
	if n == 0 {
		return true, nil
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("lease: extend: %w", err)
	}
	o := s.getOpen(r.ID)
	if o == nil {
		return false, nil // settled or expired: nothing backs more output
	}
	var hard uint64
	for i, b := range r.Buckets {
		if b.Hard {
			hard |= 1 << i
		}
	}
	// Extend ignores the headroom, as the stores do: priority.
	parts, refused := s.take(r.Buckets, o.local&hard, spec{cost: n, priority: true})
	if refused {
		return false, nil
	}
	var demoted []buckets.Bucket
	for _, p := range parts {
		if p.demoted {
			demoted = append(demoted, r.Buckets[p.i])
		}
	}
	if len(demoted) > 0 {
		// No lease call could be made: the inner store decides for these
		// buckets, as it does for reserves (S21: failing open, from its
		// fallback; failing closed, an error, and the stream is cut). It
		// extends a copy, so that Extended is counted once, below.
		dr := buckets.Reservation{ID: r.ID, Priority: r.Priority, Lifetime: r.Lifetime, Buckets: demoted}
		ok, err := s.inner.Extend(ctx, &dr, n)
		if err != nil || !ok {
			s.undo(r.Buckets, parts, n)
			return false, err
		}
	}
	if o.inner != nil {
		// The inner store decides what of its part is hard.
		ok, err := s.inner.Extend(ctx, o.inner, n)
		if err != nil || !ok {
			s.undo(r.Buckets, parts, n)
			return false, err
		}
	}
	if r.HasHard() {
		r.Extended += n
	}
	return true, nil
}

// Settle implements buckets.Store (S8, S9): the leased part settles
// locally — its difference goes back with the next lease call — the rest
// in the inner store. Settling twice, or after the reservation's lifetime,
// changes nothing.
func (s *Store) Settle(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	if r == nil || r.ID == "" {
		return nil, fmt.Errorf("%w: settle: reservation without ID", buckets.ErrInvalidRequest)
	}
	if !leasable(r.Buckets) {
		return s.inner.Settle(ctx, r, actual)
	}
	if err := buckets.ValidateAmount("actual usage", actual); err != nil {
		return nil, err
	}
	o := s.takeOpen(r.ID)
	states := s.settleLocal(r, o, actual)
	if o == nil || o.inner == nil {
		return states, nil
	}
	o.inner.Spent = r.Spent // set by the caller for quotas of money
	inner, err := s.inner.Settle(ctx, o.inner, actual)
	if err != nil {
		return nil, err
	}
	place(states, o.local, inner)
	return states, nil
}

// settleLocal applies the settlement of r's leased part, if o is open, and
// returns the states of all of r's buckets: the leased ones estimated (see
// entry.observe), what the floor would forgive included.
func (s *Store) settleLocal(r *buckets.Reservation, o *open, actual float64) []buckets.BucketState {
	now := s.nowNS()
	live := o != nil && now < o.expires
	states := make([]buckets.BucketState, len(r.Buckets))
	var give []buckets.Bucket
	for i, b := range r.Buckets {
		if o == nil || o.local&(1<<i) == 0 {
			obs := buckets.Observation{Level: b.Limit.Capacity}
			if v, ok := s.entries.Load(b.Key); ok && b.Lease != nil {
				e := v.(*entry)
				e.mu.Lock()
				obs = e.observe(now)
				e.mu.Unlock()
			}
			states[i] = buckets.NewState(b, obs)
			continue
		}
		e := s.lock(b)
		obs := e.observe(now)
		if live {
			d := r.Charged(b) - actual
			obs.Level, obs.Forgiven = buckets.Apply(b, obs.Level, d)
			if d >= 0 {
				e.refund += d
			} else {
				e.held += d
				e.used -= d
			}
			switch {
			case e.held < 0:
				// A debt goes to the shared bucket at the next sweep if
				// no call takes it sooner: a bucket that refills to
				// capacity meanwhile would lose the refill it makes up.
				e.expires = now
			case e.expires <= now:
				e.expires = now + int64(b.Lease.TTLOrDefault())
			}
		}
		e.mu.Unlock()
		states[i] = buckets.NewState(b, obs)
		give = append(give, b)
	}
	if live && s.closed.Load() {
		// Closed: nothing else will take it back.
		s.giveBack(give)
	}
	return states
}

// place writes the inner store's states into states, at the buckets not
// in local.
func place(states []buckets.BucketState, local uint64, inner []buckets.BucketState) {
	j := 0
	for i := range states {
		if local&(1<<i) == 0 && j < len(inner) {
			states[i] = inner[j]
			j++
		}
	}
}

// SettleAsync implements buckets.AsyncSettler: the leased part settles at
// once, the rest as the inner store settles asynchronously (or at once).
func (s *Store) SettleAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	finish := func(st []buckets.BucketState, err error) {
		if done != nil {
			done(st, err)
		}
	}
	as, async := s.inner.(buckets.AsyncSettler)
	if r != nil && r.ID != "" && !leasable(r.Buckets) {
		if async {
			as.SettleAsync(r, actual, done)
			return
		}
		finish(s.inner.Settle(context.Background(), r, actual))
		return
	}
	if r == nil || r.ID == "" {
		finish(nil, fmt.Errorf("%w: settle: reservation without ID", buckets.ErrInvalidRequest))
		return
	}
	if err := buckets.ValidateAmount("actual usage", actual); err != nil {
		finish(nil, err)
		return
	}
	o := s.takeOpen(r.ID)
	states := s.settleLocal(r, o, actual)
	if o != nil && o.inner != nil {
		o.inner.Spent = r.Spent // set by the caller for quotas of money
	}
	switch {
	case o == nil || o.inner == nil:
		finish(states, nil)
	case async:
		as.SettleAsync(o.inner, actual, func(inner []buckets.BucketState, err error) {
			if err != nil {
				finish(nil, err)
				return
			}
			place(states, o.local, inner)
			finish(states, nil)
		})
	default:
		inner, err := s.inner.Settle(context.Background(), o.inner, actual)
		if err != nil {
			finish(nil, err)
			return
		}
		place(states, o.local, inner)
		finish(states, nil)
	}
}

// Flush implements buckets.AsyncSettler: it flushes the inner store.
func (s *Store) Flush(ctx context.Context) error {
	if as, ok := s.inner.(buckets.AsyncSettler); ok {
		return as.Flush(ctx)
	}
	return nil
}

// Renew implements buckets.Renewer: the reservation stays settleable for
// its lifetime from now, and the inner store renews its part.
func (s *Store) Renew(ctx context.Context, r *buckets.Reservation) error {
	if r == nil || r.ID == "" {
		return fmt.Errorf("%w: renew: reservation without ID", buckets.ErrInvalidRequest)
	}
	rn, ok := s.inner.(buckets.Renewer)
	if !leasable(r.Buckets) {
		if !ok {
			return nil
		}
		return rn.Renew(ctx, r)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("lease: renew: %w", err)
	}
	sh := s.openShard(r.ID)
	sh.mu.Lock()
	o := sh.m[r.ID]
	now := s.nowNS()
	if o != nil && o.expires > now {
		o.expires = now + int64(r.LifetimeOrDefault())
	}
	sh.mu.Unlock()
	if o == nil || o.inner == nil || !ok {
		return nil
	}
	return rn.Renew(ctx, o.inner)
}

var _ buckets.Inspector = (*Store)(nil)

// Inspect implements buckets.Inspector through the inner store: what the
// shared store holds, and for a leased bucket also what this gateway holds
// and owes of it — what a request here would meet. An inner store that
// cannot inspect answers an error wrapping errors.ErrUnsupported.
func (s *Store) Inspect(ctx context.Context, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState, error) {
	in, ok := s.inner.(buckets.Inspector)
	if !ok {
		return nil, nil, fmt.Errorf("lease: inspect: %T: %w", s.inner, errors.ErrUnsupported)
	}
	states, quotas, err := in.Inspect(ctx, bs, qs)
	if err != nil || len(states) != len(bs) {
		return states, quotas, err
	}
	for i, b := range bs {
		v, ok := s.entries.Load(b.Key)
		if !ok || b.Lease == nil {
			continue
		}
		e := v.(*entry)
		e.mu.Lock()
		give := e.held + e.refund
		e.mu.Unlock()
		st := states[i]
		hold := max(0, st.Reset-buckets.Seconds((b.Limit.Capacity-st.Remaining)/b.Limit.Rate))
		level, _ := buckets.Apply(b, st.Remaining, give)
		states[i] = buckets.NewState(b, buckets.Observation{Level: level, Hold: hold})
	}
	return states, quotas, nil
}

// InUse implements buckets.Inspector through the inner store: concurrency
// slots are never leased, so what the shared store holds is what a request
// here would meet.
func (s *Store) InUse(ctx context.Context, ss []buckets.Slot) ([]int, error) {
	in, ok := s.inner.(buckets.Inspector)
	if !ok {
		return nil, fmt.Errorf("lease: in use: %T: %w", s.inner, errors.ErrUnsupported)
	}
	return in.InUse(ctx, ss)
}

var _ buckets.SpendLister = (*Store)(nil)

// ListSpend implements buckets.SpendLister through the inner store:
// quotas are never leased, so what it holds is all there is. An inner
// store that cannot list answers an error wrapping errors.ErrUnsupported.
func (s *Store) ListSpend(ctx context.Context, q buckets.SpendQuery) (buckets.SpendList, error) {
	l, ok := s.inner.(buckets.SpendLister)
	if !ok {
		return buckets.SpendList{}, fmt.Errorf("lease: list spend: %T: %w", s.inner, errors.ErrUnsupported)
	}
	return l.ListSpend(ctx, q)
}

// Pause implements buckets.Store (S18). What this gateway holds of the
// bucket goes back first, so that the pause empties it all; other
// gateways' leases run out before they see the pause.
func (s *Store) Pause(ctx context.Context, b buckets.Bucket, until time.Time) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("lease: pause: %w", err)
	}
	_, leased := s.entries.Load(b.Key)
	leased = leased && b.Lease != nil
	if leased {
		s.giveBack([]buckets.Bucket{b})
	}
	if err := s.inner.Pause(ctx, b, until); err != nil || !leased {
		return err
	}
	// The bucket as the pause left it, for the estimates: empty, debt
	// kept, no refill until then.
	e := s.lock(b)
	now := s.nowNS()
	o := e.observe(now)
	o.Level, _ = buckets.Apply(b, o.Level, -(e.held + e.refund))
	e.known, e.level, e.hold, e.seen = true, min(o.Level, 0), max(o.Hold, until.Sub(s.epoch)-time.Duration(now)), now
	e.mu.Unlock()
	return nil
}

// giveBack returns what this gateway holds and owes of each bucket in one
// lease call.
func (s *Store) giveBack(bs []buckets.Bucket) {
	var ops []buckets.LeaseOp
	var es []*entry
	for _, b := range bs {
		e := s.lock(b)
		if e.flight == nil && (e.held != 0 || e.refund != 0) {
			ops = append(ops, buckets.LeaseOp{Bucket: b, Give: e.held + e.refund})
			e.held, e.refund = 0, 0
			e.flight = &flight{done: make(chan struct{})}
			es = append(es, e)
		}
		e.mu.Unlock()
	}
	s.returns(ops, es)
}

// returns makes the lease call of ops, which give back what the entries
// es held, and lands it.
func (s *Store) returns(ops []buckets.LeaseOp, es []*entry) error {
	if len(ops) == 0 {
		return nil
	}
	err := s.lend(ops)
	now := s.nowNS()
	for k, e := range es {
		e.mu.Lock()
		f := e.flight
		e.flight = nil
		if op := &ops[k]; op.Done {
			e.known, e.level, e.hold, e.seen = true, op.Observation.Level, op.Observation.Hold, now
		} else {
			e.held += min(0, op.Give) // see land
		}
		close(f.done)
		e.mu.Unlock()
	}
	return err
}

// ReturnExpired returns to the shared buckets what leases past their TTL
// still hold, and what settlements owe them, in one lease call, and drops
// what has been idle for long. The sweeper calls it every
// Options.SweepEvery.
func (s *Store) ReturnExpired(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("lease: return: %w", err)
	}
	return s.sweep(false)
}

// idle is how long an entry that holds and owes nothing is kept after its
// last lease call, for its rate.
const idle = time.Minute

func (s *Store) sweep(all bool) error {
	now := s.nowNS()
	if !all && s.isDown(now) {
		return nil // keep the leases for requests until calls succeed again
	}
	var ops []buckets.LeaseOp
	var es []*entry
	s.entries.Range(func(k, v any) bool {
		e := v.(*entry)
		e.mu.Lock()
		switch {
		case e.flight != nil:
		case e.held != 0 || e.refund != 0:
			if all || now >= e.expires {
				ops = append(ops, buckets.LeaseOp{Bucket: e.bucket, Give: e.held + e.refund})
				e.held, e.refund = 0, 0
				e.flight = &flight{done: make(chan struct{})}
				es = append(es, e)
			}
		case now-e.last >= int64(idle) && now-e.seen >= int64(idle):
			e.dead = true
			s.entries.CompareAndDelete(k, e)
		}
		e.mu.Unlock()
		return true
	})
	for i := range s.open {
		sh := &s.open[i]
		sh.mu.Lock()
		for id, o := range sh.m {
			if o.expires <= now {
				delete(sh.m, id) // never settled: its tokens stay charged
			}
		}
		sh.mu.Unlock()
	}
	if err := s.returns(ops, es); err != nil {
		return fmt.Errorf("lease: return: %w", err)
	}
	return nil
}

func (s *Store) sweeper(every time.Duration) {
	defer close(s.stopped)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			if err := s.sweep(false); err != nil {
				s.logger.Debug("expired leases not returned", "err", err)
			}
		}
	}
}

// Close returns everything this gateway holds of every bucket, and what
// settlements owe them, in one lease call, and stops the sweeper. Leased
// buckets are then reserved in the inner store. Call it after the last
// request has settled; settlements after it go back one by one.
func (s *Store) Close(ctx context.Context) error {
	if s.closed.Swap(true) {
		return nil
	}
	close(s.stop)
	if s.stopped != nil {
		select {
		case <-s.stopped:
		case <-ctx.Done():
			return fmt.Errorf("lease: close: %w", ctx.Err())
		}
	}
	return s.sweep(true)
}

var _ buckets.Charger = (*Store)(nil)

// Charge implements buckets.Charger. A debit (no refund, no quota, no
// slot) of buckets that are all leased is taken from their leases, as a
// reservation of that many tokens settled at once would be, with a lease
// call only where a lease is short: no call to the shared store for the
// rate-limit service's hits on a bucket this gateway holds a slice of.
// Anything else — a refund, quotas, a bucket not leased, a lease that
// cannot cover the hits (the charge must then go below zero on the shared
// bucket) — goes to the store underneath, past the slices this gateway
// leased, which it meets when it next renews them. A store underneath that
// cannot charge answers an error wrapping errors.ErrUnsupported.
func (s *Store) Charge(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	ch, ok := s.inner.(buckets.Charger)
	if !ok {
		return nil, fmt.Errorf("lease: charge: %T: %w", s.inner, errors.ErrUnsupported)
	}
	if states, ok := s.chargeLocal(ctx, r, actual); ok {
		return states, nil
	}
	return ch.Charge(ctx, r, actual)
}

// ChargeAsync implements buckets.AsyncCharger as Charge does: a charge
// the leases cover is taken from them before ChargeAsync returns; any
// other goes to the store underneath, queued there when it charges
// asynchronously.
func (s *Store) ChargeAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	if states, ok := s.chargeLocal(context.Background(), r, actual); ok {
		if done != nil {
			done(states, nil)
		}
		return
	}
	buckets.ChargeLater(s.inner, r, actual, done)
}

// chargeLocal takes a charge of actual tokens from the leases of r's
// buckets, all or none; ok is false when it took nothing and the store
// underneath must charge.
func (s *Store) chargeLocal(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, bool) {
	if r == nil || r.Cost != 0 || !(actual > 0) || len(r.Quotas) > 0 || len(r.Slots) > 0 || !leasable(r.Buckets) || ctx.Err() != nil {
		return nil, false
	}
	mask := s.leased(r.Buckets)
	if mask != 1<<len(r.Buckets)-1 {
		return nil, false // a bucket is not leased
	}
	for _, b := range r.Buckets {
		if !buckets.Fits(b, actual, false) {
			return nil, false
		}
	}
	parts, refused := s.take(r.Buckets, mask, spec{cost: actual})
	if refused {
		return nil, false // take puts back what it took
	}
	for _, p := range parts {
		if !p.taken {
			s.undo(r.Buckets, parts, actual)
			return nil, false
		}
	}
	obs := s.observations(r.Buckets, parts)
	states := make([]buckets.BucketState, len(r.Buckets))
	for i, b := range r.Buckets {
		states[i] = buckets.NewState(b, obs[i])
	}
	return states, true
}
