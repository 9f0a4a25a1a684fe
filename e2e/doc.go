// Package e2e holds tokengate's whole-system tests: real ext_proc servers
// (package extproc) behind the Envoy stand-in (package envoy/standin), real
// token counting, real Redis and Redis Cluster processes, an upstream that
// replays recorded provider traffic, and the official OpenAI Go SDK as the
// client.
//
// The tests check what no unit test can: that under concurrent load every
// reservation settles exactly once and every concurrency slot comes back
// (S8, S11), that bucket levels end exactly where the recorded usage puts
// them, that a Redis outage is answered as configured and recovered from
// without double charges (S21), that several gateways sharing one Redis
// never admit more than the bucket holds (S20), and that hostile input gets
// a clear answer and leaks nothing (S23).
//
// The package has no API. A small version of every test runs with the
// default `go test`; the heavy load versions are behind the build tag
// "load". docs/testing.md has the commands, docs/performance.md the measured
// figures.
package e2e
