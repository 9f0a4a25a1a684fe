package envoy

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	yaml "go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"

	// The extensions the shipped configurations use. Each blank import
	// registers its types, so their @type URLs resolve when decoding.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/health_check/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
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

// DefaultPolicyMetadataKey is the gRPC initial metadata key that names a
// route's tokengate policy unless the configuration sets another
// (policy_metadata_key).
const DefaultPolicyMetadataKey = "x-tokengate-policy"

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
	kindRateLimit = kind{"rate limit filter config", func() proto.Message { return &rlfilterv3.RateLimit{} }}
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
	case has("rate_limit_service", "rateLimitService"):
		return kindRateLimit, true
	case has("grpc_service", "grpcService", "processing_mode", "processingMode"):
		return kindExtProc, true
	case has("load_assignment", "loadAssignment", "connect_timeout", "connectTimeout") && has("name"):
		return kindCluster, true
	}
	return kind{}, false
}

// LooksLikeEnvoy reports whether data is YAML that Validate takes for Envoy
// configuration: a bootstrap, listener, route configuration, HTTP connection
// manager, HTTP filter, ext_proc config, cluster, a document whose @type
// names an Envoy type, or a Kubernetes manifest (apiVersion and kind), such
// as an Istio EnvoyFilter or an Envoy Gateway EnvoyExtensionPolicy. Any
// document of a multi-document file may match. tokengate's own
// configuration matches none of these shapes.
func LooksLikeEnvoy(data []byte) bool {
	docs, _ := parseDocuments(data) // a syntax error leaves the documents read before it
	for _, d := range docs {
		t, _ := newTree(d)
		if t == nil {
			continue
		}
		doc, ok := t.value.(map[string]any)
		if !ok {
			continue
		}
		if isManifest(doc) || isAgentgateway(doc) {
			return true
		}
		k, ok := detect(doc)
		if !ok {
			continue
		}
		if k.name != kindAny.name {
			return true
		}
		if u, _ := doc["@type"].(string); strings.Contains(u, "/envoy.") {
			return true
		}
	}
	return false
}

// Validate checks an Envoy YAML file with Envoy's own API, then with the
// rules tokengate needs (processing modes, filter order, HTTP/2 and TLS to
// the processor and the rate-limit service, dynamic metadata, timeouts). A
// document may be a bootstrap, a bare listener, a route configuration, an
// HTTP connection manager, an HTTP filter (name + typed_config, e.g.
// envoy.filters.http.ext_proc), an ext_proc or rate-limit filter config, a
// cluster, any of these with an explicit @type, or a Kubernetes manifest:
// an Istio EnvoyFilter (each patch value is checked as the type its
// applyTo implies), an Envoy Gateway EnvoyExtensionPolicy (each extProc
// entry is checked as the ext_proc filter Envoy Gateway generates) or
// BackendTrafficPolicy (its rate limits), or an Envoy AI Gateway
// QuotaPolicy; or an agentgateway configuration (its remoteRateLimit
// policies). Files may hold several documents separated by "---". Every
// typed_config is unpacked and validated too.
//
// The result is empty when the file is fine. Only problems with Severity
// Error mean the file will not work (see HasErrors). Validate is safe for
// concurrent use.
func Validate(file string, data []byte) []Problem {
	return Check(file, data, Options{}).Problems
}

// Options are the inputs of checks that need more than the Envoy file.
// The zero value runs the checks of Validate.
type Options struct {
	// Policies, when not empty, are tokengate configurations: every policy a
	// route or filter names in its gRPC initial metadata must be defined in
	// one of those that read that metadata key.
	Policies []PolicySet
}

// PolicySet is what a tokengate configuration says about policies.
type PolicySet struct {
	File  string   // the configuration's file name, for messages
	Key   string   // the gRPC initial metadata key naming the policy; "" means DefaultPolicyMetadataKey
	Names []string // the policies it defines
	// Domains are the rate-limit domains its rls section maps; nil when it
	// has none.
	Domains []string
}

