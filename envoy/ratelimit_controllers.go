package envoy

import (
	"fmt"
	"sort"
	"strings"
)

// The configuration controllers turn into Envoy's rate-limit filter, or
// into their own calls of a rate-limit service (docs/envoy-ratelimit.md
// §4, §5): Envoy Gateway's BackendTrafficPolicy, Envoy AI Gateway's
// QuotaPolicy, and agentgateway's remoteRateLimit policies. Each is checked
// against its own schema (unknown keys and enum values are errors, as the
// API server or agentgateway makes them) and for what matters to tokengate.

// Envoy Gateway's rate-limit rule schema (api/v1alpha1/ratelimit_types.go),
// shared with AI Gateway's QuotaPolicy bucket rules.
var (
	egSelector = obj(map[string]*schema{
		"headers": listOf(obj(map[string]*schema{
			"type": oneOf("Exact", "RegularExpression", "Distinct"), "name": aString, "value": aString, "invert": aBool,
		})),
		"methods": listOf(obj(map[string]*schema{"value": aString, "invert": aBool})),
		"path": obj(map[string]*schema{
			"type": oneOf("Exact", "PathPrefix", "RegularExpression"), "value": aString, "invert": aBool,
		}),
		"sourceCIDR": obj(map[string]*schema{"type": oneOf("Exact", "Distinct"), "value": aString, "invert": aBool}),
		"queryParams": listOf(obj(map[string]*schema{
			"type": oneOf("Exact", "RegularExpression", "Distinct"), "name": aString, "value": aString, "invert": aBool,
		})),
	})
	egCost = obj(map[string]*schema{
		"from":     oneOf("Number", "Metadata"),
		"number":   anInt,
		"metadata": obj(map[string]*schema{"namespace": aString, "key": aString}),
	})
	egRule = obj(map[string]*schema{
		"clientSelectors": listOf(egSelector),
		"limit": obj(map[string]*schema{
			"requests": anInt, "unit": oneOf("Second", "Minute", "Hour", "Day", "Week", "Month", "Year"),
			"fromMetadata": obj(map[string]*schema{"namespace": aString, "key": aString}),
		}),
		"cost":              obj(map[string]*schema{"request": egCost, "response": egCost}),
		"shared":            aBool,
		"shadowMode":        aBool,
		"xRateLimitHeaders": oneOf("Off", "DraftVersion03"),
	})
	// backendTrafficPolicySchema checks spec.rateLimit; the policy's other
	// fields (retries, timeouts, load balancing...) are not tokengate's and
	// are left to the API server.
	backendTrafficPolicySchema = withTop(&schema{open: true, fields: map[string]*schema{
		"rateLimit": obj(map[string]*schema{
			"type":   oneOf("Global", "Local"),
			"global": obj(map[string]*schema{"rules": listOf(egRule)}),
			"local":  anything,
		}),
	}})
)

// backendTrafficPolicy checks an Envoy Gateway BackendTrafficPolicy's
// global rate limits: the schema, a cost that gives a number, and a
// response cost (charged at stream end) paired with a request cost of 0,
// which only checks the budget.
func (c *checker) backendTrafficPolicy(t *tree, doc map[string]any) {
	c.conform(t, RuleEnvoyGatewayCRD, "", doc, backendTrafficPolicySchema)
	spec, _ := doc["spec"].(map[string]any)
	rl, _ := spec["rateLimit"].(map[string]any)
	u := c.unit(t, "")
	if local, _ := rl["local"].(map[string]any); local != nil {
		rules, _ := local["rules"].([]any)
		for i, r := range rules {
			rule, _ := r.(map[string]any)
			if cost, _ := rule["cost"].(map[string]any); cost["response"] != nil {
				u.add(Error, indexPath("spec.rateLimit.local.rules", i)+".cost.response", RuleEnvoyGatewayCRD,
					"Envoy Gateway rejects a response cost in a local rate limit: only a global one calls the rate-limit service at stream end")
			}
		}
	}
	global, _ := rl["global"].(map[string]any)
	rules, _ := global["rules"].([]any)
	for i, r := range rules {
		rule, _ := r.(map[string]any)
		base := indexPath("spec.rateLimit.global.rules", i)
		cost, _ := rule["cost"].(map[string]any)
		for _, dir := range []string{"request", "response"} {
			if spec, ok := cost[dir].(map[string]any); ok {
				c.costSpecifier(u, joinPath(base, "cost."+dir), spec)
			}
		}
		if cost["response"] != nil && cost["request"] == nil {
			u.add(Warning, joinPath(base, "cost"), RuleRLSRequestCost,
				"a response cost without a request cost: on the request path Envoy Gateway sends the descriptor "+
					"without hits_addend, so every request also costs 1 (docs/envoy-ratelimit.md §3.3); set "+
					"request: {from: Number, number: 0} to only check the budget before the response's cost is charged")
		}
	}
}

