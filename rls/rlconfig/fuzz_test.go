package rlconfig

import (
	"os"
	"path/filepath"
	"testing"
)

// Parse and Load never panic, and a file that loads matches any
// descriptor without panicking.
func FuzzParse(f *testing.F) {
	files, err := filepath.Glob("testdata/*/*.yaml")
	if err != nil {
		f.Fatal(err)
	}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	// Keys that are lists or mappings, and merges of lists.
	f.Add([]byte("domain: d\ndescriptors:\n  - {key: k, metadata: {[a]: {{b: 1}: 2}}}\n"))
	f.Add([]byte("domain: d\ndescriptors:\n  - &a {key: k, rate_limit: {unit: hour}}\n  - <<: [*a, {value: v}]\n    rate_limit: {requests_per_unit: 1}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := Parse("fuzz.yaml", data)
		if err != nil {
			return
		}
		c, err := Load([]*File{file}, Options{})
		if err != nil {
			return
		}
		for _, domain := range c.Domains() {
			c.Limit(domain, desc("key1", "value1", "subkey1", "x"))
			c.StatsKey(domain, desc("wild", "foo1"))
		}
	})
}
