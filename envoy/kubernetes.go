package envoy

import (
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/proto"
)

// Kubernetes manifests are told from Envoy documents (and from tokengate's
// configuration) by their apiVersion and kind. Two kinds carry Envoy
// configuration that Validate checks:
//
//   - Istio's EnvoyFilter (networking.istio.io): each configPatches[].patch.value
//     is a piece of Envoy configuration whose type follows from applyTo
//     (HTTP_FILTER → HttpFilter, CLUSTER → Cluster, ...). A MERGE value is
//     partial: fields it leaves out come from what Istio generates.
//   - Envoy Gateway's EnvoyExtensionPolicy (gateway.envoyproxy.io): each
//     spec.extProc[] entry stands for the ext_proc filter Envoy Gateway
//     generates from it; that filter is checked, and problems are reported
//     at the CRD fields that produce them.
//
// Every other kind (ServiceEntry, Backend, HTTPRoute, ...) is recognised
// and left alone.

func isManifest(doc map[string]any) bool {
	av, _ := doc["apiVersion"].(string)
	k, _ := doc["kind"].(string)
	return av != "" && k != ""
}

func (c *checker) manifest(t *tree, doc map[string]any) {
	apiVersion, _ := doc["apiVersion"].(string)
	kind, _ := doc["kind"].(string)
	group, _, _ := strings.Cut(apiVersion, "/")
	label := kind
	if md, ok := doc["metadata"].(map[string]any); ok {
		if name, ok := md["name"].(string); ok && name != "" {
			label += " " + name
		}
	}
	switch {
	case group == "networking.istio.io" && kind == "EnvoyFilter":
		c.report.Checked = append(c.report.Checked, label)
		c.envoyFilter(t, doc)
	case group == "gateway.envoyproxy.io" && kind == "EnvoyExtensionPolicy":
		c.report.Checked = append(c.report.Checked, label)
		c.extensionPolicy(t, doc)
	case group == "gateway.envoyproxy.io" && kind == "BackendTrafficPolicy":
		c.report.Checked = append(c.report.Checked, label)
		c.backendTrafficPolicy(t, doc)
	case group == "aigateway.envoyproxy.io" && kind == "QuotaPolicy":
		c.report.Checked = append(c.report.Checked, label)
		c.quotaPolicy(t, doc)
	default:
		c.report.Skipped = append(c.report.Skipped, label)
	}
}

// schema is the part of a Kubernetes resource's schema that Validate
// enforces: unknown keys and enum values are errors, as the API server's
// structural schema makes them.
type schema struct {
	fields map[string]*schema // a mapping with these keys
	open   bool               // ... and any other key, left unchecked
	list   *schema            // a list of these
	enum   []string           // a string, one of these
	kind   string             // a scalar: "string", "bool", "int"; "" means anything
}

var anything = &schema{}

func (c *checker) conform(t *tree, rule, path string, v any, s *schema) {
	u := c.unit(t, "")
	switch {
	case s.fields != nil:
		m, ok := v.(map[string]any)
		if !ok {
			if v != nil {
				u.add(Error, path, rule, "want a mapping, got %s", jsonKind(v))
			}
			return
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			sub, ok := s.fields[k]
			p := joinPath(path, k)
			if !ok && s.open {
				continue
			}
			if !ok {
				known := make([]string, 0, len(s.fields))
				for f := range s.fields {
					known = append(known, f)
				}
				slices.Sort(known)
				who := "the API server"
				if rule == RuleAgentgateway {
					who = "agentgateway"
				}
				u.add(Error, p, rule, "unknown field %q; %s rejects it (known: %s)", k, who, strings.Join(known, ", "))
				continue
			}
			c.conform(t, rule, p, m[k], sub)
		}
	case s.list != nil:
		l, ok := v.([]any)
		if !ok {
			if v != nil {
				u.add(Error, path, rule, "want a list, got %s", jsonKind(v))
			}
			return
		}
		for i, e := range l {
			c.conform(t, rule, indexPath(path, i), e, s.list)
		}
	case s.enum != nil:
		str, ok := v.(string)
		if !ok || !slices.Contains(s.enum, str) {
			u.add(Error, path, rule, "%s is not one of %s", display(v), strings.Join(s.enum, ", "))
		}
	case s.kind == "string":
		if _, ok := v.(string); !ok && v != nil {
			u.add(Error, path, rule, "want a string, got %s", jsonKind(v))
		}
	case s.kind == "bool":
		if _, ok := v.(bool); !ok && v != nil {
			u.add(Error, path, rule, "want true or false, got %s", jsonKind(v))
		}
	case s.kind == "duration":
		d, ok := v.(string)
		if _, err := time.ParseDuration(d); v != nil && (!ok || !gatewayDuration.MatchString(d) || err != nil) {
			u.add(Error, path, rule, "%s is not a Gateway API duration (e.g. 10s, 1m30s, 500ms)", display(v))
		}
	case s.kind == "int":
		if n, ok := v.(json.Number); !ok || strings.ContainsAny(string(n), ".eE") {
			if v != nil {
				u.add(Error, path, rule, "want an integer, got %s", jsonKind(v))
			}
		}
	}
}