// costSpecifier checks one cost: from Number with number, from Metadata
// with metadata, not both (Envoy Gateway's CEL rules).
func (c *checker) costSpecifier(u *unit, path string, spec map[string]any) {
	from, _ := spec["from"].(string)
	_, hasNumber := spec["number"]
	_, hasMetadata := spec["metadata"]
	switch {
	case hasNumber && hasMetadata:
		u.add(Error, path, RuleEnvoyGatewayCRD, "only one of number or metadata can be specified")
	case from == "Number" && !hasNumber:
		u.add(Error, joinPath(path, "number"), RuleEnvoyGatewayCRD, "from: Number needs number (0 only checks the budget)")
	case from == "Number" && hasMetadata:
		u.add(Error, joinPath(path, "metadata"), RuleEnvoyGatewayCRD, "from: Number takes number, not metadata")
	case from == "Metadata" && !hasMetadata:
		u.add(Error, joinPath(path, "metadata"), RuleEnvoyGatewayCRD,
			"from: Metadata needs metadata {namespace, key}, e.g. {namespace: io.envoy.ai_gateway, key: llm_total_token}")
	case from == "Metadata" && hasNumber:
		u.add(Error, joinPath(path, "number"), RuleEnvoyGatewayCRD, "from: Metadata takes metadata, not number")
	}
}

// Envoy AI Gateway's QuotaPolicy (api/v1alpha1/quota_policy.go).
var (
	aigwQuotaValue    = obj(map[string]*schema{"limit": anInt, "duration": oneOf("1s", "1m", "1h", "1d")})
	quotaPolicySchema = withTop(obj(map[string]*schema{
		"targetRefs":   listOf(obj(map[string]*schema{"group": aString, "kind": aString, "name": aString})),
		"serviceQuota": obj(map[string]*schema{"costExpression": aString, "quota": aigwQuotaValue}),
		"perModelQuotas": listOf(obj(map[string]*schema{
			"modelName": aString,
			"quota": obj(map[string]*schema{
				"costExpression": aString,
				"mode":           oneOf("Shared"),
				"defaultBucket":  aigwQuotaValue,
				"bucketRules": listOf(obj(map[string]*schema{
					"clientSelectors": listOf(egSelector), "quota": aigwQuotaValue, "shadowMode": aBool,
				})),
			}),
		})),
	}))
)

// quotaPolicy checks an Envoy AI Gateway QuotaPolicy: its schema and the
// fields it requires.
func (c *checker) quotaPolicy(t *tree, doc map[string]any) {
	c.conform(t, RuleAIGatewayCRD, "", doc, quotaPolicySchema)
	u := c.unit(t, "")
	spec, _ := doc["spec"].(map[string]any)
	quota := func(path string, v any) {
		q, ok := v.(map[string]any)
		if !ok {
			u.add(Error, path, RuleAIGatewayCRD, "is required: {limit, duration}")
			return
		}
		for _, f := range []string{"limit", "duration"} {
			if q[f] == nil {
				u.add(Error, joinPath(path, f), RuleAIGatewayCRD, "is required")
			}
		}
	}
	if sq, ok := spec["serviceQuota"].(map[string]any); ok {
		quota("spec.serviceQuota.quota", sq["quota"])
	}
	models, _ := spec["perModelQuotas"].([]any)
	for i, m := range models {
		pm, _ := m.(map[string]any)
		base := indexPath("spec.perModelQuotas", i)
		if name, _ := pm["modelName"].(string); name == "" {
			u.add(Error, joinPath(base, "modelName"), RuleAIGatewayCRD,
				"is required: the model name override of the AIGatewayRoute backendRef the quota applies to")
		}
		q, ok := pm["quota"].(map[string]any)
		if !ok {
			u.add(Error, joinPath(base, "quota"), RuleAIGatewayCRD, "is required")
			continue
		}
		quota(joinPath(base, "quota.defaultBucket"), q["defaultBucket"])
		rules, _ := q["bucketRules"].([]any)
		for j, r := range rules {
			br, _ := r.(map[string]any)
			quota(indexPath(joinPath(base, "quota.bucketRules"), j)+".quota", br["quota"])
		}
	}
}

