package redisstore

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
)

var _ buckets.SpendLister = (*Store)(nil)

// A window's spends are listed by reading, never by keeping: SCAN with a
// MATCH pattern over <prefix>q:{<escaped quota prefix>*}:<window>, on
// every master of a cluster, and the matched keys' spends with one MGET
// per page of the scan (pipelined GETs on a cluster node, whose keys are
// in many slots). Nothing is added to the path of a request. The scan is
// bounded: per node at most scanPages calls of scanCount keys each, and in
// all query.MaxReads spends; a scan stopped by either bound says so
// (SpendList.Complete false). A quota key so long that the store hashes it
// (see keyPart) does not match and is not listed: that takes policy and
// rule names of more than about 60 bytes together. A spend in another unit
// than the query's (SpendQuery.ReadsTag) is not the quota's and is not
// listed.
const (
	scanCount = 1000
	scanPages = 100
)

// ListSpend implements buckets.SpendLister, as described above.
func (s *Store) ListSpend(ctx context.Context, q buckets.SpendQuery) (buckets.SpendList, error) {
	if err := q.Validate(); err != nil {
		return buckets.SpendList{}, err
	}
	ctx, cancel, err := s.start(ctx, "list spend")
	if err != nil {
		return buckets.SpendList{}, err
	}
	defer cancel()
	span := s.spans.Span(q.Window, s.now())
	head, tail := s.prefix+"q:{"+escape(q.Prefix), "}:"+span.ID
	l := &spendScan{pattern: globEscape(head) + "*" + globEscape(tail), head: head, tail: tail, query: q, max: q.MaxReads(), complete: true}
	switch c := s.c.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error { return l.node(ctx, node, true) })
	case *redis.Ring:
		err = c.ForEachShard(ctx, func(ctx context.Context, node *redis.Client) error { return l.node(ctx, node, false) })
	default:
		err = l.node(ctx, s.c, false)
	}
	if err != nil {
		return buckets.SpendList{}, fmt.Errorf("redisstore: list spend: %w", err)
	}
	return buckets.TopSpends(span, l.read, q.Top, l.complete), nil
}

// spendScan gathers the spends of one ListSpend from its nodes, which
// are scanned concurrently.
type spendScan struct {
	pattern, head, tail string
	query               buckets.SpendQuery
	max                 int

	mu       sync.Mutex
	read     []buckets.KeySpend
	complete bool
}

// node scans one node. perKey reads the spends with one GET each in a
// pipeline instead of one MGET: a cluster node refuses an MGET of keys in
// several slots.
func (l *spendScan) node(ctx context.Context, c Scripter, perKey bool) error {
	var cursor uint64
	for range scanPages {
		scan := redis.NewScanCmd(ctx, nil, "scan", cursor, "match", l.pattern, "count", scanCount)
		if err := c.Process(ctx, scan); err != nil {
			return err
		}
		var keys []string
		keys, cursor = scan.Val()
		if len(keys) > 0 {
			values, err := spendsOf(ctx, c, keys, perKey)
			if err != nil {
				return err
			}
			if !l.add(keys, values) {
				return nil
			}
		}
		if cursor == 0 {
			return nil
		}
	}
	l.mu.Lock()
	l.complete = false
	l.mu.Unlock()
	return nil
}

// add records the spends of keys; it reports false once the bound on
// spends read is reached.
func (l *spendScan) add(keys []string, values []any) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, k := range keys {
		v, _ := values[i].(string)
		if len(v) < 8 || !l.query.ReadsTag(v[8:]) {
			continue // expired between the scan and the read, or in another unit
		}
		spent := math.Float64frombits(binary.LittleEndian.Uint64([]byte(v)))
		id := strings.TrimSuffix(strings.TrimPrefix(k, l.head), l.tail)
		if !(spent > 0) || id == "" {
			continue
		}
		if len(l.read) == l.max {
			l.complete = false
			return false
		}
		l.read = append(l.read, buckets.KeySpend{Key: unescape(id), Spent: spent})
	}
	return true
}

// spendsOf reads the values of keys: one MGET, or with perKey one GET
// each in a pipeline.
func spendsOf(ctx context.Context, c Scripter, keys []string, perKey bool) ([]any, error) {
	if !perKey {
		args := make([]any, 0, len(keys)+1)
		args = append(args, "mget")
		for _, k := range keys {
			args = append(args, k)
		}
		cmd := redis.NewSliceCmd(ctx, args...)
		if err := c.Process(ctx, cmd); err != nil {
			return nil, err
		}
		if len(cmd.Val()) != len(keys) {
			return nil, fmt.Errorf("%w: MGET of %d keys answered %d values", buckets.ErrStore, len(keys), len(cmd.Val()))
		}
		return cmd.Val(), nil
	}
	node, ok := c.(*redis.Client)
	if !ok {
		return nil, fmt.Errorf("%w: %T is not a node's client", buckets.ErrStore, c)
	}
	gets := make([]*redis.StringCmd, len(keys))
	_, err := node.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			gets[i] = p.Get(ctx, k)
		}
		return nil
	})
	if err != nil && err != redis.Nil {
		return nil, err
	}
	out := make([]any, len(keys))
	for i, g := range gets {
		if v, err := g.Result(); err == nil {
			out[i] = v
		}
	}
	return out, nil
}

// globEscape makes s match itself in a SCAN pattern.
func globEscape(s string) string {
	if !strings.ContainsAny(s, `*?[]\`) {
		return s
	}
	var b strings.Builder
	for _, c := range []byte(s) {
		if strings.IndexByte(`*?[]\`, c) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	return b.String()
}

// unescape undoes escape.
func unescape(k string) string {
	if !strings.Contains(k, "%") {
		return k
	}
	return unescaper.Replace(k)
}
