package extproc

import (
	"context"
	"strconv"
	"testing"

	"github.com/tokengate/tokengate/buckets"
)

// BenchmarkLimitsInForce measures what limits as data add to a request:
// building its chain (three buckets, one concurrency limit) with no
// overrides, and with 100,000 overrides and a tier in force, next to a
// memory store's reserve and settle of the same chain. Overrides are
// looked up in memory: no store round trip is added.
func BenchmarkLimitsInForce(b *testing.B) {
	pol := tieredPolicy()
	s, err := NewServer(Config{Policies: []Policy{pol}, DefaultPolicy: "p", Store: buckets.NewMemory(buckets.MemoryOptions{}), counter: &fakeCounter{}})
	if err != nil {
		b.Fatal(err)
	}
	newRequest := func() *processor {
		p := newProcessor(context.Background(), s, s.live.Load(), "p")
		p.req.ids = map[string]string{"team": "acme", "key": IdentityKey("sk-1", true)}
		return p
	}
	chain := func(p *processor) ([]buckets.Bucket, []buckets.Slot) {
		bs := make([]buckets.Bucket, 0, len(p.pol.Buckets))
		for _, r := range p.pol.Buckets {
			bs = append(bs, p.bucket(r))
		}
		ss := make([]buckets.Slot, 0, len(p.pol.Concurrency))
		for _, r := range p.pol.Concurrency {
			ss = append(ss, p.slot(r))
		}
		return bs, ss
	}
	b.Run("chain/plain", func(b *testing.B) {
		s.SetOverrides(nil)
		p := newRequest()
		b.ReportAllocs()
		for b.Loop() {
			chain(p)
		}
	})
	b.Run("chain/overrides-and-tier", func(b *testing.B) {
		o := Overrides{}
		for i := range 100_000 {
			o[OverrideKey{Policy: "p", Rule: "team", Identity: "team-" + strconv.Itoa(i)}] = Override{Limit: buckets.Limit{Capacity: 5000, Rate: 1}}
		}
		o[OverrideKey{Policy: "p", Rule: "team", Identity: "acme"}] = Override{Limit: buckets.Limit{Capacity: 9000, Rate: 1}}
		s.SetOverrides(o)
		p := newRequest()
		p.req.tier = "gold"
		if bs, _ := chain(p); bs[0].Limit.Capacity != 9000 {
			b.Fatalf("the override is not in force: %+v", bs[0])
		}
		b.ReportAllocs()
		for b.Loop() {
			chain(p)
		}
	})
	b.Run("reserve-and-settle/memory", func(b *testing.B) {
		s.SetOverrides(nil)
		store := buckets.NewMemory(buckets.MemoryOptions{})
		bs, ss := chain(newRequest())
		for i := range bs {
			bs[i].Limit = buckets.Limit{Capacity: 1e12, Rate: 1e9}
		}
		ctx := context.Background()
		b.ReportAllocs()
		for b.Loop() {
			d, err := store.Reserve(ctx, buckets.Request{Cost: 10, Buckets: bs, Slots: ss})
			if err != nil || !d.OK {
				b.Fatal(d, err)
			}
			if _, err := store.Settle(ctx, d.Reservation, 10); err != nil {
				b.Fatal(err)
			}
		}
	})
}
