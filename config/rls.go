package config

import (
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	yaml "go.yaml.in/yaml/v3"
	"golang.org/x/net/http/httpguts"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// RLS maps the requests of Envoy's rate-limit filter
// (envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit) onto
// policies: which domain and descriptor entries meet which rules, which
// entries are identities and which names the model (docs/rls.md).
//
// Each domain holds a tree of descriptors in envoyproxy/ratelimit's shape
// and is matched as ratelimit matches its own (docs/envoy-ratelimit.md
// §3.2): a request descriptor's entries go down one level each, an exact
// value winning over a wildcard ('*', in file order) and a wildcard over a
// descriptor without value; the descriptor meets the rules of the node its
// last entry lands on. A domain no mapping names, and a descriptor that
// lands on no rule, meet no limit, as with ratelimit.
type RLS struct {
	Domains []RLSDomain `yaml:"domains"`
	// ShadowMode answers every call OK, whatever its statuses say, as
	// ratelimit's SHADOW_MODE does (§3.5): hits are counted as usual.
	ShadowMode bool `yaml:"shadow_mode"`
	// QuotaMode puts every descriptor but the unlimited in quota mode, as
	// ratelimit's QUOTA_MODE does (§3.4): a call is over the limit only
	// when all of them are.
	QuotaMode bool `yaml:"quota_mode"`
	// ResponseDynamicMetadata answers every call with dynamic_metadata as
	// ratelimit's RESPONSE_DYNAMIC_METADATA does (§3.5): the domain, each
	// descriptor's entries (and its own limit and hits_addend), the call's
	// hits_addend, and the merged metadata of the limits that passed.
	// Envoy stores it under the filter's metadata_namespace.
	ResponseDynamicMetadata bool `yaml:"response_dynamic_metadata"`
	// LimitResponseHeaders adds RateLimit-Limit, RateLimit-Remaining and
	// RateLimit-Reset to every answer's response_headers_to_add, as
	// ratelimit's LIMIT_RESPONSE_HEADERS_ENABLED does (§3.5).
	LimitResponseHeaders RLSLimitHeaders `yaml:"limit_response_headers"`
	// JSONEndpoint serves ShouldRateLimit over HTTP at POST /json on the
	// admin listener, as ratelimit's /json (§3.7): a RateLimitRequest in
	// protobuf's JSON, the answer likewise, 429 when over the limit. Like
	// the gRPC service it asks no credentials.
	JSONEndpoint bool `yaml:"json_endpoint"`
	// DeferredCharges are the domains whose hits (a call of descriptors that
	// all carry hits other than 0) come only from Envoy's stream-done call
	// (apply_on_stream_done: AI Gateway's and Envoy Gateway's response
	// cost), whose answer Envoy ignores. Such a call is answered OK at once
	// and charged in the background, with the store's next call or within
	// its settle window, exactly once as any charge; checks (hits 0) are
	// answered as ever. A domain whose request-path descriptors carry hits
	// must not be listed: their answer would always be OK.
	DeferredCharges []string `yaml:"deferred_charges"`
	// NearLimitRatio is ratelimit's NEAR_LIMIT_RATIO: the share of a limit
	// past which its hits count as near_limit in the ratelimit-named
	// metrics (listeners.ratelimit_metrics). Default 0.8.
	NearLimitRatio *float64 `yaml:"near_limit_ratio"`
	// ReadyNeedsDomain keeps readiness failing (/readyz, /healthcheck and
	// the gRPC health of "ratelimit") while no domain is loaded, as
	// ratelimit's HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED does: before
	// ratelimit.xds's first snapshot, or while it holds none.
	ReadyNeedsDomain bool `yaml:"ready_needs_domain"`
}

// DefaultNearLimitRatio is rls.near_limit_ratio when omitted, ratelimit's
// default.
const DefaultNearLimitRatio = 0.8

// NearLimit is rls.near_limit_ratio in force.
func (r *RLS) NearLimit() float64 {
	if r == nil || r.NearLimitRatio == nil {
		return DefaultNearLimitRatio
	}
	return *r.NearLimitRatio
}

// Deferred reports whether domain's charges are answered at once and
// written in the background (RLS.DeferredCharges).
func (r *RLS) Deferred(domain string) bool {
	return r != nil && slices.Contains(r.DeferredCharges, domain)
}

// RLSLimitHeaders are the RateLimit-* headers of ratelimit's
// LIMIT_RESPONSE_HEADERS_ENABLED, taken from one status of each answer: the
// one with the least limit_remaining among those with a current_limit, or
// the last one over the limit outside quota mode. The zero value adds none;
// an empty name is ratelimit's default (Names).
type RLSLimitHeaders struct {
	Enabled bool `yaml:"enabled"`
	// LimitHeader carries the status's requests_per_unit
	// (LIMIT_LIMIT_HEADER, default RateLimit-Limit).
	LimitHeader string `yaml:"limit_header"`
	// RemainingHeader carries its limit_remaining (LIMIT_REMAINING_HEADER,
	// default RateLimit-Remaining).
	RemainingHeader string `yaml:"remaining_header"`
	// ResetHeader carries its duration_until_reset in whole seconds,
	// rounded up (LIMIT_RESET_HEADER, default RateLimit-Reset).
	ResetHeader string `yaml:"reset_header"`
}

// Names are the header names in force: the configured ones, ratelimit's
// defaults for those left empty.
func (h RLSLimitHeaders) Names() (limit, remaining, reset string) {
	or := func(s, def string) string {
		if s == "" {
			return def
		}
		return s
	}
	return or(h.LimitHeader, "RateLimit-Limit"), or(h.RemainingHeader, "RateLimit-Remaining"), or(h.ResetHeader, "RateLimit-Reset")
}

// RetryAfterHeader is the header the service adds to every OVER_LIMIT
// answer; no RateLimit-* header may take its name.
const RetryAfterHeader = "retry-after"

// framingHeaders are the headers of a connection or of a message's
// framing, which an answer's response_headers_to_add must not set.
var framingHeaders = []string{"connection", "content-length", "host", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}

// limitHeaderProblem is what is wrong with one header name of
// RLSLimitHeaders, by its field.
type limitHeaderProblem struct{ field, msg string }

// problems checks the header names: each an HTTP token, none a framing
// header or retry-after, no two the same (header names are
// case-insensitive). An empty name is the default, checked as such. label
// names a field (limit_header, ...) in a message, as its reader knows it;
// no message repeats a name.
func (h RLSLimitHeaders) problems(label func(field string) string) []limitHeaderProblem {
	var out []limitHeaderProblem
	limit, remaining, reset := h.Names()
	seen := map[string]string{}
	for _, f := range []struct{ field, name string }{
		{"limit_header", limit}, {"remaining_header", remaining}, {"reset_header", reset},
	} {
		lower := strings.ToLower(f.name)
		switch {
		case !httpguts.ValidHeaderFieldName(f.name):
			out = append(out, limitHeaderProblem{f.field, "is not an HTTP header name: want letters, digits and !#$%&'*+-.^_`|~ only"})
		case slices.Contains(framingHeaders, lower):
			out = append(out, limitHeaderProblem{f.field, "is a connection or framing header, which the rate-limit service must not set"})
		case lower == RetryAfterHeader:
			out = append(out, limitHeaderProblem{f.field, "is retry-after, which the service sets itself on OVER_LIMIT"})
		case seen[lower] != "":
			out = append(out, limitHeaderProblem{f.field, fmt.Sprintf("names the same header as %s (header names are case-insensitive)", label(seen[lower]))})
		}
		seen[lower] = f.field
	}
	return out
}

// RLSDomain is the mapping of one domain (RateLimitRequest.domain).
type RLSDomain struct {
	Domain      string          `yaml:"domain"`
	Descriptors []RLSDescriptor `yaml:"descriptors"`
}

// RLSDescriptor is one level of a domain's tree: a descriptor entry's key
// and, optionally, its value; what the entry's value means (an identity,
// the model, or only a path to follow); and, for a descriptor that ends
// here, what it meets: a policy's rules, no limit at all (unlimited), or a
// refusal of every hit (deny). A node with none of the three applies no
// limit, as a ratelimit descriptor without rate_limit does.
type RLSDescriptor struct {
	Key string `yaml:"key"`
	// Value is the value the entry must have: exact, or with '*'
	// wildcards (any run of characters); empty matches any value.
	Value string `yaml:"value"`
	// Identity names the identity of the policy below whose value this
	// entry carries. Several entries of one descriptor may name the same
	// identity; it is then their values together, in order. An identity
	// without header or metadata in its policy is given by descriptors only.
	Identity string `yaml:"identity"`
	// Model says the entry's value names the model: for rules per model
	// and for pricing cost quotas.
	Model bool `yaml:"model"`

	// Policy is the policy whose rules a descriptor ending here meets.
	Policy string `yaml:"policy"`
	// Rules names the buckets, quotas and concurrency limits of Policy it
	// meets; empty means every bucket and quota of the policy (concurrency
	// needs naming: the service checks a concurrency limit's slots, held by
	// ext_proc's requests in flight, and holds none itself).
	Rules []string `yaml:"rules"`
	// Unlimited answers OK and counts nothing (ratelimit's unlimited).
	Unlimited bool `yaml:"unlimited"`
	// Deny answers every hit OVER_LIMIT and lets a check (hits 0) pass,
	// as ratelimit does with requests_per_unit 0.
	Deny bool `yaml:"deny"`
	// ShadowMode counts as usual but always answers OK for this limit;
	// QuotaMode makes it count towards OVER_LIMIT only when every quota-mode
	// descriptor of the request is over (docs/envoy-ratelimit.md §3.5).
	ShadowMode bool `yaml:"shadow_mode"`
	QuotaMode  bool `yaml:"quota_mode"`
	// Name is what other nodes' Replaces refer to; a request meeting a node
	// whose Replaces names this one drops this one's limit (§3.2).
	Name     string   `yaml:"name"`
	Replaces []string `yaml:"replaces"`
	// Metadata is ratelimit's descriptor metadata: with
	// rls.response_dynamic_metadata, an answer's dynamic metadata holds the
	// metadata of every limit it met that was not over, merged in
	// descriptor order (the first value of a key wins; mappings merge).
	Metadata RLSMetadata `yaml:"metadata"`
	// DetailedMetric and ValueToMetric are ratelimit's detailed_metric and
	// value_to_metric: they change only the keys of the ratelimit-named
	// metrics (listeners.ratelimit_metrics) of the limits below them —
	// detailed_metric names a limit's stats by the request's own key_value
	// at every level, value_to_metric by the request's value at this
	// level (docs/envoy-ratelimit.md §3.6).
	DetailedMetric bool `yaml:"detailed_metric"`
	ValueToMetric  bool `yaml:"value_to_metric"`

	Descriptors []RLSDescriptor `yaml:"descriptors"`
}

// RLSMetadata is a descriptor's metadata: a mapping of any YAML values,
// held as the Struct ratelimit answers (numbers as numbers, a timestamp
// as its text, as ratelimit's YAML reader keeps it; keys as their text).
// The zero value is none. It is immutable: Struct's value is shared by
// every call.
type RLSMetadata struct{ s *structpb.Struct }

// NewRLSMetadata is the metadata s holds (a copy); none when s is empty.
func NewRLSMetadata(s *structpb.Struct) RLSMetadata {
	if len(s.GetFields()) == 0 {
		return RLSMetadata{}
	}
	return RLSMetadata{s: proto.CloneOf(s)}
}

// Struct is the metadata; nil when there is none. It must not be changed.
func (m RLSMetadata) Struct() *structpb.Struct { return m.s }

// UnmarshalYAML reads a mapping (see metadataStruct).
func (m *RLSMetadata) UnmarshalYAML(n *yaml.Node) error {
	s, err := metadataStruct(n)
	if err != nil {
		return err
	}
	*m = RLSMetadata{s: s}
	return nil
}

// metadataProblem is a value of metadata that has no Struct form, at path
// below the metadata field (empty for the field itself).
type metadataProblem struct {
	path string
	line int
	msg  string
}

func (p *metadataProblem) Error() string {
	if p.path == "" {
		return fmt.Sprintf("line %d: %s", p.line, p.msg)
	}
	return fmt.Sprintf("line %d: %s: %s", p.line, p.path, p.msg)
}

// metadataStruct reads a metadata mapping into a Struct; nil for an empty
// or null one. Keys are their text and must be scalars, each once; a
// timestamp stays its text, as ratelimit's YAML reader (yaml.v2) keeps
// it; merge keys (<<) are not read. A problem is a *metadataProblem.
func metadataStruct(n *yaml.Node) (*structpb.Struct, error) {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return nil, nil
	}
	if n.Kind != yaml.MappingNode {
		return nil, &metadataProblem{line: n.Line, msg: "want a mapping, got " + describe(n)}
	}
	s, err := metadataFields(n, "")
	if err != nil || len(s.Fields) == 0 {
		return nil, err
	}
	return s, nil
}

