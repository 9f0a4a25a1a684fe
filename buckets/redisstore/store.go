// Package redisstore is the buckets.Store for a fleet of gateways: bucket
// state lives in Redis, and every operation runs in a Lua script that
// refills, checks and debits in one atomic step (S20), timed by the Redis
// server's clock (S2). It works with standalone Redis and with Redis
// Cluster.
//
// # Keys
//
// A bucket with key K is the string <prefix>b:{K}, a concurrency limit is the
// sorted set <prefix>c:{K}, the spend of a quota with key K in the calendar
// window W (buckets.Window.ID: 2026-03, 2026-W13, 2026-03-29) is the string
// <prefix>q:{K}:W (K escaped so that it contains no braces), whatever the
// quota's unit: its value is the spend, a packed double, followed by the
// tag of the unit it counts (buckets.Quota.Tag), so that a quota switched
// between tokens and money, or to another currency, reads the other unit's
// spend as nothing spent, and a value without tag (written before the tag
// was) as its own unit's (see lua.go). An
// open reservation has a record, which makes its settlement once-only: in
// the value of the first bucket of its chain (or of its cluster group), or,
// past a few per bucket, in the sorted set <prefix>r (<prefix>r:{T} in a
// cluster, one per hash slot), scored by when the reservation expires
// (Request.Lifetime). Settlement deletes it: a settled request leaves
// nothing behind. A key K longer than 200 bytes, or a reservation ID longer
// than 64, enters keys and records as "%h" and the SHA-256 of it (an
// escaped K never contains "%h", and an ID that starts with it is hashed
// too), so neither a client nor a configuration can make a key of unbounded
// size. Every key has a TTL: an idle bucket expires once it would have
// refilled to full, which is the state a missing key stands for, and once
// its records have expired. A call that carries charges (Charge, which
// reserves nothing) leaves one marker for all of them, <prefix>p:{S}:<call>
// (S the shortest tag of the call's hash slot), for buckets.RepeatWindow.
// Only faults leave more, for a while: see batchLua for tombstones and
// markers.
//
// # Group commit
//
// Redis pays per call, so the store calls less: reserves and settlements
// that meet on their way to the same hash slot go in one script call, each
// still atomic and all or none for itself (batch.go). A request settled
// with SettleAsync rides on the next call, so a gateway pays one call per
// request instead of two.
//
// # Cancellation
//
// As the buckets.Store contract requires, an operation called with a
// context that is already done writes nothing and returns its error; once
// started, it runs on a context detached from the caller's cancellation and
// deadline, bounded by Options.Timeout and the client's own timeouts, so a
// client that disconnects never leaves a reservation that Redis wrote but
// nobody will settle. Settle always runs.
//
// # Calls sent again
//
// A script whose reply is lost (a read timeout while Redis is busy, a
// dropped connection) may still run, and go-redis would send it again by
// itself. The store's scripts are commands go-redis never retries; the
// store sends them again itself (Store.call), and every script applies
// once however many of its copies run, in whatever order (see lua.go): by
// the reservation's record, a tombstone, or a marker. A reserve whose
// reply is lost for good fails with a *buckets.IncompleteError, to be
// cancelled (Cancel) once Redis answers; a settlement kept during an
// outage is replayed with Replay, also after its record has expired; a
// charge whose call went unanswered is replayed with Replay of the
// error's Rest, which names that call (Reservation.Unanswered) and asks
// its marker whether it ran.
//
// # Redis Cluster
//
// The keys of one bucket key K share the hash slot of K. A chain's buckets
// usually have different keys (user, team, provider), and every user's chain
// shares the provider bucket, so no choice of hash tags can put all chains
// in one slot without putting everything there. With Options.Cluster the
// store therefore groups a chain's keys by hash slot and runs one atomic
// operation per group: each group takes its tokens only if all its own
// buckets admit. The groups are asked concurrently, so a split chain still
// costs one round trip. If any group refuses, the groups that took are
// refunded (compensated) at once. A bucket is thus never over-admitted —
// each take is checked atomically against its own level — and the cost of
// the split is only that tokens held between a take and its refund may
// refuse another request in that moment (the safe side). Quotas are split
// and compensated the same way. Settlement runs per group too, each with
// its own record in that group's slot.
//
// # Quota windows
//
// Buckets run on Redis's clock; a quota's window is named by the gateway's
// (Options.Now), since calendar arithmetic in a time zone needs the zone
// database. Gateways whose clocks differ by a few milliseconds disagree
// about the window only in those milliseconds around its boundary.
package redisstore

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
)

// Scripter is the part of a go-redis client the store uses: it sends its
// scripts as commands of its own (see Store.run). *redis.Client,
// *redis.ClusterClient and *redis.Ring satisfy it.
type Scripter interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

var (
	_ Scripter          = (*redis.Client)(nil)
	_ Scripter          = (*redis.ClusterClient)(nil)
	_ buckets.Store     = (*Store)(nil)
	_ buckets.Inspector = (*Store)(nil)
)

// Options configures a Store. The zero value gives the defaults.
type Options struct {
	// Prefix starts every key; empty means "tg:".
	Prefix string
	// Cluster splits a chain by hash slot, as Redis Cluster requires (see
	// the package documentation). It is set automatically when the client is
	// a *redis.ClusterClient.
	Cluster bool
	// Now is the gateway clock, used to turn Pause's absolute time into a
	// duration from now and to name quota windows; the buckets themselves
	// run on Redis's clock. Nil means time.Now.
	Now func() time.Time
	// Timeout bounds an operation once started, detached from the caller's
	// context (see Cancellation); the client's own read, write and pool
	// timeouts apply within it, and a call whose reply is lost is sent
	// again within it (see Calls sent again). Zero means two seconds.
	Timeout time.Duration
	// SettleWindow is how long a settlement queued by SettleAsync waits for
	// a call to Redis to join before it goes on its own. Zero means
	// buckets.DefaultSettleWindow.
	SettleWindow time.Duration
}

