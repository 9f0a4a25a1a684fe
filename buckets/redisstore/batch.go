package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// Group commit. Every reserve and settle is an op on one group (one hash
// slot in a cluster) and goes through the lane of that slot: an op that
// finds the lane idle is sent at once, so a quiet gateway pays no latency
// for batching; ops that arrive while the lane's call is in flight queue
// up, and the next call takes them all, in arrival order, in one script
// call (see batchLua). One call at a time makes the batches as large as
// the load allows, and Redis pays per call; a second call starts only
// when a whole batch is waiting, so a lane's throughput is not bound by
// one round trip's batch. The caller whose op ends a batch makes the call:
// there is no background goroutine, but for the timer that sends
// settlements queued by SettleAsync when no call has taken them within
// the settle window.
const (
	maxInflight = 2
	// maxBatchOps and maxBatchNumbers bound a batch: Lua unpacks the
	// numbers onto its stack, which holds 8000 values.
	maxBatchOps     = 64
	maxBatchNumbers = 4000
)

// op is one group's part of a Reserve or a Settle. The fields above the
// line are its input; the results are written by the batch that runs it,
// before wake (or then, for a queued settlement) tells its caller.
type op struct {
	reserve bool
	g       group
	id      string // idPart of the reservation ID
	record  string // the record key; "" for a settle without a record (a spend)
	bs      []buckets.Bucket
	ss      []buckets.Slot
	qs      []buckets.Quota
	spans   []buckets.Span // indexed like qs: the window each quota is charged in
	// reserve
	cost     float64
	money    float64
	maxWait  time.Duration
	priority bool
	life     time.Duration
	// settle: delta(b) is charged minus used; nil means refund for all.
	// qdelta(j) is the change of quota j's spend (used minus charged).
	delta  func(buckets.Bucket) float64
	refund float64
	qdelta func(j int) float64
	// tomb leaves a tombstone: two copies of the reserve may run, and one
	// may come after this settle (see batchLua).
	tomb bool
	// marker, for a replay, is its marker key, kept markTTL (ms): a replay
	// applies also without the record, once; maybe says an earlier copy
	// of the settlement may have applied (only debits apply then).
	marker  string
	markTTL float64
	maybe   bool
	// charge: a settlement never reserved, applied once by the marker of
	// the call that carries it, one per batch (batchArgs names it in
	// marker). prior, for a replay of a charge, is the marker of the call
	// that may have applied it, its reply lost (see buckets.Reservation's
	// Unanswered); fresh says that call was sent within half the repeat
	// window, so a missing marker means it never ran.
	charge bool
	prior  string
	fresh  bool
	// ----
	obs    []buckets.Observation // indexed like bs; each op writes its own
	spent  []float64             // reserve: indexed like qs; likewise
	status buckets.Reason
	full   int // index into ss of the full slot, or -1
	done   bool
	err    error
	copies sent // of the script call that ran the op (see Store.call)
	// wake receives nil when the op is done, or the batch it must run. A
	// queued settlement has no caller waiting: then is called instead.
	wake chan []*op
	then func()
}

func (o *op) numbers() int {
	if o.reserve {
		return 8 + 7*len(o.g.buckets) + 5*len(o.g.quotas) + 3*len(o.g.slots)
	}
	n := 5 + 7*len(o.g.buckets) + 4*len(o.g.quotas) + len(o.g.slots)
	if o.marker != "" || o.charge {
		n += 2
	}
	if o.prior != "" {
		n += 3
	}
	return n
}

// kind is the op's kind in batchLua.
func (o *op) kind() float64 {
	if o.reserve {
		return 1
	}
	k := 2.0
	if o.tomb {
		k++
	}
	switch {
	case o.charge:
		k += 8
	case o.marker != "":
		k += 2
		if o.maybe {
			k += 4
		}
		if o.prior != "" {
			k += 16
		}
	}
	return k
}

// quotaAmount is what a reserve op takes from quota q.
func (o *op) quotaAmount(q buckets.Quota) float64 {
	if q.Unit == buckets.Money {
		return o.money
	}
	return o.cost
}

// lane is the queue of one hash slot.
type lane struct {
	mu       sync.Mutex
	queue    []*op
	inflight int
	timer    stopper // set while queued settlements wait for a call
}

