package metrics

import "github.com/prometheus/client_golang/prometheus"

// Results of a configuration reload, the values of
// tokengate_config_reload_total's label.
const (
	// ReloadApplied: the new configuration serves new requests.
	ReloadApplied = "applied"
	// ReloadInvalid: refused, the file has problems.
	ReloadInvalid = "invalid"
	// ReloadRestartRequired: refused, it changes what only a restart
	// applies.
	ReloadRestartRequired = "restart_required"
)

// Sources of limit overrides, the values of tokengate_limit_overrides'
// label.
const (
	OverridesFromFile  = "file"
	OverridesFromStore = "store"
)

// limitMetrics are the metrics of limits as data: configuration reloads
// and per-identity overrides.
type limitMetrics struct {
	reloads        *prometheus.CounterVec
	overrides      *prometheus.GaugeVec
	overrideErrors prometheus.Counter
}

func newLimitMetrics() limitMetrics {
	l := limitMetrics{
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_config_reload_total",
			Help: "Configuration reloads (SIGHUP or a changed file) by result: applied, invalid (refused: the file has problems) or restart_required (refused: it changes what only a restart applies).",
		}, []string{"result"}),
		overrides: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "tokengate_limit_overrides",
			Help: "Per-identity limit overrides in force, by where they come from: file (the configuration) or store (the admin API), which replaces the file's override of the same identity and rule.",
		}, []string{"source"}),
		overrideErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tokengate_limit_overrides_read_errors_total",
			Help: "Failed reads of the override store; the overrides last read stay in force.",
		}),
	}
	for _, r := range []string{ReloadApplied, ReloadInvalid, ReloadRestartRequired} {
		l.reloads.WithLabelValues(r)
	}
	return l
}

func (l limitMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{l.reloads, l.overrides, l.overrideErrors}
}

// Reloaded counts one configuration reload with its result (ReloadApplied,
// ReloadInvalid or ReloadRestartRequired).
func (m *Metrics) Reloaded(result string) { m.limits.reloads.WithLabelValues(result).Inc() }

// OverridesInForce records how many per-identity overrides are in force
// from the configuration file and from the override store.
func (m *Metrics) OverridesInForce(file, store int) {
	m.limits.overrides.WithLabelValues(OverridesFromFile).Set(float64(file))
	m.limits.overrides.WithLabelValues(OverridesFromStore).Set(float64(store))
}

// OverrideReadFailed counts a failed read of the override store.
func (m *Metrics) OverrideReadFailed() { m.limits.overrideErrors.Inc() }
