package redisstore_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// trivialLua is the floor of a script call: the cheapest one the server
// can do with one key, measured on the same server in the same run.
var trivialLua = redis.NewScript(`return KEYS[1]`)

// BenchmarkReserveSettle measures what Redis pays per admitted request:
// reserve then settle (Settle, or SettleAsync, which joins the next call)
// of a chain of 1 or 3 buckets (a user's of 1,000, shared team and
// provider buckets) at 1, 16 and 64 callers on one standalone Redis, next
// to, in alternating rounds of the same run,
//   - the peer's check and charge: two pipelines of INCRBY+EXPIRE per
//     request and bucket, as envoyproxy/ratelimit does for a token limit,
//     and
//   - a trivial EVALSHA, the floor of a script call.
//
// With pace=none the callers ask back to back, and Redis never waits:
// what it spends per call then is what a call costs a busy Redis. With
// pace=gateway every caller waits between requests as a gateway does for
// its own work on each (1 ms, and a request rate of about 3,300 a second
// in all for more callers: what tokengate reaches in the peer benchmark on
// a 2-core machine), so that Redis sleeps between calls and runs each on
// cold caches, as it does behind a gateway: a call then costs it 2 to 4
// times as much, and these are the figures the peer benchmark measures
// (bench/peer-ratelimit).
//
// It reports the server's CPU (INFO cpu) per request for the store and the
// peer and their ratio (redis-cpu-vs-peer, the target is ≤ 1), the script
// time per request (INFO commandstats), per trivial call, the script calls
// per request (group commit makes it < 2 under load), requests per second
// for both, and the growth of used_memory per request over the store's
// rounds (settled requests leave nothing: the target is ≤ 16 B).
func BenchmarkReserveSettle(b *testing.B) {
	srv := redistest.Start(b)
	for _, pace := range []string{"none", "gateway"} {
		for _, chain := range []int{1, 3} {
			for _, settle := range []string{"sync", "async"} {
				for _, callers := range []int{1, 16, 64} {
					b.Run(fmt.Sprintf("pace=%s/chain=%d/settle=%s/callers=%d", pace, chain, settle, callers), func(b *testing.B) {
						var gap time.Duration
						if pace == "gateway" {
							gap = gatewayGap(callers)
						}
						reserveSettle(b, srv, chain, settle == "async", callers, gap)
					})
				}
			}
		}
	}
}

// gatewayGap is how long each of callers waits between its requests in
// BenchmarkReserveSettle's pace=gateway: a millisecond, the time of one
// request through Envoy and tokengate on the machine of the peer benchmark,
// and no more than about 3,300 requests a second in all, what one
// tokengate there reaches.
func gatewayGap(callers int) time.Duration {
	return max(time.Millisecond, time.Duration(callers)*300*time.Microsecond)
}

// benchUsers is how many users the callers of BenchmarkReserveSettle take
// turns at, as the peer benchmark's do.
const benchUsers = 1000

