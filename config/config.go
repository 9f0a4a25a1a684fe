// Package config reads tokengate's one configuration file: listeners, the
// bucket store and its failure mode, the tokenizer's fallbacks, the prices
// that cost quotas charge, the policies that Envoy routes choose between,
// and the mapping of rate-limit service requests onto them (rls.go), with
// the import of envoyproxy/ratelimit's configuration (import.go).
//
// Decoding is strict: an unknown key is an error, as is a missing required
// field or an invalid value. Every problem in a file is reported at once,
// each with the file, the YAML line and the field path. A loaded Config is
// immutable.
package config

import (
	_ "embed"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/rls/rlconfig"
)

// Config is a whole tokengate configuration file. The zero value is not
// valid; use Load, Parse or Default.
type Config struct {
	Listeners     Listeners `yaml:"listeners"`
	Store         Store     `yaml:"store"`
	Tokenizer     Tokenizer `yaml:"tokenizer"`
	DefaultPolicy string    `yaml:"default_policy"`
	Policies      []Policy  `yaml:"policies"`
	// Namespace is the Envoy dynamic metadata namespace that token counts
	// are written to (S24).
	Namespace string `yaml:"metadata_namespace"`
	// PolicyMetadataKey is the gRPC initial metadata key that names a
	// route's policy (ExtProcPerRoute.overrides.grpc_initial_metadata).
	PolicyMetadataKey string `yaml:"policy_metadata_key"`
	// ShutdownGrace bounds how long in-flight streams may run after a stop
	// signal before they are settled and closed.
	ShutdownGrace time.Duration `yaml:"shutdown_grace"`
	// Pricing is the price table that cost quotas charge by (see package
	// pricing); left out, the shipped prices in USD, refusing unpriced
	// models.
	Pricing pricing.Config `yaml:"pricing"`

	// prices is Pricing's table, built once by validation.
	prices *pricing.Table

	// UsageBound bounds the usage a provider may report for a request.
	UsageBound UsageBound `yaml:"usage_bound"`
	// AdminAPI configures the admin API on listeners.admin (limits and
	// usage).
	AdminAPI AdminAPI `yaml:"admin_api"`
	// Metrics bounds what the metrics on listeners.admin label.
	Metrics Metrics `yaml:"metrics"`

	// RLS maps Envoy's rate-limit service requests onto policies (see
	// rls.go); nil serves none.
	RLS *RLS `yaml:"rls"`
	// Ratelimit names envoyproxy/ratelimit files read at start and on
	// reload, whose policies and domains are added (see ratelimit.go).
	Ratelimit *Ratelimit `yaml:"ratelimit"`

	// rlsTrees are RLS's domains, built once by validation.
	rlsTrees map[string]*RLSTree
	// source is the file as Parse read it, which WithRatelimitXDS parses
	// again with a snapshot's files.
	source struct {
		file string
		data []byte
	}
}

// Metrics bounds the labels of the GenAI metrics (package metrics): a model
// the price table prices is labelled with its entry's name; of the other
// models, the first MaxModels that an upstream answers successfully are
// labelled by name (as modelname.Key reads it) and the rest "other".
// Omitted, MaxModels is DefaultMaxModels; 0 labels by the price table only.
type Metrics struct {
	MaxModels *int `yaml:"max_models"`
}

// DefaultMaxModels is metrics.max_models when omitted, and MaxMaxModels
// the most it may be: each model label multiplies the series of the GenAI
// histograms.
const (
	DefaultMaxModels = 20
	MaxMaxModels     = 500
)

