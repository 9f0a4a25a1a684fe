package redisstore

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/redistest"
)

// floorLua does what no batch script can do without: it reads the clock,
// unpacks the numbers, reads every bucket with one MGET and writes each
// back with a TTL, and returns a reply as long as batchLua's — and nothing
// else.
const floorLua = luaNow + `
local p = {struct.unpack(ARGV[2], ARGV[3])}
local nops, nbk = p[1], p[2]
local vs = redis.call('MGET', unpack(KEYS, 1, nbk))
for i = 1, nbk do redis.call('SET', KEYS[i], vs[i] or 'x', 'PX', string.format('%d', 60000)) end
local nv, a = 0, 6
for o = 1, nops do
  local kind, nb, ns, nq = p[a], p[a + 1], p[a + 2], p[a + 3]
  if kind == 1 then
    a, nv = a + 8 + 7 * nb + 4 * nq + 3 * ns, nv + 2 + 2 * nb + nq
  else
    local marker = 0
    if (kind - 2) % 4 >= 2 then marker = 2 end
    a, nv = a + 5 + marker + 7 * nb + 3 * nq + ns, nv + 2 + 3 * nb
  end
end
return string.rep('\0', 8 * nv)
`

// capturer records the keys and arguments of the batch script calls of
// two operations.
type capturer struct {
	*redis.Client
	calls []capturedCall
}

type capturedCall struct {
	keys []string
	args []any
}

// opsOf reads the number of operations from a batch call's packed
// numbers (see batchLua).
func opsOf(packed any) int {
	p, ok := packed.(string)
	if !ok || len(p) < 8 {
		return 0
	}
	return int(math.Float64frombits(binary.LittleEndian.Uint64([]byte(p[:8]))))
}

func (c *capturer) Process(ctx context.Context, cmd redis.Cmder) error {
	a := cmd.Args()
	if len(a) > 3 && a[0] == "evalsha" && a[1] == batchScript.sha {
		n := a[2].(int)
		if args := a[3+n:]; len(args) >= 5 && opsOf(args[2]) == 2 {
			call := capturedCall{args: append([]any(nil), args...)}
			for _, k := range a[3 : 3+n] {
				call.keys = append(call.keys, k.(string))
			}
			c.calls = append(c.calls, call)
		}
	}
	return c.Client.Process(ctx, cmd)
}

// BenchmarkBatchScript measures what Redis spends inside the batch script
// that carries one request at one caller with SettleAsync — the previous
// request's settlement and this one's reserve, each of another user (a
// chain of the user's bucket, or of it, a team's and a provider's) — next
// to floorLua with the same keys and arguments: the script time per call
// (INFO commandstats, evalsha usec_per_call) of both, and their ratio. Two
// such calls are replayed in turn, the reservation one reserves being the
// one the other settles, so that every call settles a record and adds
// one, as in BenchmarkReserveSettle. With pace=none the calls come back to
// back; with pace=gateway a millisecond apart, as one gateway's do: Redis
// sleeps between them and runs each on cold caches, which costs a script
// two to four times as much (see BenchmarkReserveSettle), and is what
// Redis spends behind a gateway.
func BenchmarkBatchScript(b *testing.B) {
	srv := redistest.Start(b)
	for _, pace := range []string{"none", "gateway"} {
		for _, chain := range []int{1, 3} {
			b.Run("pace="+pace+"/chain="+strconv.Itoa(chain), func(b *testing.B) {
				var gap time.Duration
				if pace == "gateway" {
					gap = time.Millisecond
				}
				batchScriptTime(b, srv, chain, gap)
			})
		}
	}
}