// Report is what Check found in one file. It is a plain value.
type Report struct {
	Problems []Problem
	// Modes lists every ext_proc processing mode in the file (a filter or a
	// per-route override) with tokengate's advice for it.
	Modes []ModeUse
	// Checked names the documents that were checked, e.g. "bootstrap" or
	// "EnvoyFilter tokengate"; Skipped the Kubernetes manifests that carry
	// no Envoy configuration (e.g. "ServiceEntry tokengate").
	Checked, Skipped []string
}

// Check is Validate with options, and with the modes and documents it saw.
// It is safe for concurrent use.
func Check(file string, data []byte, opts Options) Report {
	c := &checker{file: file, opts: opts}
	docs, synErr := parseDocuments(data)
	for _, d := range docs {
		c.document(d)
	}
	if synErr != nil {
		c.report.Problems = append(c.report.Problems, Problem{
			File: file, Line: synErr.pos.line, Column: synErr.pos.col,
			Rule: RuleYAML, Message: "not valid YAML: " + synErr.msg,
		})
	} else if len(docs) == 0 {
		c.report.Problems = append(c.report.Problems, Problem{File: file, Rule: RuleYAML, Message: "the file holds no YAML document"})
	}
	slices.SortStableFunc(c.report.Problems, func(a, b Problem) int {
		if a.Line != b.Line {
			return a.Line - b.Line
		}
		return a.Column - b.Column
	})
	return c.report
}

// checker checks one file.
type checker struct {
	file   string
	opts   Options
	report Report
}

// document checks one YAML document of the file.
func (c *checker) document(node *yaml.Node) {
	t, errs := newTree(node)
	for _, e := range errs {
		c.report.Problems = append(c.report.Problems, Problem{
			File: c.file, Line: e.pos.line, Column: e.pos.col, Path: e.path, Rule: RuleYAML, Message: e.msg,
		})
	}
	if t == nil {
		return
	}
	doc, ok := t.value.(map[string]any)
	if !ok {
		at := t.find("")
		c.report.Problems = append(c.report.Problems, Problem{
			File: c.file, Line: at.line, Column: at.col, Rule: RuleYAML,
			Message: fmt.Sprintf("the document must be a YAML mapping, not %s", jsonKind(t.value)),
		})
		return
	}
	if isManifest(doc) {
		c.manifest(t, doc)
		return
	}
	if isAgentgateway(doc) {
		c.report.Checked = append(c.report.Checked, "agentgateway configuration")
		c.agentgateway(t, doc)
		return
	}
	k, ok := detect(doc)
	if !ok {
		u := c.unit(t, "")
		u.add(Error, "", RuleShape, "not a kind of Envoy document tokengate validates: want a bootstrap "+
			"(static_resources), a listener (filter_chains), a route configuration (virtual_hosts), an "+
			"http connection manager (http_filters), an http filter (name + typed_config), a document with "+
			"an @type, or a Kubernetes manifest (apiVersion, kind)")
		return
	}
	c.report.Checked = append(c.report.Checked, k.name)
	u := c.unit(t, "")
	u.run(doc, k.new())
}

// unit is one Envoy message being checked: a whole document, an EnvoyFilter
// patch value, or the filter an EnvoyExtensionPolicy stands for.
type unit struct {
	c      *checker
	t      *tree  // the document, for positions
	prefix string // the path of the message within the document
	// display, when set, names the document field a path of the message
	// comes from (an EnvoyExtensionPolicy field for a generated filter).
	display func(path string) string
	// partial marks an EnvoyFilter MERGE value: fields it leaves out come
	// from the configuration Istio generates, so their absence is no
	// problem, and checks that need the merged result are left out.
	partial bool

	extProcs    []extProcAt
	perRoutes   []perRouteAt
	rateLimits  []rateLimitAt
	rlPerRoutes []rlPerRouteAt
	domains     []domainAt
	hcms        []hcmAt
	routeCfgs   []routeCfgAt
	policies    []policyAt
	bootstrap   *bootstrapv3.Bootstrap
}

func (c *checker) unit(t *tree, prefix string) *unit { return &unit{c: c, t: t, prefix: prefix} }

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

// policyAt is a policy name given in gRPC initial metadata.
type policyAt struct {
	path string // of the header value
	key  string
	name string
}

// where returns the document path and position of a path of the message.
func (u *unit) where(path string) (string, position) {
	var p string
	if u.display != nil {
		p = u.display(path)
	} else {
		p = joinPath(u.prefix, path)
	}
	return p, u.t.find(p)
}

