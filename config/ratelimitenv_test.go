package config

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// envOf is getenv over a map.
func envOf(env map[string]string) func(string) string {
	return func(k string) string { return env[k] }
}

// The environments Envoy Gateway, AI Gateway and a hand-made Deployment
// give ratelimit each map onto a configuration that validates, with the
// listeners, TLS, store and ratelimit source they ask for.
func TestFromRatelimitEnv(t *testing.T) {
	certs := writeFiles(t, map[string]string{"tls.crt": "c", "tls.key": "k", "ca.crt": "a",
		"conf.yaml": "mappings:\n  - match: \"ratelimit.service.rate_limit.*.*.over_limit\"\n    name: over\n    timer_type: histogram\n    labels: {domain: \"$1\", key1: \"$2\"}\n"})
	mapping := filepath.Join(certs, "conf.yaml")
	root := t.TempDir()
	app := filepath.Join(root, "ratelimit", "config")
	if err := os.MkdirAll(filepath.Join(app, ".hidden"), 0o700); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"a.yaml": ratelimitFile, ".hidden/b.yaml": "x: [", "notes.txt": "x"} {
		if err := os.WriteFile(filepath.Join(app, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	crt, key, ca := filepath.Join(certs, "tls.crt"), filepath.Join(certs, "tls.key"), filepath.Join(certs, "ca.crt")
	eg := map[string]string{ // §4.4, with redis and Prometheus
		"RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit", "RUNTIME_IGNOREDOTFILES": "true", "RUNTIME_WATCH_ROOT": "false",
		"LOG_LEVEL": "info", "USE_STATSD": "false", "CONFIG_TYPE": "GRPC_XDS_SOTW",
		"CONFIG_GRPC_XDS_SERVER_URL": "envoy-gateway:18001", "CONFIG_GRPC_XDS_NODE_ID": "envoy-ratelimit",
		"GRPC_SERVER_USE_TLS": "true", "GRPC_SERVER_TLS_CERT": crt, "GRPC_SERVER_TLS_KEY": key, "GRPC_SERVER_TLS_CA_CERT": ca,
		"CONFIG_GRPC_XDS_SERVER_USE_TLS": "true", "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": crt, "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": key,
		"CONFIG_GRPC_XDS_SERVER_TLS_CACERT": ca, "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
		"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "redis.redis-system.svc.cluster.local:6379",
		"USE_PROMETHEUS": "true", "PROMETHEUS_ADDR": ":19001", "PROMETHEUS_MAPPER_YAML": mapping,
		"REDIS_TIMEOUT": "5s", "RESPONSE_DYNAMIC_METADATA": "true",
	}
	aigw := map[string]string{ // §5.2-§5.3: plaintext gRPC and xDS
		"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL": "envoy-ai-gateway-controller:18002",
		"CONFIG_GRPC_XDS_NODE_ID": "envoy-ai-gateway-ratelimit", "CONFIG_GRPC_XDS_NODE_METADATA": "cluster=ai,zone:a",
		"USE_STATSD": "false", "LOG_LEVEL": "debug", "SHADOW_MODE": "true", "QUOTA_MODE": "true", "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES": "16777216",
		"TOKENGATE_DEFERRED_CHARGES":     "envoy-ai-gateway, other ,",
		"LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_REMAINING_HEADER": "X-RateLimit-Left",
		"HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": "true",
	}
	file := map[string]string{
		"RUNTIME_ROOT": root, "RUNTIME_SUBDIRECTORY": "ratelimit", "RUNTIME_IGNOREDOTFILES": "true",
		"REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "cluster", "REDIS_URL": "r1:6379, r2:6379", "REDIS_AUTH": "s3cret",
		"REDIS_TLS": "true", "REDIS_TLS_CLIENT_CERT": crt, "REDIS_TLS_CLIENT_KEY": key, "REDIS_TLS_CACERT": ca,
		"MERGE_DOMAIN_CONFIG": "true", "GRPC_MAX_CONNECTION_AGE": "90m", "GRPC_MAX_CONNECTION_AGE_GRACE": "0s", "GRPC_HOST": "127.0.0.1", "GRPC_PORT": "9081", "HOST": "127.0.0.1", "PORT": "9080",
		"LIMIT_RESET_HEADER": "X-Reset-In", "RESPONSE_DYNAMIC_METADATA": "false",
		"NEAR_LIMIT_RATIO": "0.9", "PROMETHEUS_PATH": "/stats/prometheus",
	}
	sockets := map[string]string{ // GRPC_UDS, and Redis on its socket (REDIS_SOCKET_TYPE's default)
		"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL": "127.0.0.1:18002", "GRPC_UDS": "/run/rl/grpc.sock",
		"REDIS_URL": "/var/run/nutcracker/ratelimit.sock", "REDIS_SENTINEL_AUTH": "pw",
	}
	sentinel := map[string]string{
		"CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL": "127.0.0.1:18002", "GRPC_HOST": "127.0.0.1",
		"REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "Sentinel", "REDIS_URL": "mymaster, s1:26379,s2:26379",
		"REDIS_AUTH": "master-pw", "REDIS_SENTINEL_AUTH": "sentinel-pw",
	}
	for _, tc := range []struct {
		name  string
		env   map[string]string
		level string
		check func(t *testing.T, c *Config)
		warn  []string // each a warning must contain
	}{
		{"envoy gateway", eg, "info", func(t *testing.T, c *Config) {
			l := c.Listeners
			if l.GRPC != "0.0.0.0:8081" || l.Admin != "0.0.0.0:8080" || l.Insecure {
				t.Errorf("listeners %q %q insecure=%v", l.GRPC, l.Admin, l.Insecure)
			}
			if l.MaxConnectionAge != 24*time.Hour || l.MaxConnectionAgeGrace != time.Hour {
				t.Errorf("connection age %s, grace %s: want ratelimit's defaults, 24h and 1h", l.MaxConnectionAge, l.MaxConnectionAgeGrace)
			}
			if g := l.GRPCTLS; g == nil || g.CertFile != crt || g.KeyFile != key || g.ClientCAFile != ca {
				t.Errorf("grpc_tls %+v", g)
			}
			if c.Store.Type != "redis" || len(c.Store.Redis.Addrs) != 1 || c.Store.Redis.Cluster {
				t.Errorf("store %+v", c.Store)
			}
			x := c.Ratelimit.XDS
			if x.Address != "envoy-gateway:18001" || x.NodeID != "envoy-ratelimit" || x.Insecure || x.CAFile != ca || x.CertFile != crt || x.KeyFile != key {
				t.Errorf("xds %+v", x)
			}
			if c.AdminAPI.TokenEnv != "" {
				t.Errorf("admin API on: %q", c.AdminAPI.TokenEnv)
			}
			if c.RLS == nil || !c.RLS.ResponseDynamicMetadata || c.RLS.LimitResponseHeaders.Enabled || c.RLS.JSONEndpoint {
				t.Errorf("rls %+v: want response_dynamic_metadata (RESPONSE_DYNAMIC_METADATA), no limit headers, no /json beside mTLS", c.RLS)
			}
			if l.RatelimitMetrics != ":19001" || l.RatelimitMetricsAt() != "/metrics" || l.RatelimitMetricsMapper != mapping || c.RLS.NearLimit() != DefaultNearLimitRatio {
				t.Errorf("ratelimit metrics on %q at %q by %q, near limit %v: want USE_PROMETHEUS's PROMETHEUS_ADDR and PROMETHEUS_MAPPER_YAML, ratelimit's default path and ratio",
					l.RatelimitMetrics, l.RatelimitMetricsAt(), l.RatelimitMetricsMapper, c.RLS.NearLimit())
			}
		}, []string{"REDIS_TIMEOUT", "POST /json is not served"}},
		{"ai gateway", aigw, "debug", func(t *testing.T, c *Config) {
			l := c.Listeners
			if l.GRPC != "0.0.0.0:8081" || l.GRPCTLS != nil || !l.Insecure {
				t.Errorf("listeners %+v", l)
			}
			if c.Store.Type != "memory" {
				t.Errorf("store %q", c.Store.Type)
			}
			x := c.Ratelimit.XDS
			if !x.Insecure || x.NodeID != "envoy-ai-gateway-ratelimit" || x.NodeMetadata["cluster"] != "ai" || x.NodeMetadata["zone"] != "a" || x.MaxMessageBytes != 16<<20 {
				t.Errorf("xds %+v", x)
			}
			if c.RLS == nil || !c.RLS.ShadowMode || !c.RLS.QuotaMode || !slices.Equal(c.RLS.DeferredCharges, []string{"envoy-ai-gateway", "other"}) || c.RLS.ResponseDynamicMetadata || !c.RLS.ReadyNeedsDomain {
				t.Errorf("rls %+v", c.RLS)
			}
			h := c.RLS.LimitResponseHeaders
			if limit, remaining, reset := h.Names(); !h.Enabled || limit != "RateLimit-Limit" || remaining != "X-RateLimit-Left" || reset != "RateLimit-Reset" {
				t.Errorf("limit_response_headers %+v: names %q %q %q, want ratelimit's defaults but X-RateLimit-Left", h, limit, remaining, reset)
			}
		}, []string{"REDIS_URL is unset", "verifies no client certificate"}},
		{"sockets", sockets, "warn", func(t *testing.T, c *Config) {
			if l := c.Listeners; l.GRPC != "unix:/run/rl/grpc.sock" || !l.Insecure {
				t.Errorf("listeners %+v: want the socket of GRPC_UDS, and insecure for POST /json on 0.0.0.0:8080", l)
			}
			if c.RLS == nil || !c.RLS.JSONEndpoint {
				t.Errorf("rls %+v: want POST /json, as ratelimit serves it", c.RLS)
			}
			if r := c.Store.Redis; !slices.Equal(r.Addrs, []string{"unix:/var/run/nutcracker/ratelimit.sock"}) || r.Sentinel != nil {
				t.Errorf("redis %+v: want its socket", r)
			}
		}, []string{"REDIS_SENTINEL_AUTH is set but REDIS_TYPE is not sentinel", "POST /json on 0.0.0.0:8080 asks no credentials"}},
		{"sentinel", sentinel, "warn", func(t *testing.T, c *Config) {
			r := c.Store.Redis
			sn := r.Sentinel
			if sn == nil || sn.Master != "mymaster" || !slices.Equal(sn.Addrs, []string{"s1:26379", "s2:26379"}) || sn.AuthEnv != "REDIS_SENTINEL_AUTH" || sn.PasswordEnv != "" {
				t.Fatalf("redis %+v sentinel %+v", r, sn)
			}
			if len(r.Addrs) != 0 || r.Cluster || r.AuthEnv != "REDIS_AUTH" || r.PasswordEnv != "" {
				t.Errorf("redis %+v: want no addrs of its own, the master's credentials from REDIS_AUTH", r)
			}
		}, nil},
		{"file", file, "warn", func(t *testing.T, c *Config) {
			r := c.Store.Redis
			if !r.Cluster || len(r.Addrs) != 2 || r.Addrs[1] != "r2:6379" || r.AuthEnv != "REDIS_AUTH" {
				t.Errorf("redis %+v", r)
			}
			if r.TLS == nil || r.TLS.CAFile != ca || r.TLS.CertFile != crt {
				t.Errorf("redis tls %+v", r.TLS)
			}
			want := filepath.Join(app, "a.yaml")
			if got := c.Ratelimit.Files; len(got) != 1 || got[0] != want {
				t.Errorf("files %q, want [%q]", got, want)
			}
			if l := c.Listeners; l.MaxConnectionAge != 90*time.Minute || l.MaxConnectionAgeGrace != 0 {
				t.Errorf("connection age %s, grace %s: want GRPC_MAX_CONNECTION_AGE's 90m and no grace limit", l.MaxConnectionAge, l.MaxConnectionAgeGrace)
			}
			if !c.Ratelimit.MergeDomains || c.Listeners.Insecure || c.Listeners.GRPC != "127.0.0.1:9081" {
				t.Errorf("ratelimit %+v listeners %+v", c.Ratelimit, c.Listeners)
			}
			if len(c.Policies) != 1 || c.RLS == nil || c.RLS.Domains[0].Domain != "ai-gateway" {
				t.Errorf("policies %d rls %+v", len(c.Policies), c.RLS)
			}
			if !c.RLS.JSONEndpoint {
				t.Errorf("rls %+v: want POST /json on the loopback HOST", c.RLS)
			}
			if c.RLS.LimitResponseHeaders != (RLSLimitHeaders{}) || c.RLS.ResponseDynamicMetadata {
				t.Errorf("rls %+v: want no limit headers (LIMIT_RESPONSE_HEADERS_ENABLED unset) and no metadata", c.RLS)
			}
			if math.Abs(c.RLS.NearLimit()-0.9) > 1e-6 || c.Listeners.RatelimitMetrics != "" {
				t.Errorf("near_limit_ratio %v, ratelimit metrics on %q: want NEAR_LIMIT_RATIO's 0.9, and none without USE_PROMETHEUS", c.RLS.NearLimit(), c.Listeners.RatelimitMetrics)
			}
		}, []string{"LIMIT_RESET_HEADER is set but LIMIT_RESPONSE_HEADERS_ENABLED is not true", "PROMETHEUS_PATH is set but USE_PROMETHEUS is not true"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := FromRatelimitEnv(envOf(tc.env))
			if err != nil {
				t.Fatal(err)
			}
			if r.LogLevel != tc.level {
				t.Errorf("log level %q, want %q", r.LogLevel, tc.level)
			}
			c, err := Parse(RatelimitEnvFile, r.YAML)
			if err != nil {
				t.Fatalf("%v\n%s", err, r.YAML)
			}
			tc.check(t, c)
			all := strings.Join(r.Warnings, "\n")
			for _, w := range tc.warn {
				if !strings.Contains(all, w) {
					t.Errorf("no warning names %q in:\n%s", w, all)
				}
			}
			for _, v := range tc.env {
				if len(v) > 4 && strings.Contains(all, v) || strings.Contains(string(r.YAML), "s3cret") {
					t.Errorf("a value (%q) is in the warnings or the configuration", v)
				}
			}
		})
	}
}

// What cannot work is refused, naming the variable and never its value.
func TestFromRatelimitEnvRefuses(t *testing.T) {
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "config"), 0o700); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_DELTA"}, "CONFIG_TYPE: want FILE or GRPC_XDS_SOTW"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_URL": "redis:6379"}, "REDIS_URL: with REDIS_SOCKET_TYPE=unix, want the unix socket's absolute path"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_TYPE": "cluster", "REDIS_URL": "a:1,b:2"}, "REDIS_SOCKET_TYPE: is unix (ratelimit's default), but a cluster is reached over TCP"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_SOCKET_TYPE": "udp", "REDIS_URL": "a:1"}, "REDIS_SOCKET_TYPE: want tcp or unix"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "sentinel", "REDIS_URL": "mymaster"}, "want the master's name and the sentinels"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_SOCKET_TYPE": "tcp", "REDIS_TYPE": "replicated", "REDIS_URL": "a:1"}, "REDIS_TYPE: want single, cluster or sentinel"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "redis://u:hunter22@r:6379"}, "REDIS_URL: want host:port"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "a:1,b:2"}, "set REDIS_TYPE=cluster"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "GRPC_UDS": "rl.sock"}, "GRPC_UDS: want the unix socket's absolute path"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "GRPC_SERVER_USE_TLS": "yes please"}, "GRPC_SERVER_USE_TLS: want true or false"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "GRPC_SERVER_USE_TLS": "true"}, "GRPC_SERVER_TLS_CERT: is required"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "LOG_LEVEL": "loud"}, "LOG_LEVEL"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "GRPC_MAX_CONNECTION_AGE": "a day"}, "GRPC_MAX_CONNECTION_AGE: want a duration"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES": "16MB"}, "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES: want a number of bytes"},
		{map[string]string{"RUNTIME_ROOT": root}, "holds no .yaml or .yml file"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "RESPONSE_DYNAMIC_METADATA": "on"}, "RESPONSE_DYNAMIC_METADATA: want true or false"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "LIMIT_RESPONSE_HEADERS_ENABLED": "yes please"}, "LIMIT_RESPONSE_HEADERS_ENABLED: want true or false"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_LIMIT_HEADER": "hunter22 limit"}, "LIMIT_LIMIT_HEADER: is not an HTTP header name"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_REMAINING_HEADER": "Retry-After"}, "LIMIT_REMAINING_HEADER: is retry-after"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_RESET_HEADER": "ratelimit-limit"}, "LIMIT_RESET_HEADER: names the same header as LIMIT_LIMIT_HEADER"},
		{map[string]string{"RUNTIME_ROOT": filepath.Join(root, "missing")}, "no such file"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "NEAR_LIMIT_RATIO": "1.5"}, "NEAR_LIMIT_RATIO: want a share of the limit above 0 and at most 1"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "NEAR_LIMIT_RATIO": "most"}, "NEAR_LIMIT_RATIO: want a share of the limit above 0 and at most 1"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "USE_PROMETHEUS": "true", "PROMETHEUS_ADDR": "19001"}, "PROMETHEUS_ADDR: want host:port or :port"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "USE_PROMETHEUS": "true", "PROMETHEUS_PATH": "metrics"}, "PROMETHEUS_PATH: want a URL path starting with /"},
		{map[string]string{"CONFIG_TYPE": "GRPC_XDS_SOTW", "USE_PROMETHEUS": "maybe"}, "USE_PROMETHEUS: want true or false"},
	} {
		_, err := FromRatelimitEnv(envOf(tc.env))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: error %v, want one containing %q", tc.env, err, tc.want)
			continue
		}
		if strings.Contains(err.Error(), "hunter22") {
			t.Errorf("%v: the error shows a secret: %v", tc.env, err)
		}
	}
}

