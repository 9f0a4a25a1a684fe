// Package extproc is tokengate's Envoy external-processing (ext_proc) gRPC
// server: for each HTTP request Envoy opens one bidirectional stream, and one
// processor, owned by that stream's goroutine, walks the request through
// reserve → stream → cut → settle.
//
// On the request body it counts the prompt (package tokenizer) and reserves
// input plus output allowance from the policy's chain of token buckets
// (package buckets, S3–S12), answering 413, 429, 401, 400 or 503 as an Envoy
// ImmediateResponse when the request may not pass. On the response it adds
// the rate-limit headers (S17), counts streamed output live (S13), cuts a
// stream off cleanly when a hard budget runs out (S14) and settles the real
// usage exactly once on every exit path (S8). Provider wire formats live in
// the subpackage provider.
//
// The wiring code builds a Server with NewServer and registers it on a
// grpc.Server with Register. docs/design.md describes the request flow, the
// response headers and error bodies; docs/envoy.md what the STREAMED
// response mode cannot do.
package extproc
