package failover_test

import (
	"testing"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
	"github.com/tokengate/tokengate/buckets/failover"
)

func TestChargeContract(t *testing.T) {
	bucketstest.RunCharge(t, func(t *testing.T, clock *bucketstest.Clock, n int) []buckets.Store {
		m := buckets.NewMemory(buckets.MemoryOptions{Now: clock.Now})
		return []buckets.Store{failover.New(m, failover.Options{Mode: failover.Closed, Now: clock.Now})}
	})
}
