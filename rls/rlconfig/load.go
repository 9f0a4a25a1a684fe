package rlconfig

import (
	"fmt"
	"slices"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Rule is what a descriptor of a loaded configuration applies to a request
// descriptor that ends at it: its rate_limit and the flags beside it.
// Rules are shared by every request; they must not be changed.
type Rule struct {
	RequestsPerUnit uint32
	// Unit is UNKNOWN only for an unlimited rule (or a request's own
	// limit with no unit, which ratelimit fails on).
	Unit Unit
	Name string
	// Unlimited answers OK with limit_remaining MaxUint32 and counts
	// nothing (§3.2).
	Unlimited      bool
	Replaces       []string
	ShadowMode     bool
	QuotaMode      bool
	DetailedMetric bool
	Metadata       *structpb.Struct
	// File, Line and Field say where it is configured; empty for a
	// request's own limit.
	File  string
	Line  int
	Field string
}

// Config is a loaded configuration: one descriptor tree per domain. It is
// immutable and safe for concurrent use.
type Config struct {
	domains map[string]*Tree[*Rule]
	names   []string
}

// Options are ratelimit's settings that change how files load.
type Options struct {
	// MergeDomains merges files of the same domain into one tree instead
	// of refusing the second (MERGE_DOMAIN_CONFIG); a descriptor defined in
	// both is still refused.
	MergeDomains bool
}

// Load builds the configuration of files, in order, as ratelimit loads
// them (loadConfig, loadDescriptors): it refuses an empty domain, a domain
// defined twice (unless merged), an empty key, a key and value defined
// twice at one level, a unit that is not one (an unlimited rule must have
// none), an empty replaces name or one naming its own rule, and
// share_threshold without a wildcard. Every problem is reported.
func Load(files []*File, opts Options) (*Config, error) {
	c := &Config{domains: map[string]*Tree[*Rule]{}}
	var problems Problems
	for _, f := range files {
		add := func(line int, field, format string, args ...any) {
			problems = append(problems, Problem{File: f.Name, Line: line, Field: field, Msg: fmt.Sprintf(format, args...)})
		}
		if f.Domain == "" {
			add(f.DomainLine, "domain", "config file cannot have empty domain")
			continue
		}
		t := c.domains[f.Domain]
		switch {
		case t != nil && !opts.MergeDomains:
			add(f.DomainLine, "domain", "duplicate domain '%s' in config file", f.Domain)
			continue
		case t == nil:
			t = NewTree[*Rule](f.Domain)
			c.domains[f.Domain] = t
			c.names = append(c.names, f.Domain)
		}
		loadDescriptors(f.Name, t.Root(), f.Descriptors, add)
	}
	if len(problems) > 0 {
		return nil, problems
	}
	slices.Sort(c.names)
	return c, nil
}

func loadDescriptors(file string, parent *Node[*Rule], ds []Descriptor, add func(int, string, string, ...any)) {
	for i := range ds {
		d := &ds[i]
		var rule *Rule
		if rl := d.RateLimit; rl != nil {
			rule = &Rule{
				RequestsPerUnit: rl.RequestsPerUnit, Name: rl.Name, Unlimited: rl.Unlimited, Replaces: rl.Replaces,
				ShadowMode: d.ShadowMode, QuotaMode: d.QuotaMode, DetailedMetric: d.DetailedMetric, Metadata: d.Metadata,
				File: file, Line: d.Line, Field: d.Field,
			}
			unit, valid := ParseUnit(rl.Unit)
			switch {
			case rl.Unlimited && valid:
				add(d.Line, join(d.Field, "rate_limit.unit"), "should not specify rate limit unit when unlimited")
			case !rl.Unlimited && !valid:
				add(d.Line, join(d.Field, "rate_limit.unit"), "invalid rate limit unit '%s'", rl.Unit)
			}
			rule.Unit = unit
			for j, r := range rl.Replaces {
				field := fmt.Sprintf("%s.rate_limit.replaces[%d].name", d.Field, j)
				switch {
				case r == "":
					add(d.Line, field, "should not have an empty replaces entry")
				case r == rl.Name:
					add(d.Line, field, "replaces should not contain name of same descriptor")
				}
			}
		}
		n, err := parent.Add(Spec[*Rule]{
			Key: d.Key, Value: d.Value, Data: rule, Limited: rule != nil,
			ShareThreshold: d.ShareThreshold, ValueToMetric: d.ValueToMetric, DetailedMetric: d.DetailedMetric,
		})
		if err != nil {
			add(d.Line, d.Field, "%v", err)
		}
		loadDescriptors(file, n, d.Descriptors, add)
	}
}

// Domains lists the configured domains, sorted.
func (c *Config) Domains() []string { return slices.Clone(c.names) }

// Tree is the descriptor tree of domain; nil when the domain is not
// configured.
func (c *Config) Tree(domain string) *Tree[*Rule] { return c.domains[domain] }

// Limit is GetLimit (§3.2): the rule one request descriptor meets in
// domain, and whether the domain is configured at all (an unknown domain
// applies no limit, and ratelimit counts it as domain_not_found). A
// descriptor with its own limit (RateLimitDescriptor.limit, e.g. Envoy
// Gateway's limit.fromMetadata) meets that limit, whatever the tree says,
// with no shadow or quota mode, as long as the domain is configured. The
// rule is nil where no limit applies.
func (c *Config) Limit(domain string, d *commonv3.RateLimitDescriptor) (rule *Rule, known bool) {
	t := c.domains[domain]
	if t == nil {
		return nil, false
	}
	if o := d.GetLimit(); o != nil {
		return &Rule{RequestsPerUnit: o.GetRequestsPerUnit(), Unit: Unit(o.GetUnit())}, true
	}
	if n := t.Match(d.GetEntries()); n != nil {
		return n.Data, true
	}
	return nil, true
}

// StatsKey is the name of the stats of the limit a descriptor meets in
// domain ([Tree.StatsKey]); for a descriptor with its own limit it is the
// domain and the request's key_value entries ("domain.k1_v1.k2").
func (c *Config) StatsKey(domain string, d *commonv3.RateLimitDescriptor) string {
	t := c.domains[domain]
	if t == nil {
		return ""
	}
	if d.GetLimit() == nil {
		return t.StatsKey(d.GetEntries())
	}
	key := domain + "."
	for i, e := range d.GetEntries() {
		if i > 0 {
			key += "."
		}
		key += e.GetKey()
		if e.GetValue() != "" {
			key += "_" + e.GetValue()
		}
	}
	return key
}

// CurrentLimit is the limit as a DescriptorStatus reports it.
func (r *Rule) CurrentLimit() *rlsv3.RateLimitResponse_RateLimit {
	return &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: r.RequestsPerUnit, Unit: r.Unit, Name: r.Name}
}

// Replaced reports which of the limits a request's descriptors met
// (limits[i] for descriptor i; the zero T where none) ratelimit drops:
// those whose name is among the names that any met limit replaces,
// unlimited ones included (§3.2). name and replaces read a limit's name
// and replaces.
func Replaced[T any](limits []T, name func(T) string, replaces func(T) []string) []bool {
	var gone map[string]bool
	for _, l := range limits {
		for _, r := range replaces(l) {
			if gone == nil {
				gone = map[string]bool{}
			}
			gone[r] = true
		}
	}
	out := make([]bool, len(limits))
	if gone == nil {
		return out
	}
	for i, l := range limits {
		if n := name(l); n != "" && gone[n] {
			out[i] = true
		}
	}
	return out
}
