package buckets_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// BenchmarkMemoryReserveSettle measures reserve+settle pairs of a 3-bucket
// chain (user, team, provider) from parallel callers, each its own user:
// "shared" callers share team and provider, as one organisation's traffic
// does; "unrelated" callers share nothing, which shows that unrelated keys
// do not wait for each other.
func BenchmarkMemoryReserveSettle(b *testing.B) {
	b.Run("shared", func(b *testing.B) { benchmarkMemory(b, true) })
	b.Run("unrelated", func(b *testing.B) { benchmarkMemory(b, false) })
}

func benchmarkMemory(b *testing.B, shared bool) {
	m := buckets.NewMemory(buckets.MemoryOptions{})
	ctx := context.Background()
	lim := buckets.Limit{Capacity: 1e12, Rate: 1e3}
	var users atomic.Int64
	cpu0 := cpuTime()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		n := strconv.FormatInt(users.Add(1), 10)
		user := buckets.Bucket{Name: "user", Key: "user" + n, Limit: lim}
		team := buckets.Bucket{Name: "team", Key: "team", Limit: lim}
		prov := buckets.Bucket{Name: "provider", Key: "provider", Limit: lim}
		if !shared {
			team.Key, prov.Key = "team"+n, "provider"+n
		}
		req := buckets.Request{Cost: 100, Buckets: []buckets.Bucket{user, team, prov}}
		for pb.Next() {
			d, err := m.Reserve(ctx, req)
			if err != nil || !d.OK {
				b.Fatalf("Reserve = %+v, %v", d, err)
			}
			if _, err := m.Settle(ctx, d.Reservation, 80); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
	// CPU time per pair does not depend on what else the machine runs:
	// 1e9 / cpu-ns/pair is the pairs per second one core can settle.
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/pair")
}

// cpuTime returns the CPU time this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
