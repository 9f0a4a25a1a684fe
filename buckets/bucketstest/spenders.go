package bucketstest

import (
	"context"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// RunListSpend checks buckets.SpendLister: the spends of one quota's
// window that holds now, largest first, cut to Top, from the keys that
// begin with the prefix and no others (another quota, another window),
// with identities in the form they were given, characters a store
// escapes included; reservations count until they are settled; listing
// writes nothing.
func RunListSpend(t *testing.T, open Open) {
	clock := NewClock()
	st := open(t, clock, 1)[0]
	l, ok := st.(buckets.SpendLister)
	if !ok {
		t.Fatalf("%T does not implement buckets.SpendLister", st)
	}
	ctx := context.Background()
	day := window("day", "UTC")
	prefix := t.Name() + "/p:daily:"
	spend := func(id string, reserve, settle float64) {
		t.Helper()
		q := buckets.Quota{Name: "daily", Key: prefix + id, Window: day, Limit: 1e6}
		other := buckets.Quota{Name: "daily2", Key: t.Name() + "/p:daily2:" + id, Window: day, Limit: 1e6}
		d, err := st.Reserve(ctx, buckets.Request{Cost: reserve, Quotas: []buckets.Quota{q, other}})
		if err != nil || !d.OK {
			t.Fatalf("Reserve for %s = %+v, %v", id, d, err)
		}
		if settle >= 0 {
			if _, err := st.Settle(ctx, d.Reservation, settle); err != nil {
				t.Fatalf("Settle for %s: %v", id, err)
			}
		}
	}
	spend("alice", 100, 40)
	spend("{bob}%7D", 100, 70) // braces and a percent sign: Redis escapes them in its keys
	spend("carol", 55, -1)     // in flight: its reservation counts
	spend("dave", 30, 0)       // settled at nothing: no spend to list
	list := func(top int) buckets.SpendList {
		t.Helper()
		got, err := l.ListSpend(ctx, buckets.SpendQuery{Prefix: prefix, Window: day, Top: top})
		if err != nil {
			t.Fatalf("ListSpend: %v", err)
		}
		return got
	}
	want := buckets.SpendList{
		Window:   day.Span(clock.Now()),
		Top:      []buckets.KeySpend{{Key: "{bob}%7D", Spent: 70}, {Key: "carol", Spent: 55}},
		Read:     3,
		Complete: true,
	}
	for range 2 { // twice: listing changes nothing
		if d := cmp.Diff(want, list(2), floatsClose); d != "" {
			t.Errorf("ListSpend top 2 (-want +got):\n%s", d)
		}
	}
	if got := list(10); len(got.Top) != 3 || got.Top[2] != (buckets.KeySpend{Key: "alice", Spent: 40}) {
		t.Errorf("ListSpend top 10 = %+v, want bob, carol and alice", got.Top)
	}
	// The next day's window has spent nothing yet.
	clock.Set(endOfEpochDay)
	if got := list(10); got.Read != 0 || len(got.Top) != 0 || !got.Complete || got.Window.ID != "2027-01-16" {
		t.Errorf("ListSpend in the next window = %+v, want nothing in 2027-01-16", got)
	}
	if _, err := l.ListSpend(ctx, buckets.SpendQuery{Prefix: prefix, Window: day}); err == nil {
		t.Error("ListSpend without Top succeeded, want an error")
	}
}
