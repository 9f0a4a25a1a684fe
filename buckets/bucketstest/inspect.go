package bucketstest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// Inspector is a store that reports its buckets and concurrency limits
// without writing: what a usage report reads.
type Inspector interface {
	Inspect(ctx context.Context, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState, error)
	InUse(ctx context.Context, ss []buckets.Slot) ([]int, error)
}

// RunInspectSlots holds Inspect and InUse to what Reserve, Pause and Settle
// leave, on the store's clock, and checks that they write nothing. The
// stores open returns must be Inspectors.
func RunInspectSlots(t *testing.T, open Open) {
	clock := NewClock()
	store := open(t, clock, 1)[0]
	in, ok := store.(Inspector)
	if !ok {
		t.Fatalf("%T does not implement Inspect and InUse", store)
	}
	ctx := context.Background()
	a := buckets.Bucket{Name: "a", Key: "inspect:a", Limit: buckets.Limit{Capacity: 100, Rate: 10}}
	b := buckets.Bucket{Name: "b", Key: "inspect:b", Limit: buckets.Limit{Capacity: 50, Rate: 1}}
	slot := buckets.Slot{Name: "s", Key: "inspect:s", Max: 2}
	check := func(step string, want []buckets.BucketState, held int) {
		t.Helper()
		for range 2 { // a second look sees the same: nothing was written
			got, _, err := in.Inspect(ctx, []buckets.Bucket{a, b}, nil)
			if err != nil {
				t.Fatalf("%s: Inspect: %v", step, err)
			}
			if d := cmp.Diff(want, got); d != "" {
				t.Errorf("%s: Inspect (-want +got):\n%s", step, d)
			}
			n, err := in.InUse(ctx, []buckets.Slot{slot})
			if err != nil {
				t.Fatalf("%s: InUse: %v", step, err)
			}
			if n[0] != held {
				t.Errorf("%s: InUse = %d, want %d", step, n[0], held)
			}
		}
	}
	state := func(bk buckets.Bucket, remaining float64, reset time.Duration) buckets.BucketState {
		return buckets.BucketState{Name: bk.Name, Limit: bk.Limit, Remaining: remaining, Reset: reset}
	}
	check("unused", []buckets.BucketState{state(a, 100, 0), state(b, 50, 0)}, 0)

	d, err := store.Reserve(ctx, buckets.Request{Cost: 30, Buckets: []buckets.Bucket{a}, Slots: []buckets.Slot{slot}})
	if err != nil || !d.OK {
		t.Fatalf("Reserve: %+v, %v", d, err)
	}
	check("after a reservation of 30", []buckets.BucketState{state(a, 70, 3*time.Second), state(b, 50, 0)}, 1)

	clock.Set(time.Second)
	check("a second later", []buckets.BucketState{state(a, 80, 2*time.Second), state(b, 50, 0)}, 1)

	if err := store.Pause(ctx, a, Epoch.Add(5*time.Second)); err != nil {
		t.Fatal(err)
	}
	check("paused until 5s", []buckets.BucketState{state(a, 0, 14*time.Second), state(b, 50, 0)}, 1)

	if _, err := store.Settle(ctx, d.Reservation, 30); err != nil {
		t.Fatal(err)
	}
	check("settled", []buckets.BucketState{state(a, 0, 14*time.Second), state(b, 50, 0)}, 0)

	if _, _, err := in.Inspect(ctx, []buckets.Bucket{{Name: "x", Limit: a.Limit}}, nil); !errors.Is(err, buckets.ErrInvalidLimit) {
		t.Errorf("Inspect of a bucket without a key: %v, want ErrInvalidLimit", err)
	}
	if _, err := in.InUse(ctx, []buckets.Slot{{Name: "x", Key: "k"}}); !errors.Is(err, buckets.ErrInvalidLimit) {
		t.Errorf("InUse of a slot without a max: %v, want ErrInvalidLimit", err)
	}
}

// OverrideStore is a store of limit overrides (buckets.OverrideKey).
type OverrideStore interface {
	Put(ctx context.Context, k buckets.OverrideKey, value []byte) (string, error)
	Get(ctx context.Context, k buckets.OverrideKey) ([]byte, bool, error)
	Delete(ctx context.Context, k buckets.OverrideKey) (bool, string, error)
	Version(ctx context.Context) (string, error)
	Load(ctx context.Context) (buckets.OverrideSet, error)
}

