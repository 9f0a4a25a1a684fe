// Package provider knows the wire formats of the LLM providers tokengate
// fronts: where each reports usage (S22); how a streamed response is framed
// (S13), as server-sent events or, for Gemini without alt=sse, as a JSON
// array; which bytes of an event are model output to count live; how to hide
// usage that tokengate asked for on the client's behalf (S15); and which
// events end a stream cleanly at a length cut-off (S14).
//
// It does no I/O and knows nothing of gRPC or buckets: the ext_proc server
// feeds it response bytes and acts on what it returns.
package provider
