package envoy

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"

	// The extensions the shipped configurations use. Each blank import
	// registers its types, so their @type URLs resolve when decoding.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/health_check/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// ExtProcFilterName is the canonical name of Envoy's external processing
// HTTP filter, also the key of its per-route configuration.
const ExtProcFilterName = "envoy.filters.http.ext_proc"

// MetadataNamespace is the dynamic metadata namespace tokengate writes its
// token counts to (input_tokens, output_tokens, reserved_tokens,
// settled_tokens). Envoy drops it unless the ext_proc filter lists it in
// metadata_options.receiving_namespaces.untyped.
const MetadataNamespace = "tokengate"

// kind is the kind of Envoy document Validate decodes.
type kind struct {
	name string
	new  func() proto.Message
}

var (
	kindBootstrap = kind{"bootstrap", func() proto.Message { return &bootstrapv3.Bootstrap{} }}
	kindListener  = kind{"listener", func() proto.Message { return &listenerv3.Listener{} }}
	kindRoutes    = kind{"route configuration", func() proto.Message { return &routev3.RouteConfiguration{} }}
	kindHCM       = kind{"http connection manager", func() proto.Message { return &hcmv3.HttpConnectionManager{} }}
	kindFilter    = kind{"http filter", func() proto.Message { return &hcmv3.HttpFilter{} }}
	kindExtProc   = kind{"ext_proc filter config", func() proto.Message { return &extprocv3.ExternalProcessor{} }}
	kindCluster   = kind{"cluster", func() proto.Message { return &clusterv3.Cluster{} }}
	kindAny       = kind{"typed message", func() proto.Message { return &anypb.Any{} }}
)

// detect tells the kind of a decoded YAML mapping by its @type or its shape.
func detect(doc map[string]any) (kind, bool) {
	if t, ok := doc["@type"].(string); ok && t != "" {
		return kindAny, true
	}
	has := func(keys ...string) bool {
		for _, k := range keys {
			if _, ok := doc[k]; ok {
				return true
			}
		}
		return false
	}
	switch {
	case has("static_resources", "staticResources", "dynamic_resources", "dynamicResources",
		"admin", "layered_runtime", "layeredRuntime", "overload_manager", "overloadManager"):
		return kindBootstrap, true
	case has("filter_chains", "filterChains", "default_filter_chain", "defaultFilterChain"):
		return kindListener, true
	case has("virtual_hosts", "virtualHosts", "vhds"):
		return kindRoutes, true
	case has("http_filters", "httpFilters", "route_config", "routeConfig", "rds"):
		return kindHCM, true
	case has("typed_config", "typedConfig") && has("name"):
		name, _ := doc["name"].(string)
		if strings.HasPrefix(name, "envoy.") {
			return kindFilter, true
		}
	case has("grpc_service", "grpcService", "processing_mode", "processingMode"):
		return kindExtProc, true
	case has("load_assignment", "loadAssignment", "connect_timeout", "connectTimeout") && has("name"):
		return kindCluster, true
	}
	return kind{}, false
}

// LooksLikeEnvoy reports whether data is a YAML document Validate would take
// for Envoy configuration: a bootstrap, listener, route configuration, HTTP
// connection manager, HTTP filter, ext_proc config, cluster, or any document
// whose @type names an Envoy type. tokengate's own configuration matches none
// of these shapes.
func LooksLikeEnvoy(data []byte) bool {
	var doc map[string]any
	if err := yaml.Unmarshal(data, &doc); err != nil || doc == nil {
		return false
	}
	k, ok := detect(doc)
	if !ok {
		return false
	}
	if k.name == kindAny.name {
		t, _ := doc["@type"].(string)
		return strings.Contains(t, "/envoy.")
	}
	return true
}

// Validate checks one Envoy YAML document with Envoy's own API, then with
// the rules tokengate needs (processing modes, timeouts, HTTP/2 to the
// processor, dynamic metadata). The document may be a bootstrap, a bare
// listener, a route configuration, an HTTP connection manager, an HTTP filter
// (name + typed_config, e.g. envoy.filters.http.ext_proc), an ext_proc config,
// a cluster, or any of these with an explicit @type. Every typed_config is
// unpacked and validated too. The result is empty when the document is fine;
// only problems with Severity Error should fail a check (see HasErrors).
// Validate is safe for concurrent use.
func Validate(file string, data []byte) []Problem {
	v := &validation{file: file}
	v.run(data)
	return v.problems
}

// validation collects the problems of one document.
type validation struct {
	file     string
	problems []Problem

	extProcs  []extProcAt
	perRoutes []perRouteAt
	hcms      []hcmAt
	routeCfgs []routeCfgAt
	bootstrap *bootstrapv3.Bootstrap
}

type extProcAt struct {
	path string
	cfg  *extprocv3.ExternalProcessor
	raw  map[string]any
}

type perRouteAt struct {
	path string
	cfg  *extprocv3.ExtProcPerRoute
}

type hcmAt struct {
	path string
	hcm  *hcmv3.HttpConnectionManager
}

