package rlconfig

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/structpb"
)

// load parses the named files (under testdata) and loads them together.
func load(t *testing.T, opts Options, names ...string) (*Config, error) {
	t.Helper()
	var files []*File
	for _, name := range names {
		data, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		f, err := Parse(name, data)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	return Load(files, opts)
}

func mustLoad(t *testing.T, opts Options, names ...string) *Config {
	t.Helper()
	c, err := load(t, opts, names...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// One fixture per configuration error, as envoyproxy/ratelimit has them
// (its test/config, copied unchanged into testdata/ratelimit), plus ours
// for the errors it has no fixture for (testdata/errors). Each refusal
// carries ratelimit's own text, with the file, line and field.
func TestRatelimitConfigErrorFixtures(t *testing.T) {
	for _, tt := range []struct {
		files []string
		merge bool
		want  []string
	}{
		{files: []string{"ratelimit/empty_domain.yaml"},
			want: []string{"ratelimit/empty_domain.yaml: domain: config file cannot have empty domain"}},
		{files: []string{"ratelimit/basic_config.yaml", "ratelimit/duplicate_domain.yaml"},
			want: []string{"ratelimit/duplicate_domain.yaml:1: domain: duplicate domain 'test-domain' in config file"}},
		{files: []string{"ratelimit/empty_key.yaml"},
			want: []string{"ratelimit/empty_key.yaml:3: descriptors[0]: descriptor has empty key"}},
		{files: []string{"ratelimit/duplicate_key.yaml"},
			want: []string{"ratelimit/duplicate_key.yaml:6: descriptors[1]: duplicate descriptor composite key 'test-domain.key1_value1'"}},
		{files: []string{"ratelimit/merge_domain_key1.yaml", "ratelimit/merge_domain_key1.yaml"}, merge: true, want: []string{"ratelimit/merge_domain_key1.yaml:5: descriptors[0]: duplicate descriptor composite key 'test-domain.key1_value1'"}},
		{files: []string{"ratelimit/bad_limit_unit.yaml"},
			want: []string{"ratelimit/bad_limit_unit.yaml:3: descriptors[0].rate_limit.unit: invalid rate limit unit 'foo'"}},
		{files: []string{"ratelimit/replaces_self.yaml"},
			want: []string{"ratelimit/replaces_self.yaml:6: descriptors[0].descriptors[0].rate_limit.replaces[0].name: replaces should not contain name of same descriptor"}},
		{files: []string{"ratelimit/replaces_empty.yaml"},
			want: []string{"ratelimit/replaces_empty.yaml:6: descriptors[0].descriptors[0].rate_limit.replaces[0].name: should not have an empty replaces entry"}},
		{files: []string{"ratelimit/bad_yaml.yaml"},
			want: []string{"ratelimit/bad_yaml.yaml:2: error loading config file: found unexpected end of stream"}},
		{files: []string{"ratelimit/misspelled_key.yaml"},
			want: []string{"ratelimit/misspelled_key.yaml:5: descriptors[0].ratelimit: config error, unknown key 'ratelimit'"}},
		{files: []string{"ratelimit/misspelled_key2.yaml"},
			want: []string{"ratelimit/misspelled_key2.yaml:7: descriptors[0].rate_limit.requestsperunit: config error, unknown key 'requestsperunit'"}},
		{files: []string{"ratelimit/non_string_key.yaml"},
			want: []string{"ratelimit/non_string_key.yaml:1: config error, key is not of type string: 0.25"}},
		{files: []string{"ratelimit/non_map_list.yaml"}, merge: false, want: []string{
			"ratelimit/non_map_list.yaml:3: descriptors[0]: config error, yaml file contains list of type other than map: a",
			"ratelimit/non_map_list.yaml:4: descriptors[1]: config error, yaml file contains list of type other than map: b",
			"ratelimit/non_map_list.yaml:5: descriptors[2]: config error, yaml file contains list of type other than map: c",
		}},
		{files: []string{"ratelimit/unlimited_with_unit.yaml"},
			want: []string{"ratelimit/unlimited_with_unit.yaml:3: descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited"}},

		{files: []string{"errors/float_value.yaml"},
			want: []string{"errors/float_value.yaml:6: descriptors[0].rate_limit.requests_per_unit: error checking config"}},
		{files: []string{"errors/wrong_type.yaml"}, merge: false, want: []string{
			"errors/wrong_type.yaml:4: descriptors[0].shadow_mode: error loading config file: cannot unmarshal !!str `sometimes` into true or false",
			"errors/wrong_type.yaml:7: descriptors[0].rate_limit.requests_per_unit: error loading config file: cannot unmarshal !!str `five` into a whole number from 0 to 4294967295",
		}},
		{files: []string{"errors/negative_requests.yaml"},
			want: []string{"errors/negative_requests.yaml:6: descriptors[0].rate_limit.requests_per_unit: error loading config file: cannot unmarshal !!int `-1` into a whole number from 0 to 4294967295"}},
		{files: []string{"errors/share_threshold_without_wildcard.yaml"},
			want: []string{"errors/share_threshold_without_wildcard.yaml:3: descriptors[0]: share_threshold can only be used with wildcard values (containing '*'), but found key 'files_files/a'"}},
		{files: []string{"errors/not_a_mapping.yaml"},
			want: []string{"errors/not_a_mapping.yaml:1: error loading config file: cannot unmarshal !!seq into a mapping"}},
		{files: []string{"errors/descriptors_not_a_list.yaml"},
			want: []string{"errors/descriptors_not_a_list.yaml:2: descriptors: error loading config file: cannot unmarshal !!str `key1` into a list of descriptors"}},
		{files: []string{"errors/metadata_not_a_mapping.yaml"},
			want: []string{"errors/metadata_not_a_mapping.yaml:4: descriptors[0].metadata: error loading config file: cannot unmarshal !!str `service_1` into a mapping"}},
		{files: []string{"errors/several_problems.yaml"}, merge: false, want: []string{
			"errors/several_problems.yaml:3: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'",
			"errors/several_problems.yaml:7: descriptors[1]: duplicate descriptor composite key 'test-domain.key1'",
			"errors/several_problems.yaml:8: descriptors[2]: descriptor has empty key",
			"errors/several_problems.yaml:9: descriptors[3].rate_limit.unit: should not specify rate limit unit when unlimited",
		}},
	} {
		t.Run(strings.Join(tt.files, "+"), func(t *testing.T) {
			_, err := load(t, Options{MergeDomains: tt.merge}, tt.files...)
			var ps Problems
			if !errors.As(err, &ps) {
				t.Fatalf("got %v, want Problems", err)
			}
			var got []string
			for _, p := range ps {
				got = append(got, p.Error())
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("problems (-want +got):\n%s", diff)
			}
		})
	}
}

// Every good file of ratelimit's own, and the configurations of its
// examples, load.
func TestRatelimitOwnFilesLoad(t *testing.T) {
	for _, name := range []string{
		"basic_config.yaml", "shadowmode_config.yaml", "wildcard.yaml", "share_threshold.yaml", "metadata.yaml",
		"examples/config.yaml", "examples/example.yaml",
	} {
		c := mustLoad(t, Options{}, filepath.Join("ratelimit", name))
		if len(c.Domains()) != 1 {
			t.Errorf("%s: domains %q, want one", name, c.Domains())
		}
	}
	c := mustLoad(t, Options{MergeDomains: true}, "ratelimit/merge_domain_key1.yaml", "ratelimit/merge_domain_key2.yaml")
	for _, key := range []string{"key1", "key2"} {
		if _, ok := limitOf(c, "test-domain", key, "value"+key[3:]); !ok {
			t.Errorf("merged domain lacks %s", key)
		}
	}
}

// ratelimit reads YAML with yaml.v2: YAML 1.1 scalars, any scalar's text
// for a string, the last of a repeated key, "<<" merges; keys valid at
// another level are accepted there and ignored (listed in Ignored).
func TestRatelimitYAMLReadAsYAMLv2(t *testing.T) {
	src := `
domain: 0x10
unit: ignored at the root
base: &base {unit: Minute, requests_per_unit: 1_000}
`
	// "base" is not a ratelimit key: the file is refused, as ratelimit refuses it.
	if _, err := Parse("f.yaml", []byte(src)); err == nil || !strings.Contains(err.Error(), "unknown key 'base'") {
		t.Fatalf("got %v, want the unknown key", err)
	}
	src = `
domain: 0x10
unit: ignored at the root
descriptors:
  - key: 1
    value: yes
    shadow_mode: on
    quota_mode: No
    rate_limit: &rl
      unit: Minute
      requests_per_unit: 0o17
  - key: 2
    rate_limit:
      <<: *rl
      requests_per_unit: 1_000
    metadata: {name: svc, weight: 3, tags: [a, 1]}
    key: 3
`
	f, err := Parse("f.yaml", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	meta, err := structpb.NewStruct(map[string]any{"name": "svc", "weight": 3, "tags": []any{"a", 1}})
	if err != nil {
		t.Fatal(err)
	}
	want := &File{
		Name: "f.yaml", Domain: "0x10", DomainLine: 2,
		Descriptors: []Descriptor{
			{Key: "1", Value: "yes", ShadowMode: true, RateLimit: &RateLimit{Unit: "Minute", RequestsPerUnit: 15}, Line: 5, Field: "descriptors[0]"},
			{Key: "3", RateLimit: &RateLimit{Unit: "Minute", RequestsPerUnit: 1000}, Metadata: meta, Line: 12, Field: "descriptors[1]"},
		},
		Ignored: Problems{
			{File: "f.yaml", Line: 3, Field: "unit", Msg: `ratelimit ignores "unit" here (it reads domain, descriptors)`},
			{File: "f.yaml", Line: 12, Field: "descriptors[1].key", Msg: `"key" is repeated; ratelimit keeps only its last value`},
		},
	}
	if diff := cmp.Diff(want, f, protocmp.Transform()); diff != "" {
		t.Errorf("file (-want +got):\n%s", diff)
	}
	c, err := Load([]*File{f}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := limitOf(c, "0x10", "1", "yes"); r == nil || r.Unit != Unit(2) || !r.ShadowMode {
		t.Errorf("descriptor 1=yes: %+v, want 15/MINUTE in shadow mode", r)
	}
}

// An empty file, or one holding only null, has no domain: Load refuses it
// as ratelimit does.
func TestRatelimitEmptyFileHasNoDomain(t *testing.T) {
	for _, src := range []string{"", "~\n", "# nothing\n"} {
		f, err := Parse("empty.yaml", []byte(src))
		if err != nil {
			t.Fatalf("%q: %v", src, err)
		}
		if _, err := Load([]*File{f}, Options{}); err == nil || !strings.Contains(err.Error(), "config file cannot have empty domain") {
			t.Errorf("%q: %v, want the empty domain", src, err)
		}
	}
}

// limitOf is the rule a one-entry descriptor meets.
func limitOf(c *Config, domain, key, value string) (*Rule, bool) {
	return c.Limit(domain, desc(key, value))
}

// parseNoPanic is Parse, a panic turned into a test failure.
func parseNoPanic(t *testing.T, data string) (f *File, err error) {
	t.Helper()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("Parse panicked on %q: %v (ratelimit's yaml.v2 refuses it: \"invalid map key\")", data, r)
		}
	}()
	return Parse("f.yaml", []byte(data))
}

// TestRatelimitCollectionKeyRefusedNotAPanic: a mapping or a list used as
// a key inside metadata (or inside a key) is refused by ratelimit's
// yaml.v2 ("yaml: invalid map key: ..."), a config error, and Parse
// refuses it without panicking: config.Load reads ratelimit.files with it
// at start and on every reload, and a reload with a bad file keeps the
// configuration in force (docs/rls.md "Reading ratelimit's files as they
// are").
func TestRatelimitCollectionKeyRefusedNotAPanic(t *testing.T) {
	for _, data := range []string{
		"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    metadata: {{a: 1}: 2}\n",
		"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    metadata: {[a]: 2}\n",
		"domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    metadata: {x: {[b]: 1}}\n",
		"domain: d\ndescriptors:\n  - {key: k, {{a: 1}: 1}: 2}\n",
	} {
		t.Run("", func(t *testing.T) {
			if _, err := parseNoPanic(t, data); err == nil {
				t.Errorf("Parse accepted %q; ratelimit refuses it (invalid map key)", data)
			}
		})
	}
}

// TestRatelimitMergeOfAListEarlierWins: in a merge of a sequence of
// mappings (<<: [*a, *b]) the earlier mapping's keys win, by the YAML
// merge-key spec and by yaml.v2, which ratelimit decodes with (decode.go
// merge: "Step backwards as earlier nodes take precedence"). docs/rls.md
// says Parse reads "`<<` merges" as yaml.v2 does.
func TestRatelimitMergeOfAListEarlierWins(t *testing.T) {
	const data = `domain: d
descriptors:
  - &strict {key: tier, value: free, rate_limit: {unit: minute, requests_per_unit: 10}}
  - &loose {key: tier, value: paid, rate_limit: {unit: minute, requests_per_unit: 1000}}
  - <<: [*strict, *loose]
    value: trial
`
	f, err := parseNoPanic(t, data)
	if err != nil {
		t.Fatal(err)
	}
	d := f.Descriptors[2]
	if d.Value != "trial" || d.RateLimit == nil || d.RateLimit.RequestsPerUnit != 10 {
		t.Errorf("tier=trial merged from [*strict, *loose]: %+v %+v, want 10 per minute (the earlier mapping wins, as in yaml.v2)", d, d.RateLimit)
	}
}

// TestRatelimitRepeatedRateLimitDecodedOverTheEarlier: yaml.v2 decodes a second
// rate_limit mapping of a descriptor (a merged one overridden, or a key
// written twice) into the *YamlRateLimit the first one made, so the
// fields it leaves out keep their values: ratelimit loads
// `<<: *base` + `rate_limit: {requests_per_unit: 100}` as 100 per minute.
// Parse decodes it so too: a file ratelimit loads, Load loads.
func TestRatelimitRepeatedRateLimitDecodedOverTheEarlier(t *testing.T) {
	const data = `domain: d
descriptors:
  - &base {key: user, rate_limit: {unit: minute, requests_per_unit: 10}}
  - <<: *base
    key: admin
    rate_limit: {requests_per_unit: 100}
`
	f, err := parseNoPanic(t, data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Load([]*File{f}, Options{}); err != nil {
		t.Fatalf("Load refused a file ratelimit loads: %v", err)
	}
	if rl := f.Descriptors[1].RateLimit; rl == nil || rl.RequestsPerUnit != 100 || rl.Unit != "minute" {
		t.Errorf("admin: %+v, want 100 per minute (yaml.v2 keeps the merged unit)", rl)
	}
	// Written twice in one mapping: the same, and nothing is ignored; a
	// null between starts afresh.
	f, err = parseNoPanic(t, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    metadata: {a: 1}\n    rate_limit: {requests_per_unit: 5}\n    metadata: {b: 2}\n")
	if err != nil {
		t.Fatal(err)
	}
	d := f.Descriptors[0]
	if rl := d.RateLimit; rl == nil || rl.RequestsPerUnit != 5 || rl.Unit != "hour" || len(f.Ignored) != 0 || len(d.Metadata.GetFields()) != 2 {
		t.Errorf("rate_limit and metadata written twice: %+v, metadata %v, ignored %v; want 5 per hour, both metadata keys, nothing ignored", rl, d.Metadata, f.Ignored)
	}
	f, err = parseNoPanic(t, "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    rate_limit: ~\n    rate_limit: {requests_per_unit: 5}\n")
	if err != nil {
		t.Fatal(err)
	}
	if rl := f.Descriptors[0].RateLimit; rl == nil || rl.RequestsPerUnit != 5 || rl.Unit != "" {
		t.Errorf("rate_limit, null, rate_limit: %+v, want 5 without a unit (the null starts afresh)", rl)
	}
}

// TestRatelimitBinaryValueIsItsBytes: yaml.v2 decodes a !!binary scalar into a
// string field as the bytes it encodes (decode.go: `if tag ==
// yaml_BINARY_TAG { out.SetString(resolved.(string)) }`), so ratelimit
// matches the value "hello", and so does Parse.
func TestRatelimitBinaryValueIsItsBytes(t *testing.T) {
	f, err := parseNoPanic(t, "domain: d\ndescriptors:\n  - key: k\n    value: !!binary aGVsbG8=\n    rate_limit: {unit: minute, requests_per_unit: 1}\n")
	if err != nil {
		t.Fatal(err)
	}
	if v := f.Descriptors[0].Value; v != "hello" {
		t.Errorf("value %q, want %q as ratelimit reads it", v, "hello")
	}
}
