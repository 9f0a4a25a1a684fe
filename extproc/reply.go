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
	"github.com/tokengate/tokengate/tokenizer"
)

// Response header names (S16, S17).
const (
	headerRetryAfter   = "retry-after"
	headerRetryAfterMs = "retry-after-ms"
	headerShouldRetry  = "x-should-retry"
	headerLimit        = "x-ratelimit-limit-tokens"
	headerRemaining    = "x-ratelimit-remaining-tokens"
	headerReset        = "x-ratelimit-reset-tokens"
)

// anthropicLimitHeaders are the limit, remaining and reset headers of
// Anthropic's own three token families, sent on Anthropic routes.
var anthropicLimitHeaders = [3][3]string{
	{"anthropic-ratelimit-tokens-limit", "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"},
	{"anthropic-ratelimit-input-tokens-limit", "anthropic-ratelimit-input-tokens-remaining", "anthropic-ratelimit-input-tokens-reset"},
	{"anthropic-ratelimit-output-tokens-limit", "anthropic-ratelimit-output-tokens-remaining", "anthropic-ratelimit-output-tokens-reset"},
}

// sdkRetryCeiling bounds the waits the official OpenAI and Anthropic SDKs
// take from retry-after-ms or Retry-After: one of a minute or more they
// ignore, and retry on their own backoff within seconds, attempts that
// can only be refused again (see sdkWaits).
const sdkRetryCeiling = time.Minute

// errorDetail is tokengate's account of an answer it gives itself: its
// code, its type (tokens, requests or budget for a limit that refused,
// else invalid_request_error or server_error), a message, and the bucket
// or quota that refused. In OpenAI's shape it is the error object itself
// (S16); the other shapes carry it beside the provider's own fields.
type errorDetail struct {
	Code     string `json:"code"`
	Message  string `json:"message,omitempty"`
	Type     string `json:"type"`
	Bucket   string `json:"bucket,omitempty"`
	Quota    string `json:"quota,omitempty"`
	Capacity int64  `json:"capacity,omitempty"`
	Cost     int64  `json:"cost,omitempty"`
}

// errorBody is OpenAI's error shape: {"error":{"code","message","type"}}.
type errorBody struct {
	Error errorDetail `json:"error"`
}

// anthropicBody is Anthropic's error shape,
// {"type":"error","error":{"type","message"}}, with tokengate's account
// beside it at the top, where the Anthropic SDKs keep unknown fields.
type anthropicBody struct {
	Type      string          `json:"type"`
	Error     anthropicDetail `json:"error"`
	Tokengate errorDetail     `json:"tokengate"`
}

type anthropicDetail struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

// googleBody is Google's error shape,
// {"error":{"code","message","status","details"}}. tokengate's account is
// a google.rpc.ErrorInfo of domain "tokengate" in details, which Google's
// SDKs hand over; a wait is a google.rpc.RetryInfo there too.
type googleBody struct {
	Error googleDetail `json:"error"`
}

type googleDetail struct {
	Code    int           `json:"code"`
	Message string        `json:"message"`
	Status  string        `json:"status"`
	Details []googleEntry `json:"details"`
}

// googleEntry is one entry of details: an ErrorInfo or a RetryInfo.
type googleEntry struct {
	Type       string            `json:"@type"`
	Reason     string            `json:"reason,omitempty"`
	Domain     string            `json:"domain,omitempty"`
	Metadata   map[string]string `json:"metadata,omitempty"`
	RetryDelay string            `json:"retryDelay,omitempty"`
}

// reply is one local reply (an Envoy ImmediateResponse), rendered in the
// error shape of the request's API (see proto).
type reply struct {
	status int
	detail errorDetail
	// wait is how long until a retry may be admitted, sent as
	// Retry-After and retry-after-ms; 0 sends neither.
	wait time.Duration
	// limit is the bucket whose limit headers go with the reply (S16).
	limit   *buckets.BucketState
	headers [][2]string // further headers: the refusing quota's
	details string      // %RESPONSE_CODE_DETAILS%
}

// proto renders r for a request of api at now.
func (r reply) proto(api tokenizer.API, now time.Time, md *structpb.Struct) *extprocv3.ProcessingResponse {
	hs := r.headerList(api, now)
	set := make([]*corev3.HeaderValueOption, 0, len(hs)+1)
	set = append(set, headerOption("content-type", "application/json"))
	for _, h := range hs {
		set = append(set, headerOption(h[0], h[1]))
	}
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_ImmediateResponse{
			ImmediateResponse: &extprocv3.ImmediateResponse{
				Status:  &typev3.HttpStatus{Code: typev3.StatusCode(r.status)},
				Headers: &extprocv3.HeaderMutation{SetHeaders: set},
				Body:    r.body(api),
				Details: r.details,
			},
		},
		DynamicMetadata: md,
	}
}

