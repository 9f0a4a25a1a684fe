package buckets

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
)

// SpendLister is implemented by stores that can list the spend of one
// quota's current window across its keys, writing nothing: who spent most
// this month, as a budget page shows it. ListSpend reads the spend, in the
// window of q.Window that holds now, of every quota key that begins with
// q.Prefix, and returns the q.Top largest. A store that keeps its spend
// elsewhere than in this process bounds what it reads (SpendQuery.MaxRead)
// and says when it stopped short (SpendList.Complete).
type SpendLister interface {
	ListSpend(ctx context.Context, q SpendQuery) (SpendList, error)
}

// SpendQuery names the spends ListSpend reads. Prefix, Window and a
// positive Top are required.
type SpendQuery struct {
	// Prefix is what the keys of the quota's spends begin with: the
	// quota's Key up to its identity.
	Prefix string
	// Window is the quota's window.
	Window Window
	// Unit and Currency are the quota's (see Quota): a spend recorded in
	// another unit is not the quota's and is not listed (Quota.ReadsTag).
	Unit     Unit
	Currency string
	// Top is how many of the largest spends to return.
	Top int
	// MaxRead bounds the spends a store reads; zero means DefaultMaxRead.
	MaxRead int
}

// DefaultMaxRead is how many spends ListSpend reads at most when the
// query does not say.
const DefaultMaxRead = 10000

// SpendList is what ListSpend found.
type SpendList struct {
	// Window is the window read, the one that holds now.
	Window Span
	// Top holds the largest spends, largest first (equal ones by key),
	// at most SpendQuery.Top of them. Keys without spend in the window
	// are not listed.
	Top []KeySpend
	// Read is how many keys with spend in the window were read.
	Read int
	// Complete reports whether every key of the window was read; when it
	// is false there are at least Read, and Top is the largest of those.
	Complete bool
}

// KeySpend is one key's spend in a window.
type KeySpend struct {
	// Key is the quota key with SpendQuery.Prefix cut off: the identity.
	Key string
	// Spent is in the quota's unit: tokens, or micro-units of money.
	Spent float64
}

// Validate reports whether the query can be run: Prefix is set, the
// window has a period and Top is positive. The error wraps
// ErrInvalidRequest.
func (q SpendQuery) Validate() error {
	switch {
	case q.Prefix == "":
		return fmt.Errorf("%w: spend list without a key prefix", ErrInvalidRequest)
	case q.Window.Period < Day || q.Window.Period > Month:
		return fmt.Errorf("%w: spend list: window period must be day, week or month, got %v", ErrInvalidRequest, q.Window.Period)
	case q.Top <= 0 || q.MaxRead < 0:
		return fmt.Errorf("%w: spend list: top must be positive and max read not negative, got %d and %d", ErrInvalidRequest, q.Top, q.MaxRead)
	}
	return nil
}

// ReadsTag reports whether a spend recorded with tag is the quota's, as
// Quota.ReadsTag does.
func (q SpendQuery) ReadsTag(tag string) bool { return readsTag(q.Unit, q.Currency, tag) }

// MaxReads is q.MaxRead, or DefaultMaxRead when it is zero.
func (q SpendQuery) MaxReads() int { return cmp.Or(q.MaxRead, DefaultMaxRead) }

// TopSpends is the SpendList of the spends read in window: the top largest,
// largest first and equal ones by key.
func TopSpends(window Span, read []KeySpend, top int, complete bool) SpendList {
	slices.SortFunc(read, func(a, b KeySpend) int {
		return cmp.Or(cmp.Compare(b.Spent, a.Spent), strings.Compare(a.Key, b.Key))
	})
	return SpendList{Window: window, Top: slices.Clip(read[:min(top, len(read))]), Read: len(read), Complete: complete}
}

var _ SpendLister = (*Memory)(nil)

// ListSpend implements SpendLister: every spend of the window is in
// memory, so it reads them all (Complete), one shard at a time.
func (m *Memory) ListSpend(ctx context.Context, q SpendQuery) (SpendList, error) {
	if err := q.Validate(); err != nil {
		return SpendList{}, err
	}
	if err := ctx.Err(); err != nil {
		return SpendList{}, fmt.Errorf("list spend: %w", err)
	}
	_, wall := m.clock()
	span := m.spans.Span(q.Window, wall)
	var read []KeySpend
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		for k, sp := range sh.quotas {
			if k.window == span.ID && sp.expires > wall.UnixNano() && sp.amount > 0 && q.ReadsTag(sp.tag) {
				if id, ok := strings.CutPrefix(k.key, q.Prefix); ok && id != "" {
					read = append(read, KeySpend{Key: id, Spent: sp.amount})
				}
			}
		}
		sh.mu.Unlock()
	}
	return TopSpends(span, read, q.Top, true), nil
}
