package envoy

import (
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
)

// BodyMode is how Envoy sends one direction's body to tokengate.
type BodyMode = extprocv3.ProcessingMode_BodySendMode

// Body modes tokengate supports (see Modes).
const (
	Buffered   = extprocv3.ProcessingMode_BUFFERED
	Streamed   = extprocv3.ProcessingMode_STREAMED
	FullDuplex = extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
)

// Mode is one combination of body modes tokengate supports, with the Envoy
// versions it fits. In every combination both header modes are SEND (or
// DEFAULT), and a FULL_DUPLEX_STREAMED direction has its trailer mode SEND
// (Envoy rejects the filter otherwise); other trailer modes may be SKIP or
// SEND.
type Mode struct {
	Request, Response BodyMode
	// MinEnvoy is the oldest Envoy that has the modes ("" for any Envoy
	// with ext_proc metadata options, 1.30).
	MinEnvoy string
	// Recommended says for which Envoy and which traffic tokengate
	// recommends the combination, or what it gives up.
	Recommended string
}

// Modes lists the six body-mode combinations tokengate supports: request
// BUFFERED, STREAMED or FULL_DUPLEX_STREAMED × response STREAMED or
// FULL_DUPLEX_STREAMED. Validate refuses every other combination. The
// slice is shared; do not modify it.
var Modes = []Mode{
	{Buffered, FullDuplex, "1.34", "recommended on Envoy ≥ 1.36 (1.37 preferred) for prompts up to a few MiB " +
		"(raise per_connection_buffer_limit_bytes): the prompt is counted before the upstream is contacted, " +
		"and a cut-off ends the response and cancels the upstream"},
	{FullDuplex, FullDuplex, "1.34", "recommended on Envoy ≥ 1.36 (1.37 preferred) for prompts of any size: " +
		"no Envoy buffer limit, the upstream is contacted only after the decision; bound it with " +
		"stream_idle_timeout"},
	{Streamed, FullDuplex, "1.34", "works, but on Envoy ≥ 1.34 FULL_DUPLEX_STREAMED requests count prompts of " +
		"any size without contacting the upstream before the decision"},
	{Buffered, Streamed, "", "the fallback for Envoy ≤ 1.33: a cut-off cannot end the response or cancel " +
		"the upstream"},
	{Streamed, Streamed, "", "the fallback for Envoy ≤ 1.33 when prompts exceed the buffer limit: a refusal " +
		"resets a half-sent upstream request, and a cut-off cannot end the response"},
	{FullDuplex, Streamed, "1.34", "works, but an Envoy with FULL_DUPLEX_STREAMED should use it for responses " +
		"too, so that a cut-off ends the response"},
}

const (
	supportedRequestModes = "tokengate supports request_body_mode BUFFERED (recommended for prompts up to " +
		"the buffer limit), FULL_DUPLEX_STREAMED with request_trailer_mode SEND (Envoy ≥ 1.34, for prompts " +
		"of any size) or STREAMED"
	supportedResponseModes = "tokengate supports response_body_mode FULL_DUPLEX_STREAMED with " +
		"response_trailer_mode SEND (Envoy ≥ 1.34, recommended on ≥ 1.36) or STREAMED (the fallback for " +
		"Envoy ≤ 1.33)"
)

// ModeUse is one ext_proc processing mode found in a file: a filter's, or a
// per-route override's.
type ModeUse struct {
	File         string
	Line, Column int
	Path         string // of the processing_mode field
	Request      BodyMode
	Response     BodyMode
	// Supported is false for a combination Validate reports as an error;
	// then Mode is the zero value.
	Supported bool
	Mode      Mode
}

func modeUse(file, path string, at position, pm *extprocv3.ProcessingMode) ModeUse {
	u := ModeUse{
		File: file, Line: at.line, Column: at.col, Path: path,
		Request: pm.GetRequestBodyMode(), Response: pm.GetResponseBodyMode(),
	}
	skip, send := extprocv3.ProcessingMode_SKIP, extprocv3.ProcessingMode_SEND
	if pm.GetRequestHeaderMode() == skip || pm.GetResponseHeaderMode() == skip ||
		u.Request == FullDuplex && pm.GetRequestTrailerMode() != send ||
		u.Response == FullDuplex && pm.GetResponseTrailerMode() != send {
		return u
	}
	for _, m := range Modes {
		if m.Request == u.Request && m.Response == u.Response {
			u.Supported, u.Mode = true, m
		}
	}
	return u
}