// headerList is the reply's headers but its content type: the retry
// hints, the limit headers of the bucket that refused (in the route's
// API's own names too), and the quota's.
func (r reply) headerList(api tokenizer.API, now time.Time) [][2]string {
	hs := make([][2]string, 0, 16)
	if r.wait > 0 {
		hs = append(hs, retryHints(r.wait, r.retryable())...)
	} else {
		hs = append(hs, [2]string{headerShouldRetry, strconv.FormatBool(r.retryable())})
	}
	if r.limit != nil {
		hs = append(hs, limitHeaders(*r.limit, api, now)...)
	}
	return append(hs, r.headers...)
}

// retryHints are the headers of a wait before a retry (S16, S18):
// Retry-After, retry-after-ms, and x-should-retry saying retry.
func retryHints(wait time.Duration, retry bool) [][2]string {
	return [][2]string{
		{headerRetryAfter, retryAfter(wait)},
		{headerRetryAfterMs, strconv.FormatInt(waitMs(wait), 10)},
		{headerShouldRetry, strconv.FormatBool(retry)},
	}
}

// sdkWaits reports whether the OpenAI and Anthropic SDKs take a wait this
// long from the retry headers; a longer one they ignore, and retry on
// their own backoff.
func sdkWaits(wait time.Duration) bool { return wait < sdkRetryCeiling }

// retryable is what x-should-retry tells the OpenAI and Anthropic SDKs,
// which obey it over their own rules: a retry soon helps after a 503 (the
// store answers again within moments, S21) and after a 429 whose wait the
// SDKs honour. It never helps after a 400, 401 or 413, which the same
// request meets again (S4), nor after a 429 whose wait is longer than the
// SDKs wait: they would retry on their own backoff and be refused again.
func (r reply) retryable() bool {
	switch r.status {
	case 503:
		return true
	case 429:
		return sdkWaits(r.wait)
	}
	return false
}

// body is the reply's JSON in api's error shape; OpenAI's for every API
// that is neither Anthropic's nor Google's, and before the API is known.
func (r reply) body(api tokenizer.API) []byte {
	var v any
	switch api {
	case tokenizer.Messages:
		own := r.detail
		own.Message = ""
		v = anthropicBody{Type: "error", Error: anthropicDetail{Type: anthropicType(r.status), Message: r.detail.Message}, Tokengate: own}
	case tokenizer.Gemini:
		v = googleBody{Error: googleDetail{Code: r.status, Message: r.detail.Message, Status: googleStatus(r.status), Details: r.googleDetails()}}
	default:
		v = errorBody{Error: r.detail}
	}
	body, err := json.Marshal(v)
	if err != nil { // cannot happen: the body is plain strings and numbers
		return []byte(`{"error":{"code":"internal_error","type":"server_error"}}`)
	}
	return body
}

// anthropicType is the error type Anthropic documents for an HTTP status.
func anthropicType(status int) string {
	switch status {
	case 400:
		return "invalid_request_error"
	case 401:
		return "authentication_error"
	case 413:
		return "request_too_large"
	case 429:
		return "rate_limit_error"
	}
	return "api_error" // 500 and 503: a fault of the gateway, not of the request
}

// googleStatus is the canonical status name Google's APIs answer with an
// HTTP status. Gemini answers a request too large for it, in bytes or in
// tokens, with INVALID_ARGUMENT.
func googleStatus(status int) string {
	switch status {
	case 400, 413:
		return "INVALID_ARGUMENT"
	case 401:
		return "UNAUTHENTICATED"
	case 429:
		return "RESOURCE_EXHAUSTED"
	case 503:
		return "UNAVAILABLE"
	}
	return "INTERNAL"
}

// googleDetails are the details of a reply in Google's shape: tokengate's
// account as an ErrorInfo (its code, upper case, as the reason), and the
// wait as a RetryInfo.
func (r reply) googleDetails() []googleEntry {
	d := r.detail
	md := map[string]string{"type": d.Type}
	for k, v := range map[string]string{"bucket": d.Bucket, "quota": d.Quota} {
		if v != "" {
			md[k] = v
		}
	}
	for k, v := range map[string]int64{"capacity": d.Capacity, "cost": d.Cost} {
		if v != 0 {
			md[k] = strconv.FormatInt(v, 10)
		}
	}
	out := []googleEntry{{Type: "type.googleapis.com/google.rpc.ErrorInfo", Reason: strings.ToUpper(d.Code), Domain: "tokengate", Metadata: md}}
	if r.wait > 0 {
		out = append(out, googleEntry{Type: "type.googleapis.com/google.rpc.RetryInfo",
			RetryDelay: strconv.FormatFloat(float64(waitMs(r.wait))/1000, 'f', -1, 64) + "s"})
	}
	return out
}

