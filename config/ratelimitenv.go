package config

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

// RatelimitEnv is the tokengate configuration equal to envoyproxy/ratelimit's
// environment (FromRatelimitEnv): the file serve would read, and what the
// environment asks that tokengate does not do.
type RatelimitEnv struct {
	// YAML is the configuration, for Parse; it names no secret (REDIS_AUTH
	// becomes store.redis.auth_env).
	YAML []byte
	// LogLevel is LOG_LEVEL as slog reads it: debug, info, warn or error.
	LogLevel string
	// Files are the ratelimit files listed (CONFIG_TYPE=FILE), which
	// YAML names.
	Files []string
	// Warnings name each variable set that tokengate ignores or reads
	// differently, never its value.
	Warnings []string
}

// RatelimitEnvFile is the file name problems of a RatelimitEnv's YAML
// carry.
const RatelimitEnvFile = "ratelimit environment"

// ratelimitIgnored are envoyproxy/ratelimit's variables that tokengate
// does without, each with what happens instead.
var ratelimitIgnored = []struct{ name, why string }{
	{"DEBUG_HOST", "there is no debug listener"},
	{"DEBUG_PORT", "there is no debug listener"},
	{"USE_DOG_STATSD", "there is no statsd output; metrics are Prometheus on the admin listener's /metrics"},
	{"USE_DOG_STATSD_MOGRIFIERS", "there is no statsd output"},
	{"STATSD_HOST", "there is no statsd output"},
	{"STATSD_PORT", "there is no statsd output"},
	{"EXTRA_TAGS", "metrics carry no extra tags"},
	{"STATS_FLUSH_INTERVAL", "Prometheus is scraped, nothing is flushed"},
	{"DISABLE_STATS", "metrics are always on the admin listener's /metrics"},
	{"LOG_FORMAT", "logs are JSON lines"},
	{"EXPIRATION_JITTER_MAX_SECONDS", "keys expire with their window"},
	{"LOCAL_CACHE_SIZE_IN_BYTES", "there is no local over-limit cache"},
	{"STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "hits over the limit are counted as ratelimit counts them by default"},
	{"REDIS_PIPELINE_WINDOW", "the Redis client pipelines as it does"},
	{"REDIS_PIPELINE_LIMIT", "the Redis client pipelines as it does"},
	{"REDIS_PERSECOND", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_SOCKET_TYPE", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_TYPE", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_URL", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_POOL_SIZE", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_AUTH", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_TLS", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_PIPELINE_WINDOW", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_PIPELINE_LIMIT", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "/healthcheck follows the store's readiness"},
	{"CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "the xDS stream carries no extra headers"},
	{"CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "the xDS stream redials after 1s, doubling to 60s"},
	{"XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "the xDS stream redials after 1s, doubling to 60s"},
	{"XDS_CLIENT_BACKOFF_MAX_INTERVAL", "the xDS stream redials after 1s, doubling to 60s"},
	{"XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "the xDS stream redials after 1s, doubling to 60s"},
	{"XDS_CLIENT_BACKOFF_JITTER", "the xDS stream redials after 1s, doubling to 60s"},
	{"TRACING_ENABLED", "there is no tracing"},
	{"TRACING_SERVICE_NAME", "there is no tracing"},
	{"TRACING_SERVICE_NAMESPACE", "there is no tracing"},
	{"TRACING_SERVICE_INSTANCE_ID", "there is no tracing"},
	{"TRACING_EXPORTER_PROTOCOL", "there is no tracing"},
	{"TRACING_SAMPLING_RATE", "there is no tracing"},
	{"OTEL_EXPORTER_OTLP_ENDPOINT", "there is no tracing"},
	{"MEMCACHE_HOST_PORT", "the store is Redis or memory"},
	{"MEMCACHE_SRV", "the store is Redis or memory"},
	{"MEMCACHE_SRV_REFRESH", "the store is Redis or memory"},
	{"MEMCACHE_MAX_IDLE_CONNS", "the store is Redis or memory"},
	{"MEMCACHE_TLS", "the store is Redis or memory"},
	{"MEMCACHE_TLS_CACERT", "the store is Redis or memory"},
	{"MEMCACHE_TLS_CLIENT_CERT", "the store is Redis or memory"},
	{"MEMCACHE_TLS_CLIENT_KEY", "the store is Redis or memory"},
	{"MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION", "the store is Redis or memory"},
	{"PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "the default mapping's response time is in seconds (a PROMETHEUS_MAPPER_YAML without its scale keeps milliseconds)"},
	{"REDIS_TIMEOUT", "store.redis.timeout applies (default 250ms): a slow Redis meets the failure mode instead of being waited for"},
	{"REDIS_POOL_ON_EMPTY_BEHAVIOR", "the Redis client waits for a free connection (its pool timeout: store.redis.timeout and a second)"},
	{"REDIS_CLUSTER_PIPELINE_PARALLELISM", "the Redis client pipelines as it does"},
	{"REDIS_STARTUP_INITIAL_INTERVAL", "the service does not wait for Redis at start: /healthcheck and /readyz follow the store as they do later"},
	{"REDIS_STARTUP_MAX_INTERVAL", "the service does not wait for Redis at start: /healthcheck and /readyz follow the store as they do later"},
	{"REDIS_STARTUP_MAX_ELAPSED_TIME", "the service does not wait for Redis at start: /healthcheck and /readyz follow the store as they do later"},
	{"REDIS_PERSECOND_TIMEOUT", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM", "every limit is counted in REDIS_URL's Redis"},
	{"REDIS_PERSECOND_SENTINEL_AUTH", "every limit is counted in REDIS_URL's Redis"},
}

// FromRatelimitEnv maps envoyproxy/ratelimit's environment
// (docs/envoy-ratelimit.md §3.7-§3.9, §4.4) onto the tokengate
// configuration that serves the same: getenv reads a variable ("" when
// unset). With CONFIG_TYPE=FILE it lists the *.yaml and *.yml files under
// RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY; it reads nothing
// else. A variable that cannot be served as asked (a unix socket, an
// unknown CONFIG_TYPE, a value that does not parse) is an error naming it;
// one tokengate does without is a warning naming it. Neither carries a
// value, which may be a secret.
func FromRatelimitEnv(getenv func(string) string) (*RatelimitEnv, error) {
	m := &envMapper{get: getenv}
	doc := m.build()
	if len(m.errs) > 0 {
		return nil, errors.Join(m.errs...)
	}
	data, err := yaml.Marshal(doc)
	if err != nil {
		return nil, err
	}
	return &RatelimitEnv{YAML: data, LogLevel: m.level, Files: m.files, Warnings: m.warns}, nil
}

type envMapper struct {
	get   func(string) string
	files []string
	// mtls is set when the gRPC listener asks clients for certificates.
	mtls  bool
	level string
	warns []string
	errs  []error
}

func (m *envMapper) warn(format string, args ...any) {
	m.warns = append(m.warns, fmt.Sprintf(format, args...))
}

func (m *envMapper) fail(format string, args ...any) {
	m.errs = append(m.errs, fmt.Errorf(format, args...))
}

// str is a variable's value, or def when it is unset or empty.
func (m *envMapper) str(name, def string) string {
	if v := strings.TrimSpace(m.get(name)); v != "" {
		return v
	}
	return def
}

// bool reads a variable as ratelimit's envconfig does (strconv.ParseBool).
func (m *envMapper) bool(name string, def bool) bool {
	v := strings.TrimSpace(m.get(name))
	if v == "" {
		return def
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		m.fail("%s: want true or false", name)
		return def
	}
	return b
}

// jsonEndpoint serves ratelimit's POST /json on HOST:PORT, as ratelimit
// always does, unless the gRPC listener asks clients for certificates:
// there /json would let anyone who reaches HOST:PORT around them, so it
// stays off, with a warning. Served off loopback, it is as open as
// ratelimit's, which the mapping says (listeners.insecure).
func (m *envMapper) jsonEndpoint(l, rls yamlMap) {
	if m.mtls {
		m.warn("POST /json is not served: the gRPC listener asks clients for certificates (GRPC_CLIENT_TLS_CACERT), and /json on HOST:PORT would let anyone around them")
		return
	}
	rls["json_endpoint"] = true
	if host, _, err := net.SplitHostPort(l["admin"].(string)); err == nil && !isLoopback(host) && l["insecure"] == nil {
		l["insecure"] = true
		m.warn("POST /json on %s asks no credentials, as ratelimit's does: whoever reaches it can spend any descriptor's limit", l["admin"])
	}
}

// duration reads a variable as ratelimit's envconfig does
// (time.ParseDuration), def when unset.
func (m *envMapper) duration(name, def string) time.Duration {
	d, err := time.ParseDuration(m.str(name, def))
	if err != nil || d < 0 {
		m.fail("%s: want a duration (24h, 90m, 30s)", name)
	}
	return d
}

// addr is host:port of two variables.
func (m *envMapper) addr(hostVar, host, portVar, port string) string {
	p := m.str(portVar, port)
	if n, err := strconv.Atoi(p); err != nil || n < 0 || n > 65535 {
		m.fail("%s: want a port number (0 to 65535)", portVar)
	}
	return net.JoinHostPort(m.str(hostVar, host), p)
}

type yamlMap = map[string]any

func (m *envMapper) build() yamlMap {
	for _, v := range ratelimitIgnored {
		if m.get(v.name) != "" {
			m.warn("%s is set; tokengate does not support it: %s", v.name, v.why)
		}
	}
	m.logLevel()
	if m.bool("USE_STATSD", false) {
		m.warn("USE_STATSD is true; tokengate sends no statsd: its metrics are Prometheus on the admin listener's /metrics (HOST:PORT)")
	}
	m.bool("FORCE_START_WITHOUT_INITIAL_CONFIG", false)
	m.bool("RUNTIME_WATCH_ROOT", true)
	if proto := m.str("PROTO", "tcp"); proto != "tcp" {
		m.fail("PROTO: only tcp is supported")
	}
	if b := strings.ToLower(m.str("BACKEND_TYPE", "redis")); b != "redis" {
		m.fail("BACKEND_TYPE: only redis is supported (the memory store serves when REDIS_URL is unset)")
	}
	doc := yamlMap{
		"listeners": m.listeners(),
		"store":     m.store(),
	}
	m.prometheus(doc["listeners"].(yamlMap))
	rl := m.ratelimit()
	if rl != nil {
		doc["ratelimit"] = rl
	}
	rls := yamlMap{}
	if m.bool("QUOTA_MODE", false) {
		rls["quota_mode"] = true
	}
	if m.bool("SHADOW_MODE", false) {
		rls["shadow_mode"] = true
	}
	if v := m.str("NEAR_LIMIT_RATIO", ""); v != "" {
		// ratelimit reads it as a float32.
		if q, err := strconv.ParseFloat(v, 32); err != nil || !(q > 0 && q <= 1) {
			m.fail("NEAR_LIMIT_RATIO: want a share of the limit above 0 and at most 1 (ratelimit's default: 0.8)")
		} else {
			rls["near_limit_ratio"] = q
		}
	}
	if m.bool("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", false) {
		rls["ready_needs_domain"] = true
	}
	if m.bool("RESPONSE_DYNAMIC_METADATA", false) {
		rls["response_dynamic_metadata"] = true
	}
	if h := m.limitHeaders(); h != nil {
		rls["limit_response_headers"] = h
	}
	m.jsonEndpoint(doc["listeners"].(yamlMap), rls)
	// tokengate's own: ratelimit answers every call when it has counted it.
	if v := m.str("TOKENGATE_DEFERRED_CHARGES", ""); v != "" {
		var domains []string
		for d := range strings.SplitSeq(v, ",") {
			if d = strings.TrimSpace(d); d != "" {
				domains = append(domains, d)
			}
		}
		rls["deferred_charges"] = domains
	}
	if len(rls) > 0 {
		doc["rls"] = rls
	}
	return doc
}

// limitHeaders maps LIMIT_RESPONSE_HEADERS_ENABLED, LIMIT_LIMIT_HEADER,
// LIMIT_REMAINING_HEADER and LIMIT_RESET_HEADER onto
// rls.limit_response_headers; nil when the first is not true. A name that
// cannot be a header is an error naming its variable.
func (m *envMapper) limitHeaders() yamlMap {
	var h RLSLimitHeaders
	vars := []struct {
		env, field string
		name       *string
	}{
		{"LIMIT_LIMIT_HEADER", "limit_header", &h.LimitHeader},
		{"LIMIT_REMAINING_HEADER", "remaining_header", &h.RemainingHeader},
		{"LIMIT_RESET_HEADER", "reset_header", &h.ResetHeader},
	}
	if !m.bool("LIMIT_RESPONSE_HEADERS_ENABLED", false) {
		for _, v := range vars {
			if m.get(v.env) != "" {
				m.warn("%s is set but LIMIT_RESPONSE_HEADERS_ENABLED is not true: no RateLimit headers are added", v.env)
			}
		}
		return nil
	}
	out := yamlMap{"enabled": true}
	env := map[string]string{}
	for _, v := range vars {
		env[v.field] = v.env
		if s := m.str(v.env, ""); s != "" {
			*v.name = s
			out[v.field] = s
		}
	}
	for _, p := range h.problems(func(f string) string { return env[f] }) {
		m.fail("%s: %s", env[p.field], p.msg)
	}
	return out
}

// prometheus maps USE_PROMETHEUS, PROMETHEUS_ADDR, PROMETHEUS_PATH and
// PROMETHEUS_MAPPER_YAML onto listeners.ratelimit_metrics: ratelimit's
// names on a listener of their own, ratelimit's default address :9090.
func (m *envMapper) prometheus(l yamlMap) {
	if !m.bool("USE_PROMETHEUS", false) {
		for _, v := range []string{"PROMETHEUS_ADDR", "PROMETHEUS_PATH", "PROMETHEUS_MAPPER_YAML"} {
			if m.get(v) != "" {
				m.warn("%s is set but USE_PROMETHEUS is not true: no metrics listener of its own is served (tokengate's metrics are on the admin listener's /metrics)", v)
			}
		}
		return
	}
	addr := m.str("PROMETHEUS_ADDR", ":9090")
	if _, _, err := net.SplitHostPort(addr); err != nil {
		m.fail("PROMETHEUS_ADDR: want host:port or :port")
	}
	l["ratelimit_metrics"] = addr
	if p := m.str("PROMETHEUS_PATH", ""); p != "" {
		if !strings.HasPrefix(p, "/") || strings.ContainsAny(p, "?# ") {
			m.fail("PROMETHEUS_PATH: want a URL path starting with / (default /metrics)")
		}
		l["ratelimit_metrics_path"] = p
	}
	// Read when the configuration is validated: one that cannot be read
	// is an error (ratelimit would name its stats unmapped).
	if f := m.str("PROMETHEUS_MAPPER_YAML", ""); f != "" {
		l["ratelimit_metrics_mapper"] = f
	}
}

// logLevel maps logrus's levels, which ratelimit reads, onto slog's.
func (m *envMapper) logLevel() {
	switch l := strings.ToLower(m.str("LOG_LEVEL", "warn")); l {
	case "trace", "debug":
		m.level = "debug"
	case "info":
		m.level = "info"
	case "warn", "warning":
		m.level = "warn"
	case "error", "fatal", "panic":
		m.level = "error"
	default:
		m.fail("LOG_LEVEL: want trace, debug, info, warn, error, fatal or panic")
	}
}

func (m *envMapper) listeners() yamlMap {
	l := yamlMap{
		"grpc":  m.addr("GRPC_HOST", "0.0.0.0", "GRPC_PORT", "8081"),
		"admin": m.addr("HOST", "0.0.0.0", "PORT", "8080"),
	}
	// ratelimit ages its connections out by default.
	l["max_connection_age"] = m.duration("GRPC_MAX_CONNECTION_AGE", "24h").String()
	l["max_connection_age_grace"] = m.duration("GRPC_MAX_CONNECTION_AGE_GRACE", "1h").String()
	// GRPC_UDS, as ratelimit reads it, replaces GRPC_HOST and GRPC_PORT.
	if uds := m.str("GRPC_UDS", ""); uds != "" {
		if !filepath.IsAbs(uds) {
			m.fail("GRPC_UDS: want the unix socket's absolute path")
		}
		l["grpc"] = "unix:" + uds
	}
	ca := m.str("GRPC_CLIENT_TLS_CACERT", "")
	if eg := m.str("GRPC_SERVER_TLS_CA_CERT", ""); eg != "" {
		if ca != "" && ca != eg {
			m.fail("GRPC_CLIENT_TLS_CACERT and GRPC_SERVER_TLS_CA_CERT name different files; set one (both are the CA of client certificates)")
		}
		ca = eg
	}
	if m.get("GRPC_CLIENT_TLS_SAN") != "" {
		m.fail("GRPC_CLIENT_TLS_SAN: tokengate does not match the client certificate's SAN; unset it (GRPC_CLIENT_TLS_CACERT still verifies the certificate)")
	}
	if m.bool("GRPC_SERVER_USE_TLS", false) {
		t := yamlMap{
			"cert_file": m.required("GRPC_SERVER_TLS_CERT", "GRPC_SERVER_USE_TLS"),
			"key_file":  m.required("GRPC_SERVER_TLS_KEY", "GRPC_SERVER_USE_TLS"),
		}
		if ca != "" {
			t["client_ca_file"] = ca
		}
		l["grpc_tls"] = t
	} else {
		for _, v := range []string{"GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY", "GRPC_CLIENT_TLS_CACERT", "GRPC_SERVER_TLS_CA_CERT"} {
			if m.get(v) != "" {
				m.warn("%s is set but GRPC_SERVER_USE_TLS is not true: the gRPC listener serves plaintext, as ratelimit's does", v)
			}
		}
		ca = ""
	}
	// ratelimit serves whoever reaches it; tokengate refuses that off
	// loopback unless told (validateExposure), so the mapping tells it,
	// and says so.
	m.mtls = ca != ""
	_, unix := UnixSocket(l["grpc"].(string))
	if host, _, err := net.SplitHostPort(l["grpc"].(string)); err == nil && !unix && !isLoopback(host) && ca == "" {
		l["insecure"] = true
		m.warn("the gRPC listener %s verifies no client certificate, as ratelimit's does: whoever reaches it can spend any descriptor's limit "+
			"(set GRPC_SERVER_USE_TLS with GRPC_CLIENT_TLS_CACERT for mTLS)", l["grpc"])
	}
	return l
}

// required is a variable that another one needs.
func (m *envMapper) required(name, by string) string {
	v := m.str(name, "")
	if v == "" {
		m.fail("%s: is required with %s=true", name, by)
	}
	return v
}

func (m *envMapper) store() yamlMap {
	url := m.str("REDIS_URL", "")
	if url == "" {
		m.warn("REDIS_URL is unset: limits are counted in this process's memory, not shared between replicas and lost on restart")
		return yamlMap{"type": "memory"}
	}
	unix := false
	switch t := strings.ToLower(m.str("REDIS_SOCKET_TYPE", "unix")); t {
	case "tcp":
	case "unix": // ratelimit's default
		unix = true
	default:
		m.fail("REDIS_SOCKET_TYPE: want tcp or unix")
	}
	r := yamlMap{}
	redisType := strings.ToLower(m.str("REDIS_TYPE", "single"))
	parts := strings.Split(url, ",")
	switch redisType {
	case "single", "cluster":
	case "sentinel":
		// ratelimit's form: the master's name, then the sentinels.
		if len(parts) < 2 {
			m.fail("REDIS_URL: with REDIS_TYPE=sentinel, want the master's name and the sentinels: name,host:port,...")
			return yamlMap{"type": "redis", "redis": r}
		}
		sn := yamlMap{"master": strings.TrimSpace(parts[0])}
		if m.get("REDIS_SENTINEL_AUTH") != "" {
			sn["auth_env"] = "REDIS_SENTINEL_AUTH"
		}
		r["sentinel"] = sn
		parts = parts[1:]
	default:
		m.fail("REDIS_TYPE: want single, cluster or sentinel")
	}
	if redisType != "sentinel" && m.get("REDIS_SENTINEL_AUTH") != "" {
		m.warn("REDIS_SENTINEL_AUTH is set but REDIS_TYPE is not sentinel: no sentinel is asked")
	}
	if unix && redisType != "single" {
		m.fail("REDIS_SOCKET_TYPE: is unix (ratelimit's default), but a %s is reached over TCP: set REDIS_SOCKET_TYPE=tcp", redisType)
		unix = false
	}
	var addrs []string
	for _, a := range parts {
		a = strings.TrimSpace(a)
		switch {
		case unix:
			if !filepath.IsAbs(a) {
				m.fail("REDIS_URL: with REDIS_SOCKET_TYPE=unix, want the unix socket's absolute path (or set REDIS_SOCKET_TYPE=tcp for host:port)")
			}
			a = "unix:" + a
		case strings.ContainsAny(a, "@/") || hostPort(a) != nil:
			// The value is not repeated: a URL may carry a password.
			m.fail("REDIS_URL: want host:port, or host:port,host:port,... with REDIS_TYPE=cluster (no scheme, no password: REDIS_AUTH carries it)")
		}
		addrs = append(addrs, a)
	}
	switch redisType {
	case "single":
		if len(addrs) > 1 {
			m.fail("REDIS_URL: names several addresses; that is a cluster: set REDIS_TYPE=cluster")
		}
		r["addrs"] = addrs
	case "cluster":
		r["addrs"], r["cluster"] = addrs, true
	case "sentinel":
		r["sentinel"].(yamlMap)["addrs"] = addrs
	}
	// The value stays in the environment, read as ratelimit reads it:
	// user:password, or the password alone.
	if m.get("REDIS_AUTH") != "" {
		r["auth_env"] = "REDIS_AUTH"
	}
	if p := m.str("REDIS_POOL_SIZE", ""); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			m.fail("REDIS_POOL_SIZE: want a number of connections")
		}
		r["pool_size"] = n
	}
	if p := m.str("CACHE_KEY_PREFIX", ""); p != "" {
		r["key_prefix"] = p
	}
	tlsVars := []string{"REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY", "REDIS_TLS_CACERT", "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"}
	if m.bool("REDIS_TLS", false) {
		t := yamlMap{}
		for _, f := range []struct{ env, key string }{{"REDIS_TLS_CLIENT_CERT", "cert_file"}, {"REDIS_TLS_CLIENT_KEY", "key_file"}, {"REDIS_TLS_CACERT", "ca_file"}} {
			if v := m.str(f.env, ""); v != "" {
				t[f.key] = v
			}
		}
		if m.bool("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", false) {
			m.fail("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION: tokengate verifies Redis's certificate and its name; unset it")
		}
		r["tls"] = t
	} else {
		for _, v := range tlsVars {
			if m.get(v) != "" {
				m.warn("%s is set but REDIS_TLS is not true: Redis is reached in plaintext, as ratelimit reaches it", v)
			}
		}
	}
	return yamlMap{"type": "redis", "redis": r}
}

func (m *envMapper) ratelimit() yamlMap {
	rl := yamlMap{}
	if m.bool("MERGE_DOMAIN_CONFIG", false) {
		rl["merge_domains"] = true
	}
	switch t := m.str("CONFIG_TYPE", "FILE"); t {
	case "FILE":
		dir := filepath.Join(m.str("RUNTIME_ROOT", "/srv/runtime_data/current"), m.get("RUNTIME_SUBDIRECTORY"), m.str("RUNTIME_APPDIRECTORY", "config"))
		files, err := runtimeFiles(dir, m.bool("RUNTIME_IGNOREDOTFILES", false))
		switch {
		case err != nil:
			m.fail("RUNTIME_ROOT: %v", err)
		case len(files) == 0:
			m.fail("RUNTIME_ROOT: %s holds no .yaml or .yml file (RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY); tokengate needs ratelimit's configuration, or CONFIG_TYPE=GRPC_XDS_SOTW", dir)
		}
		rl["files"], m.files = files, files
	case "GRPC_XDS_SOTW":
		rl["xds"] = m.xds()
	default:
		m.fail("CONFIG_TYPE: want FILE or GRPC_XDS_SOTW")
	}
	return rl
}

func (m *envMapper) xds() yamlMap {
	x := yamlMap{
		"address": m.str("CONFIG_GRPC_XDS_SERVER_URL", "localhost:18000"),
		"node_id": m.str("CONFIG_GRPC_XDS_NODE_ID", "default"),
	}
	if hostPort(x["address"].(string)) != nil {
		m.fail("CONFIG_GRPC_XDS_SERVER_URL: want host:port")
	}
	if v := m.str("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", ""); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			m.fail("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES: want a number of bytes")
		} else {
			x["max_message_bytes"] = n
		}
	}
	if md := m.str("CONFIG_GRPC_XDS_NODE_METADATA", ""); md != "" {
		meta := map[string]string{}
		for _, kv := range strings.Split(md, ",") {
			// ratelimit splits each pair at its first '=' or ':'.
			i := strings.IndexAny(kv, "=:")
			if i <= 0 {
				m.fail("CONFIG_GRPC_XDS_NODE_METADATA: want key=value,key=value")
				break
			}
			meta[strings.TrimSpace(kv[:i])] = strings.TrimSpace(kv[i+1:])
		}
		x["node_metadata"] = meta
	}
	tlsVars := []struct{ env, key string }{
		{"CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "ca_file"},
		{"CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "cert_file"},
		{"CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "key_file"},
		{"CONFIG_GRPC_XDS_SERVER_TLS_SAN", "server_name"},
	}
	if !m.bool("CONFIG_GRPC_XDS_SERVER_USE_TLS", false) {
		x["insecure"] = true
		for _, v := range tlsVars {
			if m.get(v.env) != "" {
				m.warn("%s is set but CONFIG_GRPC_XDS_SERVER_USE_TLS is not true: the xDS server is dialled in plaintext, as ratelimit dials it", v.env)
			}
		}
		return x
	}
	for _, v := range tlsVars {
		if s := m.str(v.env, ""); s != "" {
			x[v.key] = s
		}
	}
	return x
}

// runtimeFiles lists the *.yaml and *.yml files under dir, as ratelimit
// loads its runtime directory: subdirectories included, symbolic links
// (a Kubernetes ConfigMap's) followed to files, names starting with '.'
// skipped when ignoreDot. The names are sorted.
func runtimeFiles(dir string, ignoreDot bool) ([]string, error) {
	var files []string
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if path != dir && ignoreDot && strings.HasPrefix(d.Name(), ".") {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			return nil
		}
		if ext := strings.ToLower(filepath.Ext(path)); ext != ".yaml" && ext != ".yml" {
			return nil
		}
		if d.Type()&fs.ModeSymlink != 0 {
			if fi, err := os.Stat(path); err != nil || !fi.Mode().IsRegular() {
				return nil
			}
		}
		abs, err := filepath.Abs(path)
		if err != nil {
			return err
		}
		files = append(files, abs)
		return nil
	})
	sort.Strings(files)
	return files, err
}
