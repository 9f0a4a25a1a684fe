package lease_test

import (
	"testing"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
)

// openMemory opens one Memory store that every gateway shares, as
// gateways share one Redis: it is each gateway's inner store and lender.
func openMemory(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
	m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
	stores := make([]buckets.Store, n)
	for i := range stores {
		stores[i] = m
	}
	return stores
}

func TestLeasedVectors(t *testing.T) { bucketstest.RunLeased(t, openMemory, bucketstest.LeasedSkip...) }

func TestLeaseFleet(t *testing.T) { bucketstest.RunLeaseFleet(t, openMemory) }
