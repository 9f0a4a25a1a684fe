package config

import (
	"fmt"
	"math"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"

	yaml "go.yaml.in/yaml/v3"
)

// validator collects every problem of one file.
type validator struct {
	file     string
	lines    map[string]int // field path → line
	problems Problems
}

var configShape = reflect.TypeOf(Config{})

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

// index records the line of every mapping key and sequence item.
func (v *validator) index(n *yaml.Node, path string) {
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			p := join(path, n.Content[i].Value)
			v.lines[p] = n.Content[i].Line
			v.index(n.Content[i+1], p)
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			p := fmt.Sprintf("%s[%d]", path, i)
			v.lines[p] = c.Line
			v.index(c, p)
		}
	}
}

var lineRE = regexp.MustCompile(`^line (\d+): (.*)$`)

// decodeErrors turns the decoder's type errors into problems with lines.
func (v *validator) decodeErrors(err error) {
	te, ok := err.(*yaml.TypeError)
	if !ok {
		v.problems = append(v.problems, Problem{File: v.file, Msg: strings.TrimPrefix(err.Error(), "yaml: ")})
		return
	}
	for _, e := range te.Errors {
		p := Problem{File: v.file, Msg: e}
		if m := lineRE.FindStringSubmatch(e); m != nil {
			p.Line, _ = strconv.Atoi(m[1])
			p.Msg = m[2]
			p.Field = v.fieldAt(p.Line)
		}
		v.problems = append(v.problems, p)
	}
}

// fieldAt names the deepest field on a line.
func (v *validator) fieldAt(line int) string {
	best := ""
	for p, l := range v.lines {
		if l == line && len(p) > len(best) {
			best = p
		}
	}
	return best
}

// unknownKeys reports every mapping key that the Go type has no field for.
func (v *validator) unknownKeys(n *yaml.Node, path string, t reflect.Type) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch n.Kind {
	case yaml.MappingNode:
		if t.Kind() != reflect.Struct {
			return // a type error the decoder reports
		}
		fields := yamlFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			ft, ok := fields[key]
			if !ok {
				v.problems = append(v.problems, Problem{
					File: v.file, Line: n.Content[i].Line, Field: join(path, key),
					Msg: fmt.Sprintf("unknown key %q (known: %s)", key, knownKeys(fields)),
				})
				continue
			}
			v.unknownKeys(n.Content[i+1], join(path, key), ft)
		}
	case yaml.SequenceNode:
		if t.Kind() != reflect.Slice {
			return
		}
		for i, c := range n.Content {
			v.unknownKeys(c, fmt.Sprintf("%s[%d]", path, i), t.Elem())
		}
	}
}

