package metrics

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tokengate/tokengate/buckets"
)

// TestChargeThroughInstrumentedStore: the rate-limit service charges
// through the instrumented store, timed as op "charge".
func TestChargeThroughInstrumentedStore(t *testing.T) {
	m := New(prometheus.NewRegistry(), Options{})
	mem := buckets.NewMemory(buckets.MemoryOptions{})
	var s buckets.Store = m.Instrument(mem)
	ch, ok := s.(buckets.Charger)
	if !ok {
		t.Fatalf("%T does not pass Charge through", s)
	}
	b := buckets.Bucket{Name: "b", Key: "b", Limit: buckets.Limit{Capacity: 10, Rate: 1e-9}}
	states, err := ch.Charge(context.Background(), &buckets.Reservation{ID: "c1", Buckets: []buckets.Bucket{b}}, 4)
	if err != nil || len(states) != 1 || states[0].Remaining < 5.99 || states[0].Remaining > 6.01 {
		t.Fatalf("Charge = %+v, %v; want 6 left", states, err)
	}
	if n := testutil.CollectAndCount(m.storeLatency); n != 1 {
		t.Errorf("latency series = %d, want 1 (charge)", n)
	}
	ac, ok := s.(buckets.AsyncCharger)
	if !ok {
		t.Fatalf("%T does not pass ChargeAsync through", s)
	}
	got := make(chan []buckets.BucketState, 1)
	ac.ChargeAsync(&buckets.Reservation{ID: "c2", Buckets: []buckets.Bucket{b}}, 1, func(st []buckets.BucketState, err error) {
		if err != nil {
			t.Errorf("ChargeAsync: %v", err)
		}
		got <- st
	})
	if st := <-got; len(st) != 1 || st[0].Remaining < 4.99 || st[0].Remaining > 5.01 {
		t.Errorf("ChargeAsync = %+v; want 5 left", st)
	}
	if n := testutil.CollectAndCount(m.storeLatency); n != 1 {
		t.Errorf("latency series = %d after a queued charge, want 1 (charge)", n)
	}
}

// TestRLSCounters: descriptors by domain (an unmapped one never by its
// name), hits by direction, errors by reason.
func TestRLSCounters(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{})
	m.RLSDescriptor("ai", "p", "limit", "ok", false, 5, false)
	m.RLSDescriptor("ai", "p", "limit", "over_limit", true, 2, true)
	m.RLSDescriptor("", "", "unknown_domain", "ok", false, 1, false)
	m.RLSError("no_config")
	want := `
# HELP tokengate_rls_hits_total Hits the rate-limit service charged (direction charge) or refunded (refund), by domain and policy.
# TYPE tokengate_rls_hits_total counter
tokengate_rls_hits_total{direction="charge",domain="ai",policy="p"} 5
tokengate_rls_hits_total{direction="refund",domain="ai",policy="p"} 2
# HELP tokengate_rls_errors_total Rate-limit calls answered with a gRPC error, by reason: invalid_request (empty domain or descriptors, a limit without unit), no_config (no rls mapping loaded), store_error, caller_gone; deferred_store_error counts a deferred charge the store failed after its call was answered.
# TYPE tokengate_rls_errors_total counter
tokengate_rls_errors_total{reason="no_config"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_rls_hits_total", "tokengate_rls_errors_total"); err != nil {
		t.Error(err)
	}
	if got := testutil.ToFloat64(m.rls.descriptors.WithLabelValues("!unmapped", "", "unknown_domain", "ok")); got != 1 {
		t.Errorf("unmapped descriptors = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.rls.descriptors.WithLabelValues("ai", "p", "limit", "over_limit_shadow")); got != 1 {
		t.Errorf("shadow descriptors = %v, want 1", got)
	}
}