// stopper is a timer armed with Store.afterFunc.
type stopper interface{ Stop() bool }

// canCall reports whether the lane may start a call for its queue and
// extra more ops: when it is idle, or when a whole batch is waiting and a
// second call is to spare. l.mu is held.
func (l *lane) canCall(extra int) bool {
	return l.inflight == 0 || l.inflight < maxInflight && len(l.queue)+extra >= maxBatchOps
}

// laneOf returns the lane of group tag: in standalone mode the store's
// only lane, in a cluster one per hash slot.
func (s *Store) laneOf(tag string) *lane {
	if !s.cluster {
		return &s.lane
	}
	slot := hashSlot(tag)
	if l, ok := s.lanes.Load(slot); ok {
		return l.(*lane)
	}
	l, _ := s.lanes.LoadOrStore(slot, new(lane))
	return l.(*lane)
}

// do runs o in a batch of its lane and returns when its results are in.
// ctx has been detached from the caller (see Store.start).
func (s *Store) do(ctx context.Context, o *op) {
	l := s.laneOf(o.g.tag)
	l.mu.Lock()
	if l.canCall(1) {
		// Queued ops come along, the oldest first.
		l.inflight++
		batch := l.take(o)
		l.mu.Unlock()
		s.lead(ctx, l, batch, o)
		return
	}
	o.wake = make(chan []*op, 1)
	l.queue = append(l.queue, o)
	l.mu.Unlock()
	if batch := <-o.wake; batch != nil {
		s.lead(ctx, l, batch, o)
	}
}

// later queues o, a settlement nobody waits for: it goes with the lane's
// next call, or on its own once the settle window has passed.
func (s *Store) later(o *op) {
	l := s.laneOf(o.g.tag)
	l.mu.Lock()
	l.queue = append(l.queue, o)
	s.arm(l)
	l.mu.Unlock()
}

// arm starts the settle window of the lane's queue unless one runs: the
// window of its oldest settlement, as a call that takes the whole queue
// stops it (see take). l.mu is held.
func (s *Store) arm(l *lane) {
	if l.timer != nil {
		return
	}
	// t is written here and read by flushLane, both under l.mu.
	var t stopper
	t = s.afterFunc(s.window, func() { s.flushLane(l, &t) })
	l.timer = t
}

// flushLane sends the lane's queued ops when timer *t is the lane's (not
// one stopped after it fired) and it has a call to spare; if not, the
// calls in flight take them when they end.
func (s *Store) flushLane(l *lane, t *stopper) {
	l.mu.Lock()
	if l.timer != *t {
		l.mu.Unlock()
		return
	}
	l.timer = nil
	if len(l.queue) == 0 || !l.canCall(0) {
		l.mu.Unlock()
		return
	}
	l.inflight++
	batch := l.take(nil)
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	s.lead(ctx, l, batch, nil)
}

// take returns the next batch: the oldest queued ops, within the bounds of
// a batch, then own (when not nil), the op of the caller who makes the
// call, which is always in it. Queued settlements thus run before the
// reserve that came after them, as they arrived: the reserve meets their
// refunds, and a holder drops a settled record before it adds a new one,
// which is the cheaper order for the script. l.mu is held.
func (l *lane) take(own *op) []*op {
	var batch []*op
	count, room := headerNumbers, maxBatchOps
	if own != nil {
		count += own.numbers()
		room--
	}
	n := 0
	for n < len(l.queue) && n < room {
		c := l.queue[n].numbers()
		if (n > 0 || own != nil) && count+c > maxBatchNumbers {
			break
		}
		count += c
		batch = append(batch, l.queue[n])
		n++
	}
	l.queue = append(l.queue[:0], l.queue[n:]...)
	if len(l.queue) == 0 && l.timer != nil {
		// Nothing waits for the window any more: the next settlement
		// queued gets a whole one.
		l.timer.Stop()
		l.timer = nil
	}
	if own != nil {
		batch = append(batch, own)
	}
	return batch
}

// headerNumbers is how many numbers a batch has before its first op's.
const headerNumbers = 5

// repeatMS is buckets.RepeatWindow in milliseconds, and repeatUS in
// microseconds, as the scripts take it.
var (
	repeatMS = buckets.RepeatWindow.Milliseconds()
	repeatUS = float64(buckets.RepeatWindow.Microseconds())
)

