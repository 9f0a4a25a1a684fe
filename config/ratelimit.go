package config

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// Ratelimit names envoyproxy/ratelimit configuration files that tokengate
// reads as they are, at start and on every reload: each file's domain
// becomes a policy and an rls domain, as `tokengate import ratelimit`
// prints them (ImportRatelimit), added to the file's own policies and rls
// section.
type Ratelimit struct {
	// Files are the ratelimit files, relative to this file's directory.
	Files []string `yaml:"files"`
	// MergeDomains merges files of one domain into one tree, as
	// ratelimit's MERGE_DOMAIN_CONFIG does.
	MergeDomains bool `yaml:"merge_domains"`
}

// importRatelimit reads c.Ratelimit's files and adds what they import to c:
// their policies, and their domains to c.RLS. A policy or domain that
// clashes with the file's own is reported by validation, as any duplicate.
func (v *validator) importRatelimit(c *Config) {
	r := c.Ratelimit
	if r == nil {
		return
	}
	if len(r.Files) == 0 {
		v.add("ratelimit.files", "names no file; list envoyproxy/ratelimit configuration files, or remove ratelimit")
		return
	}
	dir := filepath.Dir(v.file)
	var files []*rlconfig.File
	for i, name := range r.Files {
		path := fmt.Sprintf("ratelimit.files[%d]", i)
		if !filepath.IsAbs(name) {
			name = filepath.Join(dir, name)
		}
		data, err := ReadFile(name)
		if err != nil {
			v.add(path, "%v", err)
			continue
		}
		f, err := rlconfig.Parse(name, data)
		if err != nil {
			v.add(path, "%s", problemsText(err))
			continue
		}
		files = append(files, f)
	}
	if len(files) != len(r.Files) {
		return
	}
	im, err := ImportRatelimit(files, rlconfig.Options{MergeDomains: r.MergeDomains})
	if err != nil {
		v.add("ratelimit.files", "%s", problemsText(err))
		return
	}
	c.Policies = append(c.Policies, im.Policies...)
	if c.RLS == nil {
		c.RLS = &RLS{}
	}
	c.RLS.Domains = append(c.RLS.Domains, im.RLS.Domains...)
	if c.DefaultPolicy == "" && len(c.Policies) == len(im.Policies) {
		c.DefaultPolicy = im.DefaultPolicy
	}
}

// problemsText is an error's text, each of a joined error's on a line.
func problemsText(err error) string {
	var j interface{ Unwrap() []error }
	if errors.As(err, &j) {
		s := ""
		for i, e := range j.Unwrap() {
			if i > 0 {
				s += "; "
			}
			s += e.Error()
		}
		return s
	}
	return err.Error()
}