func display(v any) string {
	if s, ok := v.(string); ok {
		return strconv.Quote(s)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return jsonKind(v)
	}
	return string(b)
}

func obj(fields map[string]*schema) *schema { return &schema{fields: fields} }
func listOf(s *schema) *schema              { return &schema{list: s} }
func oneOf(values ...string) *schema        { return &schema{enum: values} }

var (
	aString   = &schema{kind: "string"}
	aDuration = &schema{kind: "duration"}
	aBool     = &schema{kind: "bool"}
	anInt     = &schema{kind: "int"}
)

// manifestTop is what every Kubernetes resource may have besides spec.
var manifestTop = map[string]*schema{"apiVersion": aString, "kind": aString, "metadata": anything, "status": anything}

func withTop(spec *schema) *schema {
	m := map[string]*schema{"spec": spec}
	for k, v := range manifestTop {
		m[k] = v
	}
	return obj(m)
}

// Istio EnvoyFilter (networking.istio.io/v1alpha3).

// istioApplyTo maps applyTo to the Envoy type of the patch value.
var istioApplyTo = map[string]func() proto.Message{
	"LISTENER":            func() proto.Message { return &listenerv3.Listener{} },
	"FILTER_CHAIN":        func() proto.Message { return &listenerv3.FilterChain{} },
	"NETWORK_FILTER":      func() proto.Message { return &listenerv3.Filter{} },
	"HTTP_FILTER":         func() proto.Message { return &hcmv3.HttpFilter{} },
	"ROUTE_CONFIGURATION": func() proto.Message { return &routev3.RouteConfiguration{} },
	"VIRTUAL_HOST":        func() proto.Message { return &routev3.VirtualHost{} },
	"HTTP_ROUTE":          func() proto.Message { return &routev3.Route{} },
	"CLUSTER":             func() proto.Message { return &clusterv3.Cluster{} },
	"EXTENSION_CONFIG":    func() proto.Message { return &corev3.TypedExtensionConfig{} },
	"BOOTSTRAP":           func() proto.Message { return &bootstrapv3.Bootstrap{} },
	"LISTENER_FILTER":     func() proto.Message { return &listenerv3.ListenerFilter{} },
}

var istioOperations = []string{"MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE"}

var envoyFilterSchema = func() *schema {
	applyTo := make([]string, 0, len(istioApplyTo))
	for k := range istioApplyTo {
		applyTo = append(applyTo, k)
	}
	slices.Sort(applyTo)
	return withTop(obj(map[string]*schema{
		"workloadSelector": anything,
		"targetRefs":       anything,
		"priority":         anInt,
		"configPatches": listOf(obj(map[string]*schema{
			"applyTo": oneOf(applyTo...),
			"match":   anything,
			"patch": obj(map[string]*schema{
				"operation":   oneOf(istioOperations...),
				"value":       anything,
				"filterClass": oneOf("UNSPECIFIED", "AUTHN", "AUTHZ", "STATS"),
			}),
		})),
	}))
}()

func (c *checker) envoyFilter(t *tree, doc map[string]any) {
	c.conform(t, RuleIstio, "", doc, envoyFilterSchema)
	spec, _ := doc["spec"].(map[string]any)
	patches, _ := spec["configPatches"].([]any)
	for i, p := range patches {
		cp, _ := p.(map[string]any)
		path := indexPath("spec.configPatches", i)
		applyTo, _ := cp["applyTo"].(string)
		newMsg, ok := istioApplyTo[applyTo]
		if !ok {
			continue // conform reported it
		}
		patch, _ := cp["patch"].(map[string]any)
		op, _ := patch["operation"].(string)
		if op == "REMOVE" {
			continue
		}
		u := c.unit(t, joinPath(path, "patch.value"))
		value, ok := patch["value"].(map[string]any)
		if !ok {
			if patch["value"] == nil {
				u.add(Error, "", RuleIstio, "value is missing: operation %s needs one (a %s)", op, applyTo)
			} else {
				u.add(Error, "", RuleIstio, "the patch value must be a mapping (a %s), not %s", applyTo, jsonKind(patch["value"]))
			}
			continue
		}
		u.partial = op == "MERGE"
		msg := newMsg()
		u.run(value, msg)
		if applyTo == "HTTP_FILTER" {
			c.istioFilterPlace(t, path, cp, op, msg.(*hcmv3.HttpFilter))
		}
	}
}