// lead runs batch and tells its ops but own, the caller's (nil when the
// caller is a timer or Flush). Then it hands the lane's call to the oldest
// waiting caller, with the next batch, or gives the call back.
func (s *Store) lead(ctx context.Context, l *lane, batch []*op, own *op) {
	s.runBatch(ctx, batch)
	for _, o := range batch {
		switch {
		case o.then != nil:
			o.then()
		case o != own:
			o.wake <- nil
		}
	}
	l.mu.Lock()
	waiting := -1
	for i, o := range l.queue {
		if o.then == nil {
			waiting = i
			break
		}
	}
	if waiting < 0 {
		// Nobody waits: queued settlements, if any, go with the next call
		// or when their window has passed.
		l.inflight--
		if len(l.queue) > 0 {
			s.arm(l)
		}
		l.mu.Unlock()
		return
	}
	first := l.queue[waiting]
	l.queue = append(l.queue[:waiting], l.queue[waiting+1:]...)
	next := l.take(first)
	l.mu.Unlock()
	first.wake <- next
}

// batchKeys assigns each key of a batch its index in KEYS: bucket keys
// first, as the script reads them with one MGET.
type batchKeys struct {
	keys  []string
	index map[string]int
}

func (k *batchKeys) of(key string) float64 {
	i, ok := k.index[key]
	if !ok {
		k.keys = append(k.keys, key)
		i = len(k.keys)
		k.index[key] = i
	}
	return float64(i)
}

// runBatch sends batch in one script call and writes each op's results.
func (s *Store) runBatch(ctx context.Context, batch []*op) {
	keys, args := s.batchArgs(batch)
	out, copies, err := s.call(ctx, batchScript, keys, args)
	if err == nil {
		err = s.readBatch(out, batch)
	}
	for _, o := range batch {
		o.err, o.copies = err, copies
	}
}

// batchArgs returns the KEYS and ARGV of batchLua for batch.
func (s *Store) batchArgs(batch []*op) ([]string, []any) {
	k := batchKeys{index: make(map[string]int, 4*len(batch))}
	count := headerNumbers
	var nq int
	for _, o := range batch {
		count += o.numbers()
		for _, i := range o.g.buckets {
			k.of(s.bucketKey(o.bs[i].Key))
		}
		nq += len(o.g.quotas)
	}
	nbk := len(k.keys)
	var qkeys []string // per op and quota, in order
	var now time.Time
	if nq > 0 {
		qkeys = make([]string, 0, nq)
		now = s.now()
		for _, o := range batch {
			for _, j := range o.g.quotas {
				key := s.quotaKey(o.qs[j].Key, o.spans[j].ID)
				k.of(key)
				qkeys = append(qkeys, key)
			}
		}
	}
	nqk := len(k.keys) - nbk
	// The charges of the batch apply once by one marker, named here: a
	// copy of the call carries the same. Its name is short, as every call
	// of charges leaves one for the repeat window: the batch's hash slot
	// by the shortest tag of it, and 128 random bits.
	var mark string
	for _, o := range batch {
		if o.charge {
			if mark == "" {
				var id [16]byte
				rand.Read(id[:])
				mark = s.prefix + "p:{" + slotTag(hashSlot(o.g.tag)) + "}:" + base64.RawURLEncoding.EncodeToString(id[:])
			}
			o.marker = mark
		}
	}
	packed := make([]byte, 0, 8*count)
	packed = pack(packed, float64(len(batch)), float64(nbk), float64(nqk), maxInline, repeatUS)
	args := make([]any, 3, 3+len(batch)+2)
	// The batch's strings, each once, after the IDs: the quotas' unit
	// tags, and the TTLs (ms) in decimal that the script may pass to SET
	// as they are (ttls[i] when strs[i] is one, else -1).
	var strs []string
	var ttls []float64
	tagOf := func(q buckets.Quota) float64 {
		for i, t := range strs {
			if ttls[i] < 0 && q.ReadsTag(t) {
				return float64(i + 1)
			}
		}
		strs, ttls = append(strs, q.Tag()), append(ttls, -1)
		return float64(len(strs))
	}
	ttlOf := func(ms float64) float64 {
		ms = math.Floor(ms)
		for i, t := range ttls {
			if t == ms {
				return float64(i + 1)
			}
		}
		strs, ttls = append(strs, strconv.FormatInt(int64(ms), 10)), append(ttls, ms)
		return float64(len(strs))
	}
	for _, o := range batch {
		rec := 0.0
		if o.record != "" {
			rec = k.of(o.record)
		}
		packed = pack(packed, o.kind(), float64(len(o.g.buckets)), float64(len(o.g.slots)), float64(len(o.g.quotas)), rec)
		if o.reserve {
			packed = pack(packed, o.cost, o.maxWait.Seconds(), float64(o.life.Microseconds()))
		} else if o.marker != "" {
			packed = pack(packed, k.of(o.marker), ttlOf(o.markTTL))
			if o.prior != "" {
				fresh := 0.0
				if o.fresh {
					fresh = 1
				}
				packed = pack(packed, k.of(o.prior), ttlOf(float64(repeatMS)), fresh)
			}
		}
		for _, i := range o.g.buckets {
			b := o.bs[i]
			low := ttlLow(b)
			packed = pack(packed, k.of(s.bucketKey(b.Key)), b.Limit.Capacity, b.Limit.Rate, low, ttlOf(ttlFrom(b, low)))
			if o.reserve {
				hard := 0.0
				if b.Hard {
					hard = 1
				}
				packed = pack(packed, hard, b.Reserve(o.priority))
				continue
			}
			d := o.refund
			if o.delta != nil {
				d = o.delta(b)
			}
			packed = pack(packed, b.Floor(), d)
		}
		for _, j := range o.g.quotas {
			q := o.qs[j]
			ki := k.of(qkeys[0])
			qkeys = qkeys[1:]
			ttl := quotaTTL(o.spans[j], now)
			if o.reserve {
				packed = pack(packed, ki, q.Limit, o.quotaAmount(q), ttl, tagOf(q))
				continue
			}
			packed = pack(packed, ki, o.qdelta(j), ttl, tagOf(q))
		}
		for _, j := range o.g.slots {
			sl := o.ss[j]
			packed = pack(packed, k.of(s.slotKey(sl.Key)))
			if o.reserve {
				packed = pack(packed, float64(sl.Max), float64(sl.LeaseOrDefault().Microseconds()))
			}
		}
		args = append(args, o.id)
	}
	for _, t := range strs {
		args = append(args, t)
	}
	args[0], args[1], args[2] = s.nowArg(), structFormat(count), string(packed)
	return k.keys, args
}

