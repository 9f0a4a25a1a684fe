package lease_test

import (
	"context"
	"fmt"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/lease"
)

// A gateway leases the shared provider bucket: the first request takes a
// lease of 1,000 tokens in one call, the next ones are admitted against it
// without a call, and Close gives back what is left. Remaining is the
// shared bucket as this gateway sees it: what the store holds, plus what
// the lease holds and settlements give back.
func Example() {
	now := func() time.Time { return time.Unix(1_800_000_000, 0) } // a clock that stands still
	shared := buckets.NewMemory(buckets.MemoryOptions{Now: now})   // the Redis store, in a fleet
	gw := lease.New(shared, shared, lease.Options{Now: now})
	defer gw.Close(context.Background())

	provider := buckets.Bucket{Name: "provider", Key: "openai",
		Limit: buckets.PerMinute(600_000, 0), Lease: &buckets.Lease{Size: 1000}}
	for range 3 {
		d, err := gw.Reserve(context.Background(), buckets.Request{Cost: 100, Buckets: []buckets.Bucket{provider}})
		if err != nil {
			panic(err)
		}
		fmt.Println(d.OK, d.Buckets[0].Remaining)
		if _, err := gw.Settle(context.Background(), d.Reservation, 80); err != nil {
			panic(err)
		}
	}
	// Output:
	// true 599900
	// true 599820
	// true 599740
}