// UsageBound is what usage a provider may report before tokengate charges
// the bound instead (S8), by what the model can do: a prompt of at most
// Margin × the model's context window + Slack, an output of at most Margin
// × its maximum output (or the request's cap, when lower) × its choices +
// Slack; never below what the request was counted and reserved at. The
// model's limits come from the price table's model entries
// (pricing.models[].context_window, max_output_tokens); a model without
// them has ContextWindow and tokenizer.max_output_tokens. Margin covers
// server-side tool loops, several calls of the model in one request.
// Omitted fields take the defaults: 4, 4096 and 2,000,000.
type UsageBound struct {
	Margin        *float64 `yaml:"margin"`
	Slack         *int     `yaml:"slack"`
	ContextWindow int      `yaml:"context_window"`
}

// Prices returns the price table of the configuration's pricing section,
// built when the file was validated; nil for a Config that Load or Parse
// did not return.
func (c *Config) Prices() *pricing.Table { return c.prices }

// Listeners are the addresses tokengate listens on.
type Listeners struct {
	// GRPC serves ext_proc and the gRPC health service.
	GRPC string `yaml:"grpc"`
	// Admin serves /metrics, /healthz and /readyz over HTTP.
	Admin string `yaml:"admin"`
	// RatelimitMetrics serves, over HTTP at RatelimitMetricsPath on this
	// host:port, the rate-limit service's metrics under the names
	// envoyproxy/ratelimit's Prometheus output gives them (its USE_PROMETHEUS
	// listener, PROMETHEUS_ADDR: ratelimit_service_rate_limit_*{domain,
	// key1,key2} and the rest of its default mapping, docs/rls.md); ""
	// serves none. tokengate's own metrics stay on Admin.
	RatelimitMetrics string `yaml:"ratelimit_metrics"`
	// RatelimitMetricsPath is the path they are served at (PROMETHEUS_PATH).
	// Default /metrics.
	RatelimitMetricsPath string `yaml:"ratelimit_metrics_path"`
	// RatelimitMetricsMapper is a statsd_exporter mapping file that names
	// them instead of ratelimit's default mapping (PROMETHEUS_MAPPER_YAML:
	// Envoy Gateway's /etc/statsd-exporter/conf.yaml), read at start.
	RatelimitMetricsMapper string `yaml:"ratelimit_metrics_mapper"`
	// MaxRecvMsgBytes bounds one gRPC message from Envoy; a BUFFERED request
	// body travels as one message.
	MaxRecvMsgBytes int `yaml:"max_recv_msg_bytes"`
	// GRPCTLS serves ext_proc over TLS. With ClientCAFile set, only clients
	// presenting a certificate from that CA may connect (mTLS: Envoy's cluster
	// transport_socket with a client certificate). Nil serves plaintext.
	GRPCTLS *ListenerTLS `yaml:"grpc_tls"`
	// AdminTLS serves the admin endpoints over HTTPS; nil serves plain HTTP.
	AdminTLS *ListenerTLS `yaml:"admin_tls"`
	// MaxStreams bounds the ext_proc streams open at once; one more is
	// refused with RESOURCE_EXHAUSTED. Default 10000.
	MaxStreams int `yaml:"max_streams"`
	// StreamIdleTimeout ends a stream on which Envoy sends nothing for this
	// long (its reservation is settled as aborted). It is also how long a
	// reservation stays settleable in the store past its last renewal.
	// Default 10m.
	StreamIdleTimeout time.Duration `yaml:"stream_idle_timeout"`
	// MaxEventBytes bounds one server-sent event held back while its end
	// is awaited; a stream past it is forwarded unread and charged its
	// reservation. Default 4 MiB.
	MaxEventBytes int `yaml:"max_event_bytes"`
	// MaxConnectionAge ends a gRPC connection this long after it opened
	// (GOAWAY, with gRPC's jitter of 10%), so that Envoy reconnects and
	// its load spreads over replicas added since; 0 keeps connections.
	// Streams open on the old connection go on for up to
	// MaxConnectionAgeGrace (0: until they end), then it is closed.
	MaxConnectionAge      time.Duration `yaml:"max_connection_age"`
	MaxConnectionAgeGrace time.Duration `yaml:"max_connection_age_grace"`
	// Insecure allows, for a mesh whose sidecar provides mTLS, the ext_proc
	// listener on a non-loopback address without client certificates, and
	// the admin API on a non-loopback address without admin_tls. Without it
	// such listeners are refused: anyone who reaches the ext_proc port could
	// send any identity and drain any bucket, and the admin API's token
	// and identity values would travel in clear.
	Insecure bool `yaml:"insecure"`
}

