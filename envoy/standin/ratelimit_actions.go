package standin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"sync"

	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	metadatav3 "github.com/envoyproxy/go-control-plane/envoy/type/metadata/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// This file turns a request into rate-limit descriptors as Envoy's rate
// limit actions do (docs/envoy-ratelimit.md §2.3, §2.5): each
// config.route.v3.RateLimit gives at most one descriptor, its actions
// appending one entry each in order.

// streamMetadata is a stream's dynamic metadata, which filters after the
// rate-limit filter (Config.Next) add to with SetDynamicMetadata.
type streamMetadata struct {
	mu sync.Mutex
	ns map[string]*structpb.Struct
}

type metadataKey struct{}

// SetDynamicMetadata merges fields into namespace ns of the dynamic
// metadata of the stand-in stream that ctx (a request's context, as a
// RateLimitConfig.Next handler receives it) belongs to, as a filter's
// setDynamicMetadata merges keys. The rate-limit filter reads it when it
// builds the descriptors of the stream-done call (apply_on_stream_done,
// §2.2), so a handler sets the response's cost (Envoy AI Gateway's
// io.envoy.ai_gateway:llm_total_token, say) before it returns. It reports
// false when ctx is not a stand-in stream's.
func SetDynamicMetadata(ctx context.Context, ns string, fields *structpb.Struct) bool {
	m, ok := ctx.Value(metadataKey{}).(*streamMetadata)
	if !ok {
		return false
	}
	m.set(ns, fields)
	return true
}

// DynamicMetadataOf returns a copy of namespace ns of the dynamic metadata
// of the stand-in stream ctx belongs to (what the rate-limit filter stored
// from the service's answer under its metadata_namespace, say); nil when
// the namespace is empty or ctx is not a stand-in stream's.
func DynamicMetadataOf(ctx context.Context, ns string) *structpb.Struct {
	m, ok := ctx.Value(metadataKey{}).(*streamMetadata)
	if !ok {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.ns[ns]; s != nil {
		return proto.CloneOf(s)
	}
	return nil
}

func (m *streamMetadata) set(ns string, fields *structpb.Struct) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.ns[ns]
	if s == nil {
		s = &structpb.Struct{Fields: map[string]*structpb.Value{}}
		m.ns[ns] = s
	}
	for k, v := range fields.GetFields() {
		s.Fields[k] = proto.CloneOf(v)
	}
}

// lookup finds a metadata value by namespace and path; nil when absent.
func (m *streamMetadata) lookup(key *metadatav3.MetadataKey) *structpb.Value {
	m.mu.Lock()
	defer m.mu.Unlock()
	return lookupPath(m.ns[key.GetKey()], key.GetPath())
}

func lookupPath(s *structpb.Struct, path []*metadatav3.MetadataKey_PathSegment) *structpb.Value {
	if s == nil || len(path) == 0 {
		return nil
	}
	v := s.GetFields()[path[0].GetKey()]
	for _, seg := range path[1:] {
		v = v.GetStructValue().GetFields()[seg.GetKey()]
	}
	return v
}

// snapshot copies the metadata, for the log.
func (m *streamMetadata) snapshot() map[string]*structpb.Struct {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.ns) == 0 {
		return nil
	}
	out := make(map[string]*structpb.Struct, len(m.ns))
	for k, s := range m.ns {
		out[k] = proto.CloneOf(s)
	}
	return out
}

// rlRequest is what the actions read of one request.
type rlRequest struct {
	header   func(string) (string, bool) // repeated values joined by ","
	first    func(string) (string, bool) // the first value only
	query    map[string][]string
	remote   netip.Addr // invalid when the downstream address is not IP
	route    *rlRoute
	md       *streamMetadata
	service  string // --service-cluster
	internal bool
}

// format is a substitution format string made of literal text and the
// commands the stand-in knows: %DYNAMIC_METADATA(ns:key:...)%,
// %REQ(name)% (and %REQ(name?alt)%), %DOWNSTREAM_REMOTE_ADDRESS% and
// %DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%. Anything else is refused when
// the proxy is made.
type format struct {
	parts []formatPart
	cmds  int
}

type formatPart struct {
	lit string
	cmd func(*rlRequest) *structpb.Value // nil for literal text
}

