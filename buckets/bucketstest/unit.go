package bucketstest

import (
	"context"
	"testing"

	"github.com/tokengate/tokengate/buckets"
)

// RunUnitSwitch checks that a store records a quota's unit with its spend
// (buckets.Quota.Tag): a quota switched between tokens and money, or to
// another currency, under the same key reads the other unit's spend as
// nothing spent; the first admission in the new unit replaces it, and a
// reservation admitted in the old unit settles and extends without
// touching the new unit's spend. Inspect and ListSpend agree. The store
// must be an Inspector and a SpendLister.
func RunUnitSwitch(t *testing.T, open Open) {
	clock := NewClock()
	st := open(t, clock, 1)[0]
	l, ok := st.(buckets.SpendLister)
	if !ok {
		t.Fatalf("%T does not implement buckets.SpendLister", st)
	}
	ctx := context.Background()
	day := window("day", "UTC")
	prefix := t.Name() + "/p:daily:"
	tokens := hardQuota(buckets.Quota{Name: "daily", Key: prefix + "id", Window: day, Unit: buckets.Tokens, Limit: 1000})
	usd := tokens
	usd.Unit, usd.Currency, usd.Limit = buckets.Money, "USD", 1050
	eur := usd
	eur.Currency = "EUR"
	spent := func(q buckets.Quota) float64 {
		t.Helper()
		return inspect(t, st, nil, []buckets.Quota{q})[0].Spent
	}
	listed := func(q buckets.Quota) []buckets.KeySpend {
		t.Helper()
		got, err := l.ListSpend(ctx, buckets.SpendQuery{Prefix: prefix, Window: day, Unit: q.Unit, Currency: q.Currency, Top: 10})
		if err != nil {
			t.Fatalf("ListSpend in %s: %v", q.Tag(), err)
		}
		return got.Top
	}
	reserve := func(req buckets.Request) *buckets.Reservation {
		t.Helper()
		d, err := st.Reserve(ctx, req)
		if err != nil || !d.OK {
			t.Fatalf("Reserve(%+v) = %+v, %v; want admitted", req, d, err)
		}
		return d.Reservation
	}

	r := reserve(buckets.Request{Cost: 100, Quotas: []buckets.Quota{tokens}})
	if _, err := st.Settle(ctx, r, 80); err != nil {
		t.Fatal(err)
	}
	if got := spent(tokens); got != 80 {
		t.Fatalf("tokens spent %v, want 80", got)
	}
	if got := spent(usd); got != 0 {
		t.Errorf("the quota in USD reads %v spent; want nothing: the 80 tokens are not micro-units", got)
	}
	if got := listed(usd); len(got) != 0 {
		t.Errorf("ListSpend in USD = %v; want nothing listed", got)
	}
	if got := listed(tokens); len(got) != 1 || got[0] != (buckets.KeySpend{Key: "id", Spent: 80}) {
		t.Errorf("ListSpend in tokens = %v; want id at 80", got)
	}
	if got := spent(tokens); got != 80 {
		t.Errorf("after reading it in USD the quota in tokens reads %v; want the 80 still there (nothing was written)", got)
	}

	// A reservation admitted in tokens is open when the quota becomes one
	// of money: 80 + 50 = 130 read as micro-units would refuse 1,000 of a
	// 1,050 budget.
	open1 := reserve(buckets.Request{Cost: 50, Quotas: []buckets.Quota{tokens}})
	d, err := st.Reserve(ctx, buckets.Request{Cost: 10, Money: 1000, Quotas: []buckets.Quota{usd}})
	if err != nil || !d.OK || len(d.Quotas) != 1 || d.Quotas[0].Spent != 1000 {
		t.Fatalf("Reserve of 1000 micro-units after the switch = %+v, %v; want admitted in a fresh window at 1000", d, err)
	}
	if got := spent(tokens); got != 0 {
		t.Errorf("after the admission in USD the quota in tokens reads %v; want nothing: the value was replaced", got)
	}
	// The reservation in tokens extends and settles in its own unit, which
	// the window no longer counts: the spend in USD stays.
	if ok, err := st.Extend(ctx, open1, 20); err != nil || !ok {
		t.Errorf("Extend of the reservation in tokens = %v, %v; want debited", ok, err)
	}
	if _, err := st.Settle(ctx, open1, 5); err != nil {
		t.Fatal(err)
	}
	if got := spent(usd); got != 1000 {
		t.Errorf("after the reservation in tokens extended and settled, USD spent %v; want 1000 untouched", got)
	}
	if got := listed(usd); len(got) != 1 || got[0] != (buckets.KeySpend{Key: "id", Spent: 1000}) {
		t.Errorf("ListSpend in USD = %v; want id at 1000", got)
	}
	if got := listed(tokens); len(got) != 0 {
		t.Errorf("ListSpend in tokens = %v; want nothing listed", got)
	}
	d.Reservation.Spent = 900
	if _, err := st.Settle(ctx, d.Reservation, 10); err != nil {
		t.Fatal(err)
	}
	if got := spent(usd); got != 900 {
		t.Errorf("settled at 900 of 1000 micro-units, USD spent %v; want 900", got)
	}

	// Another currency starts afresh the same way.
	if got := spent(eur); got != 0 {
		t.Errorf("the quota in EUR reads %v spent; want nothing: USD micro-units are not EUR's", got)
	}
	reserve(buckets.Request{Money: 7, Quotas: []buckets.Quota{eur}})
	if got, usdNow := spent(eur), spent(usd); got != 7 || usdNow != 0 {
		t.Errorf("after an admission in EUR: EUR spent %v, USD %v; want 7 and 0", got, usdNow)
	}
}