func headerOption(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}
}

// api is the API whose error shape the request's replies take: the one
// its body was counted as, else the one its path names (before the body
// is read, or when it cannot be counted).
func (p *processor) api() tokenizer.API {
	if a := p.req.count.API; a != "" {
		return a
	}
	return tokenizer.Classify("POST", p.req.path).API
}

// refusal builds the 429 or 413 for a refused decision (S4, S16). lease is
// the lease of the bucket that refused, if it is leased (S20).
func refusal(d buckets.Decision, cost int, lease func(bucket string) *buckets.Lease) reply {
	limiting := limitingState(d)
	wait := waitOf(d)
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
		return reply{
			status: 429,
			detail: errorDetail{
				Code:    "rate_limit_exceeded",
				Message: fmt.Sprintf("too many requests in flight for %q; retry after %s", d.Limiting, formatReset(wait)),
				Type:    "requests", Bucket: d.Limiting,
			},
			wait: wait, limit: &limiting,
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
			wait: wait, limit: &limiting,
			details: "tokengate_rate_limited",
		}
	}
}

// waitOf is how long a refused request waits before a retry may be
// admitted: the decision's wait, or a second when it names none (a slot
// frees when a request ends, which no clock foresees).
func waitOf(d buckets.Decision) time.Duration {
	if d.Wait <= 0 {
		return time.Second
	}
	return d.Wait
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

// limitHeaders are the limit headers of bucket state s (S16, S17): OpenAI's
// names, and on Anthropic routes Anthropic's too, its reset as an RFC 3339
// instant. tokengate's buckets count input and output tokens together, so
// Anthropic's input and output families repeat the one bucket: every token
// of either kind draws from what it has left.
func limitHeaders(s buckets.BucketState, api tokenizer.API, now time.Time) [][2]string {
	if s.Limit.Capacity == 0 {
		return nil
	}
	limit := strconv.FormatInt(int64(s.Limit.Capacity), 10)
	remaining := strconv.FormatInt(int64(max(0, math.Floor(s.Remaining))), 10)
	hs := [][2]string{{headerLimit, limit}, {headerRemaining, remaining}, {headerReset, formatReset(s.Reset)}}
	if api != tokenizer.Messages {
		return hs
	}
	reset := resetAt(now, s.Reset)
	for _, names := range anthropicLimitHeaders {
		hs = append(hs, [2]string{names[0], limit}, [2]string{names[1], remaining}, [2]string{names[2], reset})
	}
	return hs
}

// resetAt renders the instant d after now in RFC 3339, rounded up to the
// second (a client that waits until then finds the bucket full).
func resetAt(now time.Time, d time.Duration) string {
	t := now.Add(max(d, 0))
	if s := t.Truncate(time.Second); s.Before(t) {
		t = s.Add(time.Second)
	}
	return t.UTC().Format(time.RFC3339)
}

// retryAfter renders a wait as whole seconds, rounded up, at least 1 (S16).
func retryAfter(d time.Duration) string {
	s := int64(math.Ceil(d.Seconds()))
	if s < 1 {
		s = 1
	}
	return strconv.FormatInt(s, 10)
}

// waitMs is a wait in milliseconds, rounded up, at least 1: the exact wait
// of retry-after-ms, which the OpenAI and Anthropic SDKs prefer to
// Retry-After, and of Google's RetryInfo.
func waitMs(d time.Duration) int64 {
	return max(1, int64(math.Ceil(float64(d)/float64(time.Millisecond))))
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

func noSuchPolicy() reply {
	return reply{status: 500, detail: errorDetail{
		Code: "unknown_policy", Message: "the gateway route names an unknown rate-limit policy", Type: "server_error",
	}, details: "tokengate_unknown_policy"}
}

func unavailable() reply {
	return reply{status: 503, detail: errorDetail{
		Code:    "rate_limiter_unavailable",
		Message: "the rate limiter cannot reach its bucket store; retry shortly",
		Type:    "server_error",
	}, wait: time.Second, details: "tokengate_store_unavailable"}
}

func tooLarge(limit int) reply {
	return reply{status: 413, detail: errorDetail{
		Code:    "request_too_large",
		Message: fmt.Sprintf("request body exceeds %d bytes", limit),
		Type:    "invalid_request_error",
	}, details: "tokengate_body_too_large"}
}