// Store is the Redis buckets.Store. It is safe for concurrent use; it holds
// no bucket state, only the operations on their way to Redis, so any number
// of gateways may share one Redis. Use New; the zero value is not usable.
// Call Flush before shutting down when settling with SettleAsync or
// charging with ChargeAsync.
type Store struct {
	c       Scripter
	prefix  string
	cluster bool
	timeout time.Duration
	now     func() time.Time
	limits  sync.Map // limitKey → *[4]any, see limitArgs
	nlimits atomic.Int64
	// scriptNow, when set, replaces the Redis server's TIME inside the
	// scripts. Only this package's tests set it (export_test.go): no
	// configuration reaches it.
	scriptNow func() time.Time
	spans     buckets.Spans
	lane      lane     // standalone: the one lane (batch.go)
	reads     readLane // standalone: the reads in one call (read.go)
	lanes     sync.Map // cluster: hash slot → *lane
	window    time.Duration
	// afterFunc arms the timers of queued settlements: time.AfterFunc,
	// or a test's.
	afterFunc func(time.Duration, func()) stopper
	// unsure holds the IDs of reservations of which two copies of the
	// reserve may run, until they are settled (with a tombstone: see
	// batchLua).
	unsure  sync.Map
	flushMu sync.Mutex
	queued  int           // settlements queued by SettleAsync, not done
	idle    chan struct{} // closed when queued drops to zero
}

// New returns a Store that keeps its buckets in Redis through c.
func New(c Scripter, opts Options) *Store {
	s := &Store{c: c, prefix: opts.Prefix, cluster: opts.Cluster, now: opts.Now}
	if s.prefix == "" {
		s.prefix = "tg:"
	}
	if _, ok := c.(*redis.ClusterClient); ok {
		s.cluster = true
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.timeout = opts.Timeout
	if s.timeout <= 0 {
		s.timeout = 2 * time.Second
	}
	s.afterFunc = func(d time.Duration, f func()) stopper { return time.AfterFunc(d, f) }
	s.window = opts.SettleWindow
	if s.window <= 0 {
		s.window = buckets.DefaultSettleWindow
	}
	return s
}

// SettleWindow is how long a settlement queued by SettleAsync, or a charge
// by ChargeAsync, waits for a call to join (Options.SettleWindow).
func (s *Store) SettleWindow() time.Duration { return s.window }

// start checks that the caller still waits (ctx not done: otherwise nothing
// is written and the caller's error is returned, never ErrStore) and
// returns the context the operation runs on: detached from ctx's
// cancellation and deadline, with ctx's values, bounded by the store's own
// timeout.
func (s *Store) start(ctx context.Context, op string) (context.Context, context.CancelFunc, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, fmt.Errorf("redisstore: %s: %w", op, err)
	}
	dctx, cancel := s.detach(ctx)
	return dctx, cancel, nil
}

func (s *Store) detach(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), s.timeout)
}

type script struct{ src, sha string }

func newScript(src string) script { return script{src: src, sha: redis.NewScript(src).Hash()} }

var (
	batchScript   = newScript(batchLua)
	extendScript  = newScript(extendLua)
	pauseScript   = newScript(pauseLua)
	renewScript   = newScript(renewLua)
	inspectScript = newScript(inspectLua)
)

var _ buckets.Renewer = (*Store)(nil)

// Renew implements buckets.Renewer: it extends the reservation's record by
// its lifetime, and its slot leases by their Lease, where they have not
// expired, one script call per group.
func (s *Store) Renew(ctx context.Context, r *buckets.Reservation) error {
	if r == nil || r.ID == "" {
		return fmt.Errorf("%w: renew: reservation without ID", buckets.ErrInvalidRequest)
	}
	ctx, cancel, err := s.start(ctx, "renew")
	if err != nil {
		return err
	}
	defer cancel()
	nowArg, id := s.nowArg(), idPart(r.ID)
	for _, g := range s.groups(r.Buckets, r.Slots, r.Quotas) {
		keys := make([]string, 0, 2+len(g.slots))
		keys = append(keys, s.recordKey(g.tag))
		holder := "0"
		if len(g.buckets) > 0 {
			keys = append(keys, s.bucketKey(r.Buckets[g.buckets[0]].Key))
			holder = "1"
		}
		args := []any{nowArg, id, r.LifetimeOrDefault().Microseconds(), holder}
		for _, j := range g.slots {
			keys = append(keys, s.slotKey(r.Slots[j].Key))
			args = append(args, r.Slots[j].LeaseOrDefault().Microseconds())
		}
		if _, err := s.run(ctx, renewScript, keys, args); err != nil {
			return fmt.Errorf("redisstore: renew: %w", err)
		}
	}
	return nil
}

// run calls the script (see call) and returns its reply.
func (s *Store) run(ctx context.Context, sc script, keys []string, args []any) ([]any, error) {
	out, _, err := s.call(ctx, sc, keys, args)
	return out, err
}

// maxAttempts bounds how often call sends one script call.
const maxAttempts = 3

// sent says what a script call may have left in Redis: how many of its
// copies may run there (a copy whose reply was lost may still run, after
// the next one). Every script is safe to repeat (see lua.go), so only a
// reserve cares: a reservation of which two copies may run is settled
// with a tombstone, against the copy that comes last.
type sent int

// call calls the script by its SHA, and by its source when Redis does not
// know it yet (NOSCRIPT, after a restart or failover). go-redis would send
// a command again by itself after a timeout, while Redis may still run the
// first copy; the store's commands forbid that (evalCmd), and call sends
// them again itself, up to maxAttempts while ctx lasts, when a reply is
// lost (a timeout, a connection dropped) or Redis refuses for a moment
// (LOADING, BUSY, TRYAGAIN...). It does not when Redis could not be
// reached: it is down, and the caller's failure mode decides.
func (s *Store) call(ctx context.Context, sc script, keys []string, args []any) ([]any, sent, error) {
	var copies sent
	var err error
	for attempt := 1; ; attempt++ {
		var v any
		v, err = s.eval(ctx, "evalsha", sc.sha, keys, args)
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			v, err = s.eval(ctx, "eval", sc.src, keys, args)
		}
		if err == nil {
			copies++
			if out, ok := v.([]any); ok && len(out) > 0 {
				return out, copies, nil
			}
			return []any{v}, copies, nil
		}
		lost, again := classify(err)
		if lost {
			copies++
		}
		if !again || attempt >= maxAttempts || ctx.Err() != nil {
			break
		}
	}
	if copies == 0 {
		err = fmt.Errorf("%w: %w", errUnsent, err)
	}
	return nil, copies, fmt.Errorf("%w: %w", buckets.ErrStore, err)
}

