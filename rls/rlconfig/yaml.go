package rlconfig

import (
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"

	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// ratelimit reads its files with gopkg.in/yaml.v2 in two passes
// (ConfigFileContentToYaml, §3.1): first the whole document as a generic
// map, in which every key anywhere must be one of validKeys and every
// value a mapping, a list of mappings, a string, an int, a bool or null
// (metadata is not looked into); then the document again into its structs,
// which ignore keys that belong to another level and keep the last of a
// repeated key. Parse does the same on yaml.v3's node tree, which has the
// lines that problems carry, resolving plain scalars as yaml.v2 does (YAML
// 1.1: yes/no/on/off are booleans, 0777 is octal, 1_000 is an int).

// validKeys is ratelimit's one list of keys, valid at every level.
var validKeys = map[string]bool{
	"domain": true, "key": true, "value": true, "descriptors": true, "rate_limit": true,
	"unit": true, "requests_per_unit": true, "unlimited": true, "shadow_mode": true,
	"quota_mode": true, "name": true, "replaces": true, "detailed_metric": true,
	"value_to_metric": true, "share_threshold": true, "metadata": true,
}

// The keys each level's struct reads; the others are ignored there.
var (
	rootKeys       = []string{"domain", "descriptors"}
	descriptorKeys = []string{"key", "value", "rate_limit", "descriptors", "shadow_mode", "quota_mode",
		"detailed_metric", "value_to_metric", "share_threshold", "metadata"}
	rateLimitKeys = []string{"requests_per_unit", "unit", "unlimited", "name", "replaces"}
	replacesKeys  = []string{"name"}
)

// maxNodes bounds the values a file may expand to through aliases.
const maxNodes = 1 << 20

type kind int

const (
	kNull kind = iota
	kString
	kInt   // fits int64
	kBig   // an integer beyond int64, which yaml.v2 gives as uint64
	kFloat //
	kBool
	kSeq
	kMap
)

var tags = [...]string{"!!null", "!!str", "!!int", "!!int", "!!float", "!!bool", "!!seq", "!!map"}

// value is a YAML value as yaml.v2 decodes it into interface{}.
type value struct {
	kind  kind
	text  string // a scalar as written
	i     int64
	u     uint64
	f     float64
	b     bool
	line  int
	items []*value
	// keys and vals are a mapping's pairs, a repeated key keeping its last
	// value (where the first one stood, as a Go map would hold it); lost
	// are the keys whose value was dropped.
	keys, vals []*value
	merged     []bool
	lost       []*value
	// earlier holds, per key, the values it had before its last one, in
	// the order yaml.v2 decoded them: into a struct or a map it decodes a
	// repeated mapping over the earlier one (see decodedOver).
	earlier [][]*value
}

// goValue is v as yaml.v2 would decode it into interface{}, for messages
// (which ratelimit formats with %v) and metadata.
func (v *value) goValue() any {
	switch v.kind {
	case kString:
		return v.text
	case kInt:
		return v.i
	case kBig:
		return v.u
	case kFloat:
		return v.f
	case kBool:
		return v.b
	case kSeq:
		out := make([]any, len(v.items))
		for i, e := range v.items {
			out[i] = e.goValue()
		}
		return out
	case kMap:
		out := make(map[any]any, len(v.keys))
		for i, k := range v.keys {
			out[k.goValue()] = v.vals[i].goValue()
		}
		return out
	}
	return nil
}

type parser struct {
	file     string
	problems Problems
	ignored  Problems
	nodes    int
}

func (p *parser) add(line int, field, format string, args ...any) {
	p.problems = append(p.problems, Problem{File: p.file, Line: line, Field: field, Msg: fmt.Sprintf(format, args...)})
}

func (p *parser) ignore(line int, field, format string, args ...any) {
	p.ignored = append(p.ignored, Problem{File: p.file, Line: line, Field: field, Msg: fmt.Sprintf(format, args...)})
}

var yamlLine = regexp.MustCompile(`^(?:yaml: )?line (\d+): (.*)$`)

// Parse reads one ratelimit configuration file. It reports, all at once,
// what ratelimit's reading of a file refuses: YAML that does not parse, a
// key that is not a string, an unknown key, a list of something other than
// mappings, a value of a type ratelimit does not take (a float), a value
// its field cannot hold. What loading refuses (an empty domain, a bad
// unit, a duplicate descriptor) is reported by Load. As yaml.v2 does, Parse
// reads the first YAML document of the file only.
func Parse(name string, data []byte) (*File, error) {
	p := &parser{file: name}
	var root yaml.Node
	if err := yaml.Unmarshal(data, &root); err != nil {
		pr := Problem{File: name, Msg: "error loading config file: " + strings.TrimPrefix(err.Error(), "yaml: ")}
		if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
			pr.Line, _ = strconv.Atoi(m[1]) // the pattern matched digits
			pr.Msg = "error loading config file: " + m[2]
		}
		return nil, Problems{pr}
	}
	f := &File{Name: name}
	if len(root.Content) == 0 {
		return f, nil // an empty file is an empty mapping: Load finds no domain
	}
	doc := p.convert(root.Content[0], 0)
	if len(p.problems) > 0 {
		return nil, p.problems
	}
	switch doc.kind {
	case kNull:
		return f, nil
	case kMap:
	default:
		p.add(doc.line, "", "error loading config file: cannot unmarshal %s into a mapping", describe(doc))
		return nil, p.problems
	}
	p.validateKeys(doc, "")
	if len(p.problems) > 0 {
		return nil, p.problems
	}
	p.root(doc, f)
	if len(p.problems) > 0 {
		return nil, p.problems
	}
	f.Ignored = p.ignored
	return f, nil
}