// ListenerTLS is a listener's TLS: its certificate and, optionally, the CA
// that client certificates must chain to. The files are read again when
// they change on disk, so certificates rotate without a restart.
type ListenerTLS struct {
	CertFile     string `yaml:"cert_file"`
	KeyFile      string `yaml:"key_file"`
	ClientCAFile string `yaml:"client_ca_file"`
}

// Store chooses where bucket state lives (S20) and what happens when it is
// unreachable (S21).
type Store struct {
	Type  string `yaml:"type"` // memory or redis
	Redis Redis  `yaml:"redis"`
	// OnFailure is "closed" (refuse with 503) or "open" (admit against the
	// local fallback limit).
	OnFailure string `yaml:"on_failure"`
	// Fallback is the local per-bucket limit used while failing open.
	Fallback *Rate `yaml:"fallback"`
	// Fleet, with the Redis store failing open, makes Fallback the limit of
	// the whole fleet: each gateway takes Fallback divided by the gateways
	// alive (they heartbeat in Redis), never below Floor.
	Fleet *Fleet `yaml:"fleet"`
	// ReplayFile, with the redis store, is where a gateway that stops
	// while Redis does not answer saves the writes Redis missed (settlements,
	// outage spend), replayed at its next start; empty loses them.
	ReplayFile string `yaml:"replay_file"`
}

// Fleet divides the fail-open fallback among the gateways sharing Redis.
type Fleet struct {
	// Heartbeat is how often a gateway announces itself; zero means 1s.
	Heartbeat time.Duration `yaml:"heartbeat"`
	// Floor is the least fallback a gateway keeps however many share it.
	Floor *Rate `yaml:"floor"`
}

// Redis configures the Redis store; one address is a standalone server
// (host:port, or unix:PATH for its unix socket), several (or Cluster) a
// Redis Cluster; with Sentinel, the master its sentinels name.
type Redis struct {
	Addrs       []string  `yaml:"addrs"`
	Sentinel    *Sentinel `yaml:"sentinel"`
	Cluster     bool      `yaml:"cluster"`
	Username    string    `yaml:"username"`
	PasswordEnv string    `yaml:"password_env"`
	// AuthEnv names a variable holding envoyproxy/ratelimit's REDIS_AUTH:
	// user:password, or the password alone (split at the first colon, as
	// ratelimit splits it). It replaces username and password_env.
	AuthEnv     string        `yaml:"auth_env"`
	DB          int           `yaml:"db"`
	TLS         *TLS          `yaml:"tls"`
	KeyPrefix   string        `yaml:"key_prefix"`
	DialTimeout time.Duration `yaml:"dial_timeout"`
	Timeout     time.Duration `yaml:"timeout"`
	PoolSize    int           `yaml:"pool_size"`
	// SettleWindow is how long a settlement nobody waits for (ext_proc's,
	// settled at stream end) or a deferred charge (rls.deferred_charges)
	// waits in the gateway for a call to Redis to join before it is sent on
	// its own: longer shares script calls among more requests at low load,
	// and leaves Redis that much later in seeing them. Default 2ms, at most
	// MaxSettleWindow.
	SettleWindow time.Duration `yaml:"settle_window"`
}

// MaxSettleWindow bounds store.redis.settle_window: what a gateway holds
// back from Redis is what other gateways do not see, and what a crash of
// this one loses; past a few milliseconds a longer window shares little
// more, and a stream waits for its settlement's answer (2s at most) before
// it ends.
const MaxSettleWindow = 100 * time.Millisecond

