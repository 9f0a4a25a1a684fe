package standin

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
)

// The matchers the rate-limit stand-in's routes and actions use: Envoy's
// HeaderMatcher, StringMatcher and QueryParameterMatcher, compiled once.
// Header values of one name are joined by "," as Envoy's header map
// reads them. Not emulated: custom matchers and ignore_case on
// safe_regex.

// stringMatch is a compiled StringMatcher.
type stringMatch func(string) bool

func compileString(m *matcherv3.StringMatcher) (stringMatch, error) {
	fold := m.GetIgnoreCase()
	cmp := func(f func(s, p string) bool, p string) stringMatch {
		if fold {
			p = strings.ToLower(p)
			return func(s string) bool { return f(strings.ToLower(s), p) }
		}
		return func(s string) bool { return f(s, p) }
	}
	switch p := m.GetMatchPattern().(type) {
	case *matcherv3.StringMatcher_Exact:
		return cmp(func(s, p string) bool { return s == p }, p.Exact), nil
	case *matcherv3.StringMatcher_Prefix:
		return cmp(strings.HasPrefix, p.Prefix), nil
	case *matcherv3.StringMatcher_Suffix:
		return cmp(strings.HasSuffix, p.Suffix), nil
	case *matcherv3.StringMatcher_Contains:
		return cmp(strings.Contains, p.Contains), nil
	case *matcherv3.StringMatcher_SafeRegex:
		re, err := regexp.Compile("^(?:" + p.SafeRegex.GetRegex() + ")$")
		if err != nil {
			return nil, err
		}
		return re.MatchString, nil
	}
	return nil, fmt.Errorf("string matcher %v is not emulated", m)
}

// headerMatch is a compiled HeaderMatcher: it reports whether the request's
// headers satisfy it.
type headerMatch func(get func(string) (string, bool)) bool

func compileHeader(h *routev3.HeaderMatcher) (headerMatch, error) {
	var test func(v string, present bool) bool
	name := strings.ToLower(h.GetName())
	switch s := h.GetHeaderMatchSpecifier().(type) {
	case nil:
		test = func(_ string, present bool) bool { return present }
	case *routev3.HeaderMatcher_PresentMatch:
		want := s.PresentMatch
		test = func(_ string, present bool) bool { return present == want }
	case *routev3.HeaderMatcher_ExactMatch:
		test = func(v string, present bool) bool { return present && v == s.ExactMatch }
	case *routev3.HeaderMatcher_PrefixMatch:
		test = func(v string, present bool) bool { return present && strings.HasPrefix(v, s.PrefixMatch) }
	case *routev3.HeaderMatcher_SuffixMatch:
		test = func(v string, present bool) bool { return present && strings.HasSuffix(v, s.SuffixMatch) }
	case *routev3.HeaderMatcher_ContainsMatch:
		test = func(v string, present bool) bool { return present && strings.Contains(v, s.ContainsMatch) }
	case *routev3.HeaderMatcher_SafeRegexMatch:
		re, err := regexp.Compile("^(?:" + s.SafeRegexMatch.GetRegex() + ")$")
		if err != nil {
			return nil, err
		}
		test = func(v string, present bool) bool { return present && re.MatchString(v) }
	case *routev3.HeaderMatcher_RangeMatch:
		lo, hi := s.RangeMatch.GetStart(), s.RangeMatch.GetEnd()
		test = func(v string, present bool) bool {
			n, err := strconv.ParseInt(v, 10, 64)
			return present && err == nil && n >= lo && n < hi
		}
	case *routev3.HeaderMatcher_StringMatch:
		m, err := compileString(s.StringMatch)
		if err != nil {
			return nil, err
		}
		test = func(v string, present bool) bool { return present && m(v) }
	default:
		return nil, fmt.Errorf("header matcher %T is not emulated", s)
	}
	invert, empty := h.GetInvertMatch(), h.GetTreatMissingHeaderAsEmpty()
	return func(get func(string) (string, bool)) bool {
		v, present := get(name)
		if !present && empty {
			present = true
		}
		return test(v, present) != invert
	}, nil
}

func compileHeaders(hs []*routev3.HeaderMatcher) ([]headerMatch, error) {
	out := make([]headerMatch, 0, len(hs))
	for _, h := range hs {
		m, err := compileHeader(h)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}

// all reports whether every matcher matches (Envoy's matchHeaders).
func all(ms []headerMatch, get func(string) (string, bool)) bool {
	for _, m := range ms {
		if !m(get) {
			return false
		}
	}
	return true
}

// queryMatch is a compiled QueryParameterMatcher.
type queryMatch func(q map[string][]string) bool

func compileQuery(m *routev3.QueryParameterMatcher) (queryMatch, error) {
	name := m.GetName()
	switch s := m.GetQueryParameterMatchSpecifier().(type) {
	case *routev3.QueryParameterMatcher_PresentMatch:
		return func(q map[string][]string) bool { _, ok := q[name]; return ok == s.PresentMatch }, nil
	case *routev3.QueryParameterMatcher_StringMatch:
		sm, err := compileString(s.StringMatch)
		if err != nil {
			return nil, err
		}
		return func(q map[string][]string) bool { vs := q[name]; return len(vs) > 0 && sm(vs[0]) }, nil
	}
	return nil, fmt.Errorf("query parameter matcher %v is not emulated", m)
}