// listeners.ratelimit_metrics_mapper is read beside the file, as the
// other files it names are, and validated with statsd_exporter's mapper:
// a mapping the mapper refuses, or one that is missing, is a problem of
// the field.
func TestRatelimitMetricsMapper(t *testing.T) {
	const head = "listeners:\n  ratelimit_metrics: 127.0.0.1:19001\n  ratelimit_metrics_mapper: %s\npolicies: [{name: default, buckets: [{name: all, tokens_per_minute: 100}]}]\n"
	dir := writeFiles(t, map[string]string{
		"good.yaml":   "mappings:\n  - match: \"ratelimit.service.rate_limit.*.*.over_limit\"\n    name: over\n    timer_type: histogram\n    labels: {domain: \"$1\", key1: \"$2\"}\n",
		"bad.yaml":    "mappings:\n  - match: \"a.*\"\n    name: x\n    labels: {k: \"$1\"}\n",
		"good.conf":   fmt.Sprintf(head, "good.yaml"),
		"bad.conf":    fmt.Sprintf(head, "bad.yaml"),
		"absent.conf": fmt.Sprintf(head, "absent.yaml"),
	})
	c, err := Load(filepath.Join(dir, "good.conf"))
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "good.yaml"); c.Listeners.RatelimitMetricsMapper != want {
		t.Errorf("mapper %q, want %q (beside the file)", c.Listeners.RatelimitMetricsMapper, want)
	}
	for conf, want := range map[string]string{"bad.conf": "listeners.ratelimit_metrics_mapper: invalid label key: k", "absent.conf": "listeners.ratelimit_metrics_mapper: open "} {
		if _, err := Load(filepath.Join(dir, conf)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want a problem containing %q", conf, err, want)
		}
	}
}
