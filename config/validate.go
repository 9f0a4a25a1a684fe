package config

import (
	"fmt"
	"maps"
	"math"
	"net"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/statsdmap"
	"github.com/tokengate/tokengate/pricing"
)

// validator collects every problem of one file.
type validator struct {
	file     string
	lines    map[string]int // field path → line
	problems Problems
	// badValues counts values of the wrong type; unknown keys do not count,
	// so they do not hide problems with the values around them.
	badValues int
	// rlsGiven lists, per policy, the identities that rls descriptors give
	// (see rlsIdentities).
	rlsGiven map[string]map[string]bool
}

var (
	configShape  = reflect.TypeOf(Config{})
	durationType = reflect.TypeOf(time.Duration(0))
	leaseType    = reflect.TypeOf(Lease{})
	amountType   = reflect.TypeOf(Amount(""))
	metadataType = reflect.TypeOf(RLSMetadata{})
)

func (v *validator) add(path, format string, args ...any) {
	v.problems = append(v.problems, Problem{File: v.file, Line: v.line(path), Field: path, Msg: fmt.Sprintf(format, args...)})
}

// line finds the line of path, or of its nearest ancestor that is in the file.
func (v *validator) line(path string) int {
	for p := path; p != ""; p = parent(p) {
		if l, ok := v.lines[p]; ok {
			return l
		}
	}
	return 0
}

func parent(path string) string {
	i := strings.LastIndexAny(path, ".[")
	if i < 0 {
		return ""
	}
	return path[:i]
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

var lineRE = regexp.MustCompile(`^(?:yaml: )?line (\d+): (.*)$`)

// syntaxError turns a YAML parser error into a problem with its line.
func (v *validator) syntaxError(err error) {
	p := Problem{File: v.file, Msg: strings.TrimPrefix(err.Error(), "yaml: ")}
	if m := lineRE.FindStringSubmatch(err.Error()); m != nil {
		p.Line, _ = strconv.Atoi(m[1]) // the pattern matched digits
		p.Msg = m[2]
	}
	v.problems = append(v.problems, p)
}

// walk checks the shape of the document against the Go type before any
// value is decoded: every unknown key and every value of the wrong kind is
// reported with its own field path (the decoder's errors name only a line,
// which in a flow mapping holds several fields). It records the line of
// every field it passes.
func (v *validator) walk(n *yaml.Node, path string, t reflect.Type) {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // an empty value leaves the field unset
	}
	if t == metadataType {
		v.checkMetadata(n, path) // any values: what a Struct holds
		return
	}
	if t == leaseType && n.Kind == yaml.ScalarNode {
		if n.Value != "auto" {
			v.addAt(n, path, "want auto or a mapping with size and ttl, got %s", describe(n))
		}
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			v.addAt(n, path, "want a mapping of keys, got %s", describe(n))
			return
		}
		fields := yamlFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, val := n.Content[i], n.Content[i+1]
			p := join(path, key.Value)
			v.lines[p] = key.Line
			ft, ok := fields[key.Value]
			if !ok {
				v.problems = append(v.problems, Problem{File: v.file, Line: key.Line, Field: p,
					Msg: fmt.Sprintf("unknown key %q (known: %s)", key.Value, knownKeys(fields))})
				continue
			}
			v.walk(val, p, ft)
		}
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			v.addAt(n, path, "want a mapping, got %s", describe(n))
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			p := join(path, n.Content[i].Value)
			v.lines[p] = n.Content[i].Line
			v.walk(n.Content[i+1], p, t.Elem())
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			v.addAt(n, path, "want a list, got %s", describe(n))
			return
		}
		for i, c := range n.Content {
			p := fmt.Sprintf("%s[%d]", path, i)
			v.lines[p] = c.Line
			v.walk(c, p, t.Elem())
		}
	default:
		if n.Kind != yaml.ScalarNode {
			v.addAt(n, path, "want %s, got %s", want(t), describe(n))
			return
		}
		if err := n.Decode(reflect.New(t).Interface()); err != nil {
			v.addAt(n, path, "want %s, got %q", want(t), n.Value)
		}
	}
}

// addAt reports a problem at a node's own line.
func (v *validator) addAt(n *yaml.Node, path, format string, args ...any) {
	v.badValues++
	v.problems = append(v.problems, Problem{File: v.file, Line: n.Line, Field: path, Msg: fmt.Sprintf(format, args...)})
}

