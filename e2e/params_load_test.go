//go:build load

package e2e

// The load run (`go test -tags load`): 64 concurrent clients, thousands of
// requests.
const (
	loadWorkers  = 64
	loadRequests = 2000 // metered; as many again go direct
	heavy        = true // the load run: every variant of every test
	loadSlots    = 64   // concurrency slots per user
)
