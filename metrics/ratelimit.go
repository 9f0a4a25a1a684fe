package metrics

import (
	"context"
	_ "embed"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/statsd_exporter/pkg/mapper"
	"github.com/prometheus/statsd_exporter/pkg/registry"
	"google.golang.org/grpc"

	"github.com/tokengate/tokengate/internal/statsdmap"
	"github.com/tokengate/tokengate/rls"
)

// MaxRatelimitKeys bounds the stats keys Ratelimit names: with
// detailed_metric or value_to_metric a key holds a request's values, and
// series are kept for each. Hits of keys past the bound are counted in
// tokengate_rls_ratelimit_keys_dropped_total instead.
const MaxRatelimitKeys = 10000

// maxNames bounds the other statsd names (gRPC methods): a handful.
const maxNames = 1000

// defaultMapping names the stats as ratelimit's default mapping does.
//
//go:embed ratelimit_mapping.yaml
var defaultMapping []byte

// DefaultRatelimitMapping is the mapping the stats are named by when no
// other is given (listeners.ratelimit_metrics_mapper).
func DefaultRatelimitMapping() *mapper.MetricMapper {
	m, err := statsdmap.Parse(defaultMapping)
	if err != nil {
		panic("metrics: ratelimit_mapping.yaml: " + err.Error())
	}
	return m
}

// Ratelimit are the rate-limit service's metrics as envoyproxy/ratelimit's
// Prometheus output gives them (docs/envoy-ratelimit.md §3.6), on a
// registry of their own (listeners.ratelimit_metrics): each stat carries
// the statsd name ratelimit gives it and is named by a statsd_exporter
// mapping, with statsd_exporter's mapper and registry as ratelimit's
// output does:
//
//   - ratelimit.service.rate_limit.KEY.{total_hits,over_limit,near_limit,
//     within_limit,shadow_mode}: the hits of each limit
//     (rls.RatelimitStats), KEY its stats key sanitized as ratelimit's
//     SanitizeStatName does (':', '|' and the dots of IPv4 addresses
//     become '_');
//   - ratelimit.service.rate_limit.DOMAIN.domain_not_found: descriptors
//     of calls to a domain no mapping names, sanitized likewise (the
//     domains share the keys' bound);
//   - ratelimit.service.global_shadow_mode: calls over the limit that
//     the service's shadow mode answered OK;
//   - ratelimit.service.call.should_rate_limit.{redis_error,service_error}:
//     calls answered with an error (the store, a deferred charge's too;
//     anything else);
//   - ratelimit_server.METHOD.total_requests and .response_time: the gRPC
//     server's unary calls (ShouldRateLimit, health's Check) and their time
//     in whole milliseconds, as ratelimit's timer takes it;
//   - ratelimit.service.config_load_success and _error: configurations
//     with domains loaded (at start, on reload, by xDS) and refused.
//
// The mapping is ratelimit's default one (ratelimit_mapping.yaml:
// ratelimit_service_rate_limit_total_hits{domain,key1,key2} and so on) or
// PROMETHEUS_MAPPER_YAML's; a stat no line maps keeps its statsd name,
// escaped, and one a line drops is not kept. go_* and process_* are on the
// registry too, as on ratelimit's. ratelimit flushes its stats every
// STATS_FLUSH_INTERVAL (10s) and only those that changed; these count as
// they happen, and a series appears with its first hit: a query for
// over_limit finds nothing until a hit was over. A mapping's ttl is not
// applied: series stay. Safe for concurrent use.
type Ratelimit struct {
	reg     *prometheus.Registry
	mapper  *mapper.MetricMapper
	dropped prometheus.Counter
	count   *prometheus.GaugeVec

	mu sync.RWMutex
	// statsd is statsd_exporter's registry, which is not safe for
	// concurrent use: under mu.
	statsd *registry.Registry
	keys   map[string]*limitStats // by stats key
	names  map[string]series      // other stats, by statsd name
}

// limitStats are where one stats key's stats go, in statNames' order,
// each resolved at its first hit (under mu): statsd_exporter's registry
// makes a series as it resolves it.
type limitStats struct {
	prefix   string // the statsd name up to the stat's
	series   [6]series
	resolved [6]bool
}

// series is where one statsd name's values go: a counter's or an
// observer's, neither for a stat that is dropped.
type series struct {
	counter  prometheus.Counter
	observer prometheus.Observer
	scale    float64
}

// statNames are the per-key stats, in the order of keys' arrays: a
// limit's, and an unknown domain's domain_not_found.
var statNames = [6]string{"total_hits", "over_limit", "near_limit", "within_limit", "shadow_mode", "domain_not_found"}

