package rls

import (
	"math"
	"strings"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
)

// RatelimitStats are what envoyproxy/ratelimit adds to the stats of the
// limit one descriptor met (docs/envoy-ratelimit.md §3.6), worked out as
// its base limiter does from the hits and the count before and after
// them; package metrics serves them under ratelimit's names
// (listeners.ratelimit_metrics).
//
// A bucket's count is what it has given out of its capacity: its
// capacity less its level, so that a refilled bucket counts less where
// ratelimit's window counter would count on until the window ends.
type RatelimitStats struct {
	// Key is ratelimit's stats key for the limit, not yet sanitized
	// ("domain.key_value.key"): the configured path, the request's values
	// where detailed_metric or value_to_metric say so, the entries' own
	// for a descriptor's own limit. For DomainNotFound it is the
	// request's domain, ratelimit's key of that stat.
	Key string
	// The hits added to each stat.
	TotalHits, OverLimit, NearLimit, WithinLimit, ShadowMode uint64
	// DomainNotFound is 1 for a descriptor of a call to a domain no
	// mapping names, hits or not, as ratelimit counts its
	// domain_not_found for every descriptor it looks up there; the rest
	// is zero then.
	DomainNotFound uint64
}

// ratelimitCount is what ratelimit's base limiter adds for hits that took
// a limit's count from after-hits to after: over the limit when after is
// past limit; hits past the near threshold (ratio of the limit, as
// ratelimit rounds it) and not over it are near_limit, and with the rule's
// shadow mode the hits over the limit are shadow_mode too. total_hits is
// the caller's to add: ratelimit adds it for every limit it checks.
func ratelimitCount(st *RatelimitStats, limit, after float64, hits uint64, ratio float32, shadow bool) {
	n := float64(hits)
	before := after - n
	near := math.Floor(float64(float32(limit) * ratio))
	count := func(v float64) uint64 {
		if v <= 0 || math.IsNaN(v) {
			return 0
		}
		return uint64(math.Round(v))
	}
	if after > limit {
		over := n
		if before < limit {
			over = after - limit
			st.NearLimit += count(limit - max(near, before))
		}
		st.OverLimit += count(over)
		if shadow {
			st.ShadowMode += count(over)
		}
		return
	}
	st.WithinLimit += hits
	if after > near {
		if before >= near {
			st.NearLimit += hits
		} else {
			st.NearLimit += count(after - near)
		}
	}
}

// statsKey is ratelimit's stats key for plan p of a descriptor of domain
// with entries, "" when ratelimit keeps no stats for it: a limit of the
// tree, or a descriptor's own limit.
func (m *mapping) statsKey(p *plan, domain string, d *commonv3.RateLimitDescriptor) string {
	switch p.kind {
	case KindLimit, KindDeny:
	case KindOverride:
		return ownLimitKey(domain, d.GetEntries())
	default:
		return ""
	}
	t := m.cfg.RLSTree(domain)
	if t == nil {
		return ""
	}
	return t.StatsKey(d.GetEntries())
}

// ownLimitKey is the stats key ratelimit gives a descriptor's own limit:
// the domain and the entries' key_value ("domain.k1_v1.k2").
func ownLimitKey(domain string, entries []*commonv3.RateLimitDescriptor_Entry) string {
	var b strings.Builder
	b.WriteString(domain)
	b.WriteByte('.')
	for i, e := range entries {
		if i > 0 {
			b.WriteByte('.')
		}
		b.WriteString(e.GetKey())
		if v := e.GetValue(); v != "" {
			b.WriteByte('_')
			b.WriteString(v)
		}
	}
	return b.String()
}