// convert turns a node into a value with yaml.v2's meaning.
func (p *parser) convert(n *yaml.Node, depth int) *value {
	p.nodes++
	if p.nodes > maxNodes || depth > 1000 {
		if p.nodes == maxNodes+1 || depth == 1001 {
			p.add(n.Line, "", "error loading config file: the document expands to more than %d values", maxNodes)
		}
		return &value{kind: kNull, line: n.Line}
	}
	switch n.Kind {
	case yaml.AliasNode:
		v := p.convert(n.Alias, depth+1)
		c := *v
		c.line = n.Line
		return &c
	case yaml.DocumentNode:
		if len(n.Content) == 0 {
			return &value{kind: kNull, line: n.Line}
		}
		return p.convert(n.Content[0], depth+1)
	case yaml.SequenceNode:
		v := &value{kind: kSeq, line: n.Line}
		for _, c := range n.Content {
			v.items = append(v.items, p.convert(c, depth+1))
		}
		return v
	case yaml.MappingNode:
		v := &value{kind: kMap, line: n.Line}
		p.mapping(v, n, depth)
		return v
	}
	return scalar(n)
}

// mapping fills v with the pairs of n, merging "<<" keys in place as
// yaml.v2 does: in order, a later key replacing an earlier one. A list or
// a mapping as a key is refused, as yaml.v2 refuses it.
func (p *parser) mapping(v *value, n *yaml.Node, depth int) {
	for i := 0; i+1 < len(n.Content); i += 2 {
		kn, vn := n.Content[i], n.Content[i+1]
		if kn.Kind == yaml.ScalarNode && (kn.Tag == "!!merge" || kn.Value == "<<" && kn.Style == 0) {
			for _, src := range mergeSources(vn) {
				m := p.convert(src, depth+1)
				if m.kind != kMap {
					p.add(vn.Line, "", "error loading config file: map merge requires map or sequence of maps as the value")
					continue
				}
				for j := range m.keys {
					v.set(m.keys[j], m.vals[j], true)
				}
			}
			continue
		}
		k := p.convert(kn, depth+1)
		if k.kind == kSeq || k.kind == kMap {
			p.add(kn.Line, "", "error loading config file: invalid map key: %s", describe(k))
			continue
		}
		v.set(k, p.convert(vn, depth+1), false)
	}
}

// mergeSources are the mappings a "<<" merges, in the order yaml.v2
// applies them: of a list, the last first, so that the earlier mappings'
// keys win.
func mergeSources(n *yaml.Node) []*yaml.Node {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Kind != yaml.SequenceNode {
		return []*yaml.Node{n}
	}
	out := make([]*yaml.Node, len(n.Content))
	for i, c := range n.Content {
		out[len(out)-1-i] = c
	}
	return out
}

