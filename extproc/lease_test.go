package extproc

import (
	"strings"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/lease"
)

// A 429 from a leased bucket tells the client what leases mean for its
// retry (S16, S20): Retry-After counts the shared bucket, and tokens other
// gateways hold may keep it short for up to the lease TTL more. A bucket
// without a lease says nothing of leases.
func TestLeasedRefusalSaysWhatToExpect(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lease  *buckets.Lease
		wanted bool
	}{
		{"leased", &buckets.Lease{Size: 1, TTL: 3 * time.Second}, true},
		{"not leased", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}, Lease: tc.lease}}}
			u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
			r := newRig(t, u, rigOptions{policies: []Policy{pol}, wrap: func(s *recordingStore) buckets.Store {
				m := buckets.NewMemory(buckets.MemoryOptions{})
				return lease.New(s, m, lease.Options{SweepEvery: -1})
			}})
			if resp, _ := r.post(t, chatPath, `{"model":"m","max_tokens":80,"messages":[]}`, nil); resp.StatusCode != 200 {
				t.Fatalf("first request: %d", resp.StatusCode)
			}
			r.outcome(t)
			resp, body := r.post(t, chatPath, `{"model":"m","max_tokens":80,"messages":[]}`, nil)
			r.outcome(t)
			if resp.StatusCode != 429 || resp.Header.Get("retry-after") == "" {
				t.Fatalf("second request: %d, Retry-After %q; want 429 with Retry-After", resp.StatusCode, resp.Header.Get("retry-after"))
			}
			said := strings.Contains(body, "shared through leases") && strings.Contains(body, "within 3s")
			if said != tc.wanted {
				t.Errorf("the 429 says what leases mean: %v, want %v:\n%s", said, tc.wanted, body)
			}
		})
	}
}