func metadataFields(n *yaml.Node, path string) (*structpb.Struct, error) {
	s := &structpb.Struct{Fields: make(map[string]*structpb.Value, len(n.Content)/2)}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.AliasNode {
			k = k.Alias
		}
		switch {
		case k.Kind != yaml.ScalarNode:
			return nil, &metadataProblem{path: path, line: k.Line, msg: "a key must be a scalar, got " + describe(k)}
		case k.ShortTag() == "!!merge":
			return nil, &metadataProblem{path: path, line: k.Line, msg: "merge keys (<<) are not read in metadata: write the keys out"}
		}
		p := join(path, k.Value)
		if _, dup := s.Fields[k.Value]; dup {
			return nil, &metadataProblem{path: p, line: k.Line, msg: "the key is repeated"}
		}
		v, err := metadataValue(val, p)
		if err != nil {
			return nil, err
		}
		s.Fields[k.Value] = v
	}
	return s, nil
}

func metadataValue(n *yaml.Node, path string) (*structpb.Value, error) {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	switch n.Kind {
	case yaml.MappingNode:
		s, err := metadataFields(n, path)
		if err != nil {
			return nil, err
		}
		return structpb.NewStructValue(s), nil
	case yaml.SequenceNode:
		l := &structpb.ListValue{Values: make([]*structpb.Value, 0, len(n.Content))}
		for i, c := range n.Content {
			v, err := metadataValue(c, fmt.Sprintf("%s[%d]", path, i))
			if err != nil {
				return nil, err
			}
			l.Values = append(l.Values, v)
		}
		return structpb.NewListValue(l), nil
	}
	if n.ShortTag() == "!!timestamp" {
		return structpb.NewStringValue(n.Value), nil
	}
	var x any
	if err := n.Decode(&x); err != nil {
		return nil, &metadataProblem{path: path, line: n.Line, msg: fmt.Sprintf("cannot read %s", describe(n))}
	}
	v, err := structpb.NewValue(x)
	if err != nil {
		return nil, &metadataProblem{path: path, line: n.Line, msg: "want text, a number, true, false or null; " + strings.TrimPrefix(err.Error(), "proto: ")}
	}
	return v, nil
}

