package redisstore_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// trivialLua is the ceiling: the cheapest script call the server can do
// with one key, measured on the same server in the same run.
var trivialLua = redis.NewScript(`return KEYS[1]`)

// BenchmarkReserveSettle measures reserve+settle of a 3-bucket chain (each
// caller its own user, shared team and provider) at 1, 16 and 64
// concurrent callers on one standalone Redis, next to that server's ceiling
// for a trivial EVALSHA measured in alternating rounds of the same run, and
// reports the ratio of
// script calls per second (ratio), and the server CPU per script call of
// both (redis-µs/call, trivial-redis-µs/call).
func BenchmarkReserveSettle(b *testing.B) {
	srv := redistest.Start(b)
	for _, callers := range []int{1, 16, 64} {
		b.Run("callers="+strconv.Itoa(callers), func(b *testing.B) {
			ctx := context.Background()
			c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: callers})
			defer c.Close()
			if err := trivialLua.Load(ctx, c).Err(); err != nil {
				b.Fatal(err)
			}
			st := redisstore.New(c, redisstore.Options{Prefix: fmt.Sprintf("bench%d:", callers)})
			lim := buckets.Limit{Capacity: 1e12, Rate: 1e9}
			team := buckets.Bucket{Name: "team", Key: "team", Limit: lim}
			prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim}
			reqs := make([]buckets.Request, callers)
			for i := range reqs {
				user := buckets.Bucket{Name: "user", Key: "user" + strconv.Itoa(i), Limit: lim}
				reqs[i] = buckets.Request{Cost: 100, Buckets: []buckets.Bucket{user, team, prov}}
			}
			// Load the scripts before timing.
			if d, err := st.Reserve(ctx, reqs[0]); err != nil || !d.OK {
				b.Fatalf("Reserve = %+v, %v", d, err)
			} else if _, err := st.Settle(ctx, d.Reservation, 100); err != nil {
				b.Fatal(err)
			}
			pair := func(worker int) error {
				d, err := st.Reserve(ctx, reqs[worker])
				if err != nil {
					return err
				}
				_, err = st.Settle(ctx, d.Reservation, 80)
				return err
			}
			trivial := func(int) error {
				return c.EvalSha(ctx, trivialLua.Hash(), []string{"bench:trivial"}).Err()
			}
			// The trivial ceiling and the store run in alternating rounds, so
			// that both see the same machine load.
			const rounds = 10
			var trivialTime, trivialCPU, storeCPU, trivialProc, storeProc time.Duration
			trivialCalls := 0
			b.ReportAllocs()
			b.ResetTimer()
			for r := range rounds {
				n := b.N/rounds + min(1, max(0, b.N%rounds-r))
				b.StopTimer()
				m := max(2*n, 200)
				c.ConfigResetStat(ctx)
				p0 := procCPU(b, srv.PID())
				start := time.Now()
				parallel(callers, m, trivial)
				trivialTime += time.Since(start)
				trivialProc += procCPU(b, srv.PID()) - p0
				trivialCalls += m
				trivialCPU += time.Duration(usecPerCall(b, c) * float64(m) * 1e3)
				c.ConfigResetStat(ctx)
				p0 = procCPU(b, srv.PID())
				b.StartTimer()
				parallel(callers, n, pair)
				b.StopTimer()
				storeProc += procCPU(b, srv.PID()) - p0
				storeCPU += time.Duration(usecPerCall(b, c) * float64(2*n) * 1e3)
				b.StartTimer()
			}
			ceiling := float64(trivialCalls) / trivialTime.Seconds()
			b.StopTimer()
			rate := float64(2*b.N) / b.Elapsed().Seconds()
			b.ReportMetric(rate, "calls/s")
			b.ReportMetric(ceiling, "trivial-calls/s")
			b.ReportMetric(rate/ceiling, "ratio")
			b.ReportMetric(float64(storeCPU.Microseconds())/float64(2*b.N), "redis-µs/call")
			b.ReportMetric(float64(trivialCPU.Microseconds())/float64(trivialCalls), "trivial-redis-µs/call")
			// The server process's CPU per call, I/O included: the cost that
			// decides how many calls one Redis core can serve.
			b.ReportMetric(float64(storeProc.Microseconds())/float64(2*b.N), "server-cpu-µs/call")
			b.ReportMetric(float64(trivialProc.Microseconds())/float64(trivialCalls), "trivial-server-cpu-µs/call")
		})
	}
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

// procCPU returns the CPU time (user and system) of process pid, from
// /proc/<pid>/stat; zero where /proc is missing.
func procCPU(b *testing.B, pid int) time.Duration {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// Fields after the parenthesised command name; utime and stime are the
	// 14th and 15th fields of the line, in clock ticks (100 per second).
	f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	if len(f) < 13 {
		b.Fatalf("short /proc stat: %q", raw)
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+st) * 10 * time.Millisecond
}

// usecPerCall reads the server's CPU per EVALSHA since the last
// CONFIG RESETSTAT.
func usecPerCall(b *testing.B, c *redis.Client) float64 {
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_evalsha:") {
			continue
		}
		for _, f := range strings.Split(strings.TrimSpace(strings.TrimPrefix(line, "cmdstat_evalsha:")), ",") {
			if v, ok := strings.CutPrefix(f, "usec_per_call="); ok {
				x, _ := strconv.ParseFloat(v, 64)
				return x
			}
		}
	}
	return 0
}
