package config

import (
	"reflect"
	"strings"
)

// NeedsRestart lists the top-level keys whose values differ between c and
// n other than policies, default_policy, rls and ratelimit (whose files
// become policies and rls domains): a running tokengate reloads those (the
// policies' tiers and overrides included) and nothing else; ratelimit.xds,
// the management server it is subscribed to, needs a restart too.
// Listeners, the store, the tokenizer, the admin API, the metadata keys
// and the shutdown grace are fixed when it starts: their sockets,
// connections, counter and Envoy's side are built from them once.
func (c *Config) NeedsRestart(n *Config) []string {
	a, b := *c, *n
	a.Policies, b.Policies = nil, nil
	a.DefaultPolicy, b.DefaultPolicy = "", ""
	a.RLS, b.RLS = nil, nil
	a.Ratelimit, b.Ratelimit = nil, nil
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	var keys []string
	if !reflect.DeepEqual(c.ratelimitXDS(), n.ratelimitXDS()) {
		keys = append(keys, "ratelimit.xds")
	}
	for i := range va.NumField() {
		if !va.Type().Field(i).IsExported() {
			continue // derived from the exported fields (the price table)
		}
		if !reflect.DeepEqual(va.Field(i).Interface(), vb.Field(i).Interface()) {
			name, _, _ := strings.Cut(va.Type().Field(i).Tag.Get("yaml"), ",")
			keys = append(keys, name)
		}
	}
	return keys
}

// ratelimitXDS is ratelimit.xds, nil when not set.
func (c *Config) ratelimitXDS() *RatelimitXDS {
	if c.Ratelimit == nil {
		return nil
	}
	return c.Ratelimit.XDS
}
