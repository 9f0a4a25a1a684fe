package standin

import (
	"strconv"
	"strings"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
)

// Header names of draft-03 rate-limit headers, as Envoy writes them.
const (
	headerXRateLimitLimit     = "x-ratelimit-limit"
	headerXRateLimitRemaining = "x-ratelimit-remaining"
	headerXRateLimitReset     = "x-ratelimit-reset"
)

// windowSeconds is a unit's window in the quota policy of x-ratelimit-limit;
// UNKNOWN is 0, which leaves a status out of the policy list (§2.9).
func windowSeconds(u rlsv3.RateLimitResponse_RateLimit_Unit) int64 {
	switch u {
	case rlsv3.RateLimitResponse_RateLimit_SECOND:
		return 1
	case rlsv3.RateLimitResponse_RateLimit_MINUTE:
		return 60
	case rlsv3.RateLimitResponse_RateLimit_HOUR:
		return 3600
	case rlsv3.RateLimitResponse_RateLimit_DAY:
		return 86400
	case rlsv3.RateLimitResponse_RateLimit_WEEK:
		return 604800
	case rlsv3.RateLimitResponse_RateLimit_MONTH:
		return 2592000
	case rlsv3.RateLimitResponse_RateLimit_YEAR:
		return 31536000
	}
	return 0
}

// xRateLimitHeaders composes the DRAFT_VERSION_03 headers from an answer's
// statuses as Envoy does (§2.9): the status with the smallest
// limit_remaining among those with a current_limit is chosen (the first on
// a tie); none, or one whose descriptor has the headers off, gives no
// headers; x-ratelimit-limit is the chosen requests_per_unit followed by
// the quota policy of every status with a current_limit, headers on and a
// known window. on(i) says whether descriptor i has the headers on.
func xRateLimitHeaders(statuses []*rlsv3.RateLimitResponse_DescriptorStatus, on func(i int) bool) []header {
	chosen := -1
	for i, s := range statuses {
		if s.GetCurrentLimit() == nil {
			continue
		}
		if chosen < 0 || s.GetLimitRemaining() < statuses[chosen].GetLimitRemaining() {
			chosen = i
		}
	}
	if chosen < 0 || !on(chosen) {
		return nil
	}
	c := statuses[chosen]
	var limit strings.Builder
	limit.WriteString(strconv.FormatUint(uint64(c.GetCurrentLimit().GetRequestsPerUnit()), 10))
	for i, s := range statuses {
		cl := s.GetCurrentLimit()
		w := windowSeconds(cl.GetUnit())
		if cl == nil || !on(i) || w == 0 {
			continue
		}
		limit.WriteString(", ")
		limit.WriteString(strconv.FormatUint(uint64(cl.GetRequestsPerUnit()), 10))
		limit.WriteString(";w=")
		limit.WriteString(strconv.FormatInt(w, 10))
		if n := cl.GetName(); n != "" {
			limit.WriteString(`;name="` + n + `"`)
		}
	}
	return []header{
		{headerXRateLimitLimit, limit.String()},
		{headerXRateLimitRemaining, strconv.FormatUint(uint64(c.GetLimitRemaining()), 10)},
		{headerXRateLimitReset, strconv.FormatInt(c.GetDurationUntilReset().GetSeconds(), 10)},
	}
}

// retryAfter is the Retry-After of enable_retry_after_header, from the API
// text only (§2.1 #19, not in the Envoy source the document read): the
// largest duration_until_reset among over-limit statuses, in whole seconds,
// at least 1; "" when no status is over the limit.
func retryAfter(statuses []*rlsv3.RateLimitResponse_DescriptorStatus) string {
	best := int64(-1)
	for _, s := range statuses {
		if s.GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
			continue
		}
		if d := s.GetDurationUntilReset().GetSeconds(); d > best {
			best = d
		}
	}
	if best < 0 {
		return ""
	}
	return strconv.FormatInt(max(best, 1), 10)
}

// grpcStatusOf maps a local reply's HTTP status to the grpc-status Envoy
// sends a gRPC client (envoy:source/common/grpc/status.cc, §2.1 #6).
func grpcStatusOf(code int) int {
	switch code {
	case 400:
		return 13 // INTERNAL
	case 401:
		return 16 // UNAUTHENTICATED
	case 403:
		return 7 // PERMISSION_DENIED
	case 404:
		return 12 // UNIMPLEMENTED
	case 429, 502, 503, 504:
		return 14 // UNAVAILABLE
	}
	return 2 // UNKNOWN
}