// istioFilterPlace checks where an HTTP_FILTER patch puts its filter: ADD,
// INSERT_AFTER without a sub-filter, and INSERT_AFTER the router all append
// it after the router, which Envoy rejects; REPLACE of the router removes it.
func (c *checker) istioFilterPlace(t *tree, path string, cp map[string]any, op string, f *hcmv3.HttpFilter) {
	sub := subFilterName(cp)
	u := c.unit(t, path)
	what := fmt.Sprintf("filter %q", f.GetName())
	rule := RuleRouterLast
	if isExtProc(f) {
		what, rule = fmt.Sprintf("the ext_proc filter %q", f.GetName()), RuleExtProcOrder
	}
	after := ""
	switch {
	case op == "ADD":
		after = "ADD appends it to http_filters"
	case op == "INSERT_AFTER" && sub == "":
		after = "INSERT_AFTER without match.listener.filterChain.filter.subFilter appends it to http_filters"
	case op == "INSERT_AFTER" && sub == RouterFilterName:
		after = "INSERT_AFTER " + RouterFilterName + " puts it after the router"
	case op == "REPLACE" && sub == RouterFilterName && !isRouter(f):
		u.add(Error, "patch.operation", RuleRouterLast,
			"REPLACE of %s removes the router: Envoy rejects a chain without a terminal filter, and nothing "+
				"would forward requests; use INSERT_BEFORE", RouterFilterName)
		return
	}
	if after == "" {
		return
	}
	u.add(Error, "patch.operation", rule,
		"%s: %s, after Istio's router, and Envoy rejects a filter after the router; use INSERT_BEFORE "+
			"with subFilter %s", what, after, RouterFilterName)
}

func subFilterName(cp map[string]any) string {
	v := any(cp)
	for _, k := range []string{"match", "listener", "filterChain", "filter", "subFilter", "name"} {
		m, ok := v.(map[string]any)
		if !ok {
			return ""
		}
		v = m[k]
	}
	s, _ := v.(string)
	return s
}

// Envoy Gateway EnvoyExtensionPolicy (gateway.envoyproxy.io/v1alpha1).

// egBodyModes maps the CRD's body modes onto Envoy's.
var egBodyModes = map[string]string{
	"Streamed":           "STREAMED",
	"Buffered":           "BUFFERED",
	"BufferedPartial":    "BUFFERED_PARTIAL",
	"FullDuplexStreamed": "FULL_DUPLEX_STREAMED",
}

var extensionPolicySchema = func() *schema {
	direction := obj(map[string]*schema{
		"body":       oneOf("Streamed", "Buffered", "BufferedPartial", "FullDuplexStreamed"),
		"attributes": listOf(aString),
	})
	return withTop(obj(map[string]*schema{
		"targetRef":       anything,
		"targetRefs":      anything,
		"targetSelectors": anything,
		"mergeType":       anything,
		"wasm":            anything,
		"lua":             anything,
		"dynamicModule":   anything,
		"extProc": listOf(obj(map[string]*schema{
			"backendRef":      anything,
			"backendRefs":     anything,
			"backendSettings": anything,
			"messageTimeout":  aDuration,
			"failOpen":        aBool,
			"shadowMode":      aBool,
			"statusOnError":   anInt,
			"processingMode": obj(map[string]*schema{
				"request":           direction,
				"response":          direction,
				"allowModeOverride": aBool,
			}),
			"metadata": obj(map[string]*schema{
				"accessibleNamespaces": listOf(aString),
				"writableNamespaces":   listOf(aString),
			}),
		})),
	}))
}()

// gatewayDuration is Gateway API's duration format.
var gatewayDuration = regexp.MustCompile(`^([0-9]{1,5}(h|m|s|ms)){1,4}$`)

func (c *checker) extensionPolicy(t *tree, doc map[string]any) {
	c.conform(t, RuleEnvoyGatewayCRD, "", doc, extensionPolicySchema)
	spec, _ := doc["spec"].(map[string]any)
	entries, _ := spec["extProc"].([]any)
	for i, e := range entries {
		ep, ok := e.(map[string]any)
		if !ok {
			continue // conform reported it
		}
		base := indexPath("spec.extProc", i)
		if c.reported(base) {
			continue // the CRD would not be accepted; its translation would only repeat that
		}
		filter, ok := c.egFilter(t, base, ep)
		if !ok {
			continue
		}
		u := c.unit(t, "")
		u.display = egDisplay(base)
		u.run(filter, &hcmv3.HttpFilter{})
	}
}

// reported reports whether a problem was found at path or below it.
func (c *checker) reported(path string) bool {
	for _, p := range c.report.Problems {
		if p.Path == path || strings.HasPrefix(p.Path, path+".") || strings.HasPrefix(p.Path, path+"[") {
			return true
		}
	}
	return false
}

