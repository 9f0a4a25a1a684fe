package buckets

import (
	"context"
	"fmt"
	"hash/maphash"
	"math/bits"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"
)

// MemoryOptions configures a Memory store. The zero value gives the
// defaults.
type MemoryOptions struct {
	// Now is the store's one clock (S2); nil means time.Now. Buckets refill
	// by the differences of its readings — monotonic ones when it gives
	// them, as time.Now does, so that a step of the wall clock moves no
	// bucket — and quota windows are named by its wall clock, the
	// calendar's, also after a suspend or a step.
	Now func() time.Time
	// SweepEvery is how often each shard drops buckets that have refilled to
	// capacity, expired slot leases and expired reservations (bounded
	// memory). Zero means one minute.
	SweepEvery time.Duration
}

// Memory is the Store for a single gateway instance: bucket state lives in
// this process. It is safe for concurrent use. State is split over shards
// by key, each with its own mutex; an operation locks only the shards of
// its own keys, in a fixed order, so unrelated keys do not wait for each
// other and chains stay all-or-none (S3).
//
// A bucket that has refilled to capacity is indistinguishable from one that
// was never used, so it is dropped by a periodic sweep: memory is bounded by
// the buckets active within their time to refill. Each open reservation has
// a record, deleted at settlement (which it makes once-only) or swept after
// its lifetime: memory is bounded by the requests in flight.
//
// Use NewMemory; the zero value is not usable.
type Memory struct {
	now        func() time.Time
	epoch      time.Time
	seed       maphash.Seed
	sweepEvery int64
	spans      Spans
	shards     [shardCount]shard
}

const shardCount = 64 // one bit each in a lockSet

var (
	_ Store     = (*Memory)(nil)
	_ Renewer   = (*Memory)(nil)
	_ Inspector = (*Memory)(nil)
)

type shard struct {
	mu      sync.Mutex
	buckets map[string]*level
	slots   map[string]map[string]int64 // key → reservation ID → lease expiry
	open    map[string]int64            // open reservation ID → when it expires
	quotas  map[quotaKey]*spend
	// marks holds, by kind and reservation ID, when the store forgets a
	// call it applied (see mark): a replay or an added spend, which must
	// not apply twice, and a cancelled reservation, which must not be
	// taken again.
	marks     map[string]int64
	nextSweep int64
	_         [64]byte // keep hot mutexes on separate cache lines
}

// Kinds of marks.
const (
	replayMark = "p:"
	spendMark  = "s:"
	cancelMark = "t:"
)

// marked reports whether the mark is set at now.
func (sh *shard) marked(mark string, now int64) bool {
	exp, ok := sh.marks[mark]
	return ok && exp > now
}

func (sh *shard) mark(mark string, expires int64) {
	if exp, ok := sh.marks[mark]; !ok || expires > exp {
		sh.marks[mark] = expires
	}
}

// quotaKey names the spend of one quota in one window.
type quotaKey struct{ key, window string }

// spend is a quota's spend in one window, kept until expires (the window's
// end and QuotaSlack, by the wall clock, in Unix nanoseconds), in the unit
// tag says (Quota.Tag).
type spend struct {
	amount  float64
	expires int64
	tag     string
}

// level is a stored bucket: tokens at instant last, in nanoseconds since the
// store's epoch; refill resumes at last (later than now while paused).
type level struct {
	tokens float64
	last   int64
	limit  Limit // as last written, for the sweep
}

// full reports whether the bucket has refilled to capacity by now.
func (p *level) full(now int64) bool {
	return now >= p.last && p.tokens+p.limit.Rate*(float64(now-p.last)/1e9) >= p.limit.Capacity
}

// NewMemory returns an empty Memory store.
func NewMemory(opts MemoryOptions) *Memory {
	m := &Memory{now: opts.Now, seed: maphash.MakeSeed()}
	if m.now == nil {
		m.now = time.Now
	}
	m.epoch = m.now()
	m.sweepEvery = int64(cmp0(opts.SweepEvery, time.Minute))
	for i := range m.shards {
		sh := &m.shards[i]
		sh.buckets = make(map[string]*level)
		sh.slots = make(map[string]map[string]int64)
		sh.open = make(map[string]int64)
		sh.quotas = make(map[quotaKey]*spend)
		sh.marks = make(map[string]int64)
		sh.nextSweep = m.sweepEvery
	}
	return m
}