func (u *unit) add(sev Severity, path, rule, format string, args ...any) {
	p, at := u.where(path)
	u.c.report.Problems = append(u.c.report.Problems, Problem{
		File: u.c.file, Line: at.line, Column: at.col, Path: p, Rule: rule, Severity: sev,
		Message: fmt.Sprintf(format, args...),
	})
}

// written reports whether the user wrote path (or, for a generated
// message, the field it comes from).
func (u *unit) written(path string) bool {
	if u.display != nil {
		return true
	}
	return u.t.has(joinPath(u.prefix, path))
}

// run decodes raw as msg, then checks it.
func (u *unit) run(raw map[string]any, msg proto.Message) {
	if !u.decode(raw, msg) {
		return
	}
	if a, ok := msg.(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil { // protojson has resolved the type already
			u.add(Error, "@type", RuleDecode, "%v", err)
			return
		}
		msg = inner
	}
	if b, ok := msg.(*bootstrapv3.Bootstrap); ok {
		u.bootstrap = b
	}
	u.constraints(msg, "")
	u.walk(msg.ProtoReflect(), raw, "")
	u.check()
}

// decode decodes raw into msg as Envoy would (YAML → JSON → proto). On
// failure it reports the first field that fails, by path.
func (u *unit) decode(raw map[string]any, msg proto.Message) bool {
	js, err := json.Marshal(raw)
	if err != nil { // the tree holds only JSON values
		u.add(Error, "", RuleDecode, "%v", err)
		return false
	}
	err = protojson.UnmarshalOptions{}.Unmarshal(js, msg)
	if err == nil {
		return true
	}
	path, why := locate(raw, msg.ProtoReflect().Descriptor(), "")
	if why == "" {
		why = protojsonReason(err)
	}
	u.add(Error, path, RuleDecode, "%s", why)
	return false
}

// protojsonOffset is the "(line 1:34)" protojson puts in its errors: an
// offset into the JSON Validate made, which would only mislead a user.
var protojsonOffset = regexp.MustCompile(`\(line \d+:\d+\): `)

func protojsonReason(err error) string {
	s := strings.TrimPrefix(err.Error(), "proto:")
	s = strings.TrimSpace(s)
	return protojsonOffset.ReplaceAllString(s, "")
}

// constraints runs Envoy's field constraints (protoc-gen-validate) on msg.
// They do not descend into Any fields; walk calls constraints for each
// unpacked typed_config.
func (u *unit) constraints(msg proto.Message, path string) {
	va, ok := msg.(interface{ ValidateAll() error })
	if !ok {
		return
	}
	u.flatten(va.ValidateAll(), path)
}

// pgvError is the shape of every protoc-gen-validate error type.
type pgvError interface {
	Field() string
	Reason() string
	Cause() error
}

func (u *unit) flatten(err error, path string) {
	if err == nil {
		return
	}
	if m, ok := err.(interface{ AllErrors() []error }); ok {
		for _, e := range m.AllErrors() {
			u.flatten(e, path)
		}
		return
	}
	var pe pgvError
	if !errors.As(err, &pe) {
		u.constraint(path, "%v", err)
		return
	}
	p := joinPath(path, pgvField(pe.Field()))
	if c := pe.Cause(); c != nil {
		if _, ok := c.(interface{ AllErrors() []error }); ok {
			u.flatten(c, p)
			return
		}
		var inner pgvError
		if errors.As(c, &inner) {
			u.flatten(c, p)
			return
		}
		u.constraint(p, "%s: %v", pe.Reason(), c)
		return
	}
	u.constraint(p, "%s", pe.Reason())
}

// constraint reports a broken field constraint, except, in a partial
// message, on a field the user did not write.
func (u *unit) constraint(path, format string, args ...any) {
	if u.partial && !u.written(path) {
		return
	}
	u.add(Error, path, RuleEnvoy, format, args...)
}