// reserveSettle runs BenchmarkReserveSettle with chains of one bucket
// (the user's) or three (the user's, a team's and a provider's), against a
// peer that charges as many keys, settling with Settle or SettleAsync,
// each caller waiting gap after each request.
func reserveSettle(b *testing.B, srv *redistest.Server, chain int, async bool, callers int, gap time.Duration) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: callers})
	defer c.Close()
	if err := trivialLua.Load(ctx, c).Err(); err != nil {
		b.Fatal(err)
	}
	st := redisstore.New(c, redisstore.Options{Prefix: fmt.Sprintf("bench%d.%d:", chain, callers)})
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	team := buckets.Bucket{Name: "team", Key: "team", Limit: lim}
	prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim}
	reqs := make([]buckets.Request, benchUsers)
	for i := range reqs {
		user := buckets.Bucket{Name: "user", Key: "user" + strconv.Itoa(i), Limit: lim}
		reqs[i] = buckets.Request{Cost: 100, Buckets: []buckets.Bucket{user, team, prov}[:chain]}
	}
	// Each caller takes turns at the users; next is its turn.
	next := make([]int, callers)
	user := func(worker int) int {
		u := (worker + next[worker]*callers) % benchUsers
		next[worker]++
		return u
	}
	wait := func() {
		if gap > 0 {
			time.Sleep(gap)
		}
	}
	pair := func(worker int) error {
		defer wait()
		d, err := st.Reserve(ctx, reqs[user(worker)])
		if err != nil {
			return err
		}
		if async {
			st.SettleAsync(d.Reservation, 80, nil)
			return nil
		}
		_, err = st.Settle(ctx, d.Reservation, 80)
		return err
	}
	flush := func() {
		if err := st.Flush(ctx); err != nil {
			b.Fatal(err)
		}
	}
	peer := func(worker int) error {
		defer wait()
		keys := []string{"peer:user" + strconv.Itoa(user(worker)), "peer:team", "peer:provider"}[:chain]
		for range 2 {
			p := c.Pipeline()
			for _, key := range keys {
				p.IncrBy(ctx, key, 100)
				p.Expire(ctx, key, time.Minute)
			}
			if _, err := p.Exec(ctx); err != nil {
				return err
			}
		}
		return nil
	}
	trivial := func(int) error {
		defer wait()
		return c.EvalSha(ctx, trivialLua.Hash(), []string{"bench:trivial"}).Err()
	}
	// Every key exists before memory is measured.
	parallel(callers, benchUsers, pair)
	flush()
	parallel(callers, benchUsers, peer)
	const rounds = 10
	var storeTime, peerTime time.Duration
	var storeCPU, peerCPU, trivialCPU, scriptUS float64
	var scriptCalls int64
	mem0 := usedMemory(b, c)
	b.ReportAllocs()
	b.ResetTimer()
	for r := range rounds {
		n := b.N/rounds + min(1, max(0, b.N%rounds-r))
		b.StopTimer()
		m := max(n, 100)
		cpu0 := redisCPU(b, c)
		start := time.Now()
		parallel(callers, m, peer)
		peerTime += time.Since(start)
		cpu1 := redisCPU(b, c)
		parallel(callers, m, trivial)
		cpu2 := redisCPU(b, c)
		peerCPU += (cpu1 - cpu0) / float64(m)
		trivialCPU += (cpu2 - cpu1) / float64(m)
		calls0, us0 := evalshaStats(b, c)
		b.StartTimer()
		start = time.Now()
		parallel(callers, n, pair)
		flush()
		storeTime += time.Since(start)
		b.StopTimer()
		storeCPU += (redisCPU(b, c) - cpu2) / float64(max(n, 1))
		calls1, us1 := evalshaStats(b, c)
		scriptCalls += calls1 - calls0
		scriptUS += (us1 - us0) / float64(max(n, 1))
		b.StartTimer()
	}
	b.StopTimer()
	grown := usedMemory(b, c) - mem0
	storeCPU, peerCPU, trivialCPU = storeCPU/rounds, peerCPU/rounds, trivialCPU/rounds
	b.ReportMetric(float64(b.N)/storeTime.Seconds(), "req/s")
	b.ReportMetric(float64(rounds*max(b.N/rounds, 100))/peerTime.Seconds(), "peer-req/s")
	b.ReportMetric(storeCPU, "redis-cpu-µs/req")
	b.ReportMetric(peerCPU, "peer-redis-cpu-µs/req")
	b.ReportMetric(storeCPU/peerCPU, "redis-cpu-vs-peer")
	b.ReportMetric(scriptUS/rounds, "script-µs/req")
	b.ReportMetric(trivialCPU, "trivial-redis-cpu-µs/call")
	b.ReportMetric(float64(scriptCalls)/float64(b.N), "script-calls/req")
	b.ReportMetric(float64(grown)/float64(b.N), "redis-B/req")
}

// BenchmarkRedisBytesPerRequest measures what settled requests leave in
// Redis: the growth of used_memory over 100,000 reserve+settle pairs (or
// b.N, if more) of a 3-bucket chain (16 callers, 64 users), once every key
// exists. The target is ≤ 16 B per request; a settled request leaves
// nothing, so what remains is allocator noise.
func BenchmarkRedisBytesPerRequest(b *testing.B) {
	srv := redistest.Start(b)
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 16})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{})
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	team := buckets.Bucket{Name: "team", Key: "team", Limit: lim}
	prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim}
	var next atomic.Int64
	pair := func(int) error {
		user := buckets.Bucket{Name: "user", Key: "user" + strconv.FormatInt(next.Add(1)%64, 10), Limit: lim}
		d, err := st.Reserve(ctx, buckets.Request{Cost: 100, Buckets: []buckets.Bucket{user, team, prov}})
		if err != nil {
			return err
		}
		st.SettleAsync(d.Reservation, 80, nil)
		return nil
	}
	// At least 100,000 requests, whatever -benchtime asks.
	requests := max(b.N, 100_000)
	parallel(16, 1000, pair)
	if err := st.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	mem0, keys0 := usedMemory(b, c), c.DBSize(ctx).Val()
	b.ResetTimer()
	parallel(16, requests, pair)
	if err := st.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	grown := float64(usedMemory(b, c) - mem0)
	b.ReportMetric(grown/float64(requests)*100_000, "redis-B/100k-req")
	b.ReportMetric(grown/float64(requests), "redis-B/req")
	b.ReportMetric(float64(c.DBSize(ctx).Val()-keys0), "keys-grown")
}

// redisCPU reads the server's CPU time in microseconds, user and system,
// from INFO cpu: all it spends on the requests, I/O included.
func redisCPU(b *testing.B, c *redis.Client) float64 {
	return infoField(b, c, "cpu", "used_cpu_user:")*1e6 + infoField(b, c, "cpu", "used_cpu_sys:")*1e6
}

// usedMemory reads used_memory from INFO memory.
func usedMemory(b *testing.B, c *redis.Client) int64 {
	return int64(infoField(b, c, "memory", "used_memory:"))
}

