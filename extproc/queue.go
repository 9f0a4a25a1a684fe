package extproc

import "sync/atomic"

// waitQueue bounds how many requests of one policy wait for their tokens at
// once on this gateway (S12, MaxQueue).
//
// Waiting needs no polling and keeps arrival order across every gateway
// that shares a store: a request that may wait (buckets.Request.MaxWait) is
// admitted ahead of time — its tokens are taken at once, driving the bucket
// below zero by at most MaxWait × rate — and is then held for
// Decision.Wait before it is forwarded. A later request finds the bucket
// lower and waits longer, so requests are served in the order the store saw
// them. The bound is per gateway: each bounds the requests it holds.
//
// A request takes its place before it asks the store, so the bound is
// exact however many requests decide at once, and gives it back as soon as
// it is clear that it does not wait. A zero max lets no request wait. The
// zero value lets none wait; a waitQueue is safe for concurrent use.
type waitQueue struct {
	max     atomic.Int64 // changed by Server.Reload
	waiting atomic.Int64
}

// enter takes a place, and reports false when the queue is full.
func (q *waitQueue) enter() bool {
	if q.waiting.Add(1) <= q.max.Load() {
		return true
	}
	q.waiting.Add(-1)
	return false
}

// leave gives a place taken by enter back.
func (q *waitQueue) leave() { q.waiting.Add(-1) }
