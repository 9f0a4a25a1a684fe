package config

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// Import is a tokengate configuration made from envoyproxy/ratelimit's
// (ImportRatelimit): policies holding one bucket per rate_limit, and an rls
// section holding ratelimit's descriptor trees as they are, each limit
// pointing at its bucket. Parse accepts its YAML as it is.
type Import struct {
	DefaultPolicy string
	Policies      []Policy
	RLS           RLS
	// notes are comments for the YAML, by field path.
	notes map[string]string
	files []string
}

// IdentityOfDescriptors is the identity an imported policy keys its buckets
// by when ratelimit counts per value under entries of several keys: the
// values of a descriptor's key-only and wildcard entries together.
const IdentityOfDescriptors = "descriptor"

// ImportRatelimit converts envoyproxy/ratelimit configuration files, loaded
// as ratelimit loads them (its problems are returned as they are), into
// tokengate's terms (docs/rls.md):
//
//   - each domain becomes a policy and an rls domain of the same tree;
//   - each rate_limit becomes a bucket of that policy holding
//     requests_per_unit tokens (its burst) that refills requests_per_unit
//     per unit, with as much debt allowed (max_debt) as one window holds,
//     a hit costing a token; requests_per_unit 0 becomes deny, unlimited
//     stays unlimited;
//   - ratelimit keeps a counter per value of an entry without value, and
//     of a wildcard entry without share_threshold: those entries carry the
//     policy's identity, and a bucket below them is per that identity;
//   - shadow_mode, quota_mode, name, replaces and metadata (of a limit:
//     ratelimit answers none for other descriptors) stay on their node;
//     detailed_metric and value_to_metric stay too: they name the
//     ratelimit-named metrics (listeners.ratelimit_metrics).
func ImportRatelimit(files []*rlconfig.File, opts rlconfig.Options) (*Import, error) {
	if _, err := rlconfig.Load(files, opts); err != nil {
		return nil, err
	}
	im := &Import{notes: map[string]string{}}
	// Files of one domain (merged, with MergeDomains) make one policy and
	// one rls domain.
	var order []string
	byDomain := map[string][]*rlconfig.File{}
	for _, f := range files {
		im.files = append(im.files, f.Name)
		if byDomain[f.Domain] == nil {
			order = append(order, f.Domain)
		}
		byDomain[f.Domain] = append(byDomain[f.Domain], f)
	}
	policies := map[string]bool{}
	for di, domain := range order {
		var all []rlconfig.Descriptor
		for _, f := range byDomain[domain] {
			all = append(all, f.Descriptors...)
		}
		p := &Policy{Name: unique(sanitize(domain, "ratelimit"), policies)}
		policies[p.Name] = true
		c := &converter{im: im, policy: p, identity: identityName(all), names: map[string]bool{}}
		dom := RLSDomain{Domain: domain}
		for _, f := range byDomain[domain] {
			c.file = f.Name
			dom.Descriptors = append(dom.Descriptors, c.descriptors(f.Descriptors, fmt.Sprintf("rls.domains[%d]", di), len(dom.Descriptors), nil, false)...)
		}
		im.RLS.Domains = append(im.RLS.Domains, dom)
		if len(p.Buckets) == 0 {
			continue // nothing counted: its descriptors are unlimited, denied or free
		}
		for _, b := range p.Buckets {
			if b.Per != "" {
				p.Identities = []Identity{{Name: c.identity}}
				break
			}
		}
		im.Policies = append(im.Policies, *p)
	}
	if len(im.Policies) == 0 {
		return nil, fmt.Errorf("%s: no rate_limit with a unit and requests_per_unit above 0: nothing for tokengate to count", strings.Join(im.files, ", "))
	}
	im.DefaultPolicy = im.Policies[0].Name
	return im, nil
}