// MaxBodyBytes is the largest listeners.max_recv_msg_bytes: a request body
// of 1 GiB, a gRPC receive limit of 2 GiB.
const MaxBodyBytes = 1 << 30

// Sentinel reaches the master of a Redis Sentinel deployment: the store
// asks the sentinels at Addrs for the master named Master, and follows it
// when they fail over. Username and PasswordEnv authenticate to the
// sentinels (Redis's own username and password_env to the master); tls
// applies to both.
type Sentinel struct {
	Master      string   `yaml:"master"`
	Addrs       []string `yaml:"addrs"`
	Username    string   `yaml:"username"`
	PasswordEnv string   `yaml:"password_env"`
	// AuthEnv is ratelimit's REDIS_SENTINEL_AUTH, as Redis.AuthEnv.
	AuthEnv string `yaml:"auth_env"`
}

// UnixSocket reports whether addr, a listener's or Redis's address, names
// a unix socket (unix:PATH, or gRPC's unix://PATH), and its path.
func UnixSocket(addr string) (path string, ok bool) {
	if rest, ok := strings.CutPrefix(addr, "unix://"); ok {
		return rest, true
	}
	return strings.CutPrefix(addr, "unix:")
}

// TLS configures TLS to Redis.
type TLS struct {
	CAFile             string `yaml:"ca_file"`
	CertFile           string `yaml:"cert_file"`
	KeyFile            string `yaml:"key_file"`
	ServerName         string `yaml:"server_name"`
	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
}

// Rate is a tokens-per-minute limit with an optional burst (S1).
type Rate struct {
	TokensPerMinute float64 `yaml:"tokens_per_minute"`
	Burst           float64 `yaml:"burst"`
}

// Tokenizer configures token counting.
type Tokenizer struct {
	// FallbackEncoding counts models no rule knows ("" refuses them).
	FallbackEncoding string `yaml:"fallback_encoding"`
	// DefaultOutputTokens is the output allowance of a request without a
	// cap before history has taught an estimate (S7).
	DefaultOutputTokens int `yaml:"default_output_tokens"`
	// MaxOutputTokens is the largest output cap a request may carry; more is
	// refused as absurd.
	MaxOutputTokens int `yaml:"max_output_tokens"`
}

// Policy is one set of limits that a route can choose.
type Policy struct {
	Name        string        `yaml:"name"`
	Identities  []Identity    `yaml:"identities"`
	Anonymous   string        `yaml:"anonymous"` // shared or reject
	Buckets     []Bucket      `yaml:"buckets"`
	Concurrency []Concurrency `yaml:"concurrency"`
	Wait        *Wait         `yaml:"wait"`
	// MaxOutputTokens is a hard per-request output cap (S14); 0 is none.
	MaxOutputTokens int `yaml:"max_output_tokens"`
	// ClampOutput rewrites the body's output cap to what was reserved.
	ClampOutput *bool `yaml:"clamp_output"`
	// InjectUsage asks OpenAI streams for usage (S15); default true.
	InjectUsage *bool `yaml:"inject_usage"`
	// PriorityHeader marks priority traffic (S19) when set to true or 1.
	PriorityHeader string `yaml:"priority_header"`
	// UnknownEndpoints is what happens to a request whose path and body
	// match no API tokengate meters: refuse (400 unknown_api, the
	// default), pass (unmetered) or charge (UnknownEndpointTokens, flat).
	UnknownEndpoints string `yaml:"unknown_endpoints"`
	// UnknownEndpointTokens is the flat cost with unknown_endpoints: charge.
	UnknownEndpointTokens int `yaml:"unknown_endpoint_tokens"`
	// Quotas are budgets over calendar windows, charged with the buckets.
	Quotas []Quota `yaml:"quotas"`
	// Tier says where a request's tier is found (a header or a claim);
	// Tiers are the limits each tier gets (see overrides.go).
	Tier  *TierSource `yaml:"tier"`
	Tiers []Tier      `yaml:"tiers"`
	// Overrides give single identities limits of their own.
	Overrides []Override `yaml:"overrides"`
}