func batchScriptTime(b *testing.B, srv *redistest.Server, chain int, gap time.Duration) {
	ctx := context.Background()
	c := &capturer{Client: redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 1})}
	defer c.Close()
	// Each run of the function starts from no keys.
	if err := c.FlushDB(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	st := New(c, Options{Prefix: fmt.Sprintf("script%d:", chain)})
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	chainOf := func(user string) []buckets.Bucket {
		return []buckets.Bucket{{Name: "user", Key: user, Limit: lim}, {Name: "team", Key: "team", Limit: lim},
			{Name: "provider", Key: "provider", Limit: lim}}[:chain]
	}
	// Two users take turns: each call settles the one and reserves for
	// the other.
	for i := range 4 {
		d, err := st.Reserve(ctx, buckets.Request{Cost: 100, Buckets: chainOf("user" + strconv.Itoa(i%2))})
		if err != nil {
			b.Fatal(err)
		}
		st.SettleAsync(d.Reservation, 80, nil)
	}
	if err := st.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	if len(c.calls) < 2 {
		b.Fatal("no two batches of a settlement and a reserve were captured")
	}
	// The last two: one settles X and reserves Y, the other settles Y and
	// reserves Z; replayed with X for Z, they take turns for ever.
	calls := c.calls[len(c.calls)-2:]
	settled := calls[0].args[3]
	calls[1].args[4] = settled
	// run replays the captured calls n times and returns the script time
	// per call in µs.
	run := func(sc script, n int) float64 {
		if err := c.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		for i := range n {
			call := calls[i%2]
			if _, err := st.run(ctx, sc, call.keys, call.args); err != nil {
				b.Fatal(err)
			}
			if gap > 0 {
				time.Sleep(gap)
			}
		}
		return scriptTime(b, c)
	}
	// A check that the replay settles and reserves as the store does:
	// after an even number of calls, one record in one user's holder,
	// none in the other's.
	run(batchScript, 10)
	var lengths []int
	for _, u := range []string{"user0", "user1"} {
		lengths = append(lengths, len(c.Get(ctx, st.bucketKey(u)).Val()))
	}
	slices.Sort(lengths)
	if want := []int{16, 24 + 9 + len(settled.(string))}; !slices.Equal(lengths, want) {
		b.Fatalf("holder values of %v bytes after the replay, want %v: one record in one of them", lengths, want)
	}
	run(newScript(floorLua), 10)
	// Even runs: each ends where it began.
	againstFloor(b, func(sc script) float64 { return run(sc, max(b.N/10, 20)&^1) }, "call")
}

// BenchmarkBatchScriptWide measures what Redis spends inside the batch
// script per request when a batch carries several requests, as under load:
// per batch, the settlements of the previous batch's reservations and one
// reservation for each of 8 callers (each its own user bucket; a chain of
// 3 adds a shared team and provider bucket), next to floorLua with the
// same keys and arguments. It reports the script time per request (INFO
// commandstats) of both and their ratio.
func BenchmarkBatchScriptWide(b *testing.B) {
	srv := redistest.Start(b)
	for _, chain := range []int{1, 3} {
		b.Run("chain="+strconv.Itoa(chain), func(b *testing.B) { batchScriptWide(b, srv, chain, 8) })
	}
}

func batchScriptWide(b *testing.B, srv *redistest.Server, chain, callers int) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 1})
	defer c.Close()
	if err := c.FlushDB(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	st := New(c, Options{Prefix: fmt.Sprintf("wide%d:", chain)})
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	team := buckets.Bucket{Name: "team", Key: "team", Limit: lim}
	prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim}
	reqs := make([]buckets.Request, callers)
	for i := range reqs {
		user := buckets.Bucket{Name: "user", Key: "user" + strconv.Itoa(i), Limit: lim}
		reqs[i] = buckets.Request{Cost: 100, Buckets: []buckets.Bucket{user, team, prov}[:chain]}
	}
	open := make([]string, callers) // each caller's open reservation
	// batch returns the next batch: every open reservation settled, then
	// a new one per caller.
	batch := func() []*op {
		var ops []*op
		for i, id := range open {
			if id == "" {
				continue
			}
			r := reqs[i]
			g := st.groups(r.Buckets, nil, nil)[0]
			ops = append(ops, &op{g: g, id: id, record: st.recordKey(g.tag), bs: r.Buckets,
				delta: func(buckets.Bucket) float64 { return 20 }, obs: make([]buckets.Observation, len(r.Buckets))})
		}
		for i, r := range reqs {
			g := st.groups(r.Buckets, nil, nil)[0]
			open[i] = idPart(newID())
			ops = append(ops, &op{reserve: true, g: g, id: open[i], record: st.recordKey(g.tag), bs: r.Buckets,
				cost: r.Cost, life: r.LifetimeOrDefault(), obs: make([]buckets.Observation, len(r.Buckets))})
		}
		return ops
	}
	kept := make([]string, callers)
	run := func(sc script, n int) float64 {
		copy(kept, open)
		if err := c.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		for range n {
			ops := batch()
			if sc.sha == batchScript.sha {
				st.runBatch(ctx, ops)
				for _, o := range ops {
					if o.err != nil {
						b.Fatal(o.err)
					}
					if !o.reserve && o.done {
						b.Fatal("a settlement found no record")
					}
				}
				continue
			}
			// The floor: the same keys and arguments, built as runBatch
			// does; the reservations it makes are not recorded, so the
			// batch script's next batch settles those of its own last.
			copy(open, kept)
			keys, args := st.batchArgs(ops)
			if _, err := st.run(ctx, sc, keys, args); err != nil {
				b.Fatal(err)
			}
		}
		return scriptTime(b, c) / float64(callers)
	}
	run(batchScript, 10)
	run(newScript(floorLua), 10)
	againstFloor(b, func(sc script) float64 { return run(sc, max(b.N/10, 100)) }, "req")
}