// checkMetadata reports the problems of a metadata node as the shape walk
// reports a value of the wrong type, at path and below.
func (v *validator) checkMetadata(n *yaml.Node, path string) {
	_, err := metadataStruct(n)
	var p *metadataProblem
	if errors.As(err, &p) {
		v.badValues++
		f := path
		if p.path != "" {
			f = join(path, p.path)
		}
		v.problems = append(v.problems, Problem{File: v.file, Line: p.line, Field: f, Msg: p.msg})
	}
}

// limited reports whether a descriptor ending at d meets something other
// than no limit.
func (d *RLSDescriptor) limited() bool { return d.Policy != "" || d.Unlimited || d.Deny }

// Meets returns the rules of p a descriptor ending at d meets: those its
// Rules name (a bucket or quota, and a concurrency limit, may share a
// name: both are met), or, when Rules is empty, every bucket and quota of
// p.
func (d *RLSDescriptor) Meets(p Policy) (buckets []Bucket, quotas []Quota, concurrency []Concurrency) {
	named := func(name string) bool { return len(d.Rules) == 0 || slices.Contains(d.Rules, name) }
	for _, b := range p.Buckets {
		if named(b.Name) {
			buckets = append(buckets, b)
		}
	}
	for _, q := range p.Quotas {
		if named(q.Name) {
			quotas = append(quotas, q)
		}
	}
	for _, c := range p.Concurrency {
		if len(d.Rules) > 0 && named(c.Name) {
			concurrency = append(concurrency, c)
		}
	}
	return buckets, quotas, concurrency
}

