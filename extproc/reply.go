package extproc

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/buckets"
)

// Response header names (S16, S17).
const (
	headerRetryAfter = "retry-after"
	headerLimit      = "x-ratelimit-limit-tokens"
	headerRemaining  = "x-ratelimit-remaining-tokens"
	headerReset      = "x-ratelimit-reset-tokens"
)

// errorBody is the OpenAI-style error body every local reply carries, so
// OpenAI and Anthropic SDKs surface code, type and message.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code     string `json:"code"`
	Message  string `json:"message"`
	Type     string `json:"type"`
	Bucket   string `json:"bucket,omitempty"`
	Quota    string `json:"quota,omitempty"`
	Capacity int64  `json:"capacity,omitempty"`
	Cost     int64  `json:"cost,omitempty"`
}

// reply is one local reply (an Envoy ImmediateResponse).
type reply struct {
	status  int
	detail  errorDetail
	headers [][2]string
	details string // %RESPONSE_CODE_DETAILS%
}

func (r reply) proto(md *structpb.Struct) *extprocv3.ProcessingResponse {
	body, err := json.Marshal(errorBody{Error: r.detail})
	if err != nil { // cannot happen: the body is plain strings and numbers
		body = []byte(`{"error":{"code":"internal_error","type":"server_error"}}`)
	}
	set := make([]*corev3.HeaderValueOption, 0, len(r.headers)+1)
	set = append(set, headerOption("content-type", "application/json"))
	for _, h := range r.headers {
		set = append(set, headerOption(h[0], h[1]))
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status:  &typev3.HttpStatus{Code: typev3.StatusCode(r.status)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: set},
				Body:    body,
				Details: r.details,
			},
		},
		DynamicMetadata: md,
	}
}

func headerOption(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}
}

// refusal builds the 429 or 413 for a refused decision (S4, S16). lease is
// the lease of the bucket that refused, if it is leased (S20).
func refusal(d buckets.Decision, cost int, lease func(bucket string) *buckets.Lease) reply {
	limiting := limitingState(d)
	switch d.Reason {
	case buckets.NeverAdmissible:
		capacity := int64(limiting.Limit.Capacity)
		return reply{
			status: 413,
			detail: errorDetail{
				Code: "request_too_large",
				Message: fmt.Sprintf("request needs %d tokens but bucket %q holds at most %d: it can never be admitted",
					cost, limiting.Name, capacity),
				Type: "tokens", Bucket: limiting.Name, Capacity: capacity, Cost: int64(cost),
			},
			details: "tokengate_never_admissible",
		}
	case buckets.ConcurrencyFull:
		wait := d.Wait
		if wait <= 0 {
			wait = time.Second
		}
		return reply{
			status: 429,
			detail: errorDetail{
				Code:    "rate_limit_exceeded",
				Message: fmt.Sprintf("too many requests in flight for %q; retry after %s", d.Limiting, formatReset(wait)),
				Type:    "requests", Bucket: d.Limiting,
			},
			headers: append([][2]string{{headerRetryAfter, retryAfter(wait)}}, limitHeaders(limiting)...),
			details: "tokengate_concurrency_full",
		}
	default:
		msg := fmt.Sprintf("rate limit reached for %q: request needs %d tokens; retry after %s",
			limiting.Name, cost, formatReset(d.Wait))
		if l := lease(limiting.Name); l != nil {
			// Retry-After counts what the shared bucket holds, not what
			// other gateways hold of it in their leases (S16, S20).
			msg += fmt.Sprintf(" (the bucket is shared through leases: tokens other gateways hold come back "+
				"within %s, so a retry then may be refused once more)", formatReset(l.TTLOrDefault()))
		}
		return reply{
			status: 429,
			detail: errorDetail{
				Code:    "rate_limit_exceeded",
				Message: msg,
				Type:    "tokens", Bucket: limiting.Name,
			},
			headers: append([][2]string{{headerRetryAfter, retryAfter(d.Wait)}}, limitHeaders(limiting)...),
			details: "tokengate_rate_limited",
		}
	}
}