var formatCommand = regexp.MustCompile(`%([A-Z_]+)(?:\(([^)]*)\))?%`)

func compileFormat(s string) (*format, error) {
	f := &format{}
	last := 0
	for _, m := range formatCommand.FindAllStringSubmatchIndex(s, -1) {
		if m[0] > last {
			f.parts = append(f.parts, formatPart{lit: s[last:m[0]]})
		}
		name, arg := s[m[2]:m[3]], ""
		if m[4] >= 0 {
			arg = s[m[4]:m[5]]
		}
		cmd, err := formatCommandOf(name, arg)
		if err != nil {
			return nil, fmt.Errorf("format %q: %w", s, err)
		}
		f.parts = append(f.parts, formatPart{cmd: cmd})
		f.cmds++
		last = m[1]
	}
	if last < len(s) {
		f.parts = append(f.parts, formatPart{lit: s[last:]})
	}
	return f, nil
}

func formatCommandOf(name, arg string) (func(*rlRequest) *structpb.Value, error) {
	switch name {
	case "DYNAMIC_METADATA":
		parts := strings.Split(arg, ":")
		if len(parts) < 2 || parts[0] == "" {
			return nil, fmt.Errorf("DYNAMIC_METADATA(%s) needs a namespace and a key", arg)
		}
		key := &metadatav3.MetadataKey{Key: parts[0]}
		for _, p := range parts[1:] {
			key.Path = append(key.Path, &metadatav3.MetadataKey_PathSegment{Segment: &metadatav3.MetadataKey_PathSegment_Key{Key: p}})
		}
		return func(rq *rlRequest) *structpb.Value { return rq.md.lookup(key) }, nil
	case "REQ":
		h, alt, _ := strings.Cut(strings.ToLower(arg), "?")
		return func(rq *rlRequest) *structpb.Value {
			if v, ok := rq.header(h); ok {
				return structpb.NewStringValue(v)
			}
			if v, ok := rq.header(alt); alt != "" && ok {
				return structpb.NewStringValue(v)
			}
			return nil
		}, nil
	case "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT", "DOWNSTREAM_REMOTE_ADDRESS":
		return func(rq *rlRequest) *structpb.Value {
			if !rq.remote.IsValid() {
				return nil
			}
			return structpb.NewStringValue(rq.remote.String())
		}, nil
	}
	return nil, fmt.Errorf("command %%%s%% is not emulated", name)
}

// text formats f; an absent value formats as nothing.
func (f *format) text(rq *rlRequest) string {
	var b strings.Builder
	for _, p := range f.parts {
		if p.cmd == nil {
			b.WriteString(p.lit)
			continue
		}
		switch v := p.cmd(rq).GetKind().(type) {
		case *structpb.Value_StringValue:
			b.WriteString(v.StringValue)
		case *structpb.Value_NumberValue:
			b.WriteString(strconv.FormatFloat(v.NumberValue, 'f', -1, 64))
		case *structpb.Value_BoolValue:
			b.WriteString(strconv.FormatBool(v.BoolValue))
		}
	}
	return b.String()
}

// action appends one entry: key "" adds none; ok false drops the
// descriptor (§2.3).
type action func(rq *rlRequest) (key, value string, ok bool)

// rlPolicy is one compiled config.route.v3.RateLimit.
type rlPolicy struct {
	stage        uint32
	disableKey   string
	actions      []action
	limit        func(rq *rlRequest) *commonv3.RateLimitDescriptor_RateLimitOverride
	hitsNumber   *wrapperspb.UInt64Value
	hitsFormat   *format
	negative     bool
	onStreamDone bool
	xOption      routev3.RateLimit_XRateLimitOption
}

// policyList says which list a RateLimit comes from (§2.4): the filter's
// or a RateLimitPerRoute's rate_limits (RateLimitPolicy, which takes
// hits_addend and refuses stage, disable_key and dynamic_metadata), or a
// route's or virtual host's.
type policyList int

const (
	filterList policyList = iota
	routeList
)