// RLSTree is one domain's mapping, matched as ratelimit matches.
type RLSTree = rlconfig.Tree[*RLSDescriptor]

// RLSTree returns the tree of domain built when the file was validated; nil
// when no mapping names the domain (or for a Config that Load or Parse did
// not return).
func (c *Config) RLSTree(domain string) *RLSTree { return c.rlsTrees[domain] }

// RLSMatch is where one request descriptor lands in a domain's tree. The
// zero value is no match.
type RLSMatch struct {
	node    *rlconfig.Node[*RLSDescriptor]
	entries []*commonv3.RateLimitDescriptor_Entry
}

// MatchRLS finds what a request descriptor of domain meets. known is false
// for a domain no mapping names; ok is false when the descriptor meets no
// limit (no node, or a node without one).
func (c *Config) MatchRLS(domain string, d *commonv3.RateLimitDescriptor) (m RLSMatch, known, ok bool) {
	t := c.rlsTrees[domain]
	if t == nil {
		return RLSMatch{}, false, false
	}
	n := t.Match(d.GetEntries())
	if n == nil {
		return RLSMatch{}, true, false
	}
	return RLSMatch{node: n, entries: d.GetEntries()}, true, true
}

// Descriptor is the node the descriptor landed on.
func (m RLSMatch) Descriptor() *RLSDescriptor { return m.node.Data }

