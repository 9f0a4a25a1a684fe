package redisstore_test

import (
	"testing"

	"github.com/tokengate/tokengate/buckets/redisstore"
)

// TestHashSlot pins the slot computation to values Redis Cluster documents
// and reports (CLUSTER KEYSLOT).
func TestHashSlot(t *testing.T) {
	for tag, want := range map[string]uint16{"foo": 12182, "bar": 5061, "123456789": 0x31C3 & 16383, "": 0} {
		if got := redisstore.HashSlot(tag); got != want {
			t.Errorf("HashSlot(%q) = %d, want %d", tag, got, want)
		}
	}
}