// readBatch writes each op's results from the script's reply, one packed
// string of doubles (see batchLua).
func (s *Store) readBatch(out []any, batch []*op) error {
	p, _ := out[0].(string)
	if len(out) != 1 || len(p)%8 != 0 {
		return fmt.Errorf("%w: unexpected batch reply %q", buckets.ErrStore, out)
	}
	f := func(i int) float64 { return math.Float64frombits(binary.LittleEndian.Uint64([]byte(p[8*i:]))) }
	at, n := 0, len(p)/8
	for _, o := range batch {
		width, quotas := 3, 0
		if o.reserve {
			width, quotas = 2, len(o.g.quotas)
		}
		if at+2+width*len(o.g.buckets)+quotas > n {
			return fmt.Errorf("%w: batch reply of %d numbers for %d operations", buckets.ErrStore, n, len(batch))
		}
		st, full := f(at), int(f(at+1))
		at += 2
		for _, i := range o.g.buckets {
			ob := buckets.Observation{Level: f(at), Hold: time.Duration(f(at+1)) * time.Microsecond}
			if !o.reserve {
				ob.Forgiven = f(at + 2)
			}
			o.obs[i] = ob
			at += width
		}
		if !o.reserve {
			o.done = st == 1
			continue
		}
		for _, j := range o.g.quotas {
			o.spent[j] = f(at)
			at++
		}
		if st < 0 || int(st) >= len(scriptReasons) || st != math.Trunc(st) {
			return fmt.Errorf("%w: unexpected reserve status %v", buckets.ErrStore, st)
		}
		o.status, o.full = scriptReasons[int(st)], -1
		if full > 0 && full <= len(o.g.slots) {
			o.full = o.g.slots[full-1]
		}
	}
	if at != n {
		return fmt.Errorf("%w: batch reply of %d numbers for %d operations", buckets.ErrStore, n, len(batch))
	}
	return nil
}