type routeCfgAt struct {
	path string
	rc   *routev3.RouteConfiguration
}

func (v *validation) add(sev Severity, path, rule, format string, args ...any) {
	v.problems = append(v.problems, Problem{
		File: v.file, Path: path, Rule: rule, Severity: sev,
		Message: fmt.Sprintf(format, args...),
	})
}

func (v *validation) run(data []byte) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		v.add(Error, "", RuleYAML, "not valid YAML: %v", err)
		return
	}
	var raw any
	if err := json.Unmarshal(js, &raw); err != nil {
		v.add(Error, "", RuleYAML, "not valid YAML: %v", err)
		return
	}
	doc, ok := raw.(map[string]any)
	if !ok {
		v.add(Error, "", RuleYAML, "the document must be a YAML mapping, not %s", jsonKind(raw))
		return
	}
	k, ok := detect(doc)
	if !ok {
		v.add(Error, "", RuleShape, "not a kind of Envoy document tokengate validates: want a bootstrap "+
			"(static_resources), a listener (filter_chains), a route configuration (virtual_hosts), an "+
			"http connection manager (http_filters), an http filter (name + typed_config), or a document with an @type")
		return
	}
	msg := k.new()
	if err := (protojson.UnmarshalOptions{}).Unmarshal(js, msg); err != nil {
		path, why := locate(doc, msg.ProtoReflect().Descriptor(), "")
		if why == "" {
			why = strings.TrimPrefix(err.Error(), "proto: ")
		}
		v.add(Error, path, RuleDecode, "%s", why)
		return
	}
	if a, ok := msg.(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil { // protojson has resolved the type already
			v.add(Error, "@type", RuleDecode, "%v", err)
			return
		}
		msg = inner
	}
	if b, ok := msg.(*bootstrapv3.Bootstrap); ok {
		v.bootstrap = b
	}
	v.constraints(msg, "")
	v.walk(msg.ProtoReflect(), doc, "")
	v.check()
}

// constraints runs Envoy's field constraints (protoc-gen-validate) on msg.
// They do not descend into Any fields; walk calls constraints for each
// unpacked typed_config.
func (v *validation) constraints(msg proto.Message, path string) {
	va, ok := msg.(interface{ ValidateAll() error })
	if !ok {
		return
	}
	v.flatten(va.ValidateAll(), path)
}

// pgvError is the shape of every protoc-gen-validate error type.
type pgvError interface {
	Field() string
	Reason() string
	Cause() error
}

func (v *validation) flatten(err error, path string) {
	if err == nil {
		return
	}
	if m, ok := err.(interface{ AllErrors() []error }); ok {
		for _, e := range m.AllErrors() {
			v.flatten(e, path)
		}
		return
	}
	var pe pgvError
	if !errors.As(err, &pe) {
		v.add(Error, path, RuleEnvoy, "%v", err)
		return
	}
	p := joinPath(path, pgvField(pe.Field()))
	if c := pe.Cause(); c != nil {
		if _, ok := c.(interface{ AllErrors() []error }); ok {
			v.flatten(c, p)
			return
		}
		var inner pgvError
		if errors.As(c, &inner) {
			v.flatten(c, p)
			return
		}
		v.add(Error, p, RuleEnvoy, "%s: %v", pe.Reason(), c)
		return
	}
	v.add(Error, p, RuleEnvoy, "%s", pe.Reason())
}

// pgvField turns a protoc-gen-validate field name ("HttpFilters[1]",
// `TypedPerFilterConfig["x"]`) into its proto spelling ("http_filters[1]").
func pgvField(f string) string {
	name, rest := f, ""
	if i := strings.IndexByte(f, '['); i >= 0 {
		name, rest = f[:i], f[i:]
	}
	var b strings.Builder
	for i, r := range name {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String() + rest
}

func joinPath(path, field string) string {
	switch {
	case path == "":
		return field
	case field == "":
		return path
	case strings.HasPrefix(field, "["):
		return path + field
	}
	return path + "." + field
}

func indexPath(path string, i int) string { return path + "[" + strconv.Itoa(i) + "]" }

func keyPath(path, key string) string { return path + "[" + strconv.Quote(key) + "]" }

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case []any:
		return "a list"
	case string:
		return "a string"
	case float64:
		return "a number"
	case bool:
		return "a boolean"
	}
	return "a mapping"
}

// rawField returns the JSON value of field fd in a decoded mapping, looking
// under both spellings protojson accepts.
func rawField(m map[string]any, fd protoreflect.FieldDescriptor) any {
	if m == nil {
		return nil
	}
	if x, ok := m[string(fd.Name())]; ok {
		return x
	}
	return m[fd.JSONName()]
}

