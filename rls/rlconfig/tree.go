package rlconfig

import (
	"bytes"
	"fmt"
	"strings"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
)

// Tree is one domain's descriptors, matched the way envoyproxy/ratelimit's
// GetLimit matches a request descriptor (docs/envoy-ratelimit.md §3.2). Each
// node carries a T: ratelimit's own configuration carries its [Rule], and
// tokengate's RLS mapping its own node (package config).
//
// Build a tree with [NewTree] and [Node.Add]; once built it is read-only,
// and Match and StatsKey are safe for concurrent use.
type Tree[T any] struct {
	root Node[T]
}

// NewTree returns an empty tree for domain.
func NewTree[T any](domain string) *Tree[T] {
	t := &Tree[T]{}
	t.root.statsKey = domain
	t.root.children = map[string]*Node[T]{}
	return t
}

// Domain is the domain the tree was made for.
func (t *Tree[T]) Domain() string { return t.root.statsKey }

// Root is the node above the first level of descriptors; it carries no
// descriptor of its own.
func (t *Tree[T]) Root() *Node[T] { return &t.root }

// Node is one descriptor of a tree.
type Node[T any] struct {
	// Key and Value are the descriptor's; an empty Value matches any value.
	Key, Value string
	// Data is what the configuration says at this node. It must not be
	// changed once the tree is in use.
	Data T

	limited  bool
	shared   bool // share_threshold
	toMetric bool // value_to_metric
	detailed bool // detailed_metric
	// byValues: value_to_metric is on n or a node above it.
	byValues  bool
	composite string
	parts     [][]byte // composite split at '*' when it holds one
	statsKey  string   // domain.k_v.k... as ratelimit names the rule's stats
	parent    *Node[T]
	depth     int
	children  map[string]*Node[T]
	wildcards []*Node[T] // children with a '*', in configuration order
}

// Spec is what [Node.Add] makes a node from.
type Spec[T any] struct {
	Key, Value string
	Data       T
	// Limited says that a descriptor ending at the node meets a limit (Data
	// says which); otherwise no limit applies there.
	Limited bool
	// ShareThreshold, ValueToMetric and DetailedMetric are ratelimit's
	// share_threshold, value_to_metric and detailed_metric.
	ShareThreshold, ValueToMetric, DetailedMetric bool
}

// Add adds a child descriptor to n and returns it. It fails, with
// ratelimit's own text, on an empty key, on a key and value that another
// child of n already has (ratelimit's map key is key or key_value, so key
// "a_b" without value and key "a" with value "b" collide as they do
// there), and on share_threshold without a '*'. A child that fails is
// still returned, detached from the tree, so that what is below it can be
// checked too.
func (n *Node[T]) Add(s Spec[T]) (*Node[T], error) {
	c := &Node[T]{
		Key: s.Key, Value: s.Value, Data: s.Data,
		limited: s.Limited, shared: s.ShareThreshold, toMetric: s.ValueToMetric, detailed: s.DetailedMetric,
		parent: n, depth: n.depth + 1, children: map[string]*Node[T]{},
		byValues: n.byValues || s.ValueToMetric,
	}
	c.composite = s.Key
	if s.Value != "" {
		c.composite += "_" + s.Value
	}
	c.statsKey = n.statsKey + "." + c.composite
	switch {
	case s.Key == "":
		return c, fmt.Errorf("descriptor has empty key")
	case n.children[c.composite] != nil:
		return c, fmt.Errorf("duplicate descriptor composite key '%s'", c.statsKey)
	case s.ShareThreshold && !strings.Contains(c.composite, "*"):
		return c, fmt.Errorf("share_threshold can only be used with wildcard values (containing '*'), but found key '%s'", c.composite)
	}
	if strings.Contains(c.composite, "*") {
		for _, p := range strings.Split(c.composite, "*") {
			c.parts = append(c.parts, []byte(p))
		}
		n.wildcards = append(n.wildcards, c)
	}
	n.children[c.composite] = c
	return c, nil
}

// Parent is the node above n; the root's is nil.
func (n *Node[T]) Parent() *Node[T] { return n.parent }

// Depth is n's level: 1 for the first level of descriptors, 0 for the root.
func (n *Node[T]) Depth() int { return n.depth }

// Limited reports whether a descriptor that ends at n meets a limit.
func (n *Node[T]) Limited() bool { return n.limited }

// Shared reports share_threshold: every value that matches n's wildcard
// counts as one, ratelimit putting the pattern in the counter's key in
// place of the value (§3.4).
func (n *Node[T]) Shared() bool { return n.shared }

