package metrics

import (
	"context"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/tokengate/tokengate/rls"
)

// MaxRatelimitKeys bounds the stats keys Ratelimit labels: with
// detailed_metric or value_to_metric a key holds a request's values, and a
// series is kept for each. Hits of keys past the bound are counted in
// tokengate_rls_ratelimit_keys_dropped_total instead.
const MaxRatelimitKeys = 10000

// Ratelimit are the rate-limit service's metrics under the names
// envoyproxy/ratelimit's Prometheus output gives them with its default
// mapping (docs/envoy-ratelimit.md §3.6), which Envoy Gateway's dashboards
// and its statsd-exporter mapping use, on a registry of their own
// (listeners.ratelimit_metrics):
//
//   - ratelimit_service_rate_limit_{total_hits,over_limit,near_limit,
//     within_limit,shadow_mode}{domain,key1,key2}: the hits of each limit
//     (rls.RatelimitStats), labelled by its stats key split at its dots
//     after ratelimit's sanitizing (':', '|' and the dots of IPv4
//     addresses become '_'): the domain, the first level and the second,
//     whatever is deeper dropped. ratelimit's exporter gives a key of one
//     level no key2 and keeps the first label set a name is seen with;
//     here every series has the three, key2 "" for a key of one level,
//     which PromQL reads as no key2.
//   - ratelimit_service_should_rate_limit_error{err_type}: calls answered
//     with an error, redis_error (the store, a deferred charge's too) or
//     service_error (the rest).
//   - ratelimit_service_total_requests{grpc_method} and
//     ratelimit_service_response_time_seconds{grpc_method}: the gRPC
//     server's unary calls (ShouldRateLimit, health's Check), their time
//     in whole milliseconds as ratelimit's timer records it, in seconds.
//   - ratelimit_service_config_load_success and _error: configurations
//     loaded and refused (at start, on reload, by xDS).
//   - go_* and process_*, as on ratelimit's registry.
//
// ratelimit flushes its counters every STATS_FLUSH_INTERVAL (10s); these
// count as they happen. Safe for concurrent use.
type Ratelimit struct {
	reg                              *prometheus.Registry
	total, over, near, within, shade *prometheus.CounterVec
	errors                           *prometheus.CounterVec
	requests                         *prometheus.CounterVec
	responseTime                     *prometheus.HistogramVec
	loadOK, loadError                prometheus.Counter
	dropped                          prometheus.Counter

	mu   sync.RWMutex
	keys map[string]prometheus.Labels
}

// NewRatelimit makes the ratelimit-named metrics, their registry their
// own.
func NewRatelimit() *Ratelimit {
	vec := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ratelimit_service_rate_limit_" + name, Help: help}, []string{"domain", "key1", "key2"})
	}
	r := &Ratelimit{
		reg:    prometheus.NewRegistry(),
		total:  vec("total_hits", "Hits of the limit: every descriptor that met it, with its hits_addend (ratelimit's total_hits)."),
		over:   vec("over_limit", "Hits of the limit past it (ratelimit's over_limit)."),
		near:   vec("near_limit", "Hits of the limit past rls.near_limit_ratio of it and not past it (ratelimit's near_limit)."),
		within: vec("within_limit", "Hits of calls the limit let through (ratelimit's within_limit)."),
		shade:  vec("shadow_mode", "Hits past the limit that its shadow_mode answered OK (ratelimit's shadow_mode)."),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ratelimit_service_should_rate_limit_error",
			Help: "ShouldRateLimit calls answered with an error: redis_error (the bucket store failed), service_error (anything else).",
		}, []string{"err_type"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ratelimit_service_total_requests",
			Help: "Unary gRPC calls of the listener, by method.",
		}, []string{"grpc_method"}),
		responseTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ratelimit_service_response_time_seconds",
			Help:    "Time of unary gRPC calls, in whole milliseconds as seconds, by method.",
			Buckets: prometheus.DefBuckets,
		}, []string{"grpc_method"}),
		loadOK: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ratelimit_service_config_load_success",
			Help: "Configurations loaded: at start, on reload, and from xDS.",
		}),
		loadError: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ratelimit_service_config_load_error",
			Help: "Configurations refused: on reload and from xDS.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tokengate_rls_ratelimit_keys_dropped_total",
			Help: "Descriptors whose stats key was not labelled: more than 10000 keys were (detailed_metric and value_to_metric make a key per request value).",
		}),
		keys: map[string]prometheus.Labels{},
	}
	r.reg.MustRegister(r.total, r.over, r.near, r.within, r.shade, r.errors, r.requests, r.responseTime, r.loadOK, r.loadError, r.dropped,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

// Handler serves the metrics in Prometheus's text format.
func (r *Ratelimit) Handler() http.Handler {
	return promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{})
}