func compilePolicy(rl *routev3.RateLimit, list policyList, formatValues bool) (*rlPolicy, error) {
	p := &rlPolicy{
		stage: rl.GetStage().GetValue(), disableKey: rl.GetDisableKey(),
		onStreamDone: rl.GetApplyOnStreamDone(), xOption: rl.GetXRatelimitOption(),
	}
	if list == filterList {
		if rl.GetStage() != nil || rl.GetDisableKey() != "" {
			return nil, errors.New("stage and disable_key are not supported in rate_limits of the filter or of a RateLimitPerRoute")
		}
		if h := rl.GetHitsAddend(); h != nil {
			switch {
			case h.GetNumber() != nil && h.GetFormat() != "", h.GetNumber() == nil && h.GetFormat() == "":
				return nil, errors.New("hits_addend needs exactly one of number and format")
			case h.GetNumber() != nil:
				p.hitsNumber = h.GetNumber()
			default:
				f, err := compileFormat(h.GetFormat())
				if err != nil {
					return nil, err
				}
				if f.cmds != 1 || len(f.parts) != 1 {
					return nil, fmt.Errorf("hits_addend format %q must be exactly one substitution", h.GetFormat())
				}
				p.hitsFormat = f
			}
			p.negative = h.GetIsNegativeHits()
		}
	}
	for i, a := range rl.GetActions() {
		act, err := compileAction(a, list, formatValues)
		if err != nil {
			return nil, fmt.Errorf("actions[%d]: %w", i, err)
		}
		p.actions = append(p.actions, act)
	}
	if o := rl.GetLimit(); o != nil {
		switch {
		case o.GetDynamicMetadata() != nil:
			key := o.GetDynamicMetadata().GetMetadataKey()
			p.limit = func(rq *rlRequest) *commonv3.RateLimitDescriptor_RateLimitOverride {
				return limitFromMetadata(rq.md.lookup(key))
			}
		case o.GetRateLimit() != nil:
			static := &commonv3.RateLimitDescriptor_RateLimitOverride{
				RequestsPerUnit: o.GetRateLimit().GetRequestsPerUnit(), Unit: o.GetRateLimit().GetUnit(),
			}
			p.limit = func(*rlRequest) *commonv3.RateLimitDescriptor_RateLimitOverride { return static }
		}
	}
	return p, nil
}

// limitFromMetadata reads a limit override from dynamic metadata: a struct
// with a number requests_per_unit and a string unit that names a
// RateLimitUnit; anything else sets none (§2.3).
func limitFromMetadata(v *structpb.Value) *commonv3.RateLimitDescriptor_RateLimitOverride {
	f := v.GetStructValue().GetFields()
	rpu, ok := f["requests_per_unit"].GetKind().(*structpb.Value_NumberValue)
	unit, uok := f["unit"].GetKind().(*structpb.Value_StringValue)
	if !ok || !uok {
		return nil
	}
	u, known := typev3.RateLimitUnit_value[unit.StringValue]
	if !known {
		return nil
	}
	return &commonv3.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: uint32(rpu.NumberValue), Unit: typev3.RateLimitUnit(u)}
}

// descriptor runs the policy's actions; ok is false when one fails or when
// a hits_addend format does not give a number (§2.3, §2.5).
func (p *rlPolicy) descriptor(rq *rlRequest) (*commonv3.RateLimitDescriptor, bool) {
	d := &commonv3.RateLimitDescriptor{}
	for _, a := range p.actions {
		k, v, ok := a(rq)
		if !ok {
			return nil, false
		}
		if k != "" {
			d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: k, Value: v})
		}
	}
	if p.limit != nil {
		d.Limit = p.limit(rq)
	}
	switch {
	case p.hitsNumber != nil:
		d.HitsAddend = wrapperspb.UInt64(p.hitsNumber.GetValue())
	case p.hitsFormat != nil:
		n, ok := hitsValue(p.hitsFormat.parts[0].cmd(rq))
		if !ok {
			return nil, false
		}
		d.HitsAddend = wrapperspb.UInt64(n)
	}
	d.IsNegativeHits = p.negative
	return d, true
}

// hitsValue is a hits_addend format's value: a number, or a string that
// parses as one, in [0, 1e9], truncated; nil (absent metadata) and
// anything else is no value (§2.5).
func hitsValue(v *structpb.Value) (uint64, bool) {
	var f float64
	switch k := v.GetKind().(type) {
	case *structpb.Value_NumberValue:
		f = k.NumberValue
	case *structpb.Value_StringValue:
		var err error
		if f, err = strconv.ParseFloat(k.StringValue, 64); err != nil {
			return 0, false
		}
	default:
		return 0, false
	}
	if math.IsNaN(f) || f < 0 || f > 1e9 {
		return 0, false
	}
	return uint64(f), true
}