// errUnsent marks an error after which the call certainly wrote nothing:
// it never reached Redis, or Redis refused to run it.
var errUnsent = errors.New("not sent")

// unsent reports whether err, from call, says the call wrote nothing.
func unsent(err error) bool { return errors.Is(err, errUnsent) }

// classify tells, of a failed call, whether its reply was lost (it may
// have run, or may still run) and whether to send it again.
func classify(err error) (lost, again bool) {
	var op *net.OpError
	switch {
	case errors.As(err, &op) && op.Op == "dial", errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrClosed):
		return false, false // never sent: Redis is not there
	case isBusy(err):
		return false, true // refused, not run: ask again
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		return true, false // a script that failed may have written part
	}
	return true, true
}

// isBusy reports whether Redis refused a call for a moment: loading,
// running a long script, failing over, resharding.
func isBusy(err error) bool {
	for _, p := range [...]string{"LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// evalCmd is a script call that go-redis never sends again by itself.
type evalCmd struct{ *redis.Cmd }

// NoRetry is why evalCmd exists: see call.
func (evalCmd) NoRetry() bool { return true }

// eval sends one EVAL or EVALSHA of body.
func (s *Store) eval(ctx context.Context, name, body string, keys []string, args []any) (any, error) {
	a := make([]any, 0, 3+len(keys)+len(args))
	a = append(a, name, body, len(keys))
	for _, k := range keys {
		a = append(a, k)
	}
	a = append(a, args...)
	cmd := evalCmd{redis.NewCmd(ctx, a...)}
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3)
	}
	_ = s.c.Process(ctx, cmd)
	return cmd.Result()
}

func (s *Store) nowArg() string {
	if s.scriptNow == nil {
		return ""
	}
	return strconv.FormatInt(s.scriptNow().UnixMicro(), 10)
}

