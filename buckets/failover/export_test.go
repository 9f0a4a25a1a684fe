package failover

// ReplayInFlight reports whether the replay is applying a write it took
// from the queue, for tests outside the package.
func ReplayInFlight(s *Store) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inflight
}
