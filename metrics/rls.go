package metrics

import "github.com/prometheus/client_golang/prometheus"

// rlsMetrics are the rate-limit service's (package rls): descriptors
// answered and calls refused with an error.
type rlsMetrics struct {
	descriptors *prometheus.CounterVec
	hits        *prometheus.CounterVec
	errors      *prometheus.CounterVec
}

// unmappedDomain labels a domain no mapping names: request values never
// become labels.
const unmappedDomain = "!unmapped"

func newRLSMetrics() rlsMetrics {
	return rlsMetrics{
		descriptors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_rls_descriptors_total",
			Help: "Descriptors the rate-limit service answered, by domain (a mapped one, or !unmapped), policy, kind (limit, deny, unlimited, no_limit, unknown_domain, replaced, unpriced, override) and code (ok, over_limit; over_limit_shadow when shadow mode answered OK; deferred for a charge of a domain in rls.deferred_charges, answered before it is written).",
		}, []string{"domain", "policy", "kind", "code"}),
		hits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_rls_hits_total",
			Help: "Hits the rate-limit service charged (direction charge) or refunded (refund), by domain and policy.",
		}, []string{"domain", "policy", "direction"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_rls_errors_total",
			Help: "Rate-limit calls answered with a gRPC error, by reason: invalid_request (empty domain or descriptors, a limit without unit), no_config (no rls mapping loaded), store_error, caller_gone; deferred_store_error counts a deferred charge the store failed after its call was answered.",
		}, []string{"reason"}),
	}
}

func (r rlsMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{r.descriptors, r.hits, r.errors}
}

// RLSDescriptor counts one descriptor the rate-limit service answered:
// domain is "" for a domain no mapping names; shadow tells that shadow
// mode turned an over-limit answer into OK; hits are charged, or refunded
// when negative, for a limit or an override.
func (m *Metrics) RLSDescriptor(domain, policy, kind, code string, shadow bool, hits uint64, negative bool) {
	if domain == "" {
		domain = unmappedDomain
	}
	if shadow {
		code += "_shadow"
	}
	m.rls.descriptors.WithLabelValues(domain, policy, kind, code).Inc()
	if hits > 0 && (kind == "limit" || kind == "override") {
		dir := "charge"
		if negative {
			dir = "refund"
		}
		m.rls.hits.WithLabelValues(domain, policy, dir).Add(float64(hits))
	}
}

// RLSError counts one rate-limit call answered with an error.
func (m *Metrics) RLSError(reason string) { m.rls.errors.WithLabelValues(reason).Inc() }