// num formats f so that Lua's tonumber reads back exactly the same double.
func num(f float64) any {
	switch f {
	case 0:
		return "0"
	case 1:
		return "1"
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}

// limitArgs returns the script arguments for bucket b: capacity, rate,
// low (see ttlLow) and the TTL that covers a refill from low to full.
// Limits come from configuration, so there are few of them: they are
// formatted once.
func (s *Store) limitArgs(b buckets.Bucket) *[4]any {
	k := limitKey{b.Limit, ttlLow(b)}
	if v, ok := s.limits.Load(k); ok {
		return v.(*[4]any)
	}
	ms := math.Ceil((b.Limit.Capacity-k.low)/b.Limit.Rate*1000) + 1001
	a := &[4]any{num(b.Limit.Capacity), num(b.Limit.Rate), num(k.low), strconv.FormatInt(int64(math.Min(ms, 1e12)), 10)}
	if s.nlimits.Add(1) <= maxCachedLimits {
		s.limits.Store(k, a)
	}
	return a
}

// ttlArg returns the TTL argument of bucket b: the time to refill from
// ttlLow(b) to full, plus a second, in milliseconds.
func (s *Store) ttlArg(b buckets.Bucket) any { return s.limitArgs(b)[3] }

// ttlLow is the lowest level for which a script may use the precomputed TTL
// of ttlArg; below it (and while paused) a script computes the exact time
// to full. It is the floor, but never below -capacity: a bucket without a
// floor still gets TTLs that let it vanish once it is full.
func ttlLow(b buckets.Bucket) float64 { return max(b.Floor(), -b.Limit.Capacity) }

// pack appends float64s in the byte order of the scripts' struct formats.
func pack(p []byte, fs ...float64) []byte {
	for _, f := range fs {
		p = binary.LittleEndian.AppendUint64(p, math.Float64bits(f))
	}
	return p
}

// structFormat returns the struct format of n little-endian doubles.
func structFormat(n int) string {
	if n < len(structFormats) {
		return structFormats[n]
	}
	return "<" + strings.Repeat("d", n)
}

var structFormats = func() (f [128]string) {
	for i := range f {
		f[i] = "<" + strings.Repeat("d", i)
	}
	return f
}()

type limitKey struct {
	limit buckets.Limit
	low   float64
}

// maxCachedLimits bounds the formatted limits kept, should limits ever
// come from somewhere other than configuration.
const maxCachedLimits = 4096

// escape keeps braces out of a key so that the braces the store adds are
// its hash tag; it is injective, so distinct keys stay distinct.
func escape(k string) string {
	if !strings.ContainsAny(k, "{}%") {
		return k
	}
	return escaper.Replace(k)
}

// escaper and unescaper are built once: a Replacer builds its tables on
// first use, tens of kilobytes.
var (
	escaper   = strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D")
	unescaper = strings.NewReplacer("%25", "%", "%7B", "{", "%7D", "}")
)

// Bounds on what enters a key from outside (see the package
// documentation): longer key parts and IDs are hashed.
const (
	maxKeyPart = 200
	maxIDPart  = 64
)

// keyPart is the form of bucket or slot key k inside Redis keys: escaped,
// or hashed when long.
func keyPart(k string) string {
	if len(k) > maxKeyPart {
		return hashed(k)
	}
	return escape(k)
}

// idPart is the form of reservation ID id in marker keys, records and slot
// members: itself, or hashed when long or when it starts with '%', as the
// forms the store makes of IDs do: a hashed one ("%h…") or a record's
// tombstone ("%t…").
func idPart(id string) string {
	if len(id) > maxIDPart || strings.HasPrefix(id, "%") {
		return hashed(id)
	}
	return id
}

func hashed(v string) string {
	sum := sha256.Sum256([]byte(v))
	return "%h" + base64.RawURLEncoding.EncodeToString(sum[:])
}

func (s *Store) bucketKey(k string) string { return s.prefix + "b:{" + keyPart(k) + "}" }
func (s *Store) slotKey(k string) string   { return s.prefix + "c:{" + keyPart(k) + "}" }

// quotaKey is the key of the spend of quota key k in window id.
func (s *Store) quotaKey(k, id string) string { return s.prefix + "q:{" + keyPart(k) + "}:" + id }

// group is the part of a chain that one script call handles atomically: in
// standalone mode the whole chain, in cluster mode the keys of one hash
// slot.
type group struct {
	tag     string // escaped key whose slot the group uses, for its marker
	buckets []int
	slots   []int
	quotas  []int
}

func (s *Store) groups(bs []buckets.Bucket, ss []buckets.Slot, qs []buckets.Quota) []group {
	if !s.cluster {
		if len(bs)+len(ss)+len(qs) == 0 {
			return nil
		}
		g := group{}
		for i := range bs {
			g.buckets = append(g.buckets, i)
		}
		for j := range ss {
			g.slots = append(g.slots, j)
		}
		for j := range qs {
			g.quotas = append(g.quotas, j)
		}
		switch {
		case len(bs) > 0:
			g.tag = keyPart(bs[0].Key)
		case len(ss) > 0:
			g.tag = keyPart(ss[0].Key)
		default:
			g.tag = keyPart(qs[0].Key)
		}
		return []group{g}
	}
	var gs []group
	bySlot := map[uint16]int{}
	at := func(key string) *group {
		tag := keyPart(key)
		sl := hashSlot(tag)
		i, ok := bySlot[sl]
		if !ok {
			i = len(gs)
			bySlot[sl] = i
			gs = append(gs, group{tag: tag})
		}
		return &gs[i]
	}
	for i, b := range bs {
		g := at(b.Key)
		g.buckets = append(g.buckets, i)
	}
	for j, sl := range ss {
		g := at(sl.Key)
		g.slots = append(g.slots, j)
	}
	for j, q := range qs {
		g := at(q.Key)
		g.quotas = append(g.quotas, j)
	}
	return gs
}

func newID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// rank orders refusal reasons for combining the groups of a chain, as one
// script would decide: never admissible, then over quota, then short of
// tokens, then concurrency.
func rank(r buckets.Reason) int {
	switch r {
	case buckets.NeverAdmissible:
		return 4
	case buckets.OverQuota:
		return 3
	case buckets.ShortOfTokens:
		return 2
	case buckets.ConcurrencyFull:
		return 1
	}
	return 0
}

var scriptReasons = [...]buckets.Reason{buckets.Admitted, buckets.ShortOfTokens, buckets.ConcurrencyFull, buckets.NeverAdmissible, buckets.OverQuota}

// Reserve implements buckets.Store with one op per group (one in
// standalone mode), batched with others (see batch.go). A request without
// an ID gets a random one. Each op is safe to repeat (see batchLua): a
// reserve whose reply was lost is sent again, and the copies take once. If
// a reply is lost for good, the error is an *buckets.IncompleteError whose
// Rest (the groups that may have taken) must be cancelled; groups that
// did take while another refused or failed are refunded at once.
//
// The groups of a cluster chain are asked at once. When requests race for
// the last tokens of two groups, each group's winners may then be other
// requests, and every one of them refused: a request that some group
// admitted while another refused, once refunded, asks again group by group
// in the chain's order, each only after the one before admitted it, so
// that requests racing alike reach the second group only as winners of
// the first, and the tokens go to some of them. It asks again only when
// nothing of its first try can still run in Redis (no copy of a reserve
// or of a refund on its way), so that the second try, with the same ID,
// meets nothing of the first.
func (s *Store) Reserve(ctx context.Context, req buckets.Request) (buckets.Decision, error) {
	if err := req.Validate(); err != nil {
		return buckets.Decision{}, err
	}
	ctx, cancel, err := s.start(ctx, "reserve")
	if err != nil {
		return buckets.Decision{}, err
	}
	defer cancel()
	id := req.ID
	if id == "" {
		id = newID()
	}
	t := try{obs: make([]buckets.Observation, len(req.Buckets))}
	if len(req.Quotas) > 0 {
		t.now = s.now()
		t.spans, t.spent = make([]buckets.Span, len(req.Quotas)), make([]float64, len(req.Quotas))
		for j, q := range req.Quotas {
			t.spans[j] = s.spans.Span(q.Window, t.now)
		}
	}
	d, again, err := s.reserve(ctx, req, id, t)
	if !again || ctx.Err() != nil {
		return d, err
	}
	// Refused again, the answer is the first try's, which asked every
	// group: the reason and the wait of the whole chain.
	t.obs, t.spent, t.inOrder = slices.Clone(t.obs), slices.Clone(t.spent), true
	if d2, _, err := s.reserve(ctx, req, id, t); err != nil || d2.OK {
		return d2, err
	}
	return d, nil
}

// try is what the tries of a Reserve share: the observations of every
// bucket and the spend of every quota (a try in order starts from a copy
// of the first try's, and leaves those of the groups it does not ask as
// that try saw them), the quotas' windows and the instant that chose
// them; and whether the try asks in order.
type try struct {
	obs     []buckets.Observation
	spent   []float64
	spans   []buckets.Span
	now     time.Time
	inOrder bool
}

// reserve makes one try of Reserve: at once, or in order, group by group
// until one does not admit (see try). again says that a try at once was
// refused by contention and left nothing behind in Redis: a try in order
// may follow.
func (s *Store) reserve(ctx context.Context, req buckets.Request, id string, t try) (d buckets.Decision, again bool, err error) {
	obs, spent, spans, now, inOrder := t.obs, t.spent, t.spans, t.now, t.inOrder
	gs := s.groups(req.Buckets, req.Slots, req.Quotas)
	ops := make([]op, len(gs))
	for k, g := range gs {
		ops[k] = op{reserve: true, g: g, id: idPart(id), record: s.recordKey(g.tag), bs: req.Buckets, ss: req.Slots,
			qs: req.Quotas, spans: spans, cost: req.Cost, money: req.Money,
			maxWait: req.MaxWait, priority: req.Priority, life: req.LifetimeOrDefault(), obs: obs, spent: spent}
	}
	// The groups of a cluster chain live on different nodes: ask them all
	// at once, or in order until one does not admit. Each writes only its
	// own buckets' observations.
	if inOrder {
		for k := range ops {
			if s.do(ctx, &ops[k]); ops[k].err != nil || ops[k].status != buckets.Admitted {
				ops = ops[:k+1]
				break
			}
		}
	} else {
		eachGroup(len(ops), func(k int) { s.do(ctx, &ops[k]) })
	}
	reason, full := buckets.Admitted, -1
	// took: groups that took; twice: groups of which two copies of the
	// reserve may run, so that one may still take after this answer;
	// lost: groups whose reply was lost for good.
	var took, twice, lost []group
	var firstErr error
	for k := range ops {
		o := &ops[k]
		if o.copies > 1 {
			twice = append(twice, o.g)
		}
		switch {
		case o.err != nil:
			firstErr = cmp.Or(firstErr, o.err)
			if !unsent(o.err) {
				lost = append(lost, o.g)
			}
		case o.status == buckets.Admitted:
			took = append(took, o.g)
		case rank(o.status) > rank(reason):
			reason, full = o.status, o.full
		}
	}
	res := buckets.NewReservation(req, id, spans)
	if firstErr == nil && reason == buckets.Admitted {
		if len(twice) > 0 {
			s.unsure.Store(id, struct{}{})
		}
		return buckets.NewDecision(req, id, buckets.Step{Reason: reason, Buckets: obs, Slot: full, Quotas: spent, Spans: spans, Now: now}), false, nil
	}
	// Not admitted: refund the groups that took, and stop a copy still on
	// its way in the groups where one may run.
	undo := took
	for _, g := range twice {
		if !slices.ContainsFunc(undo, func(t group) bool { return t.tag == g.tag }) && !slices.ContainsFunc(lost, func(t group) bool { return t.tag == g.tag }) {
			undo = append(undo, g)
		}
	}
	failed, resent := s.compensate(ctx, res, undo, len(twice) > 0)
	lost = append(lost, failed...)
	if firstErr != nil || len(failed) > 0 {
		err := fmt.Errorf("redisstore: reserve: %w", cmp.Or(firstErr, fmt.Errorf("%w: refund of a partly reserved chain failed", buckets.ErrStore)))
		if len(lost) > 0 {
			return buckets.Decision{}, false, &buckets.IncompleteError{Rest: s.part(res, lost), Sent: true, Err: err}
		}
		return buckets.Decision{}, false, err
	}
	for _, g := range took {
		// Report the levels and spend the request met.
		for _, i := range g.buckets {
			obs[i].Level += req.Cost
		}
		for _, j := range g.quotas {
			spent[j] -= req.QuotaCost(req.Quotas[j])
		}
	}
	again = !inOrder && len(took) > 0 && len(twice) == 0 && !resent && reason != buckets.NeverAdmissible
	return buckets.NewDecision(req, id, buckets.Step{Reason: reason, Buckets: obs, Slot: full, Quotas: spent, Spans: spans, Now: now}), again, nil
}

// part is r reduced to the buckets, slots and quotas of groups gs, which
// settle as they would in r.
func (s *Store) part(r *buckets.Reservation, gs []group) *buckets.Reservation {
	p := *r
	p.Buckets, p.Slots, p.Quotas, p.Windows = nil, nil, nil, nil
	keep := func(i int, in func(g group) []int) bool {
		return slices.ContainsFunc(gs, func(g group) bool { return slices.Contains(in(g), i) })
	}
	for i, b := range r.Buckets {
		if keep(i, func(g group) []int { return g.buckets }) {
			p.Buckets = append(p.Buckets, b)
		}
	}
	for j, sl := range r.Slots {
		if keep(j, func(g group) []int { return g.slots }) {
			p.Slots = append(p.Slots, sl)
		}
	}
	for j, q := range r.Quotas {
		if keep(j, func(g group) []int { return g.quotas }) {
			p.Quotas = append(p.Quotas, q)
			if j < len(r.Windows) {
				p.Windows = append(p.Windows, r.Windows[j])
			}
		}
	}
	return &p
}

// recordKey is the sorted set that holds the records of the open
// reservations of groups tagged tag, scored by expiry: one for the whole
// store in standalone mode, one per hash slot in a cluster, so that the
// operations of a batch (which share a slot) share it.
func (s *Store) recordKey(tag string) string {
	if !s.cluster {
		return s.prefix + "r"
	}
	return s.prefix + "r:{" + slotTag(hashSlot(tag)) + "}"
}

// slotTags holds, per cluster hash slot, the shortest base-36 number that
// hashes to it.
var slotTags = sync.OnceValue(func() *[16384]string {
	var tags [16384]string
	for n, left := 0, len(tags); left > 0; n++ {
		tag := strconv.FormatInt(int64(n), 36)
		if sl := hashSlot(tag); tags[sl] == "" {
			tags[sl] = tag
			left--
		}
	}
	return &tags
})

func slotTag(slot uint16) string { return slotTags()[slot] }

// compensate settles the groups gs of reservation r at no usage — a full
// refund, their records and slots released, with a tombstone when tomb
// (a copy of the reserve may still run) — when another group of the chain
// refused or failed. It runs on its own timeout, since the operation's may
// be spent: the tokens must not stay taken. It returns the groups whose
// refund may not have applied; their tokens stay taken until refill
// returns them — the safe side — unless the caller cancels them later.
func (s *Store) compensate(ctx context.Context, r *buckets.Reservation, gs []group, tomb bool) (failed []group, resent bool) {
	if len(gs) == 0 {
		return nil, false
	}
	cctx, cancel := s.detach(ctx)
	defer cancel()
	obs := make([]buckets.Observation, len(r.Buckets))
	ops := make([]op, len(gs))
	qdelta := func(j int) float64 { return -r.ChargedQuota(r.Quotas[j]) }
	for k, g := range gs {
		ops[k] = op{g: g, id: idPart(r.ID), record: s.recordKey(g.tag), bs: r.Buckets, ss: r.Slots, qs: r.Quotas, spans: r.Windows,
			refund: r.Cost, qdelta: qdelta, obs: obs, tomb: tomb}
	}
	eachGroup(len(ops), func(k int) { s.do(cctx, &ops[k]) })
	for k := range ops {
		if ops[k].err != nil {
			failed = append(failed, ops[k].g)
		}
		resent = resent || ops[k].copies > 1
	}
	return failed, resent
}

// Settle implements buckets.Store: one op per group, each settling once
// per reservation, through its record. It runs whatever the state of ctx.
// When some group's call fails, the error is an *buckets.IncompleteError
// whose Rest is the part of r still to settle.
func (s *Store) Settle(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	ops, obs, err := s.settleOps(r, actual, settleOpen)
	if err != nil {
		return nil, err
	}
	ctx, cancel := s.detach(ctx)
	defer cancel()
	eachGroup(len(ops), func(k int) { s.do(ctx, &ops[k]) })
	return s.settled(r, ops, obs, "settle")
}

// settleMode is what a settlement applies when.
type settleMode int

const (
	// settleOpen: through the reservation's record, once.
	settleOpen settleMode = iota
	// replayUnsent: also without the record, once by its marker: the
	// settlement never reached Redis before.
	replayUnsent
	// replaySent: likewise, but only debits without the record: an
	// earlier copy may have applied.
	replaySent
	// settleCancel: at zero usage, through the record, and a tombstone.
	settleCancel
	// chargeOnce: without a record, once by the marker of the call that
	// carries it, one per batch, kept buckets.RepeatWindow: a Charge, sent
	// again by the store itself within its timeout. One whose reply was
	// lost is replayed (replaySent) with the names of those markers
	// (Reservation.Unanswered): within the repeat window exactly once;
	// after it, the ambiguous case.
	chargeOnce
)

// settleOps returns the ops that settle r with actual as mode says, and
// the observations they fill.
func (s *Store) settleOps(r *buckets.Reservation, actual float64, mode settleMode) ([]op, []buckets.Observation, error) {
	if r == nil || r.ID == "" {
		return nil, nil, fmt.Errorf("%w: settle: reservation without ID", buckets.ErrInvalidRequest)
	}
	if err := buckets.ValidateAmount("actual usage", actual); err != nil {
		return nil, nil, err
	}
	if err := r.ValidateQuotas(); err != nil {
		return nil, nil, err
	}
	spent := r.Spent
	if mode == settleCancel {
		spent = 0
	}
	_, tomb := s.unsure.Load(r.ID)
	obs := make([]buckets.Observation, len(r.Buckets))
	delta := func(b buckets.Bucket) float64 { return r.Charged(b) - actual }
	qdelta := func(j int) float64 {
		q := r.Quotas[j]
		used := actual
		if q.Unit == buckets.Money {
			used = spent
		}
		return used - r.ChargedQuota(q)
	}
	gs := s.groups(r.Buckets, r.Slots, r.Quotas)
	ops := make([]op, len(gs))
	var now time.Time
	if mode == replayUnsent || mode == replaySent || mode == chargeOnce {
		now = s.now()
	}
	for k, g := range gs {
		o := op{g: g, id: idPart(r.ID), record: s.recordKey(g.tag), bs: r.Buckets, ss: r.Slots, qs: r.Quotas, spans: r.Windows,
			delta: delta, qdelta: qdelta, obs: obs, tomb: tomb || mode == settleCancel}
		switch mode {
		case replayUnsent, replaySent:
			o.marker, o.maybe = s.prefix+"p:{"+g.tag+"}:"+o.id, mode == replaySent
			o.markTTL = markTTL(g, r.Windows, now)
			o.prior, o.fresh = s.unanswered(r.Unanswered, g, now)
		case chargeOnce:
			// A charge's ID was never reserved: there is no record to
			// look for, and its call's marker makes it apply once.
			o.charge, o.markTTL = true, float64(repeatMS)
			o.record, o.tomb = "", false
		}
		ops[k] = o
	}
	return ops, obs, nil
}

// unansweredCall is the note in Reservation.Unanswered of a call whose
// reply was lost, its charges' marker mark, given up at at (a moment
// after it was sent): the time in Unix milliseconds, a space, the marker
// key.
func unansweredCall(mark string, at time.Time) string {
	return strconv.FormatInt(at.UnixMilli(), 10) + " " + mark
}

// unanswered returns, of the calls notes names (see unansweredCall), the
// marker of the one that carried group g's charge — the one in g's hash
// slot (the only one in standalone mode) — and whether it was sent within
// half the repeat window before now; "" when there is none.
func (s *Store) unanswered(notes []string, g group, now time.Time) (string, bool) {
	for _, n := range notes {
		ms, mark, ok := strings.Cut(n, " ")
		at, err := strconv.ParseInt(ms, 10, 64)
		if !ok || err != nil || !strings.HasPrefix(mark, s.prefix+"p:{") {
			continue
		}
		tag, _, ok := strings.Cut(mark[len(s.prefix)+3:], "}")
		if !ok || s.cluster && hashSlot(tag) != hashSlot(g.tag) {
			continue
		}
		return mark, now.Sub(time.UnixMilli(at)) < buckets.RepeatWindow/2
	}
	return "", false
}

// markTTL is how long the marker of a replay of group g is kept, in
// milliseconds: as long as the windows it charges (a replay sent again
// after another outage must find it) and at least buckets.QuotaSlack.
func markTTL(g group, windows []buckets.Span, now time.Time) float64 {
	ttl := float64(buckets.QuotaSlack.Milliseconds())
	for _, j := range g.quotas {
		ttl = max(ttl, quotaTTL(windows[j], now))
	}
	return ttl
}

// settled returns the states of the ops' settlement of r, or their first
// error, as an *buckets.IncompleteError with the part of r still to
// settle.
func (s *Store) settled(r *buckets.Reservation, ops []op, obs []buckets.Observation, what string) ([]buckets.BucketState, error) {
	var failed []group
	var first error
	sent := false
	for k := range ops {
		if err := ops[k].err; err != nil {
			first = cmp.Or(first, err)
			failed = append(failed, ops[k].g)
			sent = sent || !unsent(err)
		}
	}
	if first != nil {
		// Groups that did settle lost their record: settling the rest
		// completes it without settling them twice.
		rest := s.part(r, failed)
		rest.Unanswered = slices.Clone(r.Unanswered)
		for k := range ops {
			if o := &ops[k]; o.charge && o.err != nil && !unsent(o.err) {
				rest.Unanswered = append(rest.Unanswered, unansweredCall(o.marker, s.now()))
			}
		}
		return nil, &buckets.IncompleteError{Rest: rest, Sent: sent, Err: fmt.Errorf("redisstore: %s: %w", what, first)}
	}
	s.unsure.Delete(r.ID)
	states := make([]buckets.BucketState, len(r.Buckets))
	for i, b := range r.Buckets {
		states[i] = buckets.NewState(b, obs[i])
	}
	return states, nil
}

var _ buckets.Replayer = (*Store)(nil)

// Replay implements buckets.Replayer: a settle op per group that applies
// also without the reservation's record, once per group by a marker key
// (<prefix>p:{T}:<ID>, kept as long as the windows it charges and at
// least buckets.QuotaSlack).
func (s *Store) Replay(ctx context.Context, r *buckets.Reservation, actual float64, sent bool) ([]buckets.BucketState, error) {
	mode := replayUnsent
	if sent {
		mode = replaySent
	}
	ops, obs, err := s.settleOps(r, actual, mode)
	if err != nil {
		return nil, err
	}
	ctx, cancel := s.detach(ctx)
	defer cancel()
	eachGroup(len(ops), func(k int) { s.do(ctx, &ops[k]) })
	return s.settled(r, ops, obs, "replay")
}

// Cancel implements buckets.Replayer: a settle op per group at zero usage
// that leaves a tombstone, which a copy of the reserve coming later finds.
func (s *Store) Cancel(ctx context.Context, r *buckets.Reservation) error {
	ops, obs, err := s.settleOps(r, 0, settleCancel)
	if err != nil {
		return err
	}
	ctx, cancel := s.detach(ctx)
	defer cancel()
	eachGroup(len(ops), func(k int) { s.do(ctx, &ops[k]) })
	_, err = s.settled(r, ops, obs, "cancel")
	return err
}

// Extend implements buckets.Store (S14): one script call per group of hard
// buckets and hard quotas; if a later group refuses, the earlier ones are
// refunded. Each call is numbered by r.Extends and applies once per group
// (see extendLua), so a copy sent again after a lost reply does not debit
// twice, and one that comes after its refund neither.
func (s *Store) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	if r == nil {
		return false, fmt.Errorf("%w: extend: nil reservation", buckets.ErrInvalidRequest)
	}
	if err := buckets.ValidateAmount("extend amount", n); err != nil {
		return false, err
	}
	if err := r.ValidateQuotas(); err != nil {
		return false, err
	}
	if n == 0 || !r.HasHard() {
		return true, nil
	}
	ctx, cancel, err := s.start(ctx, "extend")
	if err != nil {
		return false, err
	}
	defer cancel()
	r.Extends++
	var hard []buckets.Bucket
	var hardQ []buckets.Quota
	var index, indexQ []int
	for i, b := range r.Buckets {
		if b.Hard {
			hard = append(hard, b)
			index = append(index, i)
		}
	}
	for j, q := range r.Quotas {
		if q.Hard {
			hardQ = append(hardQ, q)
			indexQ = append(indexQ, j)
		}
	}
	nowArg, id := s.nowArg(), idPart(r.ID)
	var now time.Time
	if len(hardQ) > 0 {
		now = s.now()
	}
	// call runs the extension, or its undo, in group g.
	call := func(ctx context.Context, g group, undo bool) ([]any, error) {
		keys := make([]string, 0, len(g.buckets)+len(g.quotas)+1)
		args := make([]any, 0, 7+4*len(g.buckets)+4*len(g.quotas))
		args = append(args, nowArg, len(g.buckets), num(n))
		for _, i := range g.buckets {
			keys = append(keys, s.bucketKey(hard[i].Key))
			la := s.limitArgs(hard[i])
			args = append(args, la[0], la[1], la[2], la[3])
		}
		args = append(args, len(g.quotas))
		for _, j := range g.quotas {
			q, span := hardQ[j], r.Windows[indexQ[j]]
			keys = append(keys, s.quotaKey(q.Key, span.ID))
			args = append(args, num(q.Limit), num(r.ExtendQuota(q, n)), strconv.FormatFloat(quotaTTL(span, now), 'f', 0, 64), q.Tag())
		}
		keys = append(keys, s.prefix+"x:{"+g.tag+"}:"+id)
		mode := "1"
		if undo {
			mode = "2"
		}
		args = append(args, r.Extends, mode, repeatMS)
		return s.run(ctx, extendScript, keys, args)
	}
	var took []group
	for _, g := range s.groups(hard, nil, hardQ) {
		out, err := call(ctx, g, false)
		if err == nil && out[0] == int64(1) {
			took = append(took, g)
			continue
		}
		if len(took) > 0 {
			cctx, cancel := s.detach(ctx)
			for _, tg := range took {
				if _, uerr := call(cctx, tg, true); uerr != nil && err == nil {
					err = uerr
				}
			}
			cancel()
		}
		if err != nil {
			return false, fmt.Errorf("redisstore: extend: %w", err)
		}
		return false, nil
	}
	r.Extended += n
	return true, nil
}