// evalshaStats reads how many EVALSHA calls the server has run and the
// time it spent in them (µs), from INFO commandstats.
func evalshaStats(b *testing.B, c *redis.Client) (calls int64, usec float64) {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "calls":
				if calls, err = strconv.ParseInt(v, 10, 64); err != nil {
					b.Fatal(err)
				}
			case "usec":
				if usec, err = strconv.ParseFloat(v, 64); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	return calls, usec
}

func infoField(b *testing.B, c *redis.Client, section, field string) float64 {
	info, err := c.Info(context.Background(), section).Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field); ok {
			x, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatal(err)
			}
			return x
		}
	}
	b.Fatalf("INFO %s has no %s", section, field)
	return 0
}

// parallel runs n calls of fn over callers goroutines and fails the
// benchmark on the first error.
func parallel(callers, n int, fn func(worker int) error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Value
	for w := range callers {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				if err := fn(w); err != nil {
					failed.CompareAndSwap(nil, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := failed.Load(); err != nil {
		panic(err)
	}
}

// BenchmarkQuotaOverhead measures what one quota adds to a chain of three
// buckets (each caller its own user, shared team and provider): reserve
// then settle with and without a monthly quota of money, side by side in
// the same run on one standalone Redis. The run is cut into many short
// pairs of rounds, one of each, in alternating order, so that both meet
// the same machine however its load changes (other processes share it):
// quota-throughput-ratio is the median over the pairs of the chain with
// the quota's requests per second over the chain's (the target is
// ≥ 0.85), and quota-cpu-ratio the same for the CPU both sides spend per
// request, this process's and Redis's together: what limits throughput
// once the machine is busy.
func BenchmarkQuotaOverhead(b *testing.B) {
	srv := redistest.Start(b)
	for _, settle := range []string{"sync", "async"} {
		for _, callers := range []int{1, 16} {
			b.Run(fmt.Sprintf("settle=%s/callers=%d", settle, callers), func(b *testing.B) {
				quotaOverhead(b, srv, settle == "async", callers)
			})
		}
	}
}

func quotaOverhead(b *testing.B, srv *redistest.Server, async bool, callers int) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: callers})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{Prefix: fmt.Sprintf("quota%d.%v:", callers, async)})
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
	w, err := buckets.ParseWindow("month", "Europe/Amsterdam")
	if err != nil {
		b.Fatal(err)
	}
	monthly := buckets.Quota{Name: "monthly", Key: "team-monthly", Window: w, Unit: buckets.Money, Limit: 1e15}
	team := buckets.Bucket{Name: "team", Key: "team", Limit: lim}
	prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim}
	plain := make([]buckets.Request, callers)
	quota := make([]buckets.Request, callers)
	for i := range plain {
		user := buckets.Bucket{Name: "user", Key: "user" + strconv.Itoa(i), Limit: lim}
		plain[i] = buckets.Request{Cost: 100, Buckets: []buckets.Bucket{user, team, prov}}
		quota[i] = plain[i]
		quota[i].Quotas, quota[i].Money = []buckets.Quota{monthly}, 2500
	}
	pair := func(reqs []buckets.Request) func(int) error {
		return func(worker int) error {
			d, err := st.Reserve(ctx, reqs[worker])
			if err != nil {
				return err
			}
			d.Reservation.Spent = 2000
			if async {
				st.SettleAsync(d.Reservation, 80, nil)
				return nil
			}
			_, err = st.Settle(ctx, d.Reservation, 80)
			return err
		}
	}
	// run returns the requests per second and the CPU per request (µs) of
	// n requests.
	run := func(reqs []buckets.Request, n int) (rate, cpu float64) {
		cpu0, self0 := redisCPU(b, c), cpuTime()
		start := time.Now()
		parallel(callers, n, pair(reqs))
		if err := st.Flush(ctx); err != nil {
			b.Fatal(err)
		}
		d := time.Since(start)
		used := redisCPU(b, c) - cpu0 + float64((cpuTime() - self0).Microseconds())
		return float64(n) / d.Seconds(), used / float64(n)
	}
	run(plain, 4*callers) // every key exists before the rounds
	run(quota, 4*callers)
	const pairs = 21
	n := max(b.N/pairs, 200)
	var rates, cpus []float64
	var plainRate, quotaRate float64
	b.ReportAllocs()
	b.ResetTimer()
	for i := range pairs {
		var pr, pc, qr, qc float64
		if i%2 == 0 {
			pr, pc = run(plain, n)
			qr, qc = run(quota, n)
		} else {
			qr, qc = run(quota, n)
			pr, pc = run(plain, n)
		}
		rates, cpus = append(rates, qr/pr), append(cpus, pc/qc)
		plainRate, quotaRate = plainRate+pr/pairs, quotaRate+qr/pairs
	}
	b.StopTimer()
	b.ReportMetric(plainRate, "chain-req/s")
	b.ReportMetric(quotaRate, "chain+quota-req/s")
	b.ReportMetric(median(rates), "quota-throughput-ratio")
	b.ReportMetric(median(cpus), "quota-cpu-ratio")
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// cpuTime is the CPU time this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