// pgvField turns a protoc-gen-validate field name ("HttpFilters[1]",
// "TypedPerFilterConfig[x.y]") into its proto spelling ("http_filters[1]",
// `typed_per_filter_config["x.y"]`).
func pgvField(f string) string {
	name, rest := f, ""
	if i := strings.IndexByte(f, '['); i >= 0 {
		name, rest = f[:i], f[i:]
	}
	if strings.HasPrefix(rest, "[") && strings.HasSuffix(rest, "]") && !strings.HasPrefix(rest, `["`) {
		key := rest[1 : len(rest)-1]
		if _, err := strconv.Atoi(key); err != nil {
			rest = "[" + strconv.Quote(key) + "]"
		}
	}
	return snakeCase(name) + rest
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
	case json.Number, float64:
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
// returns the path and the reason, or "" when it cannot tell. When several
// fields fail, the first in key order is reported, as Envoy reports one.
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
				"ratelimit, router, health_check, upstream http protocol options, TLS transport sockets, file and "+
				"stdout access loggers)", url)
		}
		inner := make(map[string]any, len(m))
		for k, x := range m {
			if k != "@type" {
				inner[k] = x
			}
		}
		return locate(inner, mt.Descriptor(), path)
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
	seen := map[protoreflect.FieldDescriptor]string{}
	oneofs := map[protoreflect.OneofDescriptor]string{}
	for _, k := range keys {
		fd := fields.ByName(protoreflect.Name(k))
		if fd == nil {
			fd = fields.ByJSONName(k)
		}
		if fd == nil {
			return joinPath(path, k), fmt.Sprintf("unknown field %q in %s", k, md.FullName())
		}
		p := joinPath(path, string(fd.Name()))
		if other, dup := seen[fd]; dup {
			return p, fmt.Sprintf("field %s is written twice, as %q and %q", fd.Name(), other, k)
		}
		seen[fd] = k
		x := m[k]
		if x == nil {
			continue
		}
		if od := fd.ContainingOneof(); od != nil && !od.IsSynthetic() {
			if other, dup := oneofs[od]; dup {
				return p, fmt.Sprintf("%s and %s are alternatives (one of %s); set only one", other, fd.Name(), od.Name())
			}
			oneofs[od] = string(fd.Name())
		}
		switch {
		case fd.IsList():
			list, ok := x.([]any)
			if !ok {
				return p, fmt.Sprintf("want a list, got %s", jsonKind(x))
			}
			for i, e := range list {
				if at, why := locateValue(md, fd, e, indexPath(p, i), true); why != "" {
					return at, why
				}
			}
		case fd.IsMap():
			mm, ok := x.(map[string]any)
			if !ok {
				return p, fmt.Sprintf("want a mapping, got %s", jsonKind(x))
			}
			mk := make([]string, 0, len(mm))
			for k := range mm {
				mk = append(mk, k)
			}
			slices.Sort(mk)
			for _, k := range mk {
				if at, why := locateMapEntry(md, fd, k, mm[k], keyPath(p, k)); why != "" {
					return at, why
				}
			}
		default:
			if at, why := locateValue(md, fd, x, p, false); why != "" {
				return at, why
			}
		}
	}
	return "", ""
}

// locateValue checks one value of field fd of message md: a message by
// recursion, anything else by decoding it alone, as protojson would.
func locateValue(md protoreflect.MessageDescriptor, fd protoreflect.FieldDescriptor, x any, path string, inList bool) (string, string) {
	if x == nil {
		return "", ""
	}
	if k := fd.Kind(); (k == protoreflect.MessageKind || k == protoreflect.GroupKind) && !isWellKnown(fd.Message()) {
		return locate(x, fd.Message(), path)
	}
	if fd.Kind() == protoreflect.EnumKind {
		if s, ok := x.(string); ok && fd.Enum().Values().ByName(protoreflect.Name(s)) == nil {
			return path, fmt.Sprintf("unknown value %q for %s; want one of %s", s, fd.Name(), enumNames(fd.Enum()))
		}
	}
	if inList {
		x = []any{x}
	}
	if why := leafError(md, fd, x); why != "" {
		return path, why
	}
	return "", ""
}

func locateMapEntry(md protoreflect.MessageDescriptor, fd protoreflect.FieldDescriptor, key string, x any, path string) (string, string) {
	v := fd.MapValue()
	if k := v.Kind(); (k == protoreflect.MessageKind || k == protoreflect.GroupKind) && !isWellKnown(v.Message()) {
		return locate(x, v.Message(), path)
	}
	if why := leafError(md, fd, map[string]any{key: x}); why != "" {
		return path, why
	}
	return "", ""
}