// Inspect implements buckets.Inspector: one script call per group (one in
// standalone mode), reading levels refilled to now and the spend of each
// quota's current window, writing nothing.
func (s *Store) Inspect(ctx context.Context, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState, error) {
	if err := buckets.ValidateInspect(bs, qs); err != nil {
		return nil, nil, err
	}
	ctx, cancel, err := s.start(ctx, "inspect")
	if err != nil {
		return nil, nil, err
	}
	defer cancel()
	now := s.now()
	spans := make([]buckets.Span, len(qs))
	for j, q := range qs {
		spans[j] = s.spans.Span(q.Window, now)
	}
	obs := make([]buckets.Observation, len(bs))
	spent := make([]float64, len(qs))
	for _, g := range s.groups(bs, nil, qs) {
		keys := make([]string, 0, len(g.buckets)+len(g.quotas))
		args := []any{s.nowArg(), len(g.buckets)}
		for _, i := range g.buckets {
			keys = append(keys, s.bucketKey(bs[i].Key))
			la := s.limitArgs(bs[i])
			args = append(args, la[0], la[1])
		}
		for _, j := range g.quotas {
			keys = append(keys, s.quotaKey(qs[j].Key, spans[j].ID))
			args = append(args, qs[j].Tag())
		}
		if tp, ok := s.c.(pipeliner); ok && !s.cluster {
			if err := s.readPlain(ctx, tp, keys, g, bs, qs, obs, spent); err != nil {
				return nil, nil, fmt.Errorf("redisstore: inspect: %w", err)
			}
			continue
		}
		out, err := s.run(ctx, inspectScript, keys, args)
		if err != nil {
			return nil, nil, fmt.Errorf("redisstore: inspect: %w", err)
		}
		p, _ := out[0].(string)
		if len(out) != 1 || len(p) != 8*(2*len(g.buckets)+len(g.quotas)) {
			return nil, nil, fmt.Errorf("%w: unexpected inspect reply %q", buckets.ErrStore, out)
		}
		f := func(i int) float64 { return math.Float64frombits(binary.LittleEndian.Uint64([]byte(p[8*i:]))) }
		at := 0
		for _, i := range g.buckets {
			obs[i] = buckets.Observation{Level: f(at), Hold: time.Duration(f(at+1)) * time.Microsecond}
			at += 2
		}
		for _, j := range g.quotas {
			spent[j] = f(at)
			at++
		}
	}
	states := make([]buckets.BucketState, len(bs))
	for i, b := range bs {
		states[i] = buckets.NewState(b, obs[i])
	}
	quotas := make([]buckets.QuotaState, len(qs))
	for j, q := range qs {
		quotas[j] = buckets.NewQuotaState(q, spans[j], spent[j], now)
	}
	return states, quotas, nil
}