// converter turns one file's descriptors into an rls tree and buckets.
type converter struct {
	im       *Import
	policy   *Policy
	identity string
	names    map[string]bool // bucket names taken in the policy
	file     string          // the file being converted
}

// varies reports whether ratelimit counts per value of the entry that d
// matches: a key without value, or a wildcard without share_threshold.
func varies(d *rlconfig.Descriptor) bool {
	return d.Value == "" || strings.Contains(d.Value, "*") && !d.ShareThreshold
}

// identityName is the identity of an imported policy: the key of its
// varying entries when they all have one key that can name an identity,
// else IdentityOfDescriptors.
func identityName(ds []rlconfig.Descriptor) string {
	key := ""
	var walk func([]rlconfig.Descriptor) bool
	walk = func(ds []rlconfig.Descriptor) bool {
		for i := range ds {
			d := &ds[i]
			if varies(d) {
				if key != "" && key != d.Key {
					return false
				}
				key = d.Key
			}
			if !walk(d.Descriptors) {
				return false
			}
		}
		return true
	}
	if walk(ds) && key != "" && nameRE.MatchString(key) && key != "model" {
		return key
	}
	return IdentityOfDescriptors
}

func (c *converter) descriptors(ds []rlconfig.Descriptor, path string, base int, above []string, varied bool) []RLSDescriptor {
	out := make([]RLSDescriptor, 0, len(ds))
	for i := range ds {
		d := &ds[i]
		field := fmt.Sprintf("%s.descriptors[%d]", path, base+i)
		composites := append(above[:len(above):len(above)], composite(d))
		n := RLSDescriptor{Key: d.Key, Value: d.Value, DetailedMetric: d.DetailedMetric, ValueToMetric: d.ValueToMetric}
		v := varied || varies(d)
		if varies(d) {
			n.Identity = c.identity
		}
		var notes []string
		if rl := d.RateLimit; rl != nil {
			n.Name, n.Replaces = rl.Name, rl.Replaces
			switch {
			case rl.Unlimited:
				n.Unlimited = true
			case rl.RequestsPerUnit == 0:
				n.Deny = true
				notes = append(notes, "ratelimit: 0 per "+strings.ToLower(rl.Unit)+", every hit over the limit")
			default:
				c.limit(&n, d, rl, field, composites, v)
			}
			if !n.Unlimited {
				n.ShadowMode, n.QuotaMode = d.ShadowMode, d.QuotaMode
			}
		}
		// ratelimit answers the metadata of a limit it checked, never of a
		// descriptor without rate_limit or an unlimited one.
		if d.Metadata != nil {
			if n.Policy != "" || n.Deny {
				n.Metadata = NewRLSMetadata(d.Metadata)
			} else {
				notes = append(notes, "ratelimit's metadata left out: ratelimit answers none for a descriptor without a limit, or an unlimited one")
			}
		}
		if len(notes) > 0 {
			c.im.notes[field] = strings.Join(notes, "; ")
		}
		n.Descriptors = c.descriptors(d.Descriptors, field, 0, composites, v)
		out = append(out, n)
	}
	return out
}

// limit makes the bucket of one rate_limit and points n at it.
func (c *converter) limit(n *RLSDescriptor, d *rlconfig.Descriptor, rl *rlconfig.RateLimit, field string, composites []string, varied bool) {
	unit, _ := rlconfig.ParseUnit(rl.Unit) // Load accepted it
	seconds := float64(rlconfig.UnitSeconds(unit))
	b := Bucket{
		Name:            c.bucketName(rl.Name, composites),
		TokensPerMinute: float64(rl.RequestsPerUnit) * 60 / seconds,
		Burst:           float64(rl.RequestsPerUnit),
		MaxDebt:         float64(rl.RequestsPerUnit),
	}
	if varied {
		b.Per = c.identity
	}
	c.names[b.Name] = true
	c.policy.Buckets = append(c.policy.Buckets, b)
	c.im.notes[fmt.Sprintf("%s/%s", c.policy.Name, b.Name)] = fmt.Sprintf("ratelimit: %d per %s (%s: %s)", rl.RequestsPerUnit, strings.ToLower(unit.String()), c.file, d.Field)
	n.Policy, n.Rules = c.policy.Name, []string{b.Name}
}

