package redisstore

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/redistest"
)

// TestQueuedReadsShareOneCall: reads that arrive while one is in flight go
// together in the next call — one pipeline of one MGET for all — and
// each gets its own buckets' levels and quotas' spend.
func TestQueuedReadsShareOneCall(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 32})
	defer c.Close()
	t0 := time.Unix(1_800_000_000, 0)
	st := New(c, Options{})
	SetScriptClock(st, func() time.Time { return t0 })
	ctx := context.Background()
	const n = 12
	bs := make([]buckets.Bucket, n)
	qs := make([]buckets.Quota, n)
	for i := range bs {
		bs[i] = buckets.Bucket{Name: "b", Key: fmt.Sprintf("read%d", i), Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}
		qs[i] = buckets.Quota{Name: "q", Key: fmt.Sprintf("read%d", i), Limit: 1000, Window: buckets.Window{Period: buckets.Day, Location: time.UTC}}
		d, err := st.Reserve(ctx, buckets.Request{Cost: float64(i + 1), Buckets: bs[i : i+1], Quotas: qs[i : i+1]})
		if err != nil || !d.OK {
			t.Fatalf("Reserve %d = %+v, %v", i, d, err)
		}
	}
	// A read in flight: the lane is busy until leadRead below ends it.
	st.reads.mu.Lock()
	st.reads.busy = true
	st.reads.mu.Unlock()
	type result struct {
		i     int
		level float64
		spent float64
		err   error
	}
	out := make(chan result, n)
	for i := range bs {
		go func() {
			b, q, err := st.Inspect(ctx, bs[i:i+1], qs[i:i+1])
			r := result{i: i, err: err}
			if err == nil {
				r.level, r.spent = b[0].Remaining, q[0].Spent
			}
			out <- r
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st.reads.mu.Lock()
		queued := len(st.reads.queue)
		st.reads.mu.Unlock()
		if queued == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d reads queued behind the one in flight, want %d", queued, n)
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	before := commandCalls(t, c, "mget")
	own := &read{keys: []string{st.bucketKey("read0")}}
	st.leadRead(ctx, c, []*read{own}, own)
	if own.err != nil {
		t.Fatal(own.err)
	}
	for range n {
		r := <-out
		if r.err != nil {
			t.Fatalf("read %d: %v", r.i, r.err)
		}
		if want := 100 - float64(r.i+1); math.Abs(r.level-want) > 1e-6 || math.Abs(r.spent-float64(r.i+1)) > 1e-6 {
			t.Errorf("read %d: level %v, spent %v; want %v and %v", r.i, r.level, r.spent, want, r.i+1)
		}
	}
	if got := commandCalls(t, c, "mget") - before; got != 2 {
		t.Errorf("%d MGET calls for the read in flight and %d queued, want 2", got, n)
	}
	st.reads.mu.Lock()
	defer st.reads.mu.Unlock()
	if st.reads.busy || len(st.reads.queue) != 0 {
		t.Errorf("lane busy %v with %d queued once every read is done", st.reads.busy, len(st.reads.queue))
	}
}

// TestReadIsOnePipeline: a read on Redis's own clock is one MGET and then
// TIME, without MULTI/EXEC, and brings the bucket up to that clock: after a
// reserve of 40 of 100 tokens refilling 1,000 a second, a read a moment
// later sees at least the 60 left and at most the capacity.
func TestReadIsOnePipeline(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := New(c, Options{})
	ctx := context.Background()
	b := []buckets.Bucket{{Name: "b", Key: "pipelined", Limit: buckets.Limit{Capacity: 100, Rate: 1000}}}
	if d, err := st.Reserve(ctx, buckets.Request{Cost: 40, Buckets: b}); err != nil || !d.OK {
		t.Fatalf("Reserve = %+v, %v", d, err)
	}
	calls := func() [4]int {
		return [4]int{commandCalls(t, c, "multi"), commandCalls(t, c, "exec"), commandCalls(t, c, "mget"), commandCalls(t, c, "time")}
	}
	before := calls()
	states, _, err := st.Inspect(ctx, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	after := calls()
	if after[0] != before[0] || after[1] != before[1] || after[2] != before[2]+1 || after[3] != before[3]+1 {
		t.Errorf("a read ran MULTI %d, EXEC %d, MGET %d, TIME %d times; want 0, 0, 1, 1",
			after[0]-before[0], after[1]-before[1], after[2]-before[2], after[3]-before[3])
	}
	if got := states[0].Remaining; got < 60-1e-6 || got > 100 {
		t.Errorf("remaining %v after a reserve of 40 of 100, want between 60 and 100", got)
	}
}

// commandCalls is how often Redis has run cmd (INFO commandstats).
func commandCalls(t *testing.T, c *redis.Client, cmd string) int {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+cmd+":calls=")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
		if err != nil {
			t.Fatalf("commandstats %q: %v", line, err)
		}
		return n
	}
	return 0
}