// Quota is a budget per calendar window: a day, an ISO week or a month in a
// time zone, in tokens or in money (the pricing currency). Exactly one of
// Tokens and Cost is set.
type Quota struct {
	Name string `yaml:"name"`
	// Per is an identity name, "model", or empty for one global quota.
	Per string `yaml:"per"`
	// Window is day, week or month; Timezone an IANA zone name ("UTC",
	// "Europe/Amsterdam"), required.
	Window   string `yaml:"window"`
	Timezone string `yaml:"timezone"`
	// Tokens is a budget of tokens per window.
	Tokens int `yaml:"tokens"`
	// Cost is a budget of money per window, a plain decimal in the pricing
	// currency such as "500" or "2000.50".
	Cost string `yaml:"cost"`
	// Hard meters streams live against the budget and cuts them when it
	// runs out (S14).
	Hard bool `yaml:"hard"`
}

// Identity says where one identity of a request is found (S9a): a header set
// by an auth filter, or a key in forwarded dynamic metadata (JWT claims).
type Identity struct {
	Name     string `yaml:"name"`
	Header   string `yaml:"header"`
	Metadata string `yaml:"metadata"` // dynamic metadata namespace
	Path     string `yaml:"path"`     // dotted path inside that namespace
	// Hash stores a digest instead of the value (always on for API keys).
	Hash bool `yaml:"hash"`
}

// Bucket is one bucket of a policy's chain (S10).
type Bucket struct {
	Name string `yaml:"name"`
	// Per is an identity name, "model", or empty for one global bucket.
	Per             string         `yaml:"per"`
	TokensPerMinute float64        `yaml:"tokens_per_minute"`
	Burst           float64        `yaml:"burst"`
	ProviderLimit   *ProviderLimit `yaml:"provider_limit"`
	Hard            bool           `yaml:"hard"`
	MaxDebt         float64        `yaml:"max_debt"`
	// Lease lets each gateway take a slice of the bucket from Redis and
	// admit against it locally (S20); unset meters every request in Redis.
	Lease *Lease `yaml:"lease"`
}

// Lease is a bucket's allotted sub-budget on each gateway of a fleet (S20):
// `lease: auto` sizes each lease from the rate the gateway admits; a
// mapping sets Size (tokens per lease; omitted or 0: from the rate) and TTL
// (how long unused tokens stay on a gateway; omitted: 1s).
type Lease struct {
	Size float64       `yaml:"size"`
	TTL  time.Duration `yaml:"ttl"`
}

// UnmarshalYAML reads `auto` as the zero Lease, and a mapping as its fields.
func (l *Lease) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode && n.Value == "auto" {
		*l = Lease{}
		return nil
	}
	type plain Lease
	return n.Decode((*plain)(l))
}

// ProviderLimit configures a bucket from the provider's own limit (S19).
type ProviderLimit struct {
	TokensPerMinute float64  `yaml:"tokens_per_minute"`
	SafetyFactor    *float64 `yaml:"safety_factor"` // default 0.9
	// PriorityHeadroom is the fraction of the capacity only priority
	// traffic may use.
	PriorityHeadroom float64 `yaml:"priority_headroom"`
}

// Concurrency caps requests in flight per key (S11).
type Concurrency struct {
	Name  string        `yaml:"name"`
	Per   string        `yaml:"per"`
	Max   int           `yaml:"max"`
	Lease time.Duration `yaml:"lease"`
}

// Wait lets a short request wait instead of being refused (S12).
type Wait struct {
	MaxWait  time.Duration `yaml:"max_wait"`
	MaxQueue int           `yaml:"max_queue"`
}

