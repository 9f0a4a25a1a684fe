package envoy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"regexp"
	"strconv"
	"strings"
	"unicode"

	yaml "go.yaml.in/yaml/v3"
)

// A tree is one YAML document turned into the plain values protojson
// decodes (map[string]any, []any, string, json.Number, bool, nil), with the
// line and column of every mapping key and sequence item. Envoy reads YAML
// the same way: it converts the document to JSON and decodes that into the
// proto, so a position found here is where the user has to look.
type tree struct {
	value any
	pos   map[string]position // by canonical path; see canon
}

// position is a 1-based line and column in the user's file; the zero value
// means unknown.
type position struct{ line, col int }

// A document may expand, through aliases, to at most aliasFactor times the
// nodes written plus aliasSlack: enough for any sane reuse of anchors, and
// it keeps nested aliases (a "billion laughs") from making a small file take
// unbounded time and memory.
const (
	aliasFactor = 10
	aliasSlack  = 10000
)

// countNodes counts the nodes written in a document, aliases not followed.
func countNodes(n *yaml.Node) int {
	c := 1
	for _, k := range n.Content {
		c += countNodes(k)
	}
	return c
}

// yamlError is a problem found while reading YAML: a syntax error, a
// duplicate key, a value JSON cannot carry.
type yamlError struct {
	pos  position
	path string // of the value, with the keys as written
	msg  string
}

// parseDocuments reads every document of a (possibly multi-document) YAML
// stream. Documents that hold only comments are left out. A syntax error
// stops the reading; it is returned with the line yaml reports.
func parseDocuments(data []byte) ([]*yaml.Node, *yamlError) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var docs []*yaml.Node
	for {
		var n yaml.Node
		err := dec.Decode(&n)
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return docs, syntaxError(err)
		}
		if n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
			docs = append(docs, n.Content[0])
		}
	}
}

var yamlLineRE = regexp.MustCompile(`^(?:yaml: )?line (\d+): (.*)$`)

func syntaxError(err error) *yamlError {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	if m := yamlLineRE.FindStringSubmatch(err.Error()); m != nil {
		line, _ := strconv.Atoi(m[1]) // the pattern admits digits only
		return &yamlError{pos: position{line, 1}, msg: m[2]}
	}
	return &yamlError{msg: msg}
}

// newTree converts one document node. Problems that make a value
// unrepresentable (a duplicate key, a non-scalar key, .nan) are returned;
// the tree is still built from what could be read, so later checks can run,
// unless the document is too big, when the tree is nil.
func newTree(doc *yaml.Node) (*tree, []yamlError) {
	b := &treeBuilder{t: &tree{pos: map[string]position{}}, max: aliasFactor*countNodes(doc) + aliasSlack}
	b.t.pos[canonRoot] = nodePos(doc)
	b.t.value = b.value(doc, "", canonRoot, 0)
	if b.tooBig {
		return nil, b.errs
	}
	return b.t, b.errs
}

type treeBuilder struct {
	t      *tree
	errs   []yamlError
	nodes  int // converted so far
	max    int // nodes allowed
	tooBig bool
}

func nodePos(n *yaml.Node) position { return position{n.Line, n.Column} }

func (b *treeBuilder) fail(n *yaml.Node, path, format string, args ...any) {
	b.errs = append(b.errs, yamlError{nodePos(n), path, fmt.Sprintf(format, args...)})
}

// maxDepth bounds nesting, aliases included.
const maxDepth = 512

// value converts n, found at path (canonical form cpath).
func (b *treeBuilder) value(n *yaml.Node, path, cpath string, depth int) any {
	b.nodes++
	if b.nodes > b.max || depth > maxDepth {
		if !b.tooBig {
			b.tooBig = true
			b.fail(n, path, "the document's aliases expand to more than %d values or %d levels; "+
				"write the repeated parts out", b.max, maxDepth)
		}
		return nil
	}
	switch n.Kind {
	case yaml.AliasNode:
		if n.Alias == nil {
			return nil
		}
		return b.value(n.Alias, path, cpath, depth+1)
	case yaml.MappingNode:
		m := map[string]any{}
		keys := map[string]*yaml.Node{}
		b.mapping(n, path, cpath, depth, m, keys, false)
		return m
	case yaml.SequenceNode:
		list := make([]any, 0, len(n.Content))
		for i, c := range n.Content {
			cp := canonChild(cpath, strconv.Itoa(i))
			b.t.pos[cp] = nodePos(c)
			list = append(list, b.value(c, indexPath(path, i), cp, depth+1))
		}
		return list
	case yaml.ScalarNode:
		return b.scalar(n, path)
	}
	return nil
}

