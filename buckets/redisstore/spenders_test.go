package redisstore_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// addSpends gives n identities id0…id(n-1) of quota q a spend each (i+1
// tokens), through the store, 500 to a call.
func addSpends(tb testing.TB, st *redisstore.Store, q buckets.Quota, n int) {
	tb.Helper()
	ctx := context.Background()
	span := q.Window.Span(time.Now())
	for from := 0; from < n; from += 500 {
		var ss []buckets.Spend
		for i := from; i < min(n, from+500); i++ {
			qi := q
			qi.Key += "id" + strconv.Itoa(i)
			ss = append(ss, buckets.Spend{Quota: qi, Window: span, Amount: float64(i + 1)})
		}
		if err := st.AddSpend(ctx, fmt.Sprintf("seed-%s-%d", q.Key, from), ss); err != nil {
			tb.Fatal(err)
		}
	}
}

// A listing that reads past its bound stops there and says so: the
// largest of what it read, and at least that many keys, as the budget
// page shows ("showing N of at least M").
func TestListSpendStopsAtItsBoundAndSaysSo(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	st := redisstore.New(c, redisstore.Options{Prefix: "bound:"})
	q := buckets.Quota{Name: "daily", Key: "tg:p:daily:", Window: day(t), Limit: 1e9}
	addSpends(t, st, q, 50)
	ctx := context.Background()
	all, err := st.ListSpend(ctx, buckets.SpendQuery{Prefix: q.Key, Window: q.Window, Top: 3})
	if err != nil || !all.Complete || all.Read != 50 || len(all.Top) != 3 || all.Top[0] != (buckets.KeySpend{Key: "id49", Spent: 50}) {
		t.Fatalf("unbounded listing = %+v, %v; want all 50 read and id49 first", all, err)
	}
	part, err := st.ListSpend(ctx, buckets.SpendQuery{Prefix: q.Key, Window: q.Window, Top: 3, MaxRead: 20})
	if err != nil || part.Complete || part.Read != 20 || len(part.Top) != 3 {
		t.Fatalf("listing bounded at 20 = %+v, %v; want 20 read, incomplete", part, err)
	}
}

// BenchmarkListSpend is what the budget page costs on Redis per quota it
// shows: a listing of the top 10 of a window with spenders identities,
// among noise other keys of buckets and slots, which SCAN passes over.
func BenchmarkListSpend(b *testing.B) {
	srv := redistest.Start(b)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer c.Close()
	for _, n := range []struct{ spenders, noise int }{{1000, 10000}, {10000, 100000}} {
		b.Run(fmt.Sprintf("spenders=%d/keys=%d", n.spenders, n.spenders+n.noise), func(b *testing.B) {
			prefix := fmt.Sprintf("list%d:", n.spenders)
			st := redisstore.New(c, redisstore.Options{Prefix: prefix})
			w, err := buckets.ParseWindow("day", "UTC")
			if err != nil {
				b.Fatal(err)
			}
			q := buckets.Quota{Name: "daily", Key: "tg:p:daily:", Window: w, Limit: 1e9}
			addSpends(b, st, q, n.spenders)
			ctx := context.Background()
			for from := 0; from < n.noise; from += 1000 {
				pipe := c.Pipeline()
				for i := from; i < min(n.noise, from+1000); i++ {
					pipe.Set(ctx, prefix+"b:{tg:p:user:u"+strconv.Itoa(i)+"}", "x", 0)
				}
				if _, err := pipe.Exec(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			for b.Loop() {
				l, err := st.ListSpend(ctx, buckets.SpendQuery{Prefix: q.Key, Window: q.Window, Top: 10})
				if err != nil || l.Read == 0 {
					b.Fatalf("ListSpend = %+v, %v", l, err)
				}
			}
		})
	}
}