// set sets key k to x, replacing an earlier k. A key replaced by, or
// replacing, one that a merge brought is how merges are meant; any other
// repetition loses a value.
func (v *value) set(k, x *value, merged bool) {
	for i, old := range v.keys {
		if sameKey(old, k) {
			if !merged && !v.merged[i] && !decodedOver[k.text] {
				v.lost = append(v.lost, old)
			}
			v.earlier[i] = append(v.earlier[i], v.vals[i])
			v.keys[i], v.vals[i], v.merged[i] = k, x, merged
			return
		}
	}
	v.keys = append(v.keys, k)
	v.vals = append(v.vals, x)
	v.merged = append(v.merged, merged)
	v.earlier = append(v.earlier, nil)
}

// decodedOver are the descriptor fields ratelimit decodes into a struct
// pointer (rate_limit) or a map (metadata): yaml.v2 decodes a repeated or
// merged mapping of them into what the earlier one made, so the fields a
// later one leaves out keep their values, and null starts afresh.
var decodedOver = map[string]bool{"rate_limit": true, "metadata": true}

// over is the value of m's i-th key as yaml.v2 decodes it into a struct
// or a map: its mappings laid over each other since the last null.
func (m *value) over(i int) *value {
	last := m.vals[i]
	if last.kind != kMap || len(m.earlier[i]) == 0 {
		return last
	}
	all := append(append([]*value{}, m.earlier[i]...), last)
	from := 0
	for j, x := range all {
		switch x.kind {
		case kMap:
		case kNull:
			from = j + 1
		default:
			return x // refused, as yaml.v2 refuses it
		}
	}
	out := &value{kind: kMap, line: last.line}
	for _, x := range all[from:] {
		for j := range x.keys {
			out.set(x.keys[j], x.vals[j], true)
		}
		out.lost = append(out.lost, x.lost...)
	}
	return out
}

func sameKey(a, b *value) bool {
	if a.kind != b.kind {
		return false
	}
	switch a.kind {
	case kString:
		return a.text == b.text
	case kInt:
		return a.i == b.i
	case kBig:
		return a.u == b.u
	case kFloat:
		return a.f == b.f
	case kBool:
		return a.b == b.b
	case kNull:
		return true
	}
	return false // yaml.v2 cannot key a Go map by a list or a mapping; ratelimit refuses such keys anyway
}

// yaml.v2's plain scalars with a meaning of their own.
var (
	v2True   = set("y", "Y", "yes", "Yes", "YES", "on", "On", "ON", "true", "True", "TRUE")
	v2False  = set("n", "N", "no", "No", "NO", "off", "Off", "OFF", "false", "False", "FALSE")
	v2Null   = set("", "~", "null", "Null", "NULL")
	v2Inf    = set(".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF")
	v2NegInf = set("-.inf", "-.Inf", "-.INF")
	v2NaN    = set(".nan", ".NaN", ".NAN")
	v2Float  = regexp.MustCompile(`^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`)
)

func set(s ...string) map[string]bool {
	m := make(map[string]bool, len(s))
	for _, x := range s {
		m[x] = true
	}
	return m
}

// scalar resolves a scalar node as yaml.v2 does.
func scalar(n *yaml.Node) *value {
	v := &value{kind: kString, text: n.Value, line: n.Line}
	if n.Style&(yaml.SingleQuotedStyle|yaml.DoubleQuotedStyle|yaml.LiteralStyle|yaml.FoldedStyle) != 0 {
		return v
	}
	if n.Style&yaml.TaggedStyle != 0 {
		return tagged(n, v)
	}
	s := n.Value
	switch {
	case v2Null[s]:
		v.kind = kNull
	case v2True[s], v2False[s]:
		v.kind, v.b = kBool, v2True[s]
	case v2Inf[s]:
		v.kind, v.f = kFloat, math.Inf(1)
	case v2NegInf[s]:
		v.kind, v.f = kFloat, math.Inf(-1)
	case v2NaN[s]:
		v.kind, v.f = kFloat, math.NaN()
	case s[0] == '.':
		if f, err := strconv.ParseFloat(s, 64); err == nil {
			v.kind, v.f = kFloat, f
		}
	case s[0] == '+' || s[0] == '-' || s[0] >= '0' && s[0] <= '9':
		plain := strings.ReplaceAll(s, "_", "")
		if i, err := strconv.ParseInt(plain, 0, 64); err == nil {
			v.kind, v.i = kInt, i
		} else if u, err := strconv.ParseUint(plain, 0, 64); err == nil {
			v.kind, v.u = kBig, u
		} else if v2Float.MatchString(plain) {
			if f, err := strconv.ParseFloat(plain, 64); err == nil {
				v.kind, v.f = kFloat, f
			}
		}
	}
	return v
}

