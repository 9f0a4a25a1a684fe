package redisstore_test

import (
	"testing"

	"github.com/tokengate/tokengate/buckets/bucketstest"
)

// Leases on Redis (S20): the lease op answers exactly as the memory
// store's (buckets.LeaseStep); the contract vectors, S6 first, hold
// through lease stores with leases sized to 1; and 64 callers over four
// gateways, each with its own client, never admit more than the bucket.
func TestLease(t *testing.T) {
	for _, c := range []struct {
		name string
		open func(*testing.T) bucketstest.Open
	}{{"standalone", standalone}, {"cluster", cluster}} {
		t.Run(c.name, func(t *testing.T) {
			open := c.open(t)
			t.Run("lender", func(t *testing.T) { bucketstest.RunLender(t, open) })
			t.Run("vectors", func(t *testing.T) { bucketstest.RunLeased(t, open, bucketstest.LeasedSkip...) })
			t.Run("fleet", func(t *testing.T) { bucketstest.RunLeaseFleet(t, open) })
		})
	}
}