// Identity is the value of identity name in the descriptor: the value of
// the entry that names it, or, when several do, their values in order,
// each query-escaped, joined by "&" (so that no two lists of values give
// one identity). ok is false when no entry names it.
func (m RLSMatch) Identity(name string) (value string, ok bool) {
	var vals []string
	for n := m.node; n != nil && n.Depth() > 0; n = n.Parent() {
		if n.Data.Identity == name {
			vals = append(vals, m.entries[n.Depth()-1].GetValue())
		}
	}
	switch len(vals) {
	case 0:
		return "", false
	case 1:
		return vals[0], true
	}
	slices.Reverse(vals)
	for i, v := range vals {
		vals[i] = url.QueryEscape(v)
	}
	return strings.Join(vals, "&"), true
}

// Model is the value of the entry marked model; ok is false when none is.
func (m RLSMatch) Model() (model string, ok bool) {
	for n := m.node; n != nil && n.Depth() > 0; n = n.Parent() {
		if n.Data.Model {
			return m.entries[n.Depth()-1].GetValue(), true
		}
	}
	return "", false
}

// rlsPath is a node of the tree being validated, with what the nodes
// above it give.
type rlsPath struct {
	field      string
	identities map[string]string // identity → field of the first node that gives it
	model      string            // field of the node marked model
}

// rlsIdentities lists, per policy, the identities that some descriptor
// gives to a node meeting that policy. Such an identity needs no header or
// metadata of its own. It reads the file before it is validated.
func rlsIdentities(r *RLS) map[string]map[string]bool {
	out := map[string]map[string]bool{}
	if r == nil {
		return out
	}
	var walk func(ds []RLSDescriptor, given []string)
	walk = func(ds []RLSDescriptor, given []string) {
		for i := range ds {
			d := &ds[i]
			g := given
			if d.Identity != "" {
				g = append(slices.Clip(given), d.Identity)
			}
			if d.Policy != "" {
				if out[d.Policy] == nil {
					out[d.Policy] = map[string]bool{}
				}
				for _, id := range g {
					out[d.Policy][id] = true
				}
			}
			walk(d.Descriptors, g)
		}
	}
	for _, dom := range r.Domains {
		walk(dom.Descriptors, nil)
	}
	return out
}