// pipeliner is a client that sends commands in one pipeline to one
// server: *redis.Client.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// readPlain is inspectLua without a script, for a standalone Redis: one
// MGET of group g's keys and then TIME in one pipeline, shared with the
// reads queued beside it (read.go; the clock read after the values, or the
// tests' script clock; nothing written), each bucket brought up to that instant
// here, as the script's get does, and each quota's spend read as the
// script reads it. A read is safe to repeat, so go-redis may send it
// again; a script costs Redis several times these two commands on a Redis
// that sleeps between calls (docs/performance.md).
func (s *Store) readPlain(ctx context.Context, tp pipeliner, keys []string, g group, bs []buckets.Bucket, qs []buckets.Quota, obs []buckets.Observation, spent []float64) error {
	vs, now, err := s.fetch(ctx, tp, keys)
	if err != nil {
		return err
	}
	f := func(v string, at int) float64 {
		return math.Float64frombits(binary.LittleEndian.Uint64([]byte(v[at : at+8])))
	}
	at := 0
	for _, i := range g.buckets {
		b := bs[i]
		v, _ := vs[at].(string)
		at++
		if v == "" {
			obs[i] = buckets.Observation{Level: b.Limit.Capacity}
			continue
		}
		if len(v) < 16 {
			return fmt.Errorf("%w: bucket value of %d bytes", buckets.ErrStore, len(v))
		}
		l, t := f(v, 0), f(v, 8)
		if now > t {
			l = min(b.Limit.Capacity, l+b.Limit.Rate*((now-t)/1e6))
			t = now
		}
		obs[i] = buckets.Observation{Level: l, Hold: time.Duration(t-now) * time.Microsecond}
	}
	for _, j := range g.quotas {
		v, _ := vs[at].(string)
		at++
		if len(v) >= 8 && (len(v) == 8 || v[8:] == qs[j].Tag()) {
			spent[j] = f(v, 0)
		} else {
			spent[j] = 0
		}
	}
	return nil
}