// tagged resolves a scalar with an explicit tag (!!str, !!int, ...).
func tagged(n *yaml.Node, v *value) *value {
	var x any
	if err := n.Decode(&x); err != nil {
		return v // the tag does not fit the text; keep the text
	}
	switch t := x.(type) {
	case string:
		v.text = t // !!binary is the bytes it encodes
	case nil:
		v.kind = kNull
	case bool:
		v.kind, v.b = kBool, t
	case int:
		v.kind, v.i = kInt, int64(t)
	case int64:
		v.kind, v.i = kInt, t
	case uint64:
		v.kind, v.u = kBig, t
	case float64:
		v.kind, v.f = kFloat, t
	}
	return v
}

func describe(v *value) string {
	if v.kind == kSeq || v.kind == kMap {
		return tags[v.kind]
	}
	return tags[v.kind] + " `" + v.text + "`"
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// validateKeys is ratelimit's first pass (validateYamlKeys).
func (p *parser) validateKeys(m *value, path string) {
	for i, k := range m.keys {
		if k.kind != kString {
			p.add(k.line, path, "config error, key is not of type string: %v", k.goValue())
			continue
		}
		field := join(path, k.text)
		if !validKeys[k.text] {
			p.add(k.line, field, "config error, unknown key '%s'", k.text)
			continue
		}
		if k.text == "metadata" {
			continue // free-form; ratelimit converts it, unchecked, later
		}
		v := m.vals[i]
		switch v.kind {
		case kSeq:
			for j, e := range v.items {
				if e.kind != kMap {
					p.add(e.line, fmt.Sprintf("%s[%d]", field, j), "config error, yaml file contains list of type other than map: %v", e.goValue())
					continue
				}
				p.validateKeys(e, fmt.Sprintf("%s[%d]", field, j))
			}
		case kMap:
			p.validateKeys(v, field)
		case kString, kInt, kBool, kNull:
		default:
			p.add(v.line, field, "error checking config")
		}
	}
}

// fields calls read for each key of m that its level reads, and records the
// keys it ignores.
func (p *parser) fields(m *value, path string, known []string, read func(key string, v *value, field string)) {
	for _, k := range m.lost {
		p.ignore(k.line, join(path, k.text), "%q is repeated; ratelimit keeps only its last value", k.text)
	}
	for i, k := range m.keys {
		field := join(path, k.text)
		if !contains(known, k.text) {
			p.ignore(k.line, field, "ratelimit ignores %q here (it reads %s)", k.text, strings.Join(known, ", "))
			continue
		}
		v := m.vals[i]
		if decodedOver[k.text] {
			v = m.over(i)
		}
		read(k.text, v, field)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func (p *parser) typeError(v *value, field, want string) {
	p.add(v.line, field, "error loading config file: cannot unmarshal %s into %s", describe(v), want)
}

func (p *parser) str(v *value, field string) string {
	switch v.kind {
	case kNull:
		return ""
	case kSeq, kMap:
		p.typeError(v, field, "a string")
		return ""
	}
	return v.text // yaml.v2 keeps any scalar's text for a string
}

func (p *parser) boolean(v *value, field string) bool {
	switch v.kind {
	case kNull:
		return false
	case kBool:
		return v.b
	}
	p.typeError(v, field, "true or false")
	return false
}

func (p *parser) uint32(v *value, field string) uint32 {
	switch {
	case v.kind == kNull:
		return 0
	case v.kind == kInt && v.i >= 0 && v.i <= math.MaxUint32:
		return uint32(v.i)
	}
	p.typeError(v, field, "a whole number from 0 to 4294967295")
	return 0
}

func (p *parser) root(m *value, f *File) {
	p.fields(m, "", rootKeys, func(key string, v *value, field string) {
		switch key {
		case "domain":
			f.Domain, f.DomainLine = p.str(v, field), v.line
		case "descriptors":
			f.Descriptors = p.descriptors(v, field)
		}
	})
}

func (p *parser) descriptors(v *value, field string) []Descriptor {
	switch v.kind {
	case kNull:
		return nil
	case kSeq:
	default:
		p.typeError(v, field, "a list of descriptors")
		return nil
	}
	out := make([]Descriptor, 0, len(v.items))
	for i, e := range v.items {
		out = append(out, p.descriptor(e, fmt.Sprintf("%s[%d]", field, i)))
	}
	return out
}

func (p *parser) descriptor(m *value, path string) Descriptor {
	d := Descriptor{Line: m.line, Field: path}
	p.fields(m, path, descriptorKeys, func(key string, v *value, field string) {
		switch key {
		case "key":
			d.Key = p.str(v, field)
		case "value":
			d.Value = p.str(v, field)
		case "rate_limit":
			d.RateLimit = p.rateLimit(v, field)
		case "descriptors":
			d.Descriptors = p.descriptors(v, field)
		case "shadow_mode":
			d.ShadowMode = p.boolean(v, field)
		case "quota_mode":
			d.QuotaMode = p.boolean(v, field)
		case "detailed_metric":
			d.DetailedMetric = p.boolean(v, field)
		case "value_to_metric":
			d.ValueToMetric = p.boolean(v, field)
		case "share_threshold":
			d.ShareThreshold = p.boolean(v, field)
		case "metadata":
			d.Metadata = p.metadata(v, field)
		}
	})
	return d
}

func (p *parser) rateLimit(v *value, path string) *RateLimit {
	switch v.kind {
	case kNull:
		return nil
	case kMap:
	default:
		p.typeError(v, path, "a rate_limit mapping")
		return nil
	}
	rl := &RateLimit{}
	p.fields(v, path, rateLimitKeys, func(key string, x *value, field string) {
		switch key {
		case "requests_per_unit":
			rl.RequestsPerUnit = p.uint32(x, field)
		case "unit":
			rl.Unit = p.str(x, field)
		case "unlimited":
			rl.Unlimited = p.boolean(x, field)
		case "name":
			rl.Name = p.str(x, field)
		case "replaces":
			rl.Replaces = p.replaces(x, field)
		}
	})
	return rl
}

// replaces reads the list of {name} mappings; Load refuses an empty name.
func (p *parser) replaces(v *value, field string) []string {
	switch v.kind {
	case kNull:
		return nil
	case kSeq:
	default:
		p.typeError(v, field, "a list of {name: ...}")
		return nil
	}
	out := make([]string, 0, len(v.items))
	for i, e := range v.items {
		var name string
		p.fields(e, fmt.Sprintf("%s[%d]", field, i), replacesKeys, func(_ string, x *value, f string) {
			name = p.str(x, f)
		})
		out = append(out, name)
	}
	return out
}

// metadata reads the free-form metadata mapping into a Struct, keys turned
// into strings as ratelimit turns them (%v).
func (p *parser) metadata(v *value, field string) *structpb.Struct {
	switch v.kind {
	case kNull:
		return nil
	case kMap:
	default:
		p.typeError(v, field, "a mapping")
		return nil
	}
	m, _ := stringKeys(v.goValue()).(map[string]any)
	if len(m) == 0 {
		return nil
	}
	s, err := structpb.NewStruct(m)
	if err != nil {
		p.add(v.line, field, "error parsing metadata: %v", err)
		return nil
	}
	return s
}

func stringKeys(x any) any {
	switch t := x.(type) {
	case map[any]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			out[fmt.Sprint(k)] = stringKeys(e)
		}
		return out
	case []any:
		for i, e := range t {
			t[i] = stringKeys(e)
		}
	}
	return x
}