// validateRLS checks the rls section and builds its trees.
func (v *validator) validateRLS(c *Config) {
	r := c.RLS
	if r == nil {
		return
	}
	if len(r.Domains) == 0 && (c.Ratelimit == nil || c.Ratelimit.XDS == nil) {
		v.add("rls.domains", "at least one domain is required (leave rls out to serve no rate-limit service)")
	}
	c.rlsTrees = map[string]*RLSTree{}
	rc := &rlsChecker{v: v, c: c, reported: map[string]bool{}}
	seen := map[string]string{}
	for i := range r.Domains {
		dom := &r.Domains[i]
		path := fmt.Sprintf("rls.domains[%d]", i)
		switch {
		case dom.Domain == "":
			v.add(join(path, "domain"), "is required (the domain of Envoy's rate-limit filter)")
			continue
		case seen[dom.Domain] != "":
			v.add(join(path, "domain"), "domain %q is already mapped at %s", dom.Domain, seen[dom.Domain])
			continue
		}
		seen[dom.Domain] = path
		if len(dom.Descriptors) == 0 {
			v.add(join(path, "descriptors"), "at least one descriptor is required")
		}
		t := rlconfig.NewTree[*RLSDescriptor](dom.Domain)
		c.rlsTrees[dom.Domain] = t
		rc.descriptors(t.Root(), dom.Descriptors, rlsPath{field: path, identities: map[string]string{}})
	}
	if q := r.NearLimitRatio; q != nil && !(*q > 0 && *q <= 1) {
		v.add("rls.near_limit_ratio", "is %v: want a share of the limit above 0 and at most 1 (ratelimit's default: 0.8)", *q)
	}
	const lh = "rls.limit_response_headers"
	for _, p := range r.LimitResponseHeaders.problems(func(f string) string { return join(lh, f) }) {
		v.add(join(lh, p.field), "%s", p.msg)
	}
	xds := c.Ratelimit != nil && c.Ratelimit.XDS != nil
	listed := map[string]bool{}
	for i, d := range r.DeferredCharges {
		path := fmt.Sprintf("rls.deferred_charges[%d]", i)
		switch {
		case d == "":
			v.add(path, "is empty: name a domain whose charges come only from Envoy's stream-done call")
		case listed[d]:
			v.add(path, "domain %q is already listed", d)
		case c.rlsTrees[d] == nil && !xds:
			v.add(path, "names domain %q, which no mapping or ratelimit file has", d)
		}
		listed[d] = true
	}
}

// rlsChecker checks the trees of one rls section. A problem with a node
// above several limits is reported once, not once per limit.
type rlsChecker struct {
	v        *validator
	c        *Config
	reported map[string]bool
}

func (rc *rlsChecker) add(path, format string, args ...any) {
	key := path + "\x00" + fmt.Sprintf(format, args...)
	if rc.reported[key] {
		return
	}
	rc.reported[key] = true
	rc.v.add(path, format, args...)
}

func (rc *rlsChecker) descriptors(parent *rlconfig.Node[*RLSDescriptor], ds []RLSDescriptor, above rlsPath) {
	for i := range ds {
		d := &ds[i]
		field := fmt.Sprintf("%s.descriptors[%d]", above.field, i)
		at := func(f string) string { return join(field, f) }
		here := rlsPath{field: field, identities: above.identities, model: above.model}
		if d.Identity != "" && d.Model {
			rc.add(at("identity"), "an entry is an identity or the model, not both")
		}
		if _, dup := above.identities[d.Identity]; d.Identity != "" && !dup {
			here.identities = make(map[string]string, len(above.identities)+1)
			for k, f := range above.identities {
				here.identities[k] = f
			}
			here.identities[d.Identity] = at("identity")
		}
		switch {
		case d.Model && above.model != "":
			rc.add(at("model"), "the model is already given by %s", above.model)
		case d.Model:
			here.model = at("model")
		}
		rc.limit(d, field, here)
		// A wildcard whose values carry no identity counts them as one, as
		// ratelimit's share_threshold does; the stats keys follow.
		n, err := parent.Add(rlconfig.Spec[*RLSDescriptor]{
			Key: d.Key, Value: d.Value, Data: d, Limited: d.limited(),
			ShareThreshold: strings.Contains(d.Value, "*") && d.Identity == "",
			ValueToMetric:  d.ValueToMetric, DetailedMetric: d.DetailedMetric,
		})
		if err != nil {
			f := field
			if d.Key == "" {
				f = at("key")
			}
			rc.add(f, "%v", err)
		}
		rc.descriptors(n, d.Descriptors, here)
	}
}