func compileAction(a *routev3.RateLimit_Action, list policyList, formatValues bool) (action, error) {
	switch s := a.GetActionSpecifier().(type) {
	case *routev3.RateLimit_Action_SourceCluster_:
		return func(rq *rlRequest) (string, string, bool) { return "source_cluster", rq.service, true }, nil
	case *routev3.RateLimit_Action_DestinationCluster_:
		return func(rq *rlRequest) (string, string, bool) {
			if rq.route == nil || rq.route.cluster == "" {
				return "", "", false
			}
			return "destination_cluster", rq.route.cluster, true
		}, nil
	case *routev3.RateLimit_Action_RequestHeaders_:
		h := s.RequestHeaders
		name, key, skip := strings.ToLower(h.GetHeaderName()), h.GetDescriptorKey(), h.GetSkipIfAbsent()
		return func(rq *rlRequest) (string, string, bool) {
			v, ok := rq.first(name)
			switch {
			case ok:
				return key, v, true
			case skip:
				return "", "", true
			}
			return "", "", false
		}, nil
	case *routev3.RateLimit_Action_QueryParameters_:
		q := s.QueryParameters
		name, key, skip := q.GetQueryParameterName(), q.GetDescriptorKey(), q.GetSkipIfAbsent()
		return func(rq *rlRequest) (string, string, bool) {
			vs := rq.query[name]
			switch {
			case len(vs) > 0:
				return key, vs[0], true
			case skip:
				return "", "", true
			}
			return "", "", false
		}, nil
	case *routev3.RateLimit_Action_RemoteAddress_:
		return func(rq *rlRequest) (string, string, bool) {
			if !rq.remote.IsValid() {
				return "", "", false
			}
			return "remote_address", rq.remote.String(), true
		}, nil
	case *routev3.RateLimit_Action_MaskedRemoteAddress_:
		m := s.MaskedRemoteAddress
		v4, v6 := 32, 128
		if m.GetV4PrefixMaskLen() != nil {
			v4 = int(m.GetV4PrefixMaskLen().GetValue())
		}
		if m.GetV6PrefixMaskLen() != nil {
			v6 = int(m.GetV6PrefixMaskLen().GetValue())
		}
		return func(rq *rlRequest) (string, string, bool) {
			if !rq.remote.IsValid() {
				return "", "", false
			}
			bits := v6
			if rq.remote.Is4() {
				bits = v4
			}
			p, err := rq.remote.Prefix(bits)
			if err != nil {
				return "", "", false
			}
			return "masked_remote_address", p.String(), true
		}, nil
	case *routev3.RateLimit_Action_GenericKey_:
		g := s.GenericKey
		key := g.GetDescriptorKey()
		if key == "" {
			key = "generic_key"
		}
		value, def := g.GetDescriptorValue(), g.GetDefaultValue()
		if !formatValues {
			return func(*rlRequest) (string, string, bool) { return key, value, true }, nil
		}
		f, err := compileFormat(value)
		if err != nil {
			return nil, err
		}
		return formatted(key, f, def), nil
	case *routev3.RateLimit_Action_HeaderValueMatch_:
		h := s.HeaderValueMatch
		key := h.GetDescriptorKey()
		if key == "" {
			key = "header_match"
		}
		expect := h.GetExpectMatch() == nil || h.GetExpectMatch().GetValue()
		ms, err := compileHeaders(h.GetHeaders())
		if err != nil {
			return nil, err
		}
		value := func(*rlRequest) (string, string, bool) { return key, h.GetDescriptorValue(), true }
		if formatValues {
			f, err := compileFormat(h.GetDescriptorValue())
			if err != nil {
				return nil, err
			}
			value = formatted(key, f, h.GetDefaultValue())
		}
		return func(rq *rlRequest) (string, string, bool) {
			if all(ms, rq.header) != expect {
				return "", "", false
			}
			return value(rq)
		}, nil
	case *routev3.RateLimit_Action_QueryParameterValueMatch_:
		q := s.QueryParameterValueMatch
		key := q.GetDescriptorKey()
		if key == "" {
			key = "query_match"
		}
		expect := q.GetExpectMatch() == nil || q.GetExpectMatch().GetValue()
		var ms []queryMatch
		for _, m := range q.GetQueryParameters() {
			qm, err := compileQuery(m)
			if err != nil {
				return nil, err
			}
			ms = append(ms, qm)
		}
		value := q.GetDescriptorValue()
		return func(rq *rlRequest) (string, string, bool) {
			match := true
			for _, m := range ms {
				match = match && m(rq.query)
			}
			if match != expect {
				return "", "", false
			}
			return key, value, true
		}, nil
	case *routev3.RateLimit_Action_DynamicMetadata:
		if list == filterList {
			return nil, errors.New("Unsupported rate limit action: dynamic_metadata in rate_limits of the filter or of a RateLimitPerRoute")
		}
		d := s.DynamicMetadata
		return metadataAction(d.GetDescriptorKey(), d.GetMetadataKey(), d.GetDefaultValue(), routev3.RateLimit_Action_MetaData_DYNAMIC, false)
	case *routev3.RateLimit_Action_Metadata:
		m := s.Metadata
		return metadataAction(m.GetDescriptorKey(), m.GetMetadataKey(), m.GetDefaultValue(), m.GetSource(), m.GetSkipIfAbsent())
	case *routev3.RateLimit_Action_RemoteAddressMatch_:
		m := s.RemoteAddressMatch
		key := m.GetDescriptorKey()
		if key == "" {
			key = "remote_address_match"
		}
		var ranges []netip.Prefix
		for _, r := range m.GetAddressMatcher().GetRanges() {
			addr, err := netip.ParseAddr(r.GetAddressPrefix())
			if err != nil {
				return nil, fmt.Errorf("remote_address_match: %w", err)
			}
			p, err := addr.Prefix(int(r.GetPrefixLen().GetValue()))
			if err != nil {
				return nil, fmt.Errorf("remote_address_match: %w", err)
			}
			ranges = append(ranges, p)
		}
		invert := m.GetAddressMatcher().GetInvertMatch()
		f, err := compileFormat(m.GetDescriptorValue())
		if err != nil {
			return nil, err
		}
		value := formatted(key, f, m.GetDefaultValue())
		return func(rq *rlRequest) (string, string, bool) {
			if !rq.remote.IsValid() {
				return "", "", false
			}
			in := false
			for _, p := range ranges {
				in = in || p.Contains(rq.remote.Unmap())
			}
			if in == invert {
				return "", "", false
			}
			return value(rq)
		}, nil
	}
	return nil, fmt.Errorf("rate limit action %T is not emulated", a.GetActionSpecifier())
}