// how an entry found its node.
type how int

const (
	byValue    how = iota // the exact key_value
	byWildcard            // a wildcard key_value
	byKey                 // the bare key: any value
)

// child finds the child an entry leads to: its exact key_value, else the
// first wildcard (in configuration order) that matches key_value whole,
// else the bare key.
func (n *Node[T]) child(key, value string) (*Node[T], how) {
	var buf [256]byte
	kv := append(append(append(buf[:0], key...), '_'), value...)
	if c := n.children[string(kv)]; c != nil {
		return c, byValue
	}
	for _, w := range n.wildcards {
		if wildcardMatch(w.parts, kv) {
			return w, byWildcard
		}
	}
	if c := n.children[key]; c != nil {
		return c, byKey
	}
	return nil, 0
}

// wildcardMatch reports whether v matches a pattern split at its '*'s,
// each '*' matching any run of characters, none included: the first and
// last parts anchor the ends, the middle ones are found in order between.
func wildcardMatch(parts [][]byte, v []byte) bool {
	first, last := parts[0], parts[len(parts)-1]
	if !bytes.HasPrefix(v, first) || !bytes.HasSuffix(v, last) {
		return false
	}
	fixed := 0
	for _, p := range parts {
		fixed += len(p)
	}
	if len(v) < fixed {
		return false
	}
	rest := v[len(first) : len(v)-len(last)]
	for _, p := range parts[1 : len(parts)-1] {
		i := bytes.Index(rest, p)
		if i < 0 {
			return false
		}
		rest = rest[i+len(p):]
	}
	return true
}

// Match returns the node at which a descriptor's entries meet a limit, or
// nil when none applies. Each entry, in order, goes one level down (see
// child); the walk stops at an entry that finds no node, and at a node
// with nothing below it. Only the node of the last entry can apply a
// limit: one on a node above it does not, and a descriptor with more
// entries than the tree has levels meets none (§3.2). An empty descriptor
// meets none.
func (t *Tree[T]) Match(entries []*commonv3.RateLimitDescriptor_Entry) *Node[T] {
	n := &t.root
	last := len(entries) - 1
	for i, e := range entries {
		c, _ := n.child(e.GetKey(), e.GetValue())
		switch {
		case c == nil:
			return nil
		case i == last:
			if c.limited {
				return c
			}
			return nil
		case len(c.children) == 0:
			return nil
		}
		n = c
	}
	return nil
}

// StatsKey is the name ratelimit gives the stats of the limit a descriptor
// meets (its FullKey, §3.6), "" when none applies: the domain and the
// matched descriptors' key_value as configured ("domain.key1_value1.subkey1",
// a wildcard as its pattern); with detailed_metric on the limit, the
// request's own key_value at every level; with value_to_metric on a level,
// the request's value there. tokengate's metrics are labelled by rule
// names; ratelimit's own names are served with listeners.ratelimit_metrics.
// Without detailed_metric and value_to_metric the key is the leaf's
// configured path, which costs no allocation.
func (t *Tree[T]) StatsKey(entries []*commonv3.RateLimitDescriptor_Entry) string {
	leaf := t.Match(entries)
	if leaf == nil {
		return ""
	}
	if !leaf.detailed && !leaf.byValues {
		return leaf.statsKey
	}
	type step struct {
		n *Node[T]
		h how
	}
	steps := make([]step, len(entries))
	n := &t.root
	shared := false // some entry met a share_threshold wildcard
	for i, e := range entries {
		c, h := n.child(e.GetKey(), e.GetValue())
		steps[i] = step{c, h}
		shared = shared || h == byWildcard && c.shared
		n = c
	}
	var b strings.Builder
	b.WriteString(t.Domain())
	for i, e := range entries {
		s := steps[i]
		pattern := strings.TrimPrefix(s.n.composite, e.GetKey()+"_")
		var v string
		switch {
		case leaf.detailed && !shared:
			v = "_" + e.GetValue() // even an empty one: "key_"
		case leaf.detailed && s.h == byWildcard && s.n.shared:
			v = "_" + pattern
		case leaf.detailed:
			if e.GetValue() != "" {
				v = "_" + e.GetValue()
			}
		case s.h == byWildcard && (s.n.shared || !s.n.toMetric):
			v = "_" + pattern
		case s.h == byWildcard, s.h == byValue, s.n.toMetric:
			if e.GetValue() != "" {
				v = "_" + e.GetValue()
			}
		}
		b.WriteString(".")
		b.WriteString(e.GetKey())
		b.WriteString(v)
	}
	return b.String()
}
