package redisstore

import "time"

// SetScriptClock makes the scripts of s use now instead of the Redis
// server's TIME, so that tests can run on a simulated clock (S6). It also
// becomes the clock that Pause measures from.
func SetScriptClock(s *Store, now func() time.Time) {
	s.scriptNow = now
	s.now = now
}

// HashSlot exposes the cluster slot computation to tests.
var HashSlot = hashSlot