func enumNames(ed protoreflect.EnumDescriptor) string {
	vals := ed.Values()
	names := make([]string, vals.Len())
	for i := range vals.Len() {
		names[i] = string(vals.Get(i).Name())
	}
	return strings.Join(names, ", ")
}

// isWellKnown reports whether md is a google.protobuf type with its own JSON
// form (Duration, Struct, wrappers...); Any is handled by locate.
func isWellKnown(md protoreflect.MessageDescriptor) bool {
	return strings.HasPrefix(string(md.FullName()), "google.protobuf.") && md.FullName() != "google.protobuf.Any"
}

// leafError decodes {field: x} into a fresh md and returns protojson's
// complaint, with the field named in proto spelling; "" when it decodes.
func leafError(md protoreflect.MessageDescriptor, fd protoreflect.FieldDescriptor, x any) string {
	mt, err := protoregistry.GlobalTypes.FindMessageByName(md.FullName())
	if err != nil {
		return ""
	}
	js, err := json.Marshal(map[string]any{fd.JSONName(): x})
	if err != nil {
		return ""
	}
	if err := protojson.Unmarshal(js, mt.New().Interface()); err != nil {
		why := protojsonReason(err)
		why = strings.ReplaceAll(why, "field "+fd.JSONName()+":", "field "+string(fd.Name())+":")
		if fd.Kind() == protoreflect.MessageKind { // a wrapper names its own field, "value"
			why = strings.ReplaceAll(why, "field value:", "field "+string(fd.Name())+":")
		}
		return why
	}
	return ""
}

// walk visits every set message field of m, unpacking Any values, and
// records the messages the tokengate checks need. raw is the decoded YAML of
// m (nil when unknown), used to tell a field set to its default from an
// absent one.
func (u *unit) walk(m protoreflect.Message, raw any, path string) {
	rawMap, _ := raw.(map[string]any)
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			u.add(Error, path, RuleDecode, "cannot unpack %s: %v", a.GetTypeUrl(), err)
			return
		}
		u.constraints(inner, path)
		u.walk(inner.ProtoReflect(), raw, path)
		return
	}
	switch x := m.Interface().(type) {
	case *extprocv3.ExternalProcessor:
		u.extProcs = append(u.extProcs, extProcAt{path, x, rawMap})
	case *extprocv3.ExtProcPerRoute:
		u.perRoutes = append(u.perRoutes, perRouteAt{path, x})
	case *rlfilterv3.RateLimit:
		u.rateLimits = append(u.rateLimits, rateLimitAt{path, x, rawMap})
	case *rlfilterv3.RateLimitPerRoute:
		u.rlPerRoutes = append(u.rlPerRoutes, rlPerRouteAt{path, x})
	case *hcmv3.HttpConnectionManager:
		u.hcms = append(u.hcms, hcmAt{path, x})
	case *routev3.RouteConfiguration:
		u.routeCfgs = append(u.routeCfgs, routeCfgAt{path, x})
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
				u.walk(list.Get(i).Message(), r, indexPath(p, i))
			}
		case fd.IsMap():
			if k := fd.MapValue().Kind(); k != protoreflect.MessageKind && k != protoreflect.GroupKind {
				return true
			}
			rawM, _ := rawChild.(map[string]any)
			val.Map().Range(func(k protoreflect.MapKey, e protoreflect.Value) bool {
				key := k.String()
				u.walk(e.Message(), rawM[key], keyPath(p, key))
				return true
			})
		default:
			u.walk(val.Message(), rawChild, p)
		}
		return true
	})
}

// grpcMetadataPolicies records the policy names a list of gRPC initial
// metadata carries.
func (u *unit) grpcMetadataPolicies(md []*corev3.HeaderValue, path string) {
	for i, h := range md {
		v := h.GetValue()
		field := "value"
		if v == "" && len(h.GetRawValue()) > 0 {
			v, field = string(h.GetRawValue()), "raw_value"
		}
		u.policies = append(u.policies, policyAt{joinPath(indexPath(path, i), field), strings.ToLower(h.GetKey()), v})
	}
}