func yamlFields(t reflect.Type) map[string]reflect.Type {
	m := make(map[string]reflect.Type, t.NumField())
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name != "" && name != "-" {
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
	sort.Strings(keys)
	return strings.Join(keys, ", ")
}

// Known tokenizer encodings that a fallback may name.
var encodings = map[string]bool{"o200k_base": true, "cl100k_base": true}

// validate checks every field's value; it runs after defaults are applied.
func (v *validator) validate(c *Config) {
	if c.Listeners.MaxRecvMsgBytes < 1<<20 {
		v.add("listeners.max_recv_msg_bytes", "must be at least 1048576 (a BUFFERED request body travels as one message), got %d", c.Listeners.MaxRecvMsgBytes)
	}
	v.validateStore(&c.Store)
	if f := c.Tokenizer.FallbackEncoding; f != "" && !encodings[f] {
		v.add("tokenizer.fallback_encoding", "unknown encoding %q (use o200k_base or cl100k_base, or leave it empty to refuse unknown models)", f)
	}
	if c.Tokenizer.DefaultOutputTokens < 0 {
		v.add("tokenizer.default_output_tokens", "must not be negative, got %d", c.Tokenizer.DefaultOutputTokens)
	}
	if c.Tokenizer.MaxOutputTokens < c.Tokenizer.DefaultOutputTokens {
		v.add("tokenizer.max_output_tokens", "must be at least default_output_tokens (%d), got %d", c.Tokenizer.DefaultOutputTokens, c.Tokenizer.MaxOutputTokens)
	}
	if len(c.Policies) == 0 {
		v.add("policies", "at least one policy is required")
	}
	if c.ShutdownGrace < 0 {
		v.add("shutdown_grace", "must not be negative")
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
	if c.DefaultPolicy == "" {
		if len(c.Policies) > 1 {
			v.add("default_policy", "is required when there is more than one policy")
		}
	} else if _, ok := names[c.DefaultPolicy]; !ok && len(c.Policies) > 0 {
		v.add("default_policy", "names policy %q, which is not defined", c.DefaultPolicy)
	}
}

func (v *validator) validateStore(s *Store) {
	switch s.Type {
	case "memory":
	case "redis":
		if len(s.Redis.Addrs) == 0 {
			v.add("store.redis.addrs", "at least one address is required for the redis store")
		}
		for i, a := range s.Redis.Addrs {
			if !strings.Contains(a, ":") {
				v.add(fmt.Sprintf("store.redis.addrs[%d]", i), "%q is not host:port", a)
			}
		}
		if s.Redis.Timeout < 0 || s.Redis.DialTimeout < 0 {
			v.add("store.redis.timeout", "timeouts must not be negative")
		}
		if s.Redis.Cluster && s.Redis.DB != 0 {
			v.add("store.redis.db", "Redis Cluster has only database 0")
		}
		if t := s.Redis.TLS; t != nil && (t.CertFile == "") != (t.KeyFile == "") {
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
		} else {
			v.validateRate("store.fallback", s.Fallback.TokensPerMinute, s.Fallback.Burst)
		}
	default:
		v.add("store.on_failure", "must be closed or open, got %q", s.OnFailure)
	}
}

func (v *validator) validateRate(path string, tpm, burst float64) {
	if !(tpm > 0) || math.IsInf(tpm, 0) {
		v.add(join(path, "tokens_per_minute"), "must be a positive number, got %v", tpm)
	}
	if burst < 0 || math.IsNaN(burst) || math.IsInf(burst, 0) {
		v.add(join(path, "burst"), "must be positive (0 means one minute's worth), got %v", burst)
	}
}

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]*$`)

func (v *validator) validatePolicy(path string, p *Policy) {
	if p.Name != "" && !nameRE.MatchString(p.Name) {
		v.add(join(path, "name"), "%q must be lower-case letters, digits, '-' or '_'", p.Name)
	}
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
		idents[id.Name] = true
		if (id.Header == "") == (id.Metadata == "") {
			v.add(ip, "needs exactly one of header or metadata")
		}
		if id.Metadata != "" && id.Path == "" {
			v.add(join(ip, "path"), "is required with metadata (the key inside the namespace, e.g. payload.sub)")
		}
		if id.Header != "" && id.Metadata == "" && id.Path != "" {
			v.add(join(ip, "path"), "only applies with metadata")
		}
		if id.Header != strings.ToLower(id.Header) {
			v.add(join(ip, "header"), "%q must be lower-case (Envoy sends header names in lower case)", id.Header)
		}
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
		bnames[b.Name] = true
		per(join(bp, "per"), b.Per)
		if b.ProviderLimit != nil {
			if b.TokensPerMinute != 0 || b.Burst != 0 {
				v.add(bp, "set either tokens_per_minute/burst or provider_limit, not both")
			}
			pl := b.ProviderLimit
			v.validateRate(join(bp, "provider_limit"), pl.TokensPerMinute, 0)
			if sf := pl.SafetyFactor; sf != nil && !(*sf > 0 && *sf <= 1) {
				v.add(join(bp, "provider_limit.safety_factor"), "must be in (0, 1], got %v", *sf)
			}
			if !(pl.PriorityHeadroom >= 0 && pl.PriorityHeadroom < 1) {
				v.add(join(bp, "provider_limit.priority_headroom"), "must be in [0, 1), got %v", pl.PriorityHeadroom)
			}
		} else {
			v.validateRate(bp, b.TokensPerMinute, b.Burst)
		}
		if b.MaxDebt < 0 {
			v.add(join(bp, "max_debt"), "must not be negative (it is how far below zero the bucket may go)")
		}
		if b.Hard && b.MaxDebt != 0 {
			v.add(join(bp, "max_debt"), "a hard bucket never goes below zero; remove max_debt or hard")
		}
	}
	cnames := map[string]bool{}
	for i, c := range p.Concurrency {
		cp := fmt.Sprintf("%s.concurrency[%d]", path, i)
		if c.Name == "" {
			v.add(join(cp, "name"), "is required")
		} else if cnames[c.Name] {
			v.add(join(cp, "name"), "concurrency limit %q is defined twice in this policy", c.Name)
		}
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
}

// validateSharedProviders checks that provider buckets of the same name agree
// across policies: they are one bucket, the organisation's account at the
// provider, whichever policy a request comes through.
func (v *validator) validateSharedProviders(c *Config) {
	type first struct {
		path string
		b    Bucket
	}
	seen := map[string]first{}
	for i, p := range c.Policies {
		for j, b := range p.Buckets {
			if b.ProviderLimit == nil {
				continue
			}
			path := fmt.Sprintf("policies[%d].buckets[%d]", i, j)
			f, ok := seen[b.Name]
			if !ok {
				seen[b.Name] = first{path, b}
				continue
			}
			if f.b.Per != b.Per || !reflect.DeepEqual(f.b.ProviderLimit, b.ProviderLimit) || f.b.Hard != b.Hard || f.b.MaxDebt != b.MaxDebt {
				v.add(path, "provider bucket %q is shared by every policy and must match its definition at %s", b.Name, f.path)
			}
		}
	}
}