// limitingState returns the state of the decision's most limiting bucket
// (S10), or the first one.
func limitingState(d buckets.Decision) buckets.BucketState {
	for _, b := range d.Buckets {
		if b.Name == d.Limiting {
			return b
		}
	}
	if len(d.Buckets) > 0 {
		return d.Buckets[0]
	}
	return buckets.BucketState{Name: d.Limiting}
}

// mostLimiting picks the bucket with the least remaining tokens.
func mostLimiting(states []buckets.BucketState) (buckets.BucketState, bool) {
	if len(states) == 0 {
		return buckets.BucketState{}, false
	}
	m := states[0]
	for _, s := range states[1:] {
		if s.Remaining < m.Remaining {
			m = s
		}
	}
	return m, true
}

func limitHeaders(s buckets.BucketState) [][2]string {
	if s.Limit.Capacity == 0 {
		return nil
	}
	remaining := math.Floor(s.Remaining)
	if remaining < 0 {
		remaining = 0
	}
	return [][2]string{
		{headerLimit, strconv.FormatInt(int64(s.Limit.Capacity), 10)},
		{headerRemaining, strconv.FormatInt(int64(remaining), 10)},
		{headerReset, formatReset(s.Reset)},
	}
}

// retryAfter renders a wait as whole seconds, rounded up, at least 1 (S16).
func retryAfter(d time.Duration) string {
	s := int64(math.Ceil(d.Seconds()))
	if s < 1 {
		s = 1
	}
	return strconv.FormatInt(s, 10)
}

// formatReset renders a duration in OpenAI's style: "250ms", "12s",
// "1m30s", "2h0m5s" (S16). Sub-second values are rounded up to the
// millisecond, longer ones to the second.
func formatReset(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	if d < time.Second {
		return strconv.FormatInt(int64(math.Ceil(float64(d)/float64(time.Millisecond))), 10) + "ms"
	}
	s := int64(math.Ceil(d.Seconds()))
	h, m := s/3600, (s%3600)/60
	s %= 60
	switch {
	case h > 0:
		return fmt.Sprintf("%dh%dm%ds", h, m, s)
	case m > 0:
		return fmt.Sprintf("%dm%ds", m, s)
	}
	return fmt.Sprintf("%ds", s)
}

// clientDetail is detail, an error message that may quote the request, if
// it quotes nothing: short, printable ASCII, without quotes, brackets or
// braces (the tokenizer names positions and faults, and quotes any part of
// the body it cites). Otherwise it is fallback. Prompt text never reaches a
// client error (S23).
func clientDetail(detail, fallback string) string {
	if len(detail) > 200 {
		return fallback
	}
	for i := 0; i < len(detail); i++ {
		c := detail[i]
		if c < ' ' || c > '~' || strings.IndexByte("\"'`\\{}[]<>", c) >= 0 {
			return fallback
		}
	}
	return detail
}

func badRequest(code, msg string) reply {
	return reply{status: 400, detail: errorDetail{Code: code, Message: msg, Type: "invalid_request_error"}, details: "tokengate_bad_request"}
}

func unauthorized(identity string) reply {
	return reply{status: 401, detail: errorDetail{
		Code:    "missing_identity",
		Message: fmt.Sprintf("request carries no %s identity and this route does not admit anonymous requests", identity),
		Type:    "invalid_request_error",
	}, details: "tokengate_missing_identity"}
}

func duplicateIdentity(identity string) reply {
	return reply{status: 400, detail: errorDetail{
		Code:    "duplicate_identity",
		Message: fmt.Sprintf("request carries its %s identity more than once; send it once", identity),
		Type:    "invalid_request_error",
	}, details: "tokengate_duplicate_identity"}
}

func unavailable() reply {
	return reply{status: 503, detail: errorDetail{
		Code:    "rate_limiter_unavailable",
		Message: "the rate limiter cannot reach its bucket store; retry shortly",
		Type:    "server_error",
	}, headers: [][2]string{{headerRetryAfter, "1"}}, details: "tokengate_store_unavailable"}
}

func tooLarge(limit int) reply {
	return reply{status: 413, detail: errorDetail{
		Code:    "request_too_large",
		Message: fmt.Sprintf("request body exceeds %d bytes", limit),
		Type:    "invalid_request_error",
	}, details: "tokengate_body_too_large"}
}
