//go:build !load

package e2e

// The default run: small enough for `go test -race ./...`, still concurrent.
const (
	loadWorkers  = 8
	loadRequests = 120   // metered; as many again go direct
	heavy        = false // the load run: every variant of every test
	loadSlots    = 8     // concurrency slots per user
)
