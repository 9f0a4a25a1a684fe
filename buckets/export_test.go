package buckets

// Sizes reports how many buckets, slot keys and settled IDs m holds, so
// that tests can check that memory stays bounded.
func Sizes(m *Memory) (buckets, slots, settled int) {
	for i := range m.shards {
		sh := &m.shards[i]
		sh.mu.Lock()
		buckets += len(sh.buckets)
		slots += len(sh.slots)
		settled += len(sh.settled)
		sh.mu.Unlock()
	}
	return buckets, slots, settled
}
