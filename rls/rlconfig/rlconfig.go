// Package rlconfig reads envoyproxy/ratelimit's configuration as
// envoyproxy/ratelimit reads it: its YAML files (domains, nested
// descriptors, rate_limit, shadow_mode, quota_mode, replaces, ...) and the
// RateLimitConfig resources Envoy Gateway and Envoy AI Gateway push to it
// over xDS. It accepts what ratelimit accepts and refuses what ratelimit
// refuses, with ratelimit's own error texts, but reports every problem of a
// file at once, each with its file, line and field
// (docs/envoy-ratelimit.md §3.1, §3.9).
//
// [Tree] matches a request descriptor's entries the way ratelimit's
// GetLimit walks its descriptors (§3.2): exact key_value, then wildcard
// values in configuration order, then the bare key, a limit applying only
// where the descriptor's last entry lands. The tree is generic over what a
// node carries, so that tokengate's own RLS mapping (package config) is
// matched by the very same walk.
//
// The package reads configuration only. How ratelimit's fixed windows map
// onto tokengate's token buckets, and hits onto tokens, is config's import
// (docs/rls.md).
package rlconfig

import (
	"fmt"
	"strings"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// Unit is a rate limit's window, numbered as RateLimitResponse.RateLimit.Unit
// is on the wire (WEEK is 7).
type Unit = rlsv3.RateLimitResponse_RateLimit_Unit

// ParseUnit reads a unit as ratelimit does: the enum name in any case
// ("minute", "Minute", "MINUTE"). UNKNOWN and anything else is not a unit.
// ratelimit's README names second to day; its code takes every enum name,
// week, month and year included (§3.1).
func ParseUnit(s string) (Unit, bool) {
	v, ok := rlsv3.RateLimitResponse_RateLimit_Unit_value[strings.ToUpper(s)]
	if !ok || v == int32(rlsv3.RateLimitResponse_RateLimit_UNKNOWN) {
		return rlsv3.RateLimitResponse_RateLimit_UNKNOWN, false
	}
	return Unit(v), true
}

// UnitSeconds is the length of a unit's window in seconds as ratelimit
// counts it (a month is 30 days, a year 365), the divider of its
// epoch-aligned windows (§3.4); 0 for UNKNOWN.
func UnitSeconds(u Unit) int64 {
	switch u {
	case rlsv3.RateLimitResponse_RateLimit_SECOND:
		return 1
	case rlsv3.RateLimitResponse_RateLimit_MINUTE:
		return 60
	case rlsv3.RateLimitResponse_RateLimit_HOUR:
		return 3600
	case rlsv3.RateLimitResponse_RateLimit_DAY:
		return 86400
	case rlsv3.RateLimitResponse_RateLimit_WEEK:
		return 7 * 86400
	case rlsv3.RateLimitResponse_RateLimit_MONTH:
		return 30 * 86400
	case rlsv3.RateLimitResponse_RateLimit_YEAR:
		return 365 * 86400
	}
	return 0
}

// File is one configuration file, or one xDS RateLimitConfig resource, as
// read and before it is loaded: the problems Load finds (an empty domain, a
// duplicate key, a bad unit) are still in it. Files are plain values.
type File struct {
	// Name is the file name, or the resource name, that problems carry.
	Name   string
	Domain string
	// DomainLine is the line of the domain key, 0 when there is none.
	DomainLine  int
	Descriptors []Descriptor
	// Ignored lists keys ratelimit accepts but does not read: a key that is
	// valid at some level of the file but not where it stands (unit beside
	// key, say), and a repeated key whose earlier value is dropped. They are
	// not errors, since ratelimit loads such a file; tokengate prints them as
	// warnings.
	Ignored Problems
}

// Descriptor is one entry of a domain's descriptor tree.
type Descriptor struct {
	Key string
	// Value is the value the entry must have; "" matches any value (the
	// "default" of its key). A '*' in it is a wildcard matching any run of
	// characters, zero included.
	Value string
	// RateLimit is the limit of a request descriptor whose last entry ends
	// here; nil applies none.
	RateLimit      *RateLimit
	ShadowMode     bool
	QuotaMode      bool
	DetailedMetric bool
	ValueToMetric  bool
	ShareThreshold bool
	// Metadata is copied into the response's dynamic metadata by ratelimit
	// when RESPONSE_DYNAMIC_METADATA is on; nil when not set.
	Metadata    *structpb.Struct
	Descriptors []Descriptor
	// Line is where the descriptor starts in its file, 0 for xDS; Field is
	// its path ("descriptors[0].descriptors[2]").
	Line  int
	Field string
}

// RateLimit is a descriptor's rate_limit, as written.
type RateLimit struct {
	RequestsPerUnit uint32
	// Unit is the unit as written ("minute"); Load resolves it (ParseUnit).
	Unit string
	// Unlimited answers OK without counting; Unit must then be unset.
	Unlimited bool
	// Name is what other limits' Replaces refer to.
	Name     string
	Replaces []string
}

// Problem is one thing wrong with a configuration file. The zero value has
// no location.
type Problem struct {
	File  string
	Line  int
	Field string
	Msg   string
}

func (p Problem) Error() string {
	var b strings.Builder
	b.WriteString(p.File)
	if p.Line > 0 {
		fmt.Fprintf(&b, ":%d", p.Line)
	}
	if p.Field != "" {
		b.WriteString(": ")
		b.WriteString(p.Field)
	}
	b.WriteString(": ")
	b.WriteString(p.Msg)
	return b.String()
}

// Problems is every problem found; it is the error Parse and Load return.
type Problems []Problem

func (ps Problems) Error() string {
	lines := make([]string, len(ps))
	for i, p := range ps {
		lines[i] = p.Error()
	}
	return strings.Join(lines, "\n")
}
