// Package bucketstest is the contract suite of buckets.Store: one set of
// step vectors, races and random sequences that every store — the memory
// store and the Redis store on standalone Redis and Redis Cluster — must
// pass identically, so the Go and Lua implementations cannot drift.
//
// A store under test runs on a simulated Clock; Run and the other entry
// points take a function that opens stores sharing one backend.
package bucketstest

import (
	"sync"
	"time"
)

// Epoch is where every Clock starts: a whole second, so that every instant
// the suite uses is a whole number of microseconds, the resolution of the
// Redis store.
var Epoch = time.Unix(1_800_000_000, 0)

// Clock is a simulated clock. The zero value is not usable; use NewClock.
// It is safe for concurrent use.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a clock standing at Epoch.
func NewClock() *Clock { return &Clock{now: Epoch} }

// Now returns the simulated time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Set moves the clock to Epoch + d.
func (c *Clock) Set(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = Epoch.Add(d)
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