// egFilter builds the ext_proc HTTP filter Envoy Gateway generates for one
// extProc entry (internal/xds/translator/extproc.go): a direction's headers
// are sent exactly when processingMode names the direction, its trailers
// only for FullDuplexStreamed, every other mode is off; failure_mode_allow
// is stated when failOpen is. It reports the CRD rules Envoy Gateway
// enforces itself and returns false if the entry cannot be translated.
func (c *checker) egFilter(t *tree, base string, ep map[string]any) (map[string]any, bool) {
	u := c.unit(t, base)
	pm := map[string]any{
		"request_header_mode": "SKIP", "response_header_mode": "SKIP",
		"request_body_mode": "NONE", "response_body_mode": "NONE",
		"request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
	}
	cfg := map[string]any{
		"@type":           "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
		"grpc_service":    map[string]any{"envoy_grpc": map[string]any{"cluster_name": "extproc"}},
		"processing_mode": pm,
	}
	ok := true
	duplex := false
	mode, _ := ep["processingMode"].(map[string]any)
	for _, dir := range []string{"request", "response"} {
		o, present := mode[dir].(map[string]any)
		if !present {
			continue
		}
		pm[dir+"_header_mode"] = "SEND"
		body, _ := o["body"].(string)
		if body == "" {
			continue
		}
		m, known := egBodyModes[body]
		if !known {
			ok = false // conform reported it
			continue
		}
		pm[dir+"_body_mode"] = m
		if m == "FULL_DUPLEX_STREAMED" {
			pm[dir+"_trailer_mode"] = "SEND"
			duplex = true
		}
	}
	if a, isBool := mode["allowModeOverride"].(bool); isBool {
		cfg["allow_mode_override"] = a
	}
	if fo, isBool := ep["failOpen"].(bool); isBool {
		cfg["failure_mode_allow"] = fo
		if fo && duplex {
			u.add(Error, "failOpen", RuleEnvoyGatewayCRD,
				"Envoy Gateway refuses failOpen: true with a FullDuplexStreamed body; set failOpen: false")
		}
	}
	if d, isString := ep["messageTimeout"].(string); isString {
		if dur, err := time.ParseDuration(d); err == nil { // conform checked the format
			cfg["message_timeout"] = strconv.FormatFloat(dur.Seconds(), 'f', -1, 64) + "s"
		}
	}
	if s, isBool := ep["shadowMode"].(bool); isBool {
		cfg["observability_mode"] = s
	}
	if md, isMap := ep["metadata"].(map[string]any); isMap {
		mo := map[string]any{}
		if ns, has := md["accessibleNamespaces"]; has {
			mo["forwarding_namespaces"] = map[string]any{"untyped": ns}
		}
		if ns, has := md["writableNamespaces"]; has {
			mo["receiving_namespaces"] = map[string]any{"untyped": ns}
		}
		cfg["metadata_options"] = mo
	}
	if code, isNum := ep["statusOnError"].(json.Number); isNum {
		cfg["status_on_error"] = map[string]any{"code": code}
	}
	return map[string]any{"name": ExtProcFilterName, "typed_config": cfg}, ok
}

// egFields maps paths of the generated filter to the CRD fields that set
// them, most specific first.
var egFields = []struct{ envoy, crd string }{
	{"typed_config.processing_mode.request_header_mode", "processingMode.request"},
	{"typed_config.processing_mode.request_body_mode", "processingMode.request.body"},
	{"typed_config.processing_mode.request_trailer_mode", "processingMode.request.body"},
	{"typed_config.processing_mode.response_header_mode", "processingMode.response"},
	{"typed_config.processing_mode.response_body_mode", "processingMode.response.body"},
	{"typed_config.processing_mode.response_trailer_mode", "processingMode.response.body"},
	{"typed_config.processing_mode", "processingMode"},
	{"typed_config.allow_mode_override", "processingMode.allowModeOverride"},
	{"typed_config.failure_mode_allow", "failOpen"},
	{"typed_config.message_timeout", "messageTimeout"},
	{"typed_config.observability_mode", "shadowMode"},
	{"typed_config.metadata_options.receiving_namespaces", "metadata.writableNamespaces"},
	{"typed_config.metadata_options.forwarding_namespaces", "metadata.accessibleNamespaces"},
	{"typed_config.metadata_options", "metadata"},
	{"typed_config.status_on_error", "statusOnError"},
	{"typed_config.grpc_service", "backendRefs"},
}

// egDisplay names, for a path of the generated filter, the CRD field of
// entry base that sets it.
func egDisplay(base string) func(string) string {
	return func(path string) string {
		for _, f := range egFields {
			if path == f.envoy || strings.HasPrefix(path, f.envoy+".") || strings.HasPrefix(path, f.envoy+"[") {
				return joinPath(base, f.crd)
			}
		}
		return base
	}
}