// Stats adds what one descriptor added to its limit's stats. A series
// appears with its first hit, as ratelimit's do (its stats library flushes
// no counter that is still 0): a query for over_limit finds nothing until
// a hit was over.
func (r *Ratelimit) Stats(s rls.RatelimitStats) {
	l := r.key(s.Key)
	if l == nil {
		return
	}
	for _, c := range []struct {
		vec *prometheus.CounterVec
		n   uint64
	}{{r.total, s.TotalHits}, {r.over, s.OverLimit}, {r.near, s.NearLimit}, {r.within, s.WithinLimit}, {r.shade, s.ShadowMode}} {
		if c.n > 0 {
			c.vec.With(l).Add(float64(c.n))
		}
	}
}

// key is the labels of a stats key; nil past MaxRatelimitKeys.
func (r *Ratelimit) key(raw string) prometheus.Labels {
	r.mu.RLock()
	k := r.keys[raw]
	r.mu.RUnlock()
	if k != nil {
		return k
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if k = r.keys[raw]; k != nil {
		return k
	}
	if len(r.keys) >= MaxRatelimitKeys {
		r.dropped.Inc()
		return nil
	}
	k = RatelimitLabels(raw)
	r.keys[raw] = k
	return k
}

// ipv4 is ratelimit's pattern of an IPv4 address in a stats name.
var ipv4 = regexp.MustCompile(`\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}`)

// RatelimitLabels are the labels ratelimit's default mapping gives the
// stats of key: sanitized as ratelimit's SanitizeStatName does, split at
// its dots into the domain, key1 and key2.
func RatelimitLabels(key string) prometheus.Labels {
	key = strings.NewReplacer(":", "_", "|", "_").Replace(key)
	key = ipv4.ReplaceAllStringFunc(key, func(ip string) string { return strings.ReplaceAll(ip, ".", "_") })
	parts := strings.SplitN(key, ".", 4)
	l := prometheus.Labels{"domain": parts[0], "key1": "", "key2": ""}
	if len(parts) > 1 {
		l["key1"] = parts[1]
	}
	if len(parts) > 2 {
		l["key2"] = parts[2]
	}
	return l
}

// Error counts a call answered with an error, by its rls reason.
func (r *Ratelimit) Error(reason string) {
	t := "service_error"
	if reason == rls.ErrorStore || reason == rls.ErrorDeferred {
		t = "redis_error"
	}
	r.errors.WithLabelValues(t).Inc()
}

// ConfigLoad counts a configuration loaded (ok) or refused.
func (r *Ratelimit) ConfigLoad(ok bool) {
	if ok {
		r.loadOK.Inc()
	} else {
		r.loadError.Inc()
	}
}

// UnaryInterceptor counts the gRPC server's unary calls and their time,
// by method, as ratelimit's server reporter does.
func (r *Ratelimit) UnaryInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		method := info.FullMethod[strings.LastIndexByte(info.FullMethod, '/')+1:]
		r.requests.WithLabelValues(method).Inc()
		resp, err := handler(ctx, req)
		r.responseTime.WithLabelValues(method).Observe(float64(time.Since(start).Milliseconds()) / 1000)
		return resp, err
	}
}