// locate finds where a document fails to decode, for a message that names
// the field: protojson only reports a byte offset in the converted JSON. It
// returns the YAML path and the reason, or "" when it cannot tell.
func locate(raw any, md protoreflect.MessageDescriptor, path string) (string, string) {
	if md.FullName() == "google.protobuf.Any" {
		m, ok := raw.(map[string]any)
		if !ok {
			return path, fmt.Sprintf("want a mapping with an @type, got %s", jsonKind(raw))
		}
		url, _ := m["@type"].(string)
		if url == "" {
			return path, "typed config without an @type"
		}
		mt, err := protoregistry.GlobalTypes.FindMessageByURL(url)
		if err != nil {
			return joinPath(path, "@type"), fmt.Sprintf("unknown @type %q: not an Envoy type, or an "+
				"extension tokengate does not ship (validate knows http_connection_manager, ext_proc, "+
				"router, health_check, upstream http protocol options, file and stdout access loggers)", url)
		}
		inner := make(map[string]any, len(m))
		for k, x := range m {
			if k != "@type" {
				inner[k] = x
			}
		}
		return locate(inner, mt.Descriptor(), path)
	}
	if strings.HasPrefix(string(md.FullName()), "google.protobuf.") {
		return "", "" // well-known types have their own JSON forms
	}
	m, ok := raw.(map[string]any)
	if !ok {
		return path, fmt.Sprintf("want a mapping for %s, got %s", md.FullName(), jsonKind(raw))
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	fields := md.Fields()
	for _, k := range keys {
		fd := fields.ByName(protoreflect.Name(k))
		if fd == nil {
			fd = fields.ByJSONName(k)
		}
		if fd == nil {
			return joinPath(path, k), fmt.Sprintf("unknown field %q in %s", k, md.FullName())
		}
		x := m[k]
		p := joinPath(path, string(fd.Name()))
		if x == nil {
			continue
		}
		switch {
		case fd.IsList():
			list, ok := x.([]any)
			if !ok {
				return p, fmt.Sprintf("want a list, got %s", jsonKind(x))
			}
			for i, e := range list {
				if at, why := locateValue(e, fd, indexPath(p, i)); why != "" {
					return at, why
				}
			}
		case fd.IsMap():
			mm, ok := x.(map[string]any)
			if !ok {
				return p, fmt.Sprintf("want a mapping, got %s", jsonKind(x))
			}
			for mk, e := range mm {
				if at, why := locateValue(e, fd.MapValue(), keyPath(p, mk)); why != "" {
					return at, why
				}
			}
		default:
			if at, why := locateValue(x, fd, p); why != "" {
				return at, why
			}
		}
	}
	return "", ""
}

func locateValue(x any, fd protoreflect.FieldDescriptor, path string) (string, string) {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return locate(x, fd.Message(), path)
	case protoreflect.EnumKind:
		s, ok := x.(string)
		if !ok {
			return "", ""
		}
		if fd.Enum().Values().ByName(protoreflect.Name(s)) == nil {
			var names []string
			vals := fd.Enum().Values()
			for i := range vals.Len() {
				names = append(names, string(vals.Get(i).Name()))
			}
			return path, fmt.Sprintf("unknown value %q; want one of %s", s, strings.Join(names, ", "))
		}
	}
	return "", ""
}

// walk visits every set message field of m, unpacking Any values, and
// records the messages the tokengate checks need. raw is the decoded YAML of
// m (nil when unknown), used to tell a field set to its default from an
// absent one.
func (v *validation) walk(m protoreflect.Message, raw any, path string) {
	rawMap, _ := raw.(map[string]any)
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			v.add(Error, path, RuleDecode, "cannot unpack %s: %v", a.GetTypeUrl(), err)
			return
		}
		v.constraints(inner, path)
		v.walk(inner.ProtoReflect(), raw, path)
		return
	}
	switch x := m.Interface().(type) {
	case *extprocv3.ExternalProcessor:
		v.extProcs = append(v.extProcs, extProcAt{path, x, rawMap})
	case *extprocv3.ExtProcPerRoute:
		v.perRoutes = append(v.perRoutes, perRouteAt{path, x})
	case *hcmv3.HttpConnectionManager:
		v.hcms = append(v.hcms, hcmAt{path, x})
	case *routev3.RouteConfiguration:
		v.routeCfgs = append(v.routeCfgs, routeCfgAt{path, x})
	}
	m.Range(func(fd protoreflect.FieldDescriptor, val protoreflect.Value) bool {
		if fd.Kind() != protoreflect.MessageKind && fd.Kind() != protoreflect.GroupKind {
			return true
		}
		p := joinPath(path, string(fd.Name()))
		rawChild := rawField(rawMap, fd)
		switch {
		case fd.IsList():
			list := val.List()
			rawList, _ := rawChild.([]any)
			for i := range list.Len() {
				var r any
				if i < len(rawList) {
					r = rawList[i]
				}
				v.walk(list.Get(i).Message(), r, indexPath(p, i))
			}
		case fd.IsMap():
			if k := fd.MapValue().Kind(); k != protoreflect.MessageKind && k != protoreflect.GroupKind {
				return true
			}
			rawM, _ := rawChild.(map[string]any)
			val.Map().Range(func(k protoreflect.MapKey, e protoreflect.Value) bool {
				key := k.String()
				v.walk(e.Message(), rawM[key], keyPath(p, key))
				return true
			})
		default:
			v.walk(val.Message(), rawChild, p)
		}
		return true
	})
}