func want(t reflect.Type) string {
	switch {
	case t == durationType:
		return "a duration such as 500ms, 30s or 10m"
	case t == amountType:
		return `an amount such as "2000.50"`
	case t.Kind() == reflect.Float64:
		return "a number"
	case t.Kind() == reflect.Int:
		return "a whole number"
	case t.Kind() == reflect.Bool:
		return "true or false"
	}
	return "a string"
}

func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return strconv.Quote(n.Value)
}

func yamlFields(t reflect.Type) map[string]reflect.Type {
	m := make(map[string]reflect.Type, t.NumField())
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		switch {
		case opts == "inline" && f.Type.Kind() == reflect.Struct:
			maps.Copy(m, yamlFields(f.Type))
		case name != "" && name != "-" && f.IsExported():
			m[name] = f.Type
		}
	}
	return m
}

func knownKeys(fields map[string]reflect.Type) string {
	keys := make([]string, 0, len(fields))
	for k := range fields {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return strings.Join(keys, ", ")
}

// decodeError reports what the decoder found that the walk did not (a
// duplicate key, for one).
func (v *validator) decodeError(err error) {
	te, ok := err.(*yaml.TypeError)
	if !ok {
		v.syntaxError(err)
		return
	}
	for _, e := range te.Errors {
		p := Problem{File: v.file, Msg: e}
		if m := lineRE.FindStringSubmatch(e); m != nil {
			p.Line, _ = strconv.Atoi(m[1]) // the pattern matched digits
			p.Msg = m[2]
		}
		v.problems = append(v.problems, p)
	}
}

// Known tokenizer encodings that a fallback may name.
var encodings = map[string]bool{"o200k_base": true, "cl100k_base": true}

// nameRE is what every name in the file (policy, identity, bucket,
// concurrency limit) must match: names become parts of store keys, metric
// labels and error bodies.
var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]*$`)

// metadataKeyRE is a gRPC metadata key as Envoy sends it: lower case.
var metadataKeyRE = regexp.MustCompile(`^[a-z0-9_.-]+$`)

// validate checks every field's value; it runs after defaults are applied.
func (v *validator) validate(c *Config) {
	v.rlsGiven = rlsIdentities(c.RLS)
	v.validateListeners(&c.Listeners)
	v.validateListenerTLS(c)
	v.validateStore(&c.Store)
	v.validateUsageBound(&c.UsageBound)
	if n := *c.Metrics.MaxModels; n < 0 || n > MaxMaxModels {
		v.add("metrics.max_models", "must be between 0 (label models of the price table only) and %d, got %d", MaxMaxModels, n)
	}
	v.validateAdminAPI(&c.AdminAPI)
	if f := c.Tokenizer.FallbackEncoding; f != "" && !encodings[f] {
		v.add("tokenizer.fallback_encoding", "unknown encoding %q (use o200k_base or cl100k_base, or leave it empty to refuse unknown models)", f)
	}
	if c.Tokenizer.DefaultOutputTokens < 0 {
		v.add("tokenizer.default_output_tokens", "must not be negative, got %d", c.Tokenizer.DefaultOutputTokens)
	}
	if c.Tokenizer.MaxOutputTokens < c.Tokenizer.DefaultOutputTokens {
		v.add("tokenizer.max_output_tokens", "must be at least default_output_tokens (%d), got %d", c.Tokenizer.DefaultOutputTokens, c.Tokenizer.MaxOutputTokens)
	}
	if !metadataKeyRE.MatchString(c.PolicyMetadataKey) || strings.HasSuffix(c.PolicyMetadataKey, "-bin") {
		v.add("policy_metadata_key", "%q is not a gRPC metadata key: lower-case letters, digits, '-', '_' or '.', not ending in -bin", c.PolicyMetadataKey)
	}
	if len(c.Policies) == 0 && (c.Ratelimit == nil || c.Ratelimit.XDS == nil) {
		v.add("policies", "at least one policy is required")
	}
	if c.ShutdownGrace < 0 {
		v.add("shutdown_grace", "must not be negative, got %s", c.ShutdownGrace)
	}
	names := map[string]int{}
	for i := range c.Policies {
		path := fmt.Sprintf("policies[%d]", i)
		p := &c.Policies[i]
		if p.Name == "" {
			v.add(join(path, "name"), "is required")
		} else if j, dup := names[p.Name]; dup {
			v.add(join(path, "name"), "policy %q is already defined at policies[%d]", p.Name, j)
		} else {
			names[p.Name] = i
		}
		v.validatePolicy(path, p)
	}
	v.validateSharedProviders(c)
	v.validateLeases(c)
	v.validatePricing(c)
	v.validateRLS(c)
	if c.DefaultPolicy == "" {
		if len(c.Policies) > 1 {
			v.add("default_policy", "is required when there is more than one policy")
		}
	} else if _, ok := names[c.DefaultPolicy]; !ok && len(c.Policies) > 0 {
		v.add("default_policy", "names policy %q, which is not defined", c.DefaultPolicy)
	}
}

func (v *validator) validateListeners(l *Listeners) {
	if err := listenAddr(l.GRPC); err != nil {
		v.add("listeners.grpc", "%v", err)
	}
	if _, unix := UnixSocket(l.Admin); unix {
		v.add("listeners.admin", "%q: the admin listener takes host:port, not a unix socket: probes, scrapes and tokengate health reach it over TCP", l.Admin)
	} else if err := hostPort(l.Admin); err != nil {
		v.add("listeners.admin", "%v", err)
	}
	if l.GRPC == l.Admin && !strings.HasSuffix(l.GRPC, ":0") {
		v.add("listeners.admin", "%q is also listeners.grpc; the two listeners need different addresses", l.Admin)
	}
	if a := l.RatelimitMetrics; a != "" {
		switch _, unix := UnixSocket(a); {
		case unix:
			v.add("listeners.ratelimit_metrics", "%q: takes host:port, not a unix socket: Prometheus scrapes it over TCP", a)
		case hostPort(a) != nil:
			v.add("listeners.ratelimit_metrics", "%v", hostPort(a))
		case strings.HasSuffix(a, ":0"):
		case a == l.GRPC, a == l.Admin:
			v.add("listeners.ratelimit_metrics", "%q is also listeners.grpc or listeners.admin; it needs an address of its own", a)
		}
	}
	if p := l.RatelimitMetricsPath; p != "" && (l.RatelimitMetrics == "" || !strings.HasPrefix(p, "/") || strings.ContainsAny(p, "?# ")) {
		if l.RatelimitMetrics == "" {
			v.add("listeners.ratelimit_metrics_path", "applies to listeners.ratelimit_metrics, which is not set")
		} else {
			v.add("listeners.ratelimit_metrics_path", "%q: want a URL path starting with / (default /metrics)", p)
		}
	}
	if f := l.RatelimitMetricsMapper; f != "" {
		switch {
		case l.RatelimitMetrics == "":
			v.add("listeners.ratelimit_metrics_mapper", "applies to listeners.ratelimit_metrics, which is not set")
		default:
			if !filepath.IsAbs(f) {
				l.RatelimitMetricsMapper = filepath.Join(filepath.Dir(v.file), f)
			}
			data, err := ReadFile(l.RatelimitMetricsMapper)
			if err == nil {
				_, err = statsdmap.Parse(data)
			}
			if err != nil {
				v.add("listeners.ratelimit_metrics_mapper", "%v", err)
			}
		}
	}
	switch {
	case l.MaxRecvMsgBytes < 1<<20:
		v.add("listeners.max_recv_msg_bytes", "must be at least 1048576 (a BUFFERED request body travels as one message), got %d", l.MaxRecvMsgBytes)
	case l.MaxRecvMsgBytes > MaxBodyBytes:
		v.add("listeners.max_recv_msg_bytes", "must be at most %d (1 GiB; the gRPC receive limit is twice it, and a gRPC message is at most 4 GiB), got %d", MaxBodyBytes, l.MaxRecvMsgBytes)
	}
	if l.MaxStreams < 1 {
		v.add("listeners.max_streams", "must be at least 1, got %d", l.MaxStreams)
	}
	if l.MaxConnectionAge < 0 {
		v.add("listeners.max_connection_age", "must not be negative (0 keeps connections), got %s", l.MaxConnectionAge)
	}
	if l.MaxConnectionAgeGrace < 0 {
		v.add("listeners.max_connection_age_grace", "must not be negative (0 lets streams run until they end), got %s", l.MaxConnectionAgeGrace)
	} else if l.MaxConnectionAgeGrace > 0 && l.MaxConnectionAge == 0 {
		v.add("listeners.max_connection_age_grace", "applies to listeners.max_connection_age, which is not set")
	}
	if l.StreamIdleTimeout < time.Second {
		v.add("listeners.stream_idle_timeout", "must be at least 1s (longer than the longest silence of an upstream), got %s", l.StreamIdleTimeout)
	}
	if l.MaxEventBytes < 64<<10 {
		v.add("listeners.max_event_bytes", "must be at least 65536 (one server-sent event of an ordinary stream must fit), got %d", l.MaxEventBytes)
	}
}

// validateUsageBound checks the bound on reported usage.
func (v *validator) validateUsageBound(u *UsageBound) {
	if m := *u.Margin; !finite(m) || m < 1 {
		v.add("usage_bound.margin", "must be a number of at least 1 (reported usage up to margin × what the model can do), got %v", m)
	}
	if s := *u.Slack; s < 1 {
		v.add("usage_bound.slack", "must be at least 1 (tokens allowed beyond margin × what the model can do), got %d", s)
	}
	if w := u.ContextWindow; w < 1 {
		v.add("usage_bound.context_window", "must be at least 1 (the context window of a model the price table gives none for, in tokens), got %d", w)
	}
}

// listenAddr checks an address that a listener or a Redis dialer will
// take: host:port, or an absolute unix socket path.
func listenAddr(addr string) error {
	path, ok := UnixSocket(addr)
	if !ok {
		return hostPort(addr)
	}
	if !filepath.IsAbs(path) {
		return fmt.Errorf("%q: a unix socket needs an absolute path (unix:/run/tokengate/grpc.sock)", addr)
	}
	return nil
}

// hostPort checks an address that net.Listen or a Redis dialer will take:
// host:port with a numeric port.
func hostPort(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port (e.g. 127.0.0.1:9090 or :9090)", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("%q: port %q is not a number from 0 to 65535", addr, port)
	}
	return nil
}

// validateSentinel checks store.redis.sentinel: the master's name and the
// sentinels' addresses, and nothing that contradicts them.
func (v *validator) validateSentinel(r *Redis) {
	sn := r.Sentinel
	if sn.Master == "" {
		v.add("store.redis.sentinel.master", "is required: the name the sentinels know the master by (SENTINEL GET-MASTER-ADDR-BY-NAME)")
	}
	if len(sn.Addrs) == 0 {
		v.add("store.redis.sentinel.addrs", "at least one sentinel address is required")
	}
	for i, a := range sn.Addrs {
		if err := hostPort(a); err != nil {
			v.add(fmt.Sprintf("store.redis.sentinel.addrs[%d]", i), "%v", err)
		}
	}
	if sn.AuthEnv != "" && (sn.Username != "" || sn.PasswordEnv != "") {
		v.add("store.redis.sentinel.auth_env", "carries the user and the password (user:password, or the password alone): set it or username and password_env")
	}
	if len(r.Addrs) > 0 {
		v.add("store.redis.addrs", "is set together with store.redis.sentinel: the sentinels name the master; set one of the two")
	}
	if r.Cluster {
		v.add("store.redis.cluster", "does not go with store.redis.sentinel: Sentinel serves one master and its replicas")
	}
}

func (v *validator) validateStore(s *Store) {
	switch s.Type {
	case "memory":
		if _, given := v.lines["store.redis"]; given {
			// A fleet whose store is left at memory meters on each
			// gateway alone: each admits the whole limit (S20).
			v.add("store.redis", "only applies with store.type: redis; the store is memory, which each gateway keeps for itself")
		}
	case "redis":
		r := &s.Redis
		switch {
		case r.Sentinel != nil:
			v.validateSentinel(r)
		case len(r.Addrs) == 0:
			v.add("store.redis.addrs", "at least one address is required for the redis store (or store.redis.sentinel)")
		}
		for i, a := range r.Addrs {
			if err := listenAddr(a); err != nil {
				v.add(fmt.Sprintf("store.redis.addrs[%d]", i), "%v", err)
			} else if _, unix := UnixSocket(a); unix && (len(r.Addrs) > 1 || r.Cluster) {
				v.add(fmt.Sprintf("store.redis.addrs[%d]", i), "%q: a unix socket reaches one standalone Redis, not a cluster", a)
			}
		}
		if r.AuthEnv != "" && (r.Username != "" || r.PasswordEnv != "") {
			v.add("store.redis.auth_env", "carries the user and the password (user:password, or the password alone): set it or username and password_env")
		}
		if r.DialTimeout < 0 {
			v.add("store.redis.dial_timeout", "must not be negative, got %s", r.DialTimeout)
		}
		if r.Timeout < 0 {
			v.add("store.redis.timeout", "must not be negative, got %s", r.Timeout)
		}
		if r.SettleWindow < 0 || r.SettleWindow > MaxSettleWindow {
			v.add("store.redis.settle_window", "must be between 0 (the default, %s) and %s, got %s: settlements and deferred charges wait this long before Redis sees them", buckets.DefaultSettleWindow, MaxSettleWindow, r.SettleWindow)
		}
		if r.DB < 0 {
			v.add("store.redis.db", "must not be negative, got %d", r.DB)
		}
		if r.Cluster && r.DB != 0 {
			v.add("store.redis.db", "Redis Cluster has only database 0")
		}
		if r.PoolSize < 0 {
			v.add("store.redis.pool_size", "must not be negative (0 means go-redis's default), got %d", r.PoolSize)
		}
		if t := r.TLS; t != nil && (t.CertFile == "") != (t.KeyFile == "") {
			v.add("store.redis.tls", "cert_file and key_file go together")
		}
	default:
		v.add("store.type", "must be memory or redis, got %q", s.Type)
	}
	switch s.OnFailure {
	case "closed":
		if s.Fallback != nil {
			v.add("store.fallback", "only applies with on_failure: open")
		}
	case "open":
		if s.Fallback == nil {
			v.add("store.fallback", "is required with on_failure: open (the local limit used while the store is down)")
		} else if v.validateRate("store.fallback", s.Fallback.TokensPerMinute, s.Fallback.Burst) {
			if err := s.Fallback.Limit().Validate(); err != nil {
				v.add("store.fallback", "the limit these values give is unusable: %v", err)
			}
		}
	default:
		v.add("store.on_failure", "must be closed or open, got %q", s.OnFailure)
	}
	if s.ReplayFile != "" && s.Type != "redis" {
		v.add("store.replay_file", "only applies to the redis store (the memory store has nothing to replay)")
	}
	if f := s.Fleet; f != nil {
		if s.Type != "redis" || s.OnFailure != "open" {
			v.add("store.fleet", "only applies to the redis store with on_failure: open")
		}
		if f.Heartbeat < 0 {
			v.add("store.fleet.heartbeat", "must not be negative, got %v", f.Heartbeat)
		}
		if f.Floor != nil {
			v.validateRate("store.fleet.floor", f.Floor.TokensPerMinute, f.Floor.Burst)
		}
	}
}

// validateRate checks a tokens-per-minute rate and its burst and reports
// whether both are usable.
func (v *validator) validateRate(path string, tpm, burst float64) bool {
	ok := true
	if !finite(tpm) || tpm <= 0 {
		v.add(join(path, "tokens_per_minute"), "must be a positive number, got %v", tpm)
		ok = false
	}
	if !finite(burst) || burst < 0 {
		v.add(join(path, "burst"), "must be positive (0 means one minute's worth), got %v", burst)
		ok = false
	}
	return ok
}

func finite(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }

func (v *validator) validatePolicy(path string, p *Policy) {
	name := func(fp, s string) {
		if s != "" && !nameRE.MatchString(s) {
			v.add(fp, "%q must be lower-case letters, digits, '-' or '_'", s)
		}
	}
	name(join(path, "name"), p.Name)
	idents := map[string]bool{}
	for i, id := range p.Identities {
		ip := fmt.Sprintf("%s.identities[%d]", path, i)
		switch {
		case id.Name == "":
			v.add(join(ip, "name"), "is required")
		case id.Name == "model":
			v.add(join(ip, "name"), `"model" is reserved for per-model buckets`)
		case idents[id.Name]:
			v.add(join(ip, "name"), "identity %q is defined twice", id.Name)
		}
		name(join(ip, "name"), id.Name)
		idents[id.Name] = true
		if id.Header == "" && id.Metadata == "" && id.Path == "" && v.rlsGiven[p.Name][id.Name] {
			continue // given by rls descriptors only; over ext_proc it is always absent
		}
		v.validateSource(ip, id.Header, id.Metadata, id.Path, "payload.sub")
	}
	switch p.Anonymous {
	case "shared", "reject":
	default:
		v.add(join(path, "anonymous"), "must be shared or reject, got %q", p.Anonymous)
	}
	per := func(fp, s string) {
		if s != "" && s != "model" && !idents[s] {
			v.add(fp, "%q is not an identity of this policy (nor \"model\", nor empty for global)", s)
		}
	}
	if len(p.Buckets) == 0 {
		v.add(join(path, "buckets"), "at least one bucket is required")
	}
	bnames := map[string]bool{}
	for i := range p.Buckets {
		b := &p.Buckets[i]
		bp := fmt.Sprintf("%s.buckets[%d]", path, i)
		if b.Name == "" {
			v.add(join(bp, "name"), "is required")
		} else if bnames[b.Name] {
			v.add(join(bp, "name"), "bucket %q is defined twice in this policy", b.Name)
		}
		name(join(bp, "name"), b.Name)
		bnames[b.Name] = true
		per(join(bp, "per"), b.Per)
		ok := true
		if b.ProviderLimit != nil {
			if b.TokensPerMinute != 0 || b.Burst != 0 {
				v.add(bp, "set either tokens_per_minute/burst or provider_limit, not both")
				ok = false
			}
			pl := b.ProviderLimit
			ok = v.validateRate(join(bp, "provider_limit"), pl.TokensPerMinute, 0) && ok
			if sf := pl.SafetyFactor; sf != nil && !(*sf > 0 && *sf <= 1) {
				v.add(join(bp, "provider_limit.safety_factor"), "must be in (0, 1], got %v", *sf)
				ok = false
			}
			if !(pl.PriorityHeadroom >= 0 && pl.PriorityHeadroom < 1) {
				v.add(join(bp, "provider_limit.priority_headroom"), "must be in [0, 1), got %v", pl.PriorityHeadroom)
				ok = false
			}
		} else {
			ok = v.validateRate(bp, b.TokensPerMinute, b.Burst)
		}
		if !finite(b.MaxDebt) || b.MaxDebt < 0 {
			v.add(join(bp, "max_debt"), "must be a number not below zero (it is how far below zero the bucket may go), got %v", b.MaxDebt)
			ok = false
		}
		if b.Hard && b.MaxDebt != 0 {
			v.add(join(bp, "max_debt"), "a hard bucket never goes below zero; remove max_debt or hard")
			ok = false
		}
		// The values are each in range; the limit derived from them must
		// also be one the store accepts (a tiny rate can round to zero).
		var limit buckets.Limit
		if ok {
			var err error
			if limit, _, err = b.Limit(); err != nil {
				v.add(bp, "the limit these values give is unusable: %v", err)
				ok = false
			}
		}
		if l := b.Lease; l != nil {
			lp := join(bp, "lease")
			switch {
			case !finite(l.Size) || l.Size < 0:
				v.add(join(lp, "size"), "must be a number of tokens, not negative (omit it to size leases from the rate), got %v", l.Size)
			case ok && l.Size > limit.Capacity:
				v.add(join(lp, "size"), "%v is more than the bucket's capacity (%v tokens): a lease is a slice of the bucket", l.Size, limit.Capacity)
			}
			if l.TTL < 0 {
				v.add(join(lp, "ttl"), "must be positive (omit it for 1s), got %s", l.TTL)
			}
		}
	}
	for i := range p.Quotas {
		q := &p.Quotas[i]
		qp := fmt.Sprintf("%s.quotas[%d]", path, i)
		switch {
		case q.Name == "":
			v.add(join(qp, "name"), "is required")
		case bnames[q.Name]:
			v.add(join(qp, "name"), "%q is already the name of a bucket or quota of this policy; names label response headers and metrics", q.Name)
		}
		name(join(qp, "name"), q.Name)
		bnames[q.Name] = true
		per(join(qp, "per"), q.Per)
		v.validateQuota(qp, q)
	}
	cnames := map[string]bool{}
	for i, c := range p.Concurrency {
		cp := fmt.Sprintf("%s.concurrency[%d]", path, i)
		if c.Name == "" {
			v.add(join(cp, "name"), "is required")
		} else if cnames[c.Name] {
			v.add(join(cp, "name"), "concurrency limit %q is defined twice in this policy", c.Name)
		}
		name(join(cp, "name"), c.Name)
		cnames[c.Name] = true
		per(join(cp, "per"), c.Per)
		if c.Max <= 0 {
			v.add(join(cp, "max"), "must be at least 1, got %d", c.Max)
		}
		if c.Lease <= 0 {
			v.add(join(cp, "lease"), "must be positive, got %s", c.Lease)
		}
	}
	if w := p.Wait; w != nil {
		if w.MaxWait <= 0 {
			v.add(join(path, "wait.max_wait"), "must be positive, got %s", w.MaxWait)
		}
		if w.MaxQueue <= 0 {
			v.add(join(path, "wait.max_queue"), "must be at least 1, got %d", w.MaxQueue)
		}
	}
	if p.MaxOutputTokens < 0 {
		v.add(join(path, "max_output_tokens"), "must not be negative, got %d", p.MaxOutputTokens)
	}
	if p.PriorityHeader != strings.ToLower(p.PriorityHeader) {
		v.add(join(path, "priority_header"), "%q must be lower-case", p.PriorityHeader)
	}
	switch p.UnknownEndpoints {
	case "refuse", "pass":
		if p.UnknownEndpointTokens != 0 {
			v.add(join(path, "unknown_endpoint_tokens"), "only applies with unknown_endpoints: charge")
		}
	case "charge":
		if p.UnknownEndpointTokens <= 0 {
			v.add(join(path, "unknown_endpoint_tokens"), "must be at least 1 with unknown_endpoints: charge, got %d", p.UnknownEndpointTokens)
		}
	default:
		v.add(join(path, "unknown_endpoints"), "must be refuse, pass or charge, got %q", p.UnknownEndpoints)
	}
	v.validateTiers(path, p)
	v.validateOverrides(path, p)
}

// validateSharedProviders checks that provider buckets of the same name agree
// across policies: they are one bucket, the organisation's account at the
// provider, whichever policy a request comes through. A provider bucket's
// name is therefore global, and no policy may use it for a bucket of its own.
func (v *validator) validateSharedProviders(c *Config) {
	type first struct {
		path string
		b    Bucket
	}
	providers := map[string]first{}
	for i, p := range c.Policies {
		for j, b := range p.Buckets {
			if b.ProviderLimit == nil {
				continue
			}
			path := fmt.Sprintf("policies[%d].buckets[%d]", i, j)
			f, ok := providers[b.Name]
			if !ok {
				providers[b.Name] = first{path, b}
				continue
			}
			if f.b.Per != b.Per || !reflect.DeepEqual(f.b.ProviderLimit, b.ProviderLimit) || f.b.Hard != b.Hard || f.b.MaxDebt != b.MaxDebt || !reflect.DeepEqual(f.b.Lease, b.Lease) {
				v.add(path, "provider bucket %q is shared by every policy and must match its definition at %s", b.Name, f.path)
			}
		}
	}
	for i, p := range c.Policies {
		for j, b := range p.Buckets {
			if f, ok := providers[b.Name]; ok && b.ProviderLimit == nil {
				v.add(fmt.Sprintf("policies[%d].buckets[%d].name", i, j),
					"%q is the name of the provider bucket at %s, which every policy shares; give this bucket another name", b.Name, f.path)
			}
		}
	}
}

// validateLeases checks that leases are asked for only where they apply:
// with the Redis store, shared by a fleet; one gateway's memory store is
// local already.
func (v *validator) validateLeases(c *Config) {
	if c.Store.Type == "redis" {
		return
	}
	for i, p := range c.Policies {
		for j, b := range p.Buckets {
			if b.Lease != nil {
				v.add(fmt.Sprintf("policies[%d].buckets[%d].lease", i, j),
					"only applies to the redis store (with the %s store every bucket is local already)", c.Store.Type)
			}
		}
	}
}

// maxQuotaTokens bounds a token budget so that sums of spend stay exact.
const maxQuotaTokens = 1_000_000_000_000_000

// validateQuota checks one quota's window, zone and budget.
func (v *validator) validateQuota(path string, q *Quota) {
	if _, err := buckets.ParsePeriod(q.Window); err != nil {
		if q.Window == "" {
			v.add(join(path, "window"), "is required: day, week or month")
		} else {
			v.add(join(path, "window"), "%q: want day, week or month", q.Window)
		}
	}
	if _, err := buckets.LoadZone(q.Timezone); err != nil {
		v.add(join(path, "timezone"), "%s", strings.TrimPrefix(err.Error(), buckets.ErrInvalidWindow.Error()+": "))
	}
	switch {
	case q.Tokens != 0 && q.Cost != "":
		v.add(path, "set tokens (a token budget) or cost (a money budget), not both")
	case q.Tokens == 0 && q.Cost == "":
		v.add(path, "needs tokens (a token budget per window) or cost (a money budget per window, in the pricing currency)")
	case q.Cost != "":
		v.validateCost(join(path, "cost"), q.Cost)
	case q.Tokens < 0 || q.Tokens > maxQuotaTokens:
		v.add(join(path, "tokens"), "must be from 1 to %d, got %d", maxQuotaTokens, q.Tokens)
	}
}

// validateCost checks a budget of money: a plain decimal amount above
// zero.
func (v *validator) validateCost(path, cost string) {
	if m, err := pricing.ParseAmount(cost); err != nil {
		v.add(path, "%s", strings.TrimPrefix(err.Error(), pricing.ErrInvalidPrice.Error()+": "))
	} else if m == 0 {
		v.add(path, "must be more than zero, got %q", cost)
	}
}

// validatePricing checks the pricing section and keeps its table, and
// checks that a cost quota has a price for some model.
func (v *validator) validatePricing(c *Config) {
	t, err := c.Pricing.Table()
	if err != nil {
		fes := pricing.FieldErrors(err)
		for _, fe := range fes {
			v.add(join("pricing", fe.Field), "%s", fe.Msg)
		}
		if len(fes) == 0 {
			v.add("pricing", "%v", err)
		}
		return
	}
	c.prices = t
	if len(t.Models()) > 0 || c.Pricing.UnknownModels == "fallback" {
		return
	}
	for i, p := range c.Policies {
		for j, q := range p.Quotas {
			if q.Cost != "" {
				v.add(fmt.Sprintf("policies[%d].quotas[%d].cost", i, j),
					"no model has a price (pricing.defaults is none, and pricing has no models and no fallback): every request would be refused")
			}
		}
	}
}

// Budget returns the quota in the store's terms: its calendar window, its
// unit and its limit per window (tokens, or micro-units of the pricing
// currency). Parse refuses a configuration where the error is not nil.
func (q Quota) Budget() (w buckets.Window, unit buckets.Unit, limit float64, err error) {
	w, err = buckets.ParseWindow(q.Window, q.Timezone)
	if err != nil {
		return buckets.Window{}, 0, 0, err
	}
	if q.Cost != "" {
		m, err := pricing.ParseAmount(q.Cost)
		if err != nil {
			return buckets.Window{}, 0, 0, err
		}
		return w, buckets.Money, float64(m), nil
	}
	return w, buckets.Tokens, float64(q.Tokens), nil
}

// placeholderKey stands in for a store key when a bucket's limit is checked
// at load time: keys are made per request, but buckets.Bucket.Validate
// checks one is set.
const placeholderKey = "config"

// Limit returns the bucket in the store's terms: its capacity and refill
// rate (S1) — from tokens_per_minute and burst, or from provider_limit
// scaled by its safety factor (S19) — and the headroom only priority
// traffic may use. The error says why the store would refuse it; Parse
// refuses a configuration where that is so, so for a loaded Config it is
// nil.
func (b Bucket) Limit() (limit buckets.Limit, headroom float64, err error) {
	if pl := b.ProviderLimit; pl != nil {
		p := buckets.ProviderLimit{TokensPerMinute: pl.TokensPerMinute, PriorityHeadroom: pl.PriorityHeadroom}
		if pl.SafetyFactor != nil {
			p.SafetyFactor = *pl.SafetyFactor
		}
		pb, err := p.Bucket(b.Name, placeholderKey)
		return pb.Limit, pb.Headroom, err
	}
	l := buckets.PerMinute(b.TokensPerMinute, b.Burst)
	return l, 0, buckets.Bucket{Name: b.Name, Key: placeholderKey, Limit: l, Hard: b.Hard, MaxDebt: b.MaxDebt}.Validate()
}

// Limit returns the fallback rate in the store's terms (S1, S21).
func (r Rate) Limit() buckets.Limit { return buckets.PerMinute(r.TokensPerMinute, r.Burst) }

// validateSource checks where a request value is read from, an identity's
// or a tier's: exactly one of a header or a metadata namespace, a path
// inside the namespace (example shows one), and a header name as Envoy
// sends it.
func (v *validator) validateSource(path, header, metadata, key, example string) {
	if (header == "") == (metadata == "") {
		v.add(path, "needs exactly one of header or metadata")
	}
	if metadata != "" && key == "" {
		v.add(join(path, "path"), "is required with metadata (the key inside the namespace, e.g. %s)", example)
	}
	if header != "" && metadata == "" && key != "" {
		v.add(join(path, "path"), "only applies with metadata")
	}
	if header != strings.ToLower(header) {
		v.add(join(path, "header"), "%q must be lower-case (Envoy sends header names in lower case)", header)
	}
}