// scriptTime reads the time Redis spent per EVALSHA call (µs) from INFO
// commandstats since its statistics were last reset.
func scriptTime(b *testing.B, c redis.UniversalClient) float64 {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	_, rest, ok := strings.Cut(info, "cmdstat_evalsha:")
	_, rest, ok2 := strings.Cut(rest, "usec_per_call=")
	v, _, ok3 := strings.Cut(rest, ",")
	if !ok || !ok2 || !ok3 {
		b.Fatalf("INFO commandstats has no evalsha usec_per_call: %q", info)
	}
	us, err := strconv.ParseFloat(v, 64)
	if err != nil {
		b.Fatal(err)
	}
	return us
}

// againstFloor runs the batch script and floorLua in ten alternating
// rounds, each run returning the script time per unit (a call or a
// request), and reports both and their ratio.
func againstFloor(b *testing.B, run func(script) float64, unit string) {
	floor := newScript(floorLua)
	const rounds = 10
	var script, base float64
	b.ResetTimer()
	for r := range rounds {
		if r%2 == 0 {
			script += run(batchScript)
			base += run(floor)
		} else {
			base += run(floor)
			script += run(batchScript)
		}
	}
	b.StopTimer()
	b.ReportMetric(script/rounds, "script-µs/"+unit)
	b.ReportMetric(base/rounds, "floor-µs/"+unit)
	b.ReportMetric(script/base, "script-vs-floor")
}

// BenchmarkChargeScript measures what Redis spends on a charge made alone
// — the rate-limit service's one-call hit at one caller: a batch of one
// charge on one of 1,000 users' buckets, its marker set as it is looked
// at — in Redis's own counters: the script time per call (INFO
// commandstats) and the CPU Redis used per call (INFO cpu: its event loop,
// the system calls and the script). With pace=gateway the charges come a
// millisecond apart, so that Redis sleeps between them as behind a
// gateway at one caller.
func BenchmarkChargeScript(b *testing.B) {
	srv := redistest.Start(b)
	for _, pace := range []string{"none", "gateway"} {
		b.Run("pace="+pace, func(b *testing.B) {
			ctx := context.Background()
			c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 1})
			defer c.Close()
			st := New(c, Options{Prefix: "charge:"})
			lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
			charge := func(i int) {
				r := &buckets.Reservation{ID: b.Name() + strconv.Itoa(i), Buckets: []buckets.Bucket{{Name: "user", Key: "u" + strconv.Itoa(i%1000), Limit: lim}}}
				if _, err := st.Charge(ctx, r, 500); err != nil {
					b.Fatal(err)
				}
			}
			for i := range 1000 {
				charge(-1 - i)
			}
			n := max(b.N, 200)
			if err := c.ConfigResetStat(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			cpu0 := redisCPU(b, c)
			b.ResetTimer()
			for i := range n {
				charge(i)
				if pace == "gateway" {
					time.Sleep(time.Millisecond)
				}
			}
			b.StopTimer()
			cpu := redisCPU(b, c) - cpu0
			b.ReportMetric(scriptTime(b, c), "script-µs/call")
			b.ReportMetric(cpu/float64(n), "redis-cpu-µs/call")
		})
	}
}