// Problem is one thing wrong with a configuration file.
type Problem struct {
	File  string
	Line  int
	Field string
	Msg   string
}

func (p Problem) Error() string {
	var b strings.Builder
	b.WriteString(p.File)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
	}
	if p.Field != "" {
		b.WriteString(": ")
		b.WriteString(p.Field)
	}
	b.WriteString(": ")
	b.WriteString(p.Msg)
	return b.String()
}

// Problems is every problem found in one file; it is the error Load and
// Parse return.
type Problems []Problem

func (ps Problems) Error() string {
	lines := make([]string, len(ps))
	for i, p := range ps {
		lines[i] = p.Error()
	}
	return strings.Join(lines, "\n")
}

//go:embed default.yaml
var defaultYAML []byte

// DefaultYAML is the embedded configuration used when none is given.
func DefaultYAML() []byte { return defaultYAML }

// Default returns the embedded default configuration: the memory store and
// the documented default policy.
func Default() *Config {
	c, err := Parse("embedded default", defaultYAML)
	if err != nil {
		panic("embedded default configuration is invalid: " + err.Error())
	}
	return c
}

// Load reads and validates the file at path.
func Load(path string) (*Config, error) {
	data, err := ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// MaxFileBytes bounds a file that serve, reload or validate reads: a
// tokengate configuration or an Envoy YAML file. The largest real ones
// are a few hundred KiB, and a larger file would hold its whole decoded
// tree in memory.
const MaxFileBytes = 8 << 20

// ReadFile reads a configuration file of at most MaxFileBytes, and refuses
// a larger one without reading past the limit.
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxFileBytes {
		return nil, fmt.Errorf("%s: the file is larger than %d MiB, the most tokengate reads", path, MaxFileBytes>>20)
	}
	return data, nil
}

// Parse decodes and validates a configuration; file names it in problems.
func Parse(file string, data []byte) (*Config, error) {
	return parse(file, data, nil)
}

// parse is Parse with the files of an xDS snapshot (ratelimit.xds) imported
// beside ratelimit.files.
func parse(file string, data []byte, xds []*rlconfig.File) (*Config, error) {
	v := &validator{file: file, lines: map[string]int{}}
	var root yaml.Node
	if err := yaml.Unmarshal(data, &root); err != nil {
		v.syntaxError(err)
		return nil, v.problems
	}
	if len(root.Content) == 0 {
		return nil, Problems{{File: file, Msg: "the file is empty"}}
	}
	// Strictness: the node tree is walked against the struct fields first,
	// so every unknown key and every value of the wrong type is reported,
	// each with its path. Values are checked unless one failed to decode (it
	// would be reported again as its zero value, wrongly); unknown keys do
	// not stop them.
	v.walk(root.Content[0], "", configShape)
	if v.badValues > 0 {
		return nil, v.sorted()
	}
	var c Config
	if err := root.Content[0].Decode(&c); err != nil {
		v.decodeError(err)
		return nil, v.sorted()
	}
	v.importRatelimit(&c, xds)
	c.applyDefaults()
	v.validate(&c)
	if len(v.problems) > 0 {
		return nil, v.sorted()
	}
	c.source.file, c.source.data = file, data
	return &c, nil
}

func (v *validator) sorted() Problems {
	sort.SliceStable(v.problems, func(i, j int) bool { return v.problems[i].Line < v.problems[j].Line })
	return v.problems
}

// Policy returns the policy with the given name.
func (c *Config) Policy(name string) (Policy, bool) {
	for _, p := range c.Policies {
		if p.Name == name {
			return p, true
		}
	}
	return Policy{}, false
}

