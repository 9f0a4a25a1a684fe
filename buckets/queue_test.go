package buckets_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tokengate/tokengate/buckets"
)

// TestQueue checks S12 waiting: a request is held for its wait and then
// admitted; the queue bound turns waiting off; an abandoned wait refunds.
func TestQueue(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		m := buckets.NewMemory(buckets.MemoryOptions{})
		b := buckets.Bucket{Name: "b", Key: "b", Limit: buckets.Limit{Capacity: 10, Rate: 2}}
		q := buckets.NewQueue(1)
		if d, err := m.Reserve(ctx, buckets.Request{Cost: 10, Buckets: []buckets.Bucket{b}}); err != nil || !d.OK {
			t.Fatalf("Reserve(10) = %+v, %v", d, err)
		}
		waiting := buckets.Request{Cost: 4, Buckets: []buckets.Bucket{b}, MaxWait: 5 * time.Second}

		start := time.Now()
		done := make(chan buckets.Decision)
		go func() {
			d, err := q.Reserve(ctx, m, waiting)
			if err != nil {
				t.Errorf("Queue.Reserve: %v", err)
			}
			done <- d
		}()
		synctest.Wait()
		if got := q.Waiting(); got != 1 {
			t.Errorf("Waiting() = %d while one request waits, want 1", got)
		}
		// The queue is full: the next request is decided without waiting.
		d, err := q.Reserve(ctx, m, waiting)
		if err != nil || d.OK || d.Reason != buckets.ShortOfTokens {
			t.Errorf("Reserve with a full queue = %+v, %v; want refused", d, err)
		}
		d = <-done
		if !d.OK || d.Wait != 2*time.Second || time.Since(start) != 2*time.Second {
			t.Errorf("waited %v with decision %+v; want admitted after 2s", time.Since(start), d)
		}
		if got := q.Waiting(); got != 0 {
			t.Errorf("Waiting() = %d after the wait, want 0", got)
		}

		// An abandoned wait gives its tokens back.
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err = q.Reserve(cctx, m, waiting)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Reserve with a deadline before the wait = %v, want DeadlineExceeded", err)
		}
		d, err = m.Reserve(ctx, buckets.Request{Cost: 0, Buckets: []buckets.Bucket{b}})
		// At +3s the level is -4 + 3*2 = 2 had the abandoned request been refunded.
		if err != nil || d.Buckets[0].Remaining != 2 {
			t.Errorf("level after the abandoned wait = %+v, %v; want 2", d.Buckets, err)
		}
	})
}
