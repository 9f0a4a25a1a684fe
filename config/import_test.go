package config

import (
	"encoding/json"
	"flag"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

var update = flag.Bool("update", false, "rewrite the golden files of the import tests")

// ratelimitFiles are envoyproxy/ratelimit's own configurations (copied
// under rls/rlconfig/testdata with its licence) and ours.
var ratelimitFiles = []string{
	"ratelimit/basic_config.yaml", "ratelimit/shadowmode_config.yaml", "ratelimit/wildcard.yaml",
	"ratelimit/share_threshold.yaml", "ratelimit/metadata.yaml",
	"ratelimit/examples/config.yaml", "ratelimit/examples/example.yaml",
	"precedence.yaml", "metrics.yaml",
}

func readRatelimit(t *testing.T, names ...string) []*rlconfig.File {
	t.Helper()
	var files []*rlconfig.File
	for _, name := range names {
		data, err := os.ReadFile(filepath.Join("../rls/rlconfig/testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		f, err := rlconfig.Parse(name, data)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	return files
}

// samples are descriptors that reach every node of a ratelimit tree, in
// two variants: a value of its own for each entry without value, and each
// wildcard filled with it.
func samples(ds []rlconfig.Descriptor, above [][]string) [][]string {
	var out [][]string
	for i := range ds {
		d := &ds[i]
		for _, fill := range []string{"one", "two"} {
			v := d.Value
			switch {
			case v == "":
				v = "value-" + fill
			case strings.Contains(v, "*"):
				v = strings.ReplaceAll(v, "*", fill)
			}
			var path []string
			if len(above) > 0 {
				path = slices.Clone(above[0])
				if fill == "two" && len(above) > 1 {
					path = slices.Clone(above[1])
				}
			}
			path = append(path, d.Key, v)
			out = append(out, path)
		}
		out = append(out, samples(d.Descriptors, out[len(out)-2:])...)
	}
	return out
}

// counterKey is ratelimit's counter of a descriptor (§3.4, without the
// window): the domain and every entry, a share_threshold wildcard's
// pattern in place of the value.
func counterKey(tree *rlconfig.Tree[*rlconfig.Rule], d *commonv3.RateLimitDescriptor) string {
	n := tree.Match(d.Entries)
	parts := make([]string, len(d.Entries))
	for ; n != nil && n.Depth() > 0; n = n.Parent() {
		e := d.Entries[n.Depth()-1]
		v := e.Value
		if n.Shared() {
			v = n.Value
		}
		parts[n.Depth()-1] = e.Key + "_" + v
	}
	return tree.Domain() + "_" + strings.Join(parts, "_")
}

// The configuration `tokengate import ratelimit` prints from ratelimit's
// own files is valid, and on every descriptor those files configure it
// answers as ratelimit does where the semantics agree: no limit where
// ratelimit has none, unlimited, deny for requests_per_unit 0, else one
// bucket of requests_per_unit tokens refilling requests_per_unit per unit,
// with the same shadow mode, quota mode, name and replaces; and two
// descriptors share a bucket exactly when they share ratelimit's counter.
func TestImportRatelimitAnswersAsRatelimit(t *testing.T) {
	for _, name := range ratelimitFiles {
		t.Run(name, func(t *testing.T) {
			files := readRatelimit(t, name)
			rl, err := rlconfig.Load(files, rlconfig.Options{})
			if err != nil {
				t.Fatal(err)
			}
			im, err := ImportRatelimit(files, rlconfig.Options{})
			if err != nil {
				t.Fatal(err)
			}
			out, err := im.YAML()
			if err != nil {
				t.Fatal(err)
			}
			c, err := Parse("imported.yaml", out)
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			domain := files[0].Domain
			tree := rl.Tree(domain)
			counters := map[string]string{} // ratelimit counter → tokengate bucket and identity
			buckets := map[string]string{}  // the reverse
			checked := 0
			for _, kv := range samples(files[0].Descriptors, nil) {
				d := descriptor(kv...)
				r, _ := rl.Limit(domain, d)
				m, known, ok := c.MatchRLS(domain, d)
				if !known {
					t.Fatalf("domain %q not mapped", domain)
				}
				if (r != nil) != ok {
					t.Errorf("%q: ratelimit limit %+v, tokengate matched %v", kv, r, ok)
					continue
				}
				if r == nil {
					continue
				}
				checked++
				n := m.Descriptor()
				switch {
				case r.Unlimited:
					if !n.Unlimited {
						t.Errorf("%q: unlimited in ratelimit, tokengate %+v", kv, n)
					}
					continue
				case r.RequestsPerUnit == 0:
					if !n.Deny {
						t.Errorf("%q: 0 per unit in ratelimit, tokengate %+v", kv, n)
					}
					continue
				}
				p, _ := c.Policy(n.Policy)
				bs, qs, cs := n.Meets(p)
				if len(bs) != 1 || len(qs)+len(cs) != 0 {
					t.Errorf("%q: meets %v %v %v, want one bucket", kv, bs, qs, cs)
					continue
				}
				b := bs[0]
				l, _, err := b.Limit()
				if err != nil {
					t.Fatal(err)
				}
				want := float64(r.RequestsPerUnit)
				if l.Capacity != want || math.Abs(l.Rate*float64(rlconfig.UnitSeconds(r.Unit))-want) > 1e-9*want {
					t.Errorf("%q: bucket %+v, want %v tokens refilling %v per %v", kv, l, want, want, r.Unit)
				}
				if b.MaxDebt != want {
					t.Errorf("%q: max_debt %v, want one window's %v", kv, b.MaxDebt, want)
				}
				if n.ShadowMode != r.ShadowMode || n.QuotaMode != r.QuotaMode || n.Name != r.Name || !slices.Equal(n.Replaces, r.Replaces) {
					t.Errorf("%q: tokengate %+v, ratelimit %+v", kv, n, r)
				}
				id := ""
				if b.Per != "" {
					v, ok := m.Identity(b.Per)
					if !ok {
						t.Errorf("%q: bucket %s is per %s, which the descriptor does not give", kv, b.Name, b.Per)
					}
					id = v
				}
				ours := b.Name + "/" + id
				theirs := counterKey(tree, d)
				if o, seen := counters[theirs]; seen && o != ours {
					t.Errorf("%q: ratelimit counts it with %s in %s, tokengate apart (%s, %s)", kv, kv, theirs, o, ours)
				}
				if o, seen := buckets[ours]; seen && o != theirs {
					t.Errorf("%q: tokengate counts %s together with %s, ratelimit apart", kv, ours, o)
				}
				counters[theirs], buckets[ours] = ours, theirs
			}
			if checked == 0 {
				t.Error("no sample met a limit")
			}
		})
	}
}

// The YAML `tokengate import ratelimit` prints for ratelimit's example
// configuration, with its comments (testdata/import/*.golden.yaml; go test
// -update rewrites them).
func TestImportRatelimitYAML(t *testing.T) {
	for _, tt := range []struct {
		golden string
		files  []string
		merge  bool
	}{
		{"example.golden.yaml", []string{"ratelimit/examples/example.yaml"}, false},
		{"merged.golden.yaml", []string{"ratelimit/merge_domain_key1.yaml", "ratelimit/merge_domain_key2.yaml", "ratelimit/wildcard.yaml"}, true},
	} {
		t.Run(tt.golden, func(t *testing.T) {
			im, err := ImportRatelimit(readRatelimit(t, tt.files...), rlconfig.Options{MergeDomains: tt.merge})
			if err != nil {
				t.Fatal(err)
			}
			got, err := im.YAML()
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join("testdata/import", tt.golden)
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(want) {
				t.Errorf("import printed:\n%s\nwant (%s):\n%s", got, path, want)
			}
			if _, err := Parse(tt.golden, got); err != nil {
				t.Error(err)
			}
		})
	}
}

// A ratelimit configuration that does not load is refused with
// ratelimit's problems; one with nothing to count is refused too.
func TestImportRatelimitRefuses(t *testing.T) {
	if _, err := ImportRatelimit(readRatelimit(t, "ratelimit/bad_limit_unit.yaml"), rlconfig.Options{}); err == nil || !strings.Contains(err.Error(), "invalid rate limit unit 'foo'") {
		t.Errorf("bad unit: %v", err)
	}
	f, err := rlconfig.Parse("free.yaml", []byte("domain: free\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ImportRatelimit([]*rlconfig.File{f}, rlconfig.Options{}); err == nil || !strings.Contains(err.Error(), "nothing for tokengate to count") {
		t.Errorf("nothing to count: %v", err)
	}
}

// Names made from ratelimit's keys and values are tokengate names,
// short, and stay apart.
func TestImportNames(t *testing.T) {
	long := strings.Repeat("httproute/default/backend/rule/0/", 4)
	for _, tt := range []struct{ in, want string }{
		{"source_cluster_proxy-destination_cluster_mock", "source_cluster_proxy-destination_cluster_mock"},
		{"Rule-0-Match-0", "rule-0-match-0"},
		{"default/eg/http", "default-eg-http"},
		{"wild_foo*", "wild_foo"},
		{"***", "limit"},
		{"_x", "limit-_x"},
		{long, "httproute-default-backend-rule-0-httpro-" + sanitize(long, "")[len(sanitize(long, ""))-8:]},
	} {
		got := sanitize(tt.in, "limit")
		if got != tt.want || !nameRE.MatchString(got) || len(got) > maxNameBytes {
			t.Errorf("sanitize(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
	if sanitize(long+"a", "") == sanitize(long+"b", "") {
		t.Error("two long names collide")
	}
}

// A RateLimitConfig as Envoy Gateway pushes it over xDS (§4.2) imports as a
// file does: the Distinct header entry (no value) is the policy's identity,
// the leaf's limit a bucket per that identity, in shadow mode.
func TestImportRatelimitFromXDS(t *testing.T) {
	route := "httproute/default/llm-api/rule/0/match/0/llm_example_com"
	f := rlconfig.FromXDS(&rlsconfv3.RateLimitConfig{
		Name: "default/eg/http", Domain: "default/eg/http",
		Descriptors: []*rlsconfv3.RateLimitDescriptor{{
			Key: route, Value: route, ShadowMode: true,
			Descriptors: []*rlsconfv3.RateLimitDescriptor{{
				Key: "rule-0-match-0", ShadowMode: true,
				RateLimit: &rlsconfv3.RateLimitPolicy{Unit: rlsconfv3.RateLimitUnit_HOUR, RequestsPerUnit: 100000},
			}},
		}},
	})
	im, err := ImportRatelimit([]*rlconfig.File{f}, rlconfig.Options{})
	if err != nil {
		t.Fatal(err)
	}
	out, err := im.YAML()
	if err != nil {
		t.Fatal(err)
	}
	c, err := Parse("eg.yaml", out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	m, _, ok := c.MatchRLS("default/eg/http", descriptor(route, route, "rule-0-match-0", "tenant-a"))
	if !ok || !m.Descriptor().ShadowMode {
		t.Fatalf("matched %v, want the shadow-mode leaf:\n%s", ok, out)
	}
	p, _ := c.Policy(m.Descriptor().Policy)
	bs, _, _ := m.Descriptor().Meets(p)
	if len(bs) != 1 || bs[0].Per != "rule-0-match-0" || bs[0].Burst != 100000 || math.Abs(bs[0].TokensPerMinute*60-100000) > 1e-6 {
		t.Errorf("buckets %+v, want 100000 tokens refilling 100000 an hour per rule-0-match-0", bs)
	}
	if id, ok := m.Identity(bs[0].Per); !ok || id != "tenant-a" {
		t.Errorf("identity %q (%v), want tenant-a", id, ok)
	}
}

// ratelimit's metadata stays on a limit's node, a deny's included
// (ratelimit answers it for a check), and is left out, with a note, where
// ratelimit never answers it: a descriptor without rate_limit, an
// unlimited one. The printed configuration holds it as it was.
func TestImportRatelimitMetadata(t *testing.T) {
	f, err := rlconfig.Parse("md.yaml", []byte(`domain: md
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
    metadata: {service: {name: svc, weight: 3}}
  - key: free
    rate_limit: {unlimited: true}
    metadata: {tier: free}
  - key: path
    metadata: {tier: none}
  - key: banned
    rate_limit: {unit: minute, requests_per_unit: 0}
    metadata: {reason: abuse}
`))
	if err != nil {
		t.Fatal(err)
	}
	im, err := ImportRatelimit([]*rlconfig.File{f}, rlconfig.Options{})
	if err != nil {
		t.Fatal(err)
	}
	out, err := im.YAML()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"ratelimit's metadata left out: ratelimit answers none for a descriptor without a limit, or an unlimited one\n        - key: free",
		"ratelimit's metadata left out: ratelimit answers none for a descriptor without a limit, or an unlimited one\n        - key: path",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the import lacks %q:\n%s", want, out)
		}
	}
	c, err := Parse("md.yaml", out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, tt := range []struct{ key, want string }{
		{"user", `{"service":{"name":"svc","weight":3}}`},
		{"banned", `{"reason":"abuse"}`},
		{"free", ""},
		{"path", "no limit"},
	} {
		m, _, ok := c.MatchRLS("md", descriptor(tt.key, "x"))
		var got string
		if !ok {
			got = "no limit"
		} else if s := m.Descriptor().Metadata.Struct(); s != nil {
			b, err := json.Marshal(s.AsMap())
			if err != nil {
				t.Fatal(err)
			}
			got = string(b)
		}
		if got != tt.want {
			t.Errorf("%s: metadata %s, want %s", tt.key, got, tt.want)
		}
	}
}