func (c *Config) applyDefaults() {
	if c.Listeners.GRPC == "" {
		c.Listeners.GRPC = "127.0.0.1:50051"
	}
	if c.Listeners.Admin == "" {
		c.Listeners.Admin = "127.0.0.1:9090"
	}
	if c.Listeners.MaxRecvMsgBytes == 0 {
		c.Listeners.MaxRecvMsgBytes = 64 << 20
	}
	if c.Listeners.MaxStreams == 0 {
		c.Listeners.MaxStreams = 10000
	}
	if c.Listeners.StreamIdleTimeout == 0 {
		c.Listeners.StreamIdleTimeout = 10 * time.Minute
	}
	if c.Listeners.MaxEventBytes == 0 {
		c.Listeners.MaxEventBytes = 4 << 20
	}
	if c.UsageBound.Margin == nil {
		m := 4.0
		c.UsageBound.Margin = &m
	}
	if c.UsageBound.Slack == nil {
		s := 4096
		c.UsageBound.Slack = &s
	}
	if c.UsageBound.ContextWindow == 0 {
		c.UsageBound.ContextWindow = 2_000_000
	}
	if c.Metrics.MaxModels == nil {
		n := DefaultMaxModels
		c.Metrics.MaxModels = &n
	}
	if c.Store.Type == "" {
		c.Store.Type = "memory"
	}
	if c.Store.OnFailure == "" {
		c.Store.OnFailure = "closed"
	}
	if c.Store.Redis.KeyPrefix == "" {
		c.Store.Redis.KeyPrefix = "tokengate:"
	}
	if c.Store.Redis.DialTimeout == 0 {
		c.Store.Redis.DialTimeout = time.Second
	}
	if c.Store.Redis.Timeout == 0 {
		c.Store.Redis.Timeout = 250 * time.Millisecond
	}
	if c.Store.Redis.SettleWindow == 0 {
		c.Store.Redis.SettleWindow = buckets.DefaultSettleWindow
	}
	if c.Tokenizer.DefaultOutputTokens == 0 {
		c.Tokenizer.DefaultOutputTokens = 1024
	}
	if c.Tokenizer.MaxOutputTokens == 0 {
		c.Tokenizer.MaxOutputTokens = 1 << 20
	}
	if c.Namespace == "" {
		c.Namespace = "tokengate"
	}
	if c.PolicyMetadataKey == "" {
		c.PolicyMetadataKey = "x-tokengate-policy"
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = 30 * time.Second
	}
	if c.DefaultPolicy == "" && len(c.Policies) == 1 {
		c.DefaultPolicy = c.Policies[0].Name
	}
	for i := range c.Policies {
		p := &c.Policies[i]
		if p.Anonymous == "" {
			p.Anonymous = "shared"
		}
		if p.UnknownEndpoints == "" {
			p.UnknownEndpoints = "refuse"
		}
		for j := range p.Concurrency {
			if p.Concurrency[j].Lease == 0 {
				p.Concurrency[j].Lease = 10 * time.Minute
			}
		}
	}
}

// WithListeners returns a copy of c whose listener addresses are replaced
// by grpc and admin where those are not empty (serve's --grpc and --admin
// flags), checked by the rules the file's listeners follow: their form,
// and who may reach them (validateExposure).
func (c *Config) WithListeners(grpc, admin string) (*Config, error) {
	n := *c
	if grpc != "" {
		n.Listeners.GRPC = grpc
	}
	if admin != "" {
		n.Listeners.Admin = admin
	}
	v := &validator{file: "flags", lines: map[string]int{}}
	v.validateListeners(&n.Listeners)
	v.validateExposure(&n)
	if len(v.problems) > 0 {
		return nil, v.problems
	}
	return &n, nil
}

// RatelimitMetricsAt is the path of listeners.ratelimit_metrics in force:
// RatelimitMetricsPath, or /metrics, as ratelimit's PROMETHEUS_PATH.
func (l Listeners) RatelimitMetricsAt() string {
	if l.RatelimitMetricsPath == "" {
		return "/metrics"
	}
	return l.RatelimitMetricsPath
}
