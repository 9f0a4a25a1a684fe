package buckets_test

import (
	"context"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/tokengate/tokengate/buckets"
)

// stepped returns t with its wall clock moved by d, whole seconds, and its
// monotonic reading kept: what time.Now returns once the system clock has
// been stepped by d, or after a suspend of d, which Linux's monotonic clock
// does not count. No exported API makes such a value, so it is built from
// the layout of time.Time (wall seconds from bit 30 of its first word when
// it has a monotonic reading), and checked.
func stepped(t *testing.T, base time.Time, d time.Duration) time.Time {
	t.Helper()
	s := base
	w := (*uint64)(unsafe.Pointer(&s))
	*w += uint64(d/time.Second) << 30
	if s.Sub(base) != 0 || s.Round(0).Sub(base.Round(0)) != d {
		t.Fatalf("the layout of time.Time has changed: stepped %v by %v gives %v (monotonic delta %v)", base, d, s, s.Sub(base))
	}
	return s
}

// TestMemoryQuotaWindowFollowsTheWallClock: the memory store names quota
// windows by the wall clock, so a gateway suspended over midnight, or whose
// clock was stepped, charges the day it is, while its buckets refill by the
// monotonic clock, which a step of the wall clock does not move.
func TestMemoryQuotaWindowFollowsTheWallClock(t *testing.T) {
	base := time.Now()
	var mu sync.Mutex
	now := base
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock})
	ctx := context.Background()
	w, err := buckets.ParseWindow("day", "UTC")
	if err != nil {
		t.Fatal(err)
	}
	q := buckets.Quota{Name: "daily", Key: "team", Window: w, Limit: 100}
	b := buckets.Bucket{Name: "user", Key: "u", Limit: buckets.Limit{Capacity: 100, Rate: 1}}
	d, err := m.Reserve(ctx, buckets.Request{ID: "today", Cost: 100, Buckets: []buckets.Bucket{b}, Quotas: []buckets.Quota{q}})
	if err != nil || !d.OK {
		t.Fatalf("first Reserve = %+v, %v", d, err)
	}
	if got, want := d.Quotas[0].Window, w.ID(base); got != want {
		t.Fatalf("first Reserve charged window %s, want %s", got, want)
	}

	mu.Lock()
	now = stepped(t, base, 24*time.Hour)
	mu.Unlock()
	tomorrow := w.ID(base.Add(24 * time.Hour))
	// The bucket has not refilled: no monotonic time has passed.
	d, err = m.Reserve(ctx, buckets.Request{ID: "bucket", Cost: 1, Buckets: []buckets.Bucket{b}})
	if err != nil || d.OK || d.Reason != buckets.ShortOfTokens {
		t.Errorf("Reserve from the bucket after a step of the wall clock = %+v, %v; want short of tokens (it refills by the monotonic clock)", d, err)
	}
	// The quota's window is the next day's, with nothing spent in it.
	d, err = m.Reserve(ctx, buckets.Request{ID: "tomorrow", Cost: 100, Quotas: []buckets.Quota{q}})
	if err != nil || !d.OK || d.Quotas[0].Window != tomorrow || d.Quotas[0].Spent != 100 {
		t.Fatalf("Reserve a day later by the wall clock = %+v, %v; want admitted in window %s", d, err, tomorrow)
	}
	_, qs, err := m.Inspect(ctx, nil, []buckets.Quota{q})
	if err != nil || qs[0].Window != tomorrow || qs[0].Spent != 100 {
		t.Errorf("Inspect = %+v, %v; want window %s with 100 spent", qs, err, tomorrow)
	}
}