// mapping adds the pairs of n to m. Keys set explicitly win over keys
// brought in by a merge key (<<), as YAML's merge convention says.
func (b *treeBuilder) mapping(n *yaml.Node, path, cpath string, depth int, m map[string]any, keys map[string]*yaml.Node, merged bool) {
	var merges []*yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.AliasNode && k.Alias != nil {
			k = k.Alias
		}
		if k.Kind != yaml.ScalarNode {
			b.fail(k, path, "a mapping key must be a plain value, not a %s", kindName(k))
			continue
		}
		if k.Tag == "!!merge" {
			merges = append(merges, v)
			continue
		}
		name := k.Value
		if prev, dup := keys[name]; dup {
			if !merged {
				b.fail(k, joinPath(path, name), "key %q appears twice in one mapping (first at line %d)", name, prev.Line)
			}
			continue
		}
		keys[name] = k
		cp := canonChild(cpath, name)
		if _, taken := b.t.pos[cp]; !taken { // fooBar and foo_bar: locate reports the pair
			b.t.pos[cp] = nodePos(k)
		}
		m[name] = b.value(v, joinPath(path, name), cp, depth+1)
	}
	for _, mv := range merges {
		if mv.Kind == yaml.AliasNode && mv.Alias != nil {
			mv = mv.Alias
		}
		srcs := []*yaml.Node{mv}
		if mv.Kind == yaml.SequenceNode {
			srcs = mv.Content
		}
		for _, s := range srcs {
			if s.Kind == yaml.AliasNode && s.Alias != nil {
				s = s.Alias
			}
			if s.Kind != yaml.MappingNode {
				b.fail(s, path, "a merge key (<<) must name a mapping")
				continue
			}
			b.mapping(s, path, cpath, depth+1, m, keys, true)
		}
	}
}

// Positions are indexed by canonical path: the path's keys and indexes,
// each key in proto (snake_case) spelling, so that a problem found under the
// proto name (typed_config) finds a key written in protojson spelling
// (typedConfig), and a map key with dots in it ("envoy.filters.http.ext_proc")
// stays one key. Keys are separated by a byte that YAML keys in Envoy
// configuration do not contain.
const (
	canonRoot = ""
	canonSep  = "\x1f"
)

func canonChild(parent, key string) string { return parent + canonSep + snakeCase(key) }

// canon turns a path (a.b[0]["x.y"], as joinPath, indexPath and keyPath
// build them) into its canonical form.
func canon(path string) string {
	var b strings.Builder
	for _, seg := range splitPath(path) {
		b.WriteString(canonSep)
		b.WriteString(snakeCase(seg))
	}
	return b.String()
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "mapping"
	case yaml.SequenceNode:
		return "list"
	}
	return "value"
}

func (b *treeBuilder) scalar(n *yaml.Node, path string) any {
	switch n.ShortTag() {
	case "!!null":
		return nil
	case "!!bool":
		var v bool
		if err := n.Decode(&v); err == nil {
			return v
		}
	case "!!int":
		var i int64
		if err := n.Decode(&i); err == nil {
			return json.Number(strconv.FormatInt(i, 10))
		}
		var u uint64
		if err := n.Decode(&u); err == nil {
			return json.Number(strconv.FormatUint(u, 10))
		}
		b.fail(n, path, "integer %s is out of range", n.Value)
		return nil
	case "!!float":
		var f float64
		if err := n.Decode(&f); err != nil {
			b.fail(n, path, "invalid number %s", n.Value)
			return nil
		}
		if math.IsNaN(f) || math.IsInf(f, 0) {
			b.fail(n, path, "%s is not a number Envoy configuration can hold", n.Value)
			return nil
		}
		return json.Number(strconv.FormatFloat(f, 'g', -1, 64))
	}
	return n.Value // strings, timestamps and binary stay as written
}

// snakeCase turns a protojson (lowerCamelCase) field name into the proto
// name: typedConfig → typed_config, http2ProtocolOptions →
// http2_protocol_options. Names already in snake_case are returned as is.
func snakeCase(s string) string {
	if strings.IndexFunc(s, unicode.IsUpper) < 0 {
		return s
	}
	var b strings.Builder
	for i, r := range s {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}

// find returns the position of path, or of its nearest ancestor in the
// document: a missing field is reported where its parent is written.
func (t *tree) find(path string) position {
	for c := canon(path); ; {
		if at, ok := t.pos[c]; ok {
			return at
		}
		i := strings.LastIndex(c, canonSep)
		if i < 0 {
			return position{}
		}
		c = c[:i]
	}
}

// has reports whether path is written in the document.
func (t *tree) has(path string) bool {
	_, ok := t.pos[canon(path)]
	return ok
}

// splitPath splits a path into its keys and indexes:
// a.b[0]["x.y"] → a, b, 0, x.y.
func splitPath(path string) []string {
	var out []string
	for path != "" {
		switch {
		case strings.HasPrefix(path, "["):
			end := strings.IndexByte(path, ']')
			if strings.HasPrefix(path, `["`) {
				if q, err := strconv.QuotedPrefix(path[1:]); err == nil {
					s, _ := strconv.Unquote(q) // QuotedPrefix returned a valid literal
					out = append(out, s)
					path = strings.TrimPrefix(path[1+len(q):], "]")
					continue
				}
			}
			if end < 0 {
				return append(out, path)
			}
			out = append(out, path[1:end])
			path = path[end+1:]
		case strings.HasPrefix(path, "."):
			path = path[1:]
		default:
			end := strings.IndexAny(path, ".[")
			if end < 0 {
				return append(out, path)
			}
			out = append(out, path[:end])
			path = path[end:]
		}
	}
	return out
}