// formatted is an entry whose value is formatted: empty gives the default
// value, and with no default the descriptor is dropped.
func formatted(key string, f *format, def string) action {
	return func(rq *rlRequest) (string, string, bool) {
		v := f.text(rq)
		if v == "" {
			v = def
		}
		if v == "" {
			return "", "", false
		}
		return key, v, true
	}
}

// metadataAction reads a string from the stream's dynamic metadata or the
// route's metadata: empty or not a string gives the default value, and
// with no default the entry is left out if skipIfAbsent, else the
// descriptor is dropped (§2.3).
func metadataAction(key string, mk *metadatav3.MetadataKey, def string, src routev3.RateLimit_Action_MetaData_Source, skipIfAbsent bool) (action, error) {
	switch src {
	case routev3.RateLimit_Action_MetaData_DYNAMIC, routev3.RateLimit_Action_MetaData_ROUTE_ENTRY:
	default:
		return nil, fmt.Errorf("metadata source %v is not emulated", src)
	}
	return func(rq *rlRequest) (string, string, bool) {
		var v *structpb.Value
		if src == routev3.RateLimit_Action_MetaData_DYNAMIC {
			v = rq.md.lookup(mk)
		} else if rq.route != nil {
			v = lookupPath(rq.route.metadata[mk.GetKey()], mk.GetPath())
		}
		s := v.GetStringValue()
		if s == "" {
			s = def
		}
		if s == "" {
			return "", "", skipIfAbsent
		}
		return key, s, true
	}, nil
}