// agentgateway's remoteRateLimit policy (schema/config.json).
var (
	agwDescriptor = obj(map[string]*schema{
		"entries":       listOf(obj(map[string]*schema{"key": aString, "value": aString})),
		"type":          oneOf("requests", "tokens"),
		"cost":          aString,
		"limitOverride": aString,
	})
	agwRemoteRateLimitFields = map[string]*schema{
		"domain":      aString,
		"descriptors": listOf(agwDescriptor),
		"failureMode": oneOf("failClosed", "FailClosed", "failOpen", "FailOpen"),
		"policies":    anything,
		"service":     obj(map[string]*schema{"name": anything, "port": anInt}),
		"host":        aString,
		"backend":     aString,
	}
	agwRemoteRateLimit = obj(agwRemoteRateLimitFields)
)

// isAgentgateway reports an agentgateway configuration file: its binds (or
// gateways) hold listeners, routes and their policies.
func isAgentgateway(doc map[string]any) bool {
	_, binds := doc["binds"].([]any)
	return binds
}

// agentgateway checks every remoteRateLimit policy of an agentgateway
// configuration, wherever it stands; the rest of the file is
// agentgateway's own.
func (c *checker) agentgateway(t *tree, doc map[string]any) {
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch x := v.(type) {
		case map[string]any:
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				p := joinPath(path, k)
				if k == "remoteRateLimit" {
					c.remoteRateLimit(t, p, x[k])
					continue
				}
				walk(p, x[k])
			}
		case []any:
			for i, e := range x {
				walk(indexPath(path, i), e)
			}
		}
	}
	walk("", doc)
}

// remoteRateLimit checks one policy, or each entry of a conditional one:
// a domain, descriptors with entries, exactly one of service, host and
// backend, and a failure mode stated (agentgateway fails closed by
// default).
func (c *checker) remoteRateLimit(t *tree, path string, v any) {
	u := c.unit(t, "")
	if m, ok := v.(map[string]any); ok && m["conditional"] != nil {
		entries, ok := m["conditional"].([]any)
		if !ok || len(m) != 1 {
			u.add(Error, path, RuleAgentgateway, "a conditional remoteRateLimit holds conditional: [...] and nothing else")
			return
		}
		fields := map[string]*schema{"condition": aString}
		for k, s := range agwRemoteRateLimitFields {
			fields[k] = s
		}
		for i, e := range entries {
			c.conform(t, RuleAgentgateway, indexPath(joinPath(path, "conditional"), i), e, obj(fields))
			c.remoteRateLimitFields(u, indexPath(joinPath(path, "conditional"), i), e)
		}
		return
	}
	c.conform(t, RuleAgentgateway, path, v, agwRemoteRateLimit)
	c.remoteRateLimitFields(u, path, v)
}

func (c *checker) remoteRateLimitFields(u *unit, path string, v any) {
	m, ok := v.(map[string]any)
	if !ok {
		return // conform reported it
	}
	if d, _ := m["domain"].(string); d == "" {
		u.add(Error, joinPath(path, "domain"), RuleAgentgateway, "is required: the domain the rate-limit service maps")
	} else {
		u.domains = append(u.domains, domainAt{joinPath(path, "domain"), d})
	}
	descs, _ := m["descriptors"].([]any)
	if len(descs) == 0 {
		u.add(Error, joinPath(path, "descriptors"), RuleAgentgateway, "at least one descriptor is required")
	}
	for i, d := range descs {
		dm, _ := d.(map[string]any)
		entries, _ := dm["entries"].([]any)
		if len(entries) == 0 {
			u.add(Error, indexPath(joinPath(path, "descriptors"), i)+".entries", RuleAgentgateway, "is required: the descriptor's key/value entries")
		}
		for j, e := range entries {
			em, _ := e.(map[string]any)
			for _, f := range []string{"key", "value"} {
				if s, _ := em[f].(string); s == "" {
					u.add(Error, fmt.Sprintf("%s.descriptors[%d].entries[%d].%s", path, i, j, f), RuleAgentgateway, "is required")
				}
			}
		}
	}
	var targets []string
	for _, k := range []string{"service", "host", "backend"} {
		if m[k] != nil {
			targets = append(targets, k)
		}
	}
	if len(targets) != 1 {
		got := "none"
		if len(targets) > 0 {
			got = strings.Join(targets, " and ")
		}
		u.add(Error, path, RuleAgentgateway, "set exactly one of service, host and backend (where tokengate's rate-limit service is); got %s", got)
	}
	if m["failureMode"] == nil {
		u.add(Warning, joinPath(path, "failureMode"), RuleRLSFailureMode,
			"failureMode is not stated: agentgateway then fails closed, answering 500 to every request while "+
				"tokengate is unreachable; state failClosed (strict metering) or failOpen (pass traffic unmetered) "+
				"so the choice is deliberate")
	}
	u.checkDomains()
}