func cmp0(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

func (m *Memory) nowNS() int64 { return int64(m.now().Sub(m.epoch)) }

// clock reads the clock once: now for buckets, leases and records, in
// nanoseconds since the epoch (by the monotonic clock when the reading
// has one), and the wall clock for quota windows.
func (m *Memory) clock() (now int64, wall time.Time) {
	t := m.now()
	return int64(t.Sub(m.epoch)), t
}

func (m *Memory) shardOf(key string) uint8 {
	return uint8(maphash.String(m.seed, key) % shardCount)
}

// lockSet is the sorted set of shards an operation locks. Locking in
// ascending order keeps concurrent chains free of deadlock.
type lockSet uint64

func (l *lockSet) add(i uint8) { *l |= 1 << i }

func (m *Memory) lock(l *lockSet) {
	for s := uint64(*l); s != 0; s &= s - 1 {
		m.shards[bits.TrailingZeros64(s)].mu.Lock()
	}
}

func (m *Memory) unlock(l *lockSet) {
	for s := uint64(*l); s != 0; s &= s - 1 {
		m.shards[bits.TrailingZeros64(s)].mu.Unlock()
	}
}

// peek returns bucket b's level brought up to now (S2) without writing it:
// a refused request must not write (S9), and not writing keeps every store's
// arithmetic identical.
func (sh *shard) peek(b Bucket, now int64) (tokens float64, last int64, p *level) {
	p = sh.buckets[b.Key]
	if p == nil {
		return b.Limit.Capacity, now, nil
	}
	tokens, last = p.tokens, p.last
	if now > last {
		tokens = min(b.Limit.Capacity, tokens+b.Limit.Rate*(float64(now-last)/1e9))
		last = now
	}
	return tokens, last, p
}

func (sh *shard) put(b Bucket, p *level, tokens float64, last, now int64) {
	if p == nil {
		if tokens >= b.Limit.Capacity && last <= now {
			return // a missing bucket is a full one
		}
		p = new(level)
		sh.buckets[b.Key] = p
	}
	p.tokens, p.last, p.limit = tokens, last, b.Limit
}

func hold(last, now int64) time.Duration {
	if last > now {
		return time.Duration(last - now)
	}
	return 0
}

// sweep drops full buckets, expired leases, reservations and marks, and
// the spend of windows past their slack, of a locked shard.
func (m *Memory) sweep(sh *shard, now int64, wall time.Time) {
	if now < sh.nextSweep {
		return
	}
	sh.nextSweep = now + m.sweepEvery
	for k, p := range sh.buckets {
		if p.full(now) {
			delete(sh.buckets, k)
		}
	}
	for k, ls := range sh.slots {
		for id, exp := range ls {
			if exp <= now {
				delete(ls, id)
			}
		}
		if len(ls) == 0 {
			delete(sh.slots, k)
		}
	}
	for id, exp := range sh.open {
		if exp <= now {
			delete(sh.open, id)
		}
	}
	for k, exp := range sh.marks {
		if exp <= now {
			delete(sh.marks, k)
		}
	}
	for k, sp := range sh.quotas {
		if sp.expires <= wall.UnixNano() {
			delete(sh.quotas, k)
		}
	}
}

// spent returns the spend of quota q in window span at wall, and its
// record (nil when nothing is spent). A spend in another unit than q's is
// nothing spent in q's unit, but its record is returned.
func (sh *shard) spent(q Quota, span Span, wall time.Time) (float64, *spend) {
	sp := sh.quotas[quotaKey{q.Key, span.ID}]
	if sp == nil || sp.expires <= wall.UnixNano() {
		return 0, nil
	}
	if !q.ReadsTag(sp.tag) {
		return 0, sp
	}
	return sp.amount, sp
}

// charge adds amount (negative refunds) to the spend of quota q in window
// span at wall; a window past its slack is not written. A spend in another
// unit than q's is replaced by an admission (admit: the window starts
// afresh in q's unit) and otherwise left alone: what a reservation settles
// or extends was charged in its own unit, which the window no longer
// counts.
func (sh *shard) charge(q Quota, span Span, amount float64, wall time.Time, admit bool) {
	expires := expiry(span)
	if expires <= wall.UnixNano() {
		return
	}
	amt, sp := sh.spent(q, span, wall)
	if sp != nil && !q.ReadsTag(sp.tag) && !admit {
		return
	}
	amt = max(0, amt+amount)
	switch {
	case sp == nil && amt == 0:
	case sp == nil:
		sh.quotas[quotaKey{q.Key, span.ID}] = &spend{amount: amt, expires: expires, tag: q.Tag()}
	case amt == 0:
		delete(sh.quotas, quotaKey{q.Key, span.ID})
	default:
		if !q.ReadsTag(sp.tag) {
			sp.tag = q.Tag()
		}
		sp.amount = amt
	}
}

// expiry is when the spend of window span may be forgotten, in Unix
// nanoseconds.
func expiry(span Span) int64 { return span.End.Add(QuotaSlack).UnixNano() }

// replayMarkTTL is how long a replay's or an added spend's mark is kept at
// wall: as long as the windows it charged, and at least QuotaSlack, so
// that a replay sent again after another outage finds it.
func replayMarkTTL(spans []Span, wall time.Time) time.Duration {
	ttl := QuotaSlack
	for _, sp := range spans {
		ttl = max(ttl, time.Duration(expiry(sp)-wall.UnixNano()))
	}
	return ttl
}

// recordShard is the shard that keeps the record of a reservation on
// buckets bs and slots ss: the shard of its first key, which its
// operations lock anyway.
func (m *Memory) recordShard(id string, bs []Bucket, ss []Slot) uint8 {
	switch {
	case len(bs) > 0:
		return m.shardOf(bs[0].Key)
	case len(ss) > 0:
		return m.shardOf(ss[0].Key)
	}
	return m.shardOf(id)
}

// newID returns a random reservation ID. A shared counter would make every
// admission touch one cache line from all cores; 64 random bits make a
// collision within the settled window vanishingly unlikely.
func (m *Memory) newID() string {
	var buf [24]byte
	return string(strconv.AppendUint(append(buf[:0], "mem-"...), rand.Uint64(), 36))
}

// Reserve implements Store (S3–S5, S11, S12, S19). A request without an ID
// gets one. A request with the ID of an open reservation takes nothing and
// is admitted (see Store), one with the ID of a reservation cancelled
// within RepeatWindow is refused as never admissible.
func (m *Memory) Reserve(ctx context.Context, req Request) (Decision, error) {
	if err := req.Validate(); err != nil {
		return Decision{}, err
	}
	if err := ctx.Err(); err != nil {
		return Decision{}, fmt.Errorf("reserve: %w", err)
	}
	id := req.ID
	if id == "" {
		id = m.newID()
	}
	var ls lockSet
	var bufShard [8]uint8
	shards := bufShard[:0]
	for _, b := range req.Buckets {
		i := m.shardOf(b.Key)
		shards = append(shards, i)
		ls.add(i)
	}
	var bufSlot [8]uint8
	slotShards := bufSlot[:0]
	for _, s := range req.Slots {
		i := m.shardOf(s.Key)
		slotShards = append(slotShards, i)
		ls.add(i)
	}
	var bufQuota [8]uint8
	quotaShards := bufQuota[:0]
	for _, q := range req.Quotas {
		i := m.shardOf(q.Key)
		quotaShards = append(quotaShards, i)
		ls.add(i)
	}
	rec := m.recordShard(id, req.Buckets, req.Slots)
	ls.add(rec)
	m.lock(&ls)
	// Unlocked below, before the decision is assembled: only the step itself
	// needs the shards.
	now, wall := m.clock()
	var spans []Span
	var spent []float64
	if len(req.Quotas) > 0 {
		spans, spent = make([]Span, len(req.Quotas)), make([]float64, len(req.Quotas))
		for j, q := range req.Quotas {
			spans[j] = m.spans.Span(q.Window, wall)
			spent[j], _ = m.shards[quotaShards[j]].spent(q, spans[j], wall)
		}
	}
	rsh := &m.shards[rec]
	exp, repeat := rsh.open[id]
	repeat = repeat && exp > now
	cancelled := !repeat && rsh.marked(cancelMark+id, now)

	var bufObs [8]Observation
	var bufLast [8]int64
	var bufP [8]*level
	obs, lasts, ps := bufObs[:0], bufLast[:0], bufP[:0]
	reason := Admitted
	var worst time.Duration
	hardShort := false
	for i, b := range req.Buckets {
		sh := &m.shards[shards[i]]
		tokens, last, p := sh.peek(b, now)
		obs = append(obs, Observation{Level: tokens, Hold: hold(last, now)})
		lasts, ps = append(lasts, last), append(ps, p)
		if !Fits(b, req.Cost, req.Priority) {
			reason = NeverAdmissible
			continue
		}
		if w := WaitFor(b, tokens, hold(last, now), req.Cost, req.Priority); w > 0 {
			hardShort = hardShort || b.Hard
			worst = max(worst, w)
		}
	}
	over := false
	for j, q := range req.Quotas {
		c := req.QuotaCost(q)
		if !FitsQuota(q, c) {
			reason = NeverAdmissible
		} else if spent[j]+c > q.Limit {
			over = true
		}
	}
	if reason == Admitted && over {
		reason = OverQuota
	}
	if reason == Admitted && worst > 0 && (hardShort || worst > req.MaxWait) {
		reason = ShortOfTokens
	}
	switch {
	case repeat:
		reason = Admitted
	case cancelled:
		reason = NeverAdmissible
	}
	full := -1
	if reason == Admitted && !repeat {
		for j, s := range req.Slots {
			leases := m.shards[slotShards[j]].slots[s.Key]
			if len(leases) >= s.Max {
				for lid, exp := range leases {
					if exp <= now {
						delete(leases, lid)
					}
				}
				if len(leases) >= s.Max {
					reason, full = ConcurrencyFull, j
					break
				}
			}
		}
	}
	if reason == Admitted && !repeat {
		for i, b := range req.Buckets {
			obs[i].Level -= req.Cost
			m.shards[shards[i]].put(b, ps[i], obs[i].Level, lasts[i], now)
		}
		for j, s := range req.Slots {
			sh := &m.shards[slotShards[j]]
			leases := sh.slots[s.Key]
			if leases == nil {
				leases = make(map[string]int64, s.Max)
				sh.slots[s.Key] = leases
			}
			leases[id] = now + int64(s.LeaseOrDefault())
		}
		for j, q := range req.Quotas {
			c := req.QuotaCost(q)
			m.shards[quotaShards[j]].charge(q, spans[j], c, wall, true)
			spent[j] += c
		}
		rsh.open[id] = now + int64(req.LifetimeOrDefault())
		for s := uint64(ls); s != 0; s &= s - 1 {
			m.sweep(&m.shards[bits.TrailingZeros64(s)], now, wall)
		}
	}
	m.unlock(&ls)
	return NewDecision(req, id, Step{Reason: reason, Buckets: obs, Slot: full, Quotas: spent, Spans: spans, Now: wall}), nil
}

// Extend implements Store (S14): it debits n from every hard bucket of r,
// all or none, and never below zero.
func (m *Memory) Extend(ctx context.Context, r *Reservation, n float64) (bool, error) {
	if r == nil {
		return false, fmt.Errorf("%w: extend: nil reservation", ErrInvalidRequest)
	}
	if err := amount("extend amount", n); err != nil {
		return false, err
	}
	if err := r.ValidateQuotas(); err != nil {
		return false, err
	}
	if n == 0 || !r.HasHard() {
		return true, nil
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("extend: %w", err)
	}
	// No call is ever sent twice in memory: the number is only counted.
	r.Extends++
	var ls lockSet
	for _, b := range r.Buckets {
		if b.Hard {
			ls.add(m.shardOf(b.Key))
		}
	}
	for _, q := range r.Quotas {
		if q.Hard {
			ls.add(m.shardOf(q.Key))
		}
	}
	m.lock(&ls)
	defer m.unlock(&ls)
	now, wall := m.clock()
	for _, b := range r.Buckets {
		if !b.Hard {
			continue
		}
		tokens, last, _ := m.shards[m.shardOf(b.Key)].peek(b, now)
		if tokens-n < 0 || last > now {
			return false, nil
		}
	}
	for j, q := range r.Quotas {
		if !q.Hard {
			continue
		}
		spent, _ := m.shards[m.shardOf(q.Key)].spent(q, r.Windows[j], wall)
		if spent+r.ExtendQuota(q, n) > q.Limit {
			return false, nil
		}
	}
	for _, b := range r.Buckets {
		if !b.Hard {
			continue
		}
		sh := &m.shards[m.shardOf(b.Key)]
		tokens, last, p := sh.peek(b, now)
		sh.put(b, p, tokens-n, last, now)
	}
	for j, q := range r.Quotas {
		if q.Hard {
			m.shards[m.shardOf(q.Key)].charge(q, r.Windows[j], r.ExtendQuota(q, n), wall, false)
		}
	}
	r.Extended += n
	return true, nil
}

// Settle implements Store (S8, S9): it replaces the reservation by actual,
// refunding at most up to capacity and debiting at most down to each
// bucket's floor, and releases the reservation's slots. Settling a
// reservation that is not open — settled already, or expired — reports the
// state and changes nothing. Settle runs whatever the state of ctx (see
// Store).
func (m *Memory) Settle(ctx context.Context, r *Reservation, actual float64) ([]BucketState, error) {
	return m.settle(r, actual, settleOpen)
}

var _ Replayer = (*Memory)(nil)

// Replay implements Replayer.
func (m *Memory) Replay(ctx context.Context, r *Reservation, actual float64, sent bool) ([]BucketState, error) {
	if sent {
		return m.settle(r, actual, replaySent)
	}
	return m.settle(r, actual, replayUnsent)
}

// Cancel implements Replayer.
func (m *Memory) Cancel(ctx context.Context, r *Reservation) error {
	if r != nil {
		rc := *r
		rc.Spent = 0
		r = &rc
	}
	_, err := m.settle(r, 0, settleCancel)
	return err
}

// settleMode is what a settlement applies when, see settle.
type settleMode int

const (
	// settleOpen: a Settle, of an open reservation only.
	settleOpen settleMode = iota
	// replayUnsent: a Replay of a settlement that never reached the
	// store, also of an expired reservation; once.
	replayUnsent
	// replaySent: a Replay of one that may have, where an expired
	// reservation is charged only what it used beyond what it holds.
	replaySent
	// settleCancel: a Cancel, of an open reservation only, at zero; the ID
	// is then refused for RepeatWindow.
	settleCancel
	// chargeOnce: a Charge, as replayUnsent, but its ID is remembered for
	// RepeatWindow only: a copy comes from the caller's own retries.
	chargeOnce
)

// settle is Settle, Replay and Cancel: each applies the settlement of r
// with actual as mode says, and reports the buckets' states.
func (m *Memory) settle(r *Reservation, actual float64, mode settleMode) ([]BucketState, error) {
	if r == nil || r.ID == "" {
		return nil, fmt.Errorf("%w: settle: reservation without ID", ErrInvalidRequest)
	}
	if err := amount("actual usage", actual); err != nil {
		return nil, err
	}
	if err := r.ValidateQuotas(); err != nil {
		return nil, err
	}
	var ls lockSet
	var bufShard [8]uint8
	shards := bufShard[:0]
	for _, b := range r.Buckets {
		i := m.shardOf(b.Key)
		shards = append(shards, i)
		ls.add(i)
	}
	for _, s := range r.Slots {
		ls.add(m.shardOf(s.Key))
	}
	for _, q := range r.Quotas {
		ls.add(m.shardOf(q.Key))
	}
	rec := &m.shards[m.recordShard(r.ID, r.Buckets, r.Slots)]
	ls.add(m.recordShard(r.ID, r.Buckets, r.Slots))
	m.lock(&ls)
	now, wall := m.clock()

	exp, open := rec.open[r.ID]
	delete(rec.open, r.ID)
	apply := open && exp > now
	debitsOnly := false
	switch mode {
	case replayUnsent, replaySent, chargeOnce:
		if rec.marked(replayMark+r.ID, now) {
			apply = false
			break
		}
		if !apply {
			apply, debitsOnly = true, mode == replaySent
		}
		ttl := replayMarkTTL(r.Windows, wall)
		if mode == chargeOnce {
			ttl = RepeatWindow
		}
		rec.mark(replayMark+r.ID, now+int64(ttl))
	case settleCancel:
		rec.mark(cancelMark+r.ID, now+int64(RepeatWindow))
	}
	var bufObs [8]Observation
	obs := bufObs[:0]
	for i, b := range r.Buckets {
		sh := &m.shards[shards[i]]
		tokens, last, p := sh.peek(b, now)
		var forgiven float64
		if apply {
			d := r.Charged(b) - actual
			if debitsOnly {
				d = min(d, 0)
			}
			tokens, forgiven = Apply(b, tokens, d)
			sh.put(b, p, tokens, last, now)
		}
		obs = append(obs, Observation{Level: tokens, Hold: hold(last, now), Forgiven: forgiven})
	}
	if apply {
		for _, s := range r.Slots {
			sh := &m.shards[m.shardOf(s.Key)]
			if leases := sh.slots[s.Key]; leases != nil {
				delete(leases, r.ID)
			}
		}
		for j, q := range r.Quotas {
			d := r.UsedQuota(q, actual) - r.ChargedQuota(q)
			if debitsOnly {
				d = max(d, 0)
			}
			m.shards[m.shardOf(q.Key)].charge(q, r.Windows[j], d, wall, false)
		}
	}
	m.unlock(&ls)
	states := make([]BucketState, len(r.Buckets))
	for i, b := range r.Buckets {
		states[i] = NewState(b, obs[i])
	}
	return states, nil
}

// Apply returns the level of bucket b after settling delta tokens (what was
// charged minus what was used) at level tokens (S8, S9, S14): a refund
// fills at most to capacity, a debit goes at most down to the floor — and a
// debit never raises a level that is already below the floor. forgiven is
// the part of a debit the floor kept from being charged.
func Apply(b Bucket, tokens, delta float64) (level, forgiven float64) {
	if delta >= 0 {
		return min(b.Limit.Capacity, tokens+delta), 0
	}
	level = min(tokens, max(b.Floor(), tokens+delta))
	return level, level - (tokens + delta)
}

// Pause implements Store (S18): the bucket is empty, and does not refill,
// until the given time. Debt is kept.
func (m *Memory) Pause(ctx context.Context, b Bucket, until time.Time) error {
	if err := b.Validate(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pause: %w", err)
	}
	sh := &m.shards[m.shardOf(b.Key)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	now := m.nowNS()
	tokens, last, p := sh.peek(b, now)
	sh.put(b, p, min(tokens, 0), max(last, int64(until.Sub(m.epoch))), now)
	return nil
}

// Renew extends the leases of r's concurrency slots by their Lease from now
// (S11), and r's record by its lifetime, for responses that outlive one
// lease; a lease or a reservation that has already expired is not taken
// again. It implements Renewer.
func (m *Memory) Renew(ctx context.Context, r *Reservation) error {
	if r == nil || r.ID == "" {
		return fmt.Errorf("%w: renew: reservation without ID", ErrInvalidRequest)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("renew: %w", err)
	}
	sh := &m.shards[m.recordShard(r.ID, r.Buckets, r.Slots)]
	sh.mu.Lock()
	if exp, ok := sh.open[r.ID]; ok && exp > m.nowNS() {
		sh.open[r.ID] = m.nowNS() + int64(r.LifetimeOrDefault())
	}
	sh.mu.Unlock()
	for _, s := range r.Slots {
		sh := &m.shards[m.shardOf(s.Key)]
		sh.mu.Lock()
		now := m.nowNS()
		if exp, ok := sh.slots[s.Key][r.ID]; ok && exp > now {
			sh.slots[s.Key][r.ID] = now + int64(s.LeaseOrDefault())
		}
		sh.mu.Unlock()
	}
	return nil
}

var _ AsyncSettler = (*Memory)(nil)

// SettleAsync implements AsyncSettler. The memory store has no call to
// save: it settles at once and calls done before it returns.
func (m *Memory) SettleAsync(r *Reservation, actual float64, done func([]BucketState, error)) {
	states, err := m.Settle(context.Background(), r, actual)
	if done != nil {
		done(states, err)
	}
}

// Flush implements AsyncSettler; nothing is ever queued.
func (m *Memory) Flush(ctx context.Context) error { return nil }

// Inspect implements Inspector: the buckets' levels and the quotas' spend
// in the window that holds now, as a request would meet them.
func (m *Memory) Inspect(ctx context.Context, bs []Bucket, qs []Quota) ([]BucketState, []QuotaState, error) {
	if err := ValidateInspect(bs, qs); err != nil {
		return nil, nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, nil, fmt.Errorf("inspect: %w", err)
	}
	states := make([]BucketState, len(bs))
	for i, b := range bs {
		sh := &m.shards[m.shardOf(b.Key)]
		sh.mu.Lock()
		now := m.nowNS()
		tokens, last, _ := sh.peek(b, now)
		sh.mu.Unlock()
		states[i] = NewState(b, Observation{Level: tokens, Hold: hold(last, now)})
	}
	quotas := make([]QuotaState, len(qs))
	for j, q := range qs {
		sh := &m.shards[m.shardOf(q.Key)]
		sh.mu.Lock()
		_, wall := m.clock()
		span := m.spans.Span(q.Window, wall)
		spent, _ := sh.spent(q, span, wall)
		sh.mu.Unlock()
		quotas[j] = NewQuotaState(q, span, spent, wall)
	}
	return states, quotas, nil
}

var _ SpendAdder = (*Memory)(nil)

// AddSpend implements SpendAdder: all the spends of one id in one step,
// once.
func (m *Memory) AddSpend(ctx context.Context, id string, ss []Spend) error {
	if err := ValidateSpend(id, ss); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("add spend: %w", err)
	}
	var ls lockSet
	mark := m.shardOf(id)
	ls.add(mark)
	spans := make([]Span, len(ss))
	for j, s := range ss {
		ls.add(m.shardOf(s.Quota.Key))
		spans[j] = s.Window
	}
	m.lock(&ls)
	defer m.unlock(&ls)
	now, wall := m.clock()
	if m.shards[mark].marked(spendMark+id, now) {
		return nil
	}
	for _, s := range ss {
		m.shards[m.shardOf(s.Quota.Key)].charge(s.Quota, s.Window, s.Amount, wall, false)
	}
	m.shards[mark].mark(spendMark+id, now+int64(replayMarkTTL(spans, wall)))
	return nil
}

var (
	_ Charger      = (*Memory)(nil)
	_ AsyncCharger = (*Memory)(nil)
)

// ChargeAsync implements AsyncCharger. The memory store has no call to
// save: it charges at once and calls done before it returns.
func (m *Memory) ChargeAsync(r *Reservation, actual float64, done func([]BucketState, error)) {
	states, err := m.Charge(context.Background(), r, actual)
	if done != nil {
		done(states, err)
	}
}

// Charge implements Charger: a Replay of a settlement that never reached
// the store, whose ID is remembered for RepeatWindow.
func (m *Memory) Charge(ctx context.Context, r *Reservation, actual float64) ([]BucketState, error) {
	if r == nil || r.ID == "" {
		return nil, fmt.Errorf("%w: charge: reservation without ID", ErrInvalidRequest)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("charge: %w", err)
	}
	_, wall := m.clock()
	ChargeWindows(r, wall)
	return m.settle(r, actual, chargeOnce)
}