// bucketName names the bucket of a rate_limit: by the limit's own name,
// else by the descriptor's key and value, with those above it as far as
// needed to tell it from the others.
func (c *converter) bucketName(name string, composites []string) string {
	if name != "" {
		return unique(sanitize(name, "limit"), c.names)
	}
	for i := len(composites) - 1; i >= 0; i-- {
		if n := sanitize(strings.Join(composites[i:], "-"), "limit"); !c.names[n] {
			return n
		}
	}
	return unique(sanitize(strings.Join(composites, "-"), "limit"), c.names)
}

func composite(d *rlconfig.Descriptor) string {
	if d.Value == "" {
		return d.Key
	}
	return d.Key + "_" + d.Value
}

// maxNameBytes bounds an imported name; a longer one keeps a digest of
// the whole so that two long names stay apart.
const maxNameBytes = 48

// sanitize makes a tokengate name (nameRE) of s: lower case, every other
// character a '-', runs of them one; empty gives fallback.
func sanitize(s, fallback string) string {
	var b strings.Builder
	dash := false
	for _, r := range strings.ToLower(s) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '_':
			b.WriteRune(r)
			dash = false
		case !dash && b.Len() > 0:
			b.WriteByte('-')
			dash = true
		}
	}
	out := strings.TrimRight(b.String(), "-")
	if out == "" || out[0] == '_' {
		out = strings.TrimLeft(fallback+"-"+out, "-")
		out = strings.TrimRight(out, "-")
	}
	if len(out) > maxNameBytes {
		sum := sha256.Sum256([]byte(s))
		out = strings.TrimRight(out[:maxNameBytes-9], "-_") + "-" + hex.EncodeToString(sum[:4])
	}
	return out
}

// unique returns name, or name-2, name-3, ... when taken has it.
func unique(name string, taken map[string]bool) string {
	if !taken[name] {
		return name
	}
	for i := 2; ; i++ {
		if n := name + "-" + strconv.Itoa(i); !taken[n] {
			return n
		}
	}
}

// YAML is the imported configuration as a tokengate configuration file,
// with comments saying where each bucket comes from and what was left out.
func (im *Import) YAML() ([]byte, error) {
	root := mapping()
	doc := &yaml.Node{Kind: yaml.DocumentNode, Content: []*yaml.Node{root}}
	doc.HeadComment = "Made by `tokengate import ratelimit` from " + strings.Join(im.files, ", ") + ".\n" +
		"Each rate_limit is a bucket of requests_per_unit tokens refilling requests_per_unit per unit,\n" +
		"a hit costing one token; see docs/rls.md for how that differs from ratelimit's fixed windows."
	add(root, "default_policy", scalar(im.DefaultPolicy))
	root.Content[len(root.Content)-2].HeadComment = "ext_proc routes that name no policy meet this one; the rate-limit service goes by rls below."
	pols := sequence()
	for _, p := range im.Policies {
		pm := mapping()
		add(pm, "name", scalar(p.Name))
		if len(p.Identities) > 0 {
			ids := sequence()
			for _, id := range p.Identities {
				idm := mapping()
				add(idm, "name", scalar(id.Name))
				ids.Content = append(ids.Content, idm)
			}
			add(pm, "identities", ids)
			pm.Content[len(pm.Content)-2].LineComment = "given by the rls descriptors that carry it"
		}
		bs := sequence()
		for _, b := range p.Buckets {
			bm := mapping()
			add(bm, "name", scalar(b.Name))
			if b.Per != "" {
				add(bm, "per", scalar(b.Per))
			}
			add(bm, "tokens_per_minute", number(b.TokensPerMinute))
			add(bm, "burst", number(b.Burst))
			add(bm, "max_debt", number(b.MaxDebt))
			bm.HeadComment = im.notes[p.Name+"/"+b.Name]
			bs.Content = append(bs.Content, bm)
		}
		add(pm, "buckets", bs)
		pols.Content = append(pols.Content, pm)
	}
	add(root, "policies", pols)
	doms := sequence()
	for i, d := range im.RLS.Domains {
		dm := mapping()
		add(dm, "domain", scalar(d.Domain))
		ds, err := im.descriptorsYAML(d.Descriptors, fmt.Sprintf("rls.domains[%d]", i))
		if err != nil {
			return nil, err
		}
		add(dm, "descriptors", ds)
		doms.Content = append(doms.Content, dm)
	}
	rls := mapping()
	add(rls, "domains", doms)
	add(root, "rls", rls)
	var b strings.Builder
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(doc); err != nil {
		return nil, err
	}
	if err := enc.Close(); err != nil {
		return nil, err
	}
	return []byte(b.String()), nil
}

