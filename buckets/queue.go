package buckets

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// Queue bounds the requests of one gateway process that wait for their
// tokens (S12, max_queue) and holds them for their wait.
//
// Waiting needs no polling and keeps arrival order across every gateway that
// shares a store: a request with Request.MaxWait is admitted ahead of time —
// its tokens are taken at once, driving the bucket below zero by at most
// MaxWait × rate — and is then held for Decision.Wait before it is
// forwarded. A later request finds the bucket lower and waits longer, so
// requests are served in the order the store saw them. The bound on waiting
// requests is per process: each gateway bounds the work it holds.
//
// The zero value is not usable; use NewQueue. A Queue is safe for concurrent
// use.
type Queue struct {
	max     int64
	waiting atomic.Int64
}

// NewQueue returns a Queue that lets at most maxQueue requests wait at once.
func NewQueue(maxQueue int) *Queue {
	return &Queue{max: int64(maxQueue)}
}

// Waiting returns how many requests are waiting now.
func (q *Queue) Waiting() int { return int(q.waiting.Load()) }

// Reserve reserves req from s, waiting up to req.MaxWait for tokens when the
// queue has room (S12); when the queue is full the request is decided
// without waiting. When it returns an admitted Decision, the wait, if any,
// is over: Decision.Wait reports how long the request waited. If ctx ends
// during the wait, the reservation is settled with zero usage (its tokens
// are refunded) and ctx's error is returned.
func (q *Queue) Reserve(ctx context.Context, s Store, req Request) (Decision, error) {
	queued := false
	if req.MaxWait > 0 {
		if q.waiting.Add(1) <= q.max {
			queued = true
			defer q.waiting.Add(-1)
		} else {
			q.waiting.Add(-1)
			req.MaxWait = 0
		}
	}
	d, err := s.Reserve(ctx, req)
	if err != nil || !d.OK || d.Wait <= 0 || !queued {
		return d, err
	}
	t := time.NewTimer(d.Wait)
	defer t.Stop()
	select {
	case <-t.C:
		return d, nil
	case <-ctx.Done():
		// The request is abandoned: give its tokens back now rather than at
		// the end of a wait nobody is waiting for.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, serr := s.Settle(sctx, d.Reservation, 0)
		return Decision{}, errors.Join(ctx.Err(), serr)
	}
}