// redisCPU reads the CPU Redis has used (user and system, µs) from INFO
// cpu.
func redisCPU(b *testing.B, c redis.UniversalClient) float64 {
	info, err := c.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var us float64
	for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
		_, rest, ok := strings.Cut(info, f)
		v, _, ok2 := strings.Cut(rest, "\r\n")
		s, err := strconv.ParseFloat(v, 64)
		if !ok || !ok2 || err != nil {
			b.Fatalf("INFO cpu has no %s: %q", f, info)
		}
		us += s * 1e6
	}
	return us
}

// minimalChargeLua is the least a once-only charge can make Redis do in a
// script: set the call's marker, read the bucket, write it back with a
// TTL, and reply with its level. No refill, no floor, no other kind of
// operation: a comparator for BenchmarkChargeFloor, not a store script.
const minimalChargeLua = `
if redis.call('SET', KEYS[2], '1', 'PX', '60000', 'NX', 'GET') then return '' end
local v = redis.call('GET', KEYS[1])
local l, t = 0, 0
if v then l, t = struct.unpack('<dd', v) end
redis.call('SET', KEYS[1], struct.pack('<dd', l - ARGV[1], t), 'PX', '60000')
return struct.pack('<dd', l, t)
`

// BenchmarkChargeFloor measures, in Redis's own CPU counters, what one
// charge costs Redis when it sleeps between calls, as behind a gateway at
// one caller (a millisecond apart): the store's charge (the batch
// script), the minimal once-only charge script above, and
// envoyproxy/ratelimit's hit (INCRBY and EXPIRE in one pipeline), in
// alternating rounds. Redis's wake-up from its sleep costs most of every
// call, whatever the call: the minimal script's ratio to the pipeline is
// the floor any script-made, once-only charge has at one caller.
func BenchmarkChargeFloor(b *testing.B) {
	srv := redistest.Start(b)
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 1})
	defer c.Close()
	st := New(c, Options{Prefix: "floor:"})
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	minimal := redis.NewScript(minimalChargeLua)
	kinds := []struct {
		name string
		hit  func(i int) error
	}{
		{"store", func(i int) error {
			r := &buckets.Reservation{ID: "s" + strconv.Itoa(i), Buckets: []buckets.Bucket{{Name: "user", Key: "u" + strconv.Itoa(i%1000), Limit: lim}}}
			_, err := st.Charge(ctx, r, 500)
			return err
		}},
		{"minimal", func(i int) error {
			k := "{m" + strconv.Itoa(i%1000) + "}"
			return minimal.Run(ctx, c, []string{k, k + ":" + strconv.Itoa(i)}, 500).Err()
		}},
		{"pipeline", func(i int) error {
			k := "p" + strconv.Itoa(i%1000)
			_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
				p.IncrBy(ctx, k, 500)
				p.Expire(ctx, k, time.Minute)
				return nil
			})
			return err
		}},
	}
	const rounds = 3
	n := max(b.N, 50)
	cpu := make([]float64, len(kinds))
	b.ResetTimer()
	for r := range rounds {
		for k, kind := range kinds {
			for i := range 100 { // the keys exist, as at a steady state
				if err := kind.hit(-1 - i - r*100); err != nil {
					b.Fatal(err)
				}
			}
			cpu0 := redisCPU(b, c)
			for i := range n {
				if err := kind.hit(r*n + i); err != nil {
					b.Fatal(err)
				}
				time.Sleep(time.Millisecond)
			}
			cpu[k] += (redisCPU(b, c) - cpu0) / float64(n*rounds)
		}
	}
	b.StopTimer()
	for k, kind := range kinds {
		b.ReportMetric(cpu[k], kind.name+"-cpu-µs/call")
	}
	b.ReportMetric(cpu[0]/cpu[2], "store-vs-pipeline")
	b.ReportMetric(cpu[1]/cpu[2], "minimal-vs-pipeline")
}