// quotaTTL is the TTL of a write of the spend of window span at now, in
// milliseconds: until the window's end and buckets.QuotaSlack; zero or
// less means the window is forgotten and nothing is written.
func quotaTTL(span buckets.Span, now time.Time) float64 {
	return math.Ceil(float64(span.End.Add(buckets.QuotaSlack).Sub(now)) / float64(time.Millisecond))
}

// ttlFrom is the time to refill bucket b from level low to full, plus a
// second, in milliseconds: the TTL of a write at or above low.
func ttlFrom(b buckets.Bucket, low float64) float64 {
	return math.Min(math.Ceil((b.Limit.Capacity-low)/b.Limit.Rate*1000)+1001, 1e12)
}

var (
	_ buckets.AsyncSettler = (*Store)(nil)
	_ buckets.AsyncCharger = (*Store)(nil)
)

// SettleAsync implements buckets.AsyncSettler: the settlement is queued on
// its lane and goes to Redis with the lane's next call, or in a call of its
// own once Options.SettleWindow has passed; done, if not nil, is then
// called from the goroutine that made the call. A gateway settling one
// request at a time thus writes each settlement with the next reservation:
// one script call per request instead of two.
func (s *Store) SettleAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	if r == nil {
		finish(done, nil, fmt.Errorf("%w: settle: reservation without ID", buckets.ErrInvalidRequest))
		return
	}
	s.queue(*r, actual, settleOpen, "settle", done)
}

// ChargeAsync implements buckets.AsyncCharger: the charge is queued as
// SettleAsync queues a settlement, so that charges nobody waits for share
// a call with each other and with the lane's next one.
func (s *Store) ChargeAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	if r == nil || r.ID == "" {
		finish(done, nil, fmt.Errorf("%w: charge: reservation without ID", buckets.ErrInvalidRequest))
		return
	}
	rc := *r
	if len(rc.Quotas) > 0 && rc.Windows == nil {
		buckets.ChargeWindows(&rc, s.now())
	}
	s.queue(rc, actual, chargeOnce, "charge", done)
}

// queue queues the settle ops of rc on their lanes (see later) and calls
// done once all of them are done.
func (s *Store) queue(rc buckets.Reservation, actual float64, mode settleMode, what string, done func([]buckets.BucketState, error)) {
	ops, obs, err := s.settleOps(&rc, actual, mode)
	if err != nil {
		finish(done, nil, err)
		return
	}
	if len(ops) == 0 {
		finish(done, []buckets.BucketState{}, nil)
		return
	}
	var left atomic.Int32
	left.Store(int32(len(ops)))
	s.pending(1)
	then := func() {
		if left.Add(-1) > 0 {
			return
		}
		defer s.pending(-1)
		states, err := s.settled(&rc, ops, obs, what)
		finish(done, states, err)
	}
	for k := range ops {
		ops[k].then = then
		s.later(&ops[k])
	}
}

func finish(done func([]buckets.BucketState, error), states []buckets.BucketState, err error) {
	if done != nil {
		done(states, err)
	}
}

// pending counts the settlements queued by SettleAsync and not yet done,
// for Flush.
func (s *Store) pending(delta int) {
	s.flushMu.Lock()
	defer s.flushMu.Unlock()
	s.queued += delta
	if s.queued == 0 && s.idle != nil {
		close(s.idle)
		s.idle = nil
	}
}

// Flush implements buckets.AsyncSettler: it sends every queued settlement
// now and returns once all are done, or when ctx ends.
func (s *Store) Flush(ctx context.Context) error {
	send := func(l *lane) {
		for {
			l.mu.Lock()
			if len(l.queue) == 0 {
				l.mu.Unlock()
				return
			}
			l.inflight++
			batch := l.take(nil)
			l.mu.Unlock()
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.timeout)
			s.lead(cctx, l, batch, nil)
			cancel()
		}
	}
	send(&s.lane)
	s.lanes.Range(func(_, l any) bool {
		send(l.(*lane))
		return true
	})
	s.flushMu.Lock()
	if s.queued == 0 {
		s.flushMu.Unlock()
		return nil
	}
	if s.idle == nil {
		s.idle = make(chan struct{})
	}
	idle := s.idle
	s.flushMu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("redisstore: flush: %w", ctx.Err())
	}
}