// NewRatelimit makes the metrics, named by m (nil: the default mapping).
func NewRatelimit(m *mapper.MetricMapper) *Ratelimit {
	if m == nil {
		m = DefaultRatelimitMapping()
	}
	r := &Ratelimit{
		reg:    prometheus.NewRegistry(),
		mapper: m,
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tokengate_rls_ratelimit_keys_dropped_total",
			Help: "Descriptors whose stats key (or unknown domain) was not named: 10000 keys were (detailed_metric and value_to_metric make a key per request value).",
		}),
		count: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "statsd_exporter_metrics_total",
			Help: "The total number of metrics.",
		}, []string{"type"}),
		keys:  map[string]*limitStats{},
		names: map[string]series{},
	}
	r.statsd = registry.NewRegistry(r.reg, m)
	r.reg.MustRegister(r.dropped, r.count, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

// Handler serves the metrics in Prometheus's text format. A series that
// clashes with another (a mapping naming two stats alike with other
// types) is left out of the answer, not the whole answer.
func (r *Ratelimit) Handler() http.Handler {
	return promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// resolve finds where the values of statsd name go, as statsd_exporter
// maps and registers them; under mu.
func (r *Ratelimit) resolve(name string, observer bool) series {
	t := mapper.MetricTypeCounter
	if observer {
		t = mapper.MetricTypeObserver
	}
	m, labels, present := r.mapper.GetMapping(name, t)
	if m == nil {
		m = &mapper.MetricMapping{}
	}
	if m.Action == mapper.ActionTypeDrop || present && m.Name == "" {
		return series{}
	}
	metric := mapper.EscapeMetricName(name)
	if present {
		metric = mapper.EscapeMetricName(m.Name)
	}
	if labels == nil {
		labels = prometheus.Labels{}
	}
	help := m.HelpText
	if help == "" {
		help = "Metric autogenerated by statsd_exporter."
	}
	s := series{scale: 1}
	if m.Scale.Set {
		s.scale = m.Scale.Val
	}
	var err error
	switch {
	case !observer:
		s.counter, err = r.statsd.GetCounter(metric, labels, help, m, r.count)
	case m.ObserverType == mapper.ObserverTypeHistogram,
		m.ObserverType == mapper.ObserverTypeDefault && r.mapper.Defaults.ObserverType == mapper.ObserverTypeHistogram:
		s.observer, err = r.statsd.GetHistogram(metric, labels, help, m, r.count)
	default:
		s.observer, err = r.statsd.GetSummary(metric, labels, help, m, r.count)
	}
	if err != nil { // a name taken by another type or label set: dropped
		return series{}
	}
	return s
}

func (s series) add(n float64) {
	if s.counter != nil && n > 0 {
		s.counter.Add(n * s.scale)
	}
}

func (s series) observe(v float64) {
	if s.observer != nil {
		s.observer.Observe(v * s.scale)
	}
}

// Stats adds what one descriptor added to its limit's stats.
func (r *Ratelimit) Stats(s rls.RatelimitStats) {
	k := r.key(s.Key)
	if k == nil {
		return
	}
	for i, n := range [6]uint64{s.TotalHits, s.OverLimit, s.NearLimit, s.WithinLimit, s.ShadowMode, s.DomainNotFound} {
		if n == 0 {
			continue
		}
		r.mu.RLock()
		st, ok := k.series[i], k.resolved[i]
		r.mu.RUnlock()
		if !ok {
			r.mu.Lock()
			if !k.resolved[i] {
				k.series[i], k.resolved[i] = r.resolve(k.prefix+statNames[i], false), true
			}
			st = k.series[i]
			r.mu.Unlock()
		}
		st.add(float64(n))
	}
}

// key is where a stats key's stats go; nil past MaxRatelimitKeys.
func (r *Ratelimit) key(raw string) *limitStats {
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
	k = &limitStats{prefix: "ratelimit.service.rate_limit." + SanitizeStatName(raw) + "."}
	r.keys[raw] = k
	return k
}

// named is where the values of a statsd name other than a limit's go.
func (r *Ratelimit) named(name string, observer bool) series {
	r.mu.RLock()
	s, ok := r.names[name]
	r.mu.RUnlock()
	if ok {
		return s
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if s, ok = r.names[name]; ok {
		return s
	}
	if len(r.names) >= maxNames {
		return series{}
	}
	s = r.resolve(name, observer)
	r.names[name] = s
	return s
}

// ipv4 is ratelimit's pattern of an IPv4 address in a stats name.
var ipv4 = regexp.MustCompile(`\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}`)

// statNameReplacer is built once: a Replacer builds its tables on first
// use.
var statNameReplacer = strings.NewReplacer(":", "_", "|", "_")

// SanitizeStatName is a stats key as ratelimit puts it in a statsd name:
// ':' and '|' become '_', and so do the dots of IPv4 addresses.
func SanitizeStatName(key string) string {
	key = statNameReplacer.Replace(key)
	return ipv4.ReplaceAllStringFunc(key, func(ip string) string { return strings.ReplaceAll(ip, ".", "_") })
}

// Error counts a call answered with an error, by its rls reason.
func (r *Ratelimit) Error(reason string) {
	t := "service_error"
	if reason == rls.ErrorStore || reason == rls.ErrorDeferred {
		t = "redis_error"
	}
	r.named("ratelimit.service.call.should_rate_limit."+t, false).add(1)
}

// GlobalShadowMode counts a call over the limit that the service's shadow
// mode answered OK.
func (r *Ratelimit) GlobalShadowMode() {
	r.named("ratelimit.service.global_shadow_mode", false).add(1)
}

// ConfigLoad counts a configuration loaded (ok) or refused.
func (r *Ratelimit) ConfigLoad(ok bool) {
	name := "ratelimit.service.config_load_error"
	if ok {
		name = "ratelimit.service.config_load_success"
	}
	r.named(name, false).add(1)
}

// UnaryInterceptor counts the gRPC server's unary calls and their time,
// by method, as ratelimit's server reporter does.
func (r *Ratelimit) UnaryInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		method := info.FullMethod[strings.LastIndexByte(info.FullMethod, '/')+1:]
		r.named("ratelimit_server."+method+".total_requests", false).add(1)
		resp, err := handler(ctx, req)
		r.named("ratelimit_server."+method+".response_time", true).observe(float64(time.Since(start).Milliseconds()))
		return resp, err
	}
}
