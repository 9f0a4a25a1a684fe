package redisstore

import (
	"context"
	"fmt"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
)

// Reads in one call. On a standalone Redis a read of buckets and quotas
// (Inspect: the rate-limit service's checks, the usage report) is one MGET
// and then TIME in one pipeline (readPlain). As with the lanes of batch.go, a
// read that finds none in flight is sent at once; reads that arrive while
// one is in flight queue up, and the next call takes them all: one MGET of
// all their keys, at one instant of Redis's clock. Redis pays per call, so
// a hundred checks at once cost it about what one does.
type readLane struct {
	mu    sync.Mutex
	busy  bool
	queue []*read
}

// read is one caller's keys and, once its call is done, their values and
// the instant they were read at (µs).
type read struct {
	keys []string
	vals []any
	now  float64
	err  error
	// wake receives nil when the read is done, or the batch it must send.
	wake chan []*read
}

// maxReadKeys bounds the keys of one call of queued reads; a read with
// more goes alone.
const maxReadKeys = 1024

// fetch reads keys with the reads queued beside them and returns their
// values and the instant of the read. ctx has been detached from the
// caller (see Store.start).
func (s *Store) fetch(ctx context.Context, tp pipeliner, keys []string) ([]any, float64, error) {
	rd := &read{keys: keys}
	l := &s.reads
	l.mu.Lock()
	if !l.busy {
		l.busy = true
		l.mu.Unlock()
		s.leadRead(ctx, tp, []*read{rd}, rd)
		return rd.vals, rd.now, rd.err
	}
	rd.wake = make(chan []*read, 1)
	l.queue = append(l.queue, rd)
	l.mu.Unlock()
	if batch := <-rd.wake; batch != nil {
		s.leadRead(ctx, tp, batch, rd)
	}
	return rd.vals, rd.now, rd.err
}

// leadRead sends batch, tells its reads but own, and hands the next call
// to the oldest queued read with the reads queued behind it, or ends the
// lane's call.
func (s *Store) leadRead(ctx context.Context, tp pipeliner, batch []*read, own *read) {
	s.sendReads(ctx, tp, batch)
	for _, rd := range batch {
		if rd != own {
			rd.wake <- nil
		}
	}
	l := &s.reads
	l.mu.Lock()
	if len(l.queue) == 0 {
		l.busy = false
		l.mu.Unlock()
		return
	}
	n, keys := 0, 0
	for n < len(l.queue) && (n == 0 || keys+len(l.queue[n].keys) <= maxReadKeys) {
		keys += len(l.queue[n].keys)
		n++
	}
	next := append([]*read(nil), l.queue[:n]...)
	l.queue = append(l.queue[:0], l.queue[n:]...)
	l.mu.Unlock()
	next[0].wake <- next
}

// sendReads reads the keys of batch in one pipeline: one MGET, then TIME
// (unless the tests' script clock stands in for it). Redis runs a
// connection's commands in order, so the clock is read after the values:
// every instant they were written at is at or before it, as in one
// MULTI/EXEC, without the two commands and the queued replies MULTI costs
// Redis. A read is safe to repeat, so the client may send it again.
func (s *Store) sendReads(ctx context.Context, tp pipeliner, batch []*read) {
	keys := batch[0].keys
	if len(batch) > 1 {
		keys = nil
		for _, rd := range batch {
			keys = append(keys, rd.keys...)
		}
	}
	p := tp.Pipeline()
	vals := p.MGet(ctx, keys...)
	var clock *redis.TimeCmd
	if s.scriptNow == nil {
		clock = p.Time(ctx)
	}
	_, err := p.Exec(ctx)
	vs := vals.Val()
	if err == nil && len(vs) != len(keys) {
		err = fmt.Errorf("%d values for %d keys", len(vs), len(keys))
	}
	var now float64
	switch {
	case err != nil:
		err = fmt.Errorf("%w: %w", buckets.ErrStore, err)
	case clock != nil:
		now = float64(clock.Val().UnixMicro())
	default:
		now = float64(s.scriptNow().UnixMicro())
	}
	at := 0
	for _, rd := range batch {
		rd.err, rd.now = err, now
		if err == nil {
			rd.vals = vs[at : at+len(rd.keys) : at+len(rd.keys)]
		}
		at += len(rd.keys)
	}
}
