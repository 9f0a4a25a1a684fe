package buckets_test

import (
	"testing"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/bucketstest"
)

func TestMemoryInspect(t *testing.T) { bucketstest.RunInspectSlots(t, openMemory) }

func TestMemoryOverrides(t *testing.T) {
	bucketstest.RunOverrides(t, func(t *testing.T, n int) []bucketstest.OverrideStore {
		m := &buckets.MemoryOverrides{}
		stores := make([]bucketstest.OverrideStore, n)
		for i := range stores {
			stores[i] = m
		}
		return stores
	})
}

func TestMemoryAddSpend(t *testing.T) { bucketstest.RunAddSpend(t, openMemory) }