// RunOverrides holds override stores to their contract: every write
// changes the version, every version differs from those before it, a
// delete of nothing changes nothing, and every store open returns (each
// with its own connection) sees the others' writes.
func RunOverrides(t *testing.T, open func(t *testing.T, n int) []OverrideStore) {
	ctx := context.Background()
	stores := open(t, 2)
	w, r := stores[0], stores[1]
	seen := map[string]bool{}
	newVersion := func(step, v string) {
		t.Helper()
		if v == "" || seen[v] {
			t.Errorf("%s: version %q is empty or was seen before", step, v)
		}
		seen[v] = true
		if got, err := r.Version(ctx); err != nil || got != v {
			t.Errorf("%s: the other store's Version = %q, %v; want %q", step, got, err, v)
		}
	}
	load := func(step, version string, want map[buckets.OverrideKey][]byte) {
		t.Helper()
		got, err := r.Load(ctx)
		if err != nil {
			t.Fatalf("%s: Load: %v", step, err)
		}
		if d := cmp.Diff(buckets.OverrideSet{Version: version, Values: want}, got); d != "" {
			t.Errorf("%s: Load (-want +got):\n%s", step, d)
		}
	}
	load("empty", "", map[buckets.OverrideKey][]byte{})
	if v, err := r.Version(ctx); err != nil || v != "" {
		t.Errorf("empty: Version = %q, %v", v, err)
	}

	k1 := buckets.OverrideKey{Policy: "p", Rule: "team", Identity: "acme"}
	k2 := buckets.OverrideKey{Policy: "p", Rule: "team", Identity: "a%3Ab+%E2%82%AC:{x}"}
	v1, err := w.Put(ctx, k1, []byte(`{"max":1}`))
	if err != nil {
		t.Fatal(err)
	}
	newVersion("put", v1)
	v2, err := w.Put(ctx, k1, []byte(`{"max":2}`))
	if err != nil {
		t.Fatal(err)
	}
	newVersion("replace", v2)
	v3, err := w.Put(ctx, k2, []byte(`{"tokens_per_minute":5}`))
	if err != nil {
		t.Fatal(err)
	}
	newVersion("second key", v3)
	load("two keys", v3, map[buckets.OverrideKey][]byte{k1: []byte(`{"max":2}`), k2: []byte(`{"tokens_per_minute":5}`)})
	if got, ok, err := r.Get(ctx, k1); err != nil || !ok || string(got) != `{"max":2}` {
		t.Errorf("Get = %q, %v, %v", got, ok, err)
	}

	deleted, v, err := w.Delete(ctx, buckets.OverrideKey{Policy: "p", Rule: "team", Identity: "nobody"})
	if err != nil || deleted || v != v3 {
		t.Errorf("Delete of nothing = %v, %q, %v; want false at %q", deleted, v, err, v3)
	}
	deleted, v4, err := w.Delete(ctx, k1)
	if err != nil || !deleted {
		t.Fatalf("Delete = %v, %v", deleted, err)
	}
	newVersion("delete", v4)
	if _, ok, err := r.Get(ctx, k1); err != nil || ok {
		t.Errorf("Get after Delete: ok %v, %v", ok, err)
	}
	load("deleted", v4, map[buckets.OverrideKey][]byte{k2: []byte(`{"tokens_per_minute":5}`)})

	for _, bad := range []struct {
		k buckets.OverrideKey
		v []byte
	}{
		{buckets.OverrideKey{Policy: "p", Rule: "r"}, []byte("{}")},
		{buckets.OverrideKey{Policy: "p", Rule: "r\x00x", Identity: "i"}, []byte("{}")},
		{k1, nil},
		{k1, make([]byte, buckets.MaxOverrideBytes+1)},
	} {
		if _, err := w.Put(ctx, bad.k, bad.v); !errors.Is(err, buckets.ErrInvalidRequest) {
			t.Errorf("Put(%q, %d bytes): %v, want ErrInvalidRequest", bad.k, len(bad.v), err)
		}
	}
	load("after refusals", v4, map[buckets.OverrideKey][]byte{k2: []byte(`{"tokens_per_minute":5}`)})
}