// rlsLimit checks what a descriptor ending at d meets.
func (rc *rlsChecker) limit(d *RLSDescriptor, field string, here rlsPath) {
	at := func(f string) string { return join(field, f) }
	n := 0
	for _, set := range []bool{d.Policy != "", d.Unlimited, d.Deny} {
		if set {
			n++
		}
	}
	if n > 1 {
		rc.add(field, "set one of policy (its rules apply), unlimited (no limit) or deny (every hit refused)")
	}
	if (d.ShadowMode || d.QuotaMode) && d.Policy == "" && !d.Deny {
		f := at("shadow_mode")
		if !d.ShadowMode {
			f = at("quota_mode")
		}
		rc.add(f, "shadow_mode and quota_mode apply to a limit: set policy or deny")
	}
	if d.Metadata.Struct() != nil && d.Policy == "" && !d.Deny {
		rc.add(at("metadata"), "metadata applies to a limit that counts: set policy or deny (ratelimit answers no metadata for a descriptor without a limit, or an unlimited one)")
	}
	if (d.Name != "" || len(d.Replaces) > 0) && n == 0 {
		f := at("name")
		if d.Name == "" {
			f = at("replaces")
		}
		rc.add(f, "name and replaces apply to a limit: set policy, unlimited or deny")
	}
	for j, r := range d.Replaces {
		rp := fmt.Sprintf("%s[%d]", at("replaces"), j)
		switch {
		case r == "":
			rc.add(rp, "must not be empty")
		case r == d.Name:
			rc.add(rp, "replaces its own node (%q)", r)
		}
	}
	if len(d.Rules) > 0 && d.Policy == "" {
		rc.add(at("rules"), "only applies with policy")
	}
	if d.Policy == "" {
		return
	}
	p, ok := rc.c.Policy(d.Policy)
	if !ok {
		rc.add(at("policy"), "names policy %q, which is not defined", d.Policy)
		return
	}
	for _, id := range slices.Sorted(maps.Keys(here.identities)) {
		if !slices.ContainsFunc(p.Identities, func(i Identity) bool { return i.Name == id }) {
			rc.add(here.identities[id], "%q is not an identity of policy %q (met at %s)", id, p.Name, field)
		}
	}
	seen := map[string]bool{}
	for j, name := range d.Rules {
		rp := fmt.Sprintf("%s[%d]", at("rules"), j)
		if seen[name] {
			rc.add(rp, "rule %q is listed twice", name)
		}
		seen[name] = true
		if !p.hasRule(name) {
			rc.add(rp, "policy %q has no bucket, quota or concurrency limit %q", p.Name, name)
		}
	}
	where := at("policy")
	if len(d.Rules) > 0 {
		where = at("rules")
	}
	bs, qs, cs := d.Meets(p)
	for _, b := range bs {
		rc.needs(where, p, b.Name, policyRule{kind: "bucket", per: b.Per}, here)
	}
	for _, q := range qs {
		rc.needs(where, p, q.Name, policyRule{kind: "quota", per: q.Per, cost: q.Cost != ""}, here)
	}
	for _, c := range cs {
		rc.needs(where, p, c.Name, policyRule{kind: "concurrency limit", per: c.Per}, here)
	}
}

// needs checks that a descriptor gives what rule r of p is kept per.
func (rc *rlsChecker) needs(where string, p Policy, name string, r policyRule, here rlsPath) {
	switch {
	case r.per == "model" && here.model == "":
		rc.add(where, "%s %q of policy %q is per model, and no entry of this descriptor names the model: mark the entry that carries it with model: true", r.kind, name, p.Name)
	case r.per != "" && r.per != "model" && here.identities[r.per] == "":
		rc.add(where, "%s %q of policy %q is per %q, and no entry of this descriptor carries it: mark that entry with identity: %s (or list the rules that apply in rules)", r.kind, name, p.Name, r.per, r.per)
	}
	if r.cost && here.model == "" {
		rc.add(where, "quota %q of policy %q is a cost quota, priced by model, and no entry of this descriptor names the model: mark the entry that carries it with model: true", name, p.Name)
	}
}

// policyRule is what the RLS checks need of one rule of a policy.
type policyRule struct {
	kind string // bucket, quota or concurrency limit
	per  string
	cost bool
}

// hasRule reports whether p has a bucket, quota or concurrency limit
// called name.
func (p Policy) hasRule(name string) bool {
	return slices.ContainsFunc(p.Buckets, func(b Bucket) bool { return b.Name == name }) ||
		slices.ContainsFunc(p.Quotas, func(q Quota) bool { return q.Name == name }) ||
		slices.ContainsFunc(p.Concurrency, func(c Concurrency) bool { return c.Name == name })
}