// Pause implements buckets.Store (S18): the bucket is empty until the given
// time, measured from now by the gateway clock (a provider's Retry-After is
// relative anyway), and refills from then on by Redis's clock.
func (s *Store) Pause(ctx context.Context, b buckets.Bucket, until time.Time) error {
	if err := b.Validate(); err != nil {
		return err
	}
	ctx, cancel, err := s.start(ctx, "pause")
	if err != nil {
		return err
	}
	defer cancel()
	hold := max(0, until.Sub(s.now()).Microseconds())
	la := s.limitArgs(b)
	args := []any{s.nowArg(), la[0], la[1], hold, la[2], la[3]}
	if _, err := s.run(ctx, pauseScript, []string{s.bucketKey(b.Key)}, args); err != nil {
		return fmt.Errorf("redisstore: pause: %w", err)
	}
	return nil
}

// eachGroup runs fn for groups 0..n-1, concurrently when there are several
// (only a cluster chain spans several), and waits for all.
func eachGroup(n int, fn func(k int)) {
	if n == 1 {
		fn(0)
		return
	}
	var wg sync.WaitGroup
	for k := range n {
		wg.Go(func() { fn(k) })
	}
	wg.Wait()
}

// hashSlot is Redis Cluster's slot of a hash tag: CRC16-XMODEM modulo 16384.
func hashSlot(tag string) uint16 {
	var crc uint16
	for i := 0; i < len(tag); i++ {
		crc ^= uint16(tag[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc & 16383
}

var _ buckets.Charger = (*Store)(nil)

// Charge implements buckets.Charger: a Replay of a settlement that never
// reached the store, a settle op per group that applies once by its
// marker, without a record. The marker lives buckets.RepeatWindow, not a
// replay's day: a rate-limit service charges every call, and copies of
// one come within the store's own timeout (or from the failover store's
// replay after a short outage).
func (s *Store) Charge(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	if r == nil || r.ID == "" {
		return nil, fmt.Errorf("%w: charge: reservation without ID", buckets.ErrInvalidRequest)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("redisstore: charge: %w", err)
	}
	if len(r.Quotas) > 0 && r.Windows == nil {
		buckets.ChargeWindows(r, s.now())
	}
	ops, obs, err := s.settleOps(r, actual, chargeOnce)
	if err != nil {
		return nil, err
	}
	ctx, cancel := s.detach(ctx)
	defer cancel()
	eachGroup(len(ops), func(k int) { s.do(ctx, &ops[k]) })
	return s.settled(r, ops, obs, "charge")
}
