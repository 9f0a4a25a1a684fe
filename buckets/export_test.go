package buckets

// Sizes reports how many buckets, slot keys and open reservations m holds,
// so that tests can check that memory stays bounded.
func Sizes(m *Memory) (buckets, slots, open int) {
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		buckets += len(sh.buckets)
		slots += len(sh.slots)
		open += len(sh.open)
		sh.mu.Unlock()
	}
	return buckets, slots, open
}

// Marks reports how many marks (of replays, charges, cancellations) m
// holds.
func Marks(m *Memory) int {
	n := 0
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		n += len(sh.marks)
		sh.mu.Unlock()
	}
	return n
}
