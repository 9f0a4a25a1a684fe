package rls_test

import (
	"context"
	"errors"
	"testing"
	"time"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/rls"
)

// deferredYAML is the test mapping with domain d's charges deferred.
const deferredYAML = mappingYAML + "  deferred_charges: [d]\n"

// TestDeferredChargesAnsweredAtOnce: in a domain of rls.deferred_charges a
// call whose descriptors all carry hits (Envoy's stream-done call, whose
// answer it ignores) is answered OK at once, even past the limit, and its
// hits are charged once in the background, down to max_debt; a check still
// reads the bucket, a call cancelled before it is queued charges nothing,
// and a call with a check among its descriptors is answered as ever (docs/rls.md, "Charges Envoy does not wait for").
func TestDeferredChargesAnsweredAtOnce(t *testing.T) {
	for _, name := range []string{"memory", "redis", "cluster"} {
		open := stores(t)[name]
		t.Run(name, func(t *testing.T) {
			r := newRig(t, open(t), deferredYAML)
			got := r.call(t, hits(desc("user", "dee"), 12))
			if got.GetOverallCode() != ok || got.Statuses[0].GetCode() != ok || got.Statuses[0].GetCurrentLimit().GetRequestsPerUnit() != 10 ||
				got.Statuses[0].GetLimitRemaining() != 0 || got.Statuses[0].GetDurationUntilReset() != nil {
				t.Fatalf("deferred charge of 12 from 10 answered %v, want OK naming the limit of 10, without remaining or reset", got)
			}
			gone, cancel := context.WithCancel(context.Background())
			cancel()
			if _, err := r.svc.ShouldRateLimit(gone, &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*commonv3.RateLimitDescriptor{hits(desc("user", "dee"), 5)}}); status.Code(err) != codes.Canceled {
				t.Errorf("deferred charge of a cancelled call = %v, want CANCELLED", err)
			}
			if err := r.svc.Drain(context.Background()); err != nil {
				t.Fatal(err)
			}
			if l := r.level(t, "user", "dee"); !near(l, -2) {
				t.Errorf("level %v after a deferred charge of 12 from 10, want -2", l)
			}
			if got := r.call(t, hits(desc("user", "dee"), 0)); got.GetOverallCode() != over {
				t.Errorf("check after the deferred charge: %v, want OVER_LIMIT (in debt)", got)
			}
			got = r.call(t, hits(desc("user", "mixed"), 0), hits(desc("both", "mixed"), 11))
			if got.GetOverallCode() != over || got.Statuses[1].GetCurrentLimit() == nil {
				t.Errorf("a check beside a charge of 11 from 5: %v, want the charge answered, OVER_LIMIT", got)
			}
			if l := r.level(t, "other", "mixed"); !near(l, -5) {
				t.Errorf("level %v of the bucket charged beside a check, want -5 (max_debt)", l)
			}
			r.mu.Lock()
			defer r.mu.Unlock()
			if len(r.seen) < 1 || r.seen[0].Code != "deferred" || r.seen[0].Hits != 12 || r.seen[0].Policy != "p" {
				t.Errorf("first descriptor counted %+v, want code deferred, 12 hits, policy p", r.seen)
			}
			if len(r.errs) != 1 || r.errs[0] != rls.ErrorCaller {
				t.Errorf("errors counted: %v, want the cancelled call's caller_gone", r.errs)
			}
		})
	}
}

// TestDeferredChargeWaitsForTheStore: a deferred charge is queued in the
// store until its next call or the settle window; Drain waits for it, and
// a Flush of the store writes it.
func TestDeferredChargeWaitsForTheStore(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: redisServer(t)})
	t.Cleanup(func() { c.Close() })
	st := redisstore.New(c, redisstore.Options{Prefix: t.Name() + ":" + admission.NewID()[:8] + ":", SettleWindow: time.Hour})
	r := newRig(t, st, deferredYAML)
	r.call(t, hits(desc("user", "wes"), 4))
	if l := r.level(t, "user", "wes"); !near(l, 10) {
		t.Errorf("level %v while the charge waits for a call, want 10", l)
	}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.svc.Drain(gone); !errors.Is(err, context.Canceled) {
		t.Errorf("Drain with the charge queued = %v, want context.Canceled", err)
	}
	if err := st.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := r.svc.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	if l := r.level(t, "user", "wes"); !near(l, 6) {
		t.Errorf("level %v after the flush, want 6", l)
	}
}