func (im *Import) descriptorsYAML(ds []RLSDescriptor, path string) (*yaml.Node, error) {
	seq := sequence()
	for i := range ds {
		d := &ds[i]
		field := fmt.Sprintf("%s.descriptors[%d]", path, i)
		m := mapping()
		add(m, "key", scalar(d.Key))
		if d.Value != "" {
			add(m, "value", scalar(d.Value))
		}
		if d.Identity != "" {
			add(m, "identity", scalar(d.Identity))
		}
		if d.Policy != "" {
			add(m, "policy", scalar(d.Policy))
			rules := sequence()
			rules.Style = yaml.FlowStyle
			for _, r := range d.Rules {
				rules.Content = append(rules.Content, scalar(r))
			}
			add(m, "rules", rules)
		}
		for _, f := range []struct {
			key string
			on  bool
		}{{"unlimited", d.Unlimited}, {"deny", d.Deny}, {"shadow_mode", d.ShadowMode}, {"quota_mode", d.QuotaMode},
			{"detailed_metric", d.DetailedMetric}, {"value_to_metric", d.ValueToMetric}} {
			if f.on {
				add(m, f.key, &yaml.Node{Kind: yaml.ScalarNode, Value: "true"})
			}
		}
		if d.Name != "" {
			add(m, "name", scalar(d.Name))
		}
		if len(d.Replaces) > 0 {
			rs := sequence()
			rs.Style = yaml.FlowStyle
			for _, r := range d.Replaces {
				rs.Content = append(rs.Content, scalar(r))
			}
			add(m, "replaces", rs)
		}
		if s := d.Metadata.Struct(); s != nil {
			md := &yaml.Node{}
			if err := md.Encode(s.AsMap()); err != nil {
				return nil, fmt.Errorf("%s.metadata: %w", field, err)
			}
			add(m, "metadata", md)
		}
		if len(d.Descriptors) > 0 {
			sub, err := im.descriptorsYAML(d.Descriptors, field)
			if err != nil {
				return nil, err
			}
			add(m, "descriptors", sub)
		}
		m.HeadComment = im.notes[field]
		seq.Content = append(seq.Content, m)
	}
	return seq, nil
}

func mapping() *yaml.Node  { return &yaml.Node{Kind: yaml.MappingNode} }
func sequence() *yaml.Node { return &yaml.Node{Kind: yaml.SequenceNode} }

// scalar is a string, quoted where YAML would read it as something else.
func scalar(s string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: s} }

func number(f float64) *yaml.Node {
	return &yaml.Node{Kind: yaml.ScalarNode, Value: strconv.FormatFloat(f, 'g', -1, 64)}
}

func add(m *yaml.Node, key string, v *yaml.Node) {
	m.Content = append(m.Content, scalar(key), v)
}
