package buckets_test

import (
	"testing"

	"github.com/tokengate/tokengate/buckets/bucketstest"
)

func TestMemoryLender(t *testing.T) { bucketstest.RunLender(t, openMemory) }
