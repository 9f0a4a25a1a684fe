package config

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// Ratelimit names envoyproxy/ratelimit configuration that tokengate reads
// as it is: files, at start and on every reload, and the RateLimitConfig
// resources an xDS management server pushes (XDS). Each domain becomes a
// policy and an rls domain, as `tokengate import ratelimit` prints them
// (ImportRatelimit), added to the file's own policies and rls section.
type Ratelimit struct {
	// Files are the ratelimit files, relative to this file's directory.
	Files []string `yaml:"files"`
	// MergeDomains merges files of one domain into one tree, as
	// ratelimit's MERGE_DOMAIN_CONFIG does.
	MergeDomains bool `yaml:"merge_domains"`
	// XDS subscribes to an xDS management server for RateLimitConfig
	// resources, as ratelimit's GRPC_XDS_SOTW provider does.
	XDS *RatelimitXDS `yaml:"xds"`
}

// RatelimitXDS is the management server that pushes ratelimit's
// configuration (docs/envoy-ratelimit.md §3.9): Envoy Gateway's
// (envoy-gateway:18001, mTLS, node envoy-ratelimit) or AI Gateway's
// (:18002, plaintext, node envoy-ai-gateway-ratelimit). It is dialled
// over TLS unless Insecure is set; its address and TLS need a restart.
type RatelimitXDS struct {
	// Address is the management server's host:port.
	Address string `yaml:"address"`
	// NodeID is the node whose snapshot the server keeps
	// (CONFIG_GRPC_XDS_NODE_ID); empty is "default", as ratelimit's.
	NodeID string `yaml:"node_id"`
	// NodeMetadata is the node's metadata (CONFIG_GRPC_XDS_NODE_METADATA).
	NodeMetadata map[string]string `yaml:"node_metadata"`
	// ServerName is the name the server's certificate must hold; empty is
	// Address's host.
	ServerName string `yaml:"server_name"`
	// CAFile verifies the server's certificate (PEM); empty uses the
	// system's roots.
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile are the client certificate of mTLS (PEM).
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// Insecure dials in plaintext, as AI Gateway's :18002 serves.
	Insecure bool `yaml:"insecure"`
	// MaxMessageBytes is the largest snapshot the client takes
	// (XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES); 0 is gRPC's 4 MiB. A larger one
	// ends the stream with gRPC's error, and the configuration in force
	// keeps serving.
	MaxMessageBytes int `yaml:"max_message_bytes"`
}

// importRatelimit reads c.Ratelimit's files and adds what they import to c,
// together with the files of the xDS snapshot in force (xds; nil before
// the first): their policies, and their domains to c.RLS. A policy or
// domain that clashes with the file's own is reported by validation, as any
// duplicate. It is the one place both sources become policies.
func (v *validator) importRatelimit(c *Config, xds []*rlconfig.File) {
	r := c.Ratelimit
	if r == nil {
		return
	}
	if r.XDS != nil {
		v.validateRatelimitXDS(r.XDS)
	} else if len(r.Files) == 0 {
		v.add("ratelimit.files", "names no file; list envoyproxy/ratelimit configuration files, set ratelimit.xds, or remove ratelimit")
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
	files = append(files, xds...)
	if len(files) == 0 {
		return // ratelimit.xds before its first snapshot
	}
	im, err := ImportRatelimit(files, rlconfig.Options{MergeDomains: r.MergeDomains})
	if err != nil {
		field := "ratelimit.files"
		if len(xds) > 0 {
			field = "ratelimit.xds"
		}
		v.add(field, "%s", problemsText(err))
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

// validateRatelimitXDS checks the management server's address and TLS:
// plaintext only when asked for, a client certificate with its key, and
// every TLS file readable.
func (v *validator) validateRatelimitXDS(x *RatelimitXDS) {
	const p = "ratelimit.xds"
	if x.Address == "" {
		v.add(join(p, "address"), "is required (the xDS management server's host:port, e.g. envoy-gateway:18001)")
	} else if err := hostPort(x.Address); err != nil {
		v.add(join(p, "address"), "%v", err)
	}
	if x.MaxMessageBytes < 0 {
		v.add(join(p, "max_message_bytes"), "is %d: want 0 (gRPC's 4 MiB) or more bytes", x.MaxMessageBytes)
	}
	if x.Insecure {
		for _, f := range []struct{ key, val string }{{"server_name", x.ServerName}, {"ca_file", x.CAFile}, {"cert_file", x.CertFile}, {"key_file", x.KeyFile}} {
			if f.val != "" {
				v.add(join(p, "insecure"), "contradicts %s.%s: insecure dials in plaintext; remove one", p, f.key)
				return
			}
		}
		return
	}
	if (x.CertFile == "") != (x.KeyFile == "") {
		v.add(p, "cert_file and key_file go together (the client certificate of mTLS and its key)")
	}
	dir := filepath.Dir(v.file)
	for _, f := range []struct {
		key string
		val *string
	}{{"ca_file", &x.CAFile}, {"cert_file", &x.CertFile}, {"key_file", &x.KeyFile}} {
		if *f.val == "" {
			continue
		}
		if !filepath.IsAbs(*f.val) {
			*f.val = filepath.Join(dir, *f.val)
		}
		if _, err := ReadFile(*f.val); err != nil {
			v.add(join(p, f.key), "%v", err)
		}
	}
}

// WithRatelimitXDS returns c's file (as Parse read it) parsed again with
// the files of an xDS snapshot imported beside ratelimit.files, which are
// read again as a reload reads them (the previous snapshot's replaced),
// validated as the file is; c's listeners stay (serve's flags may have
// replaced the file's). A snapshot whose domains clash, or whose
// policies do not validate, is an error and c stays as it is.
func (c *Config) WithRatelimitXDS(files []*rlconfig.File) (*Config, error) {
	if c.Ratelimit == nil || c.Ratelimit.XDS == nil {
		return nil, errors.New("ratelimit.xds is not set")
	}
	n, err := parse(c.source.file, c.source.data, files)
	if err != nil {
		return nil, err
	}
	n.Listeners = c.Listeners
	return n, nil
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
