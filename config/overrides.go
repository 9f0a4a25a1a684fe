package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"regexp"
	"slices"
	"strings"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/internal/identity"
	"github.com/tokengate/tokengate/pricing"
)

// Limits are values that replace a rule's own for one identity (an
// override) or for the requests of one tier. Each field applies to the rule
// of that name that takes it: tokens_per_minute and burst to a bucket (they
// replace its whole limit, as a bucket's own tokens_per_minute and burst
// do), max to a concurrency limit, tokens to a quota of tokens and cost to
// a quota of money (each replaces the quota's budget per window). A zero
// field is unset: the rule keeps its own value for it. Limits are plain
// data; their JSON form (the admin API's) has the same keys as their YAML
// form, and DecodeLimits reads it.
type Limits struct {
	TokensPerMinute float64 `yaml:"tokens_per_minute" json:"tokens_per_minute,omitempty"`
	Burst           float64 `yaml:"burst" json:"burst,omitempty"`
	Max             int     `yaml:"max" json:"max,omitempty"`
	// Tokens is a quota's budget of tokens per window.
	Tokens int `yaml:"tokens" json:"tokens,omitempty"`
	// Cost is a quota's budget of money per window, a plain decimal in the
	// pricing currency ("2000", "49.95"), as a quota's own cost is written.
	Cost Amount `yaml:"cost" json:"cost,omitempty"`
}

// Amount is an amount of money written as a plain decimal in units of the
// pricing currency ("2000.50"), read exactly by pricing.ParseAmount. Its
// JSON form is a string; a JSON number is taken as the text it is written
// as, so {"cost": 2000} and {"cost": "2000"} are the same amount.
type Amount string

// UnmarshalJSON reads a JSON string, or a JSON number as written.
func (a *Amount) UnmarshalJSON(data []byte) error {
	if len(data) > 0 && data[0] == '"' {
		var s string
		if err := json.Unmarshal(data, &s); err != nil {
			return err
		}
		*a = Amount(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(data, &n); err != nil {
		return &json.UnmarshalTypeError{Value: jsonKind(data), Type: reflect.TypeOf(*a)}
	}
	*a = Amount(n)
	return nil
}

// jsonKind names the kind of a JSON value, as a type error does.
func jsonKind(data []byte) string {
	switch {
	case len(data) == 0:
		return "value"
	case data[0] == '{':
		return "object"
	case data[0] == '[':
		return "array"
	case data[0] == 't' || data[0] == 'f':
		return "bool"
	}
	return "value"
}

// SetsBucket reports whether l sets a bucket's limit.
func (l Limits) SetsBucket() bool { return l.TokensPerMinute != 0 || l.Burst != 0 }

// SetsQuota reports whether l sets a quota's budget.
func (l Limits) SetsQuota() bool { return l.Tokens != 0 || l.Cost != "" }

// Limit is the bucket limit l sets, in the store's terms (S1); the zero
// Limit when l sets none.
func (l Limits) Limit() buckets.Limit {
	if !l.SetsBucket() {
		return buckets.Limit{}
	}
	return buckets.PerMinute(l.TokensPerMinute, l.Burst)
}

// Budgets are the quota budgets l sets in the store's terms: tokens, and
// money in micro-units of the pricing currency; each 0 when l sets none.
// The error says why Cost is not an amount; for validated limits it is
// nil.
func (l Limits) Budgets() (tokens, money float64, err error) {
	if l.Cost != "" {
		m, err := pricing.ParseAmount(string(l.Cost))
		if err != nil {
			return 0, 0, err
		}
		money = float64(m)
	}
	return float64(l.Tokens), money, nil
}

// Override gives one identity limits of its own under one rule name of its
// policy: the identity whose value the rule's buckets and concurrency
// limits are keyed by (their per), or the model for a per-model rule.
type Override struct {
	Rule string `yaml:"rule"`
	// Identity is the value as requests carry it (a bearer prefix is
	// dropped). For an identity with hash: true, tokengate hashes it as it
	// hashes requests' values; the file then holds the raw value, so prefer
	// IdentityKey there.
	Identity string `yaml:"identity"`
	// IdentityKey is, for a hashed identity, its hashed form as `tokengate
	// limits get` prints it ("h." and 32 hex digits). Set exactly one of
	// Identity and IdentityKey.
	IdentityKey string `yaml:"identity_key"`
	Limits      `yaml:",inline"`
}

// TierSource says where a request's tier is found, as an identity is found
// (S9a): a request header set by an auth filter, or a dotted path in a
// namespace of Envoy's forwarded dynamic metadata (a JWT claim). Exactly
// one of Header and Metadata is set.
type TierSource struct {
	Header   string `yaml:"header"`
	Metadata string `yaml:"metadata"`
	Path     string `yaml:"path"`
}

// Tier is a named set of limits: requests whose tier value is Name get
// them. A request without a tier, or with a value no tier names, gets the
// rules' own limits; an identity's override beats its tier.
type Tier struct {
	Name   string       `yaml:"name"`
	Limits []RuleLimits `yaml:"limits"`
}

// RuleLimits are the limits a tier gives one rule name.
type RuleLimits struct {
	Rule   string `yaml:"rule"`
	Limits `yaml:",inline"`
}

// AdminAPI configures the admin API that listeners.admin serves besides
// /metrics and the health endpoints: /v1/limits and /v1/usage.
type AdminAPI struct {
	// TokenEnv names the environment variable holding the bearer token the
	// admin API requires. Empty disables the admin API.
	TokenEnv string `yaml:"token_env"`
}

// ErrUnknownTarget is the error of an override whose policy or rule the
// configuration does not define.
var ErrUnknownTarget = errors.New("no such policy or rule")

// OverrideTarget is what overrides of one rule name of a policy are keyed
// by.
type OverrideTarget struct {
	// Per is the identity whose values key the rule, or "model".
	Per string
	// Hash is true when that identity has hash: true: its values are
	// stored, and keyed, as digests only.
	Hash bool
}

// Key is the form an identity value given by an operator takes in store
// keys: exactly the form requests' values take (a model by any spelling
// of it, a credential with or without its bearer scheme, hashed when the
// identity is).
func (t OverrideTarget) Key(value string) string {
	if t.Per == "model" {
		return identity.ModelKey(value)
	}
	return identity.Key(value, t.Hash)
}

// OverrideTarget says what overrides of rule in policy are keyed by. The
// error wraps ErrUnknownTarget when the policy or rule is not defined, and
// says why otherwise (a global rule, the provider's bucket).
func (c *Config) OverrideTarget(policy, rule string) (OverrideTarget, error) {
	p, ok := c.Policy(policy)
	if !ok {
		return OverrideTarget{}, fmt.Errorf("%w: policy %q is not defined", ErrUnknownTarget, policy)
	}
	return overrideTarget(&p, rule)
}

// CheckOverride is the rule every override's limits follow, wherever they
// come from: the configuration file's overrides and tiers, and the admin
// API's PUT bodies. The error wraps ErrUnknownTarget when policy or rule is
// not defined; otherwise it is Problems naming each field of l that cannot
// apply.
func (c *Config) CheckOverride(policy, rule string, l Limits) error {
	p, ok := c.Policy(policy)
	if !ok {
		return fmt.Errorf("%w: policy %q is not defined", ErrUnknownTarget, policy)
	}
	if _, err := overrideTarget(&p, rule); err != nil {
		return err
	}
	v := &validator{file: "limits", lines: map[string]int{}}
	v.validateLimits("", &p, rule, l, false)
	if len(v.problems) > 0 {
		return v.problems
	}
	return nil
}

// maxLimitsBytes bounds the JSON form of Limits that DecodeLimits reads.
const maxLimitsBytes = 4 << 10

// DecodeLimits reads Limits from their JSON form (the admin API's PUT
// body) as strictly as the file is read: an unknown key, a value of the
// wrong type or anything after the object is a problem naming the field.
func DecodeLimits(data []byte) (Limits, error) {
	const file = "request body"
	if len(data) > maxLimitsBytes {
		return Limits{}, Problems{{File: file, Msg: fmt.Sprintf("is %d bytes; limits take at most %d", len(data), maxLimitsBytes)}}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var l Limits
	err := dec.Decode(&l)
	if err == nil {
		if _, extra := dec.Token(); extra != io.EOF {
			return Limits{}, Problems{{File: file, Msg: "holds more than one JSON object"}}
		}
		return l, nil
	}
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te) && te.Field == "":
		return Limits{}, Problems{{File: file, Msg: "is not a JSON object: got a JSON " + te.Value}}
	case errors.As(err, &te):
		return Limits{}, Problems{{File: file, Field: te.Field, Msg: fmt.Sprintf("want %s, got a JSON %s", want(fieldType(te.Field)), te.Value)}}
	case errors.As(err, &se), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return Limits{}, Problems{{File: file, Msg: "is not a JSON object: " + err.Error()}}
	}
	if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		return Limits{}, Problems{{File: file, Field: strings.Trim(name, `"`),
			Msg: fmt.Sprintf("unknown key %s (known: %s)", name, knownKeys(yamlFields(limitsType)))}}
	}
	return Limits{}, Problems{{File: file, Msg: err.Error()}}
}

var limitsType = reflect.TypeOf(Limits{})

func fieldType(name string) reflect.Type {
	if t, ok := yamlFields(limitsType)[name]; ok {
		return t
	}
	return reflect.TypeOf("")
}

// hashedKeyRE is the hashed form of an identity value in store keys.
var hashedKeyRE = regexp.MustCompile(`^h\.[0-9a-f]{32}$`)

// ValidIdentityKey reports whether s is an identity value in its hashed
// form, as store keys and `tokengate limits get` show it.
func ValidIdentityKey(s string) bool { return hashedKeyRE.MatchString(s) }

func (p *Policy) bucket(name string) *Bucket {
	if i := slices.IndexFunc(p.Buckets, func(b Bucket) bool { return b.Name == name }); i >= 0 {
		return &p.Buckets[i]
	}
	return nil
}

func (p *Policy) concurrency(name string) *Concurrency {
	if i := slices.IndexFunc(p.Concurrency, func(c Concurrency) bool { return c.Name == name }); i >= 0 {
		return &p.Concurrency[i]
	}
	return nil
}

func (p *Policy) quota(name string) *Quota {
	if i := slices.IndexFunc(p.Quotas, func(q Quota) bool { return q.Name == name }); i >= 0 {
		return &p.Quotas[i]
	}
	return nil
}

// overrideTarget finds what overrides of rule are keyed by, or says why
// the rule has none. A rule name may be a bucket's or a quota's (never
// both) and a concurrency limit's.
func overrideTarget(p *Policy, rule string) (OverrideTarget, error) {
	b, c, q := p.bucket(rule), p.concurrency(rule), p.quota(rule)
	var pers []string
	var kinds []string
	if b != nil {
		pers, kinds = append(pers, b.Per), append(kinds, "bucket")
	}
	if q != nil {
		pers, kinds = append(pers, q.Per), append(kinds, "quota")
	}
	if c != nil {
		pers, kinds = append(pers, c.Per), append(kinds, "concurrency limit")
	}
	switch {
	case len(pers) == 0:
		return OverrideTarget{}, fmt.Errorf("%w: policy %q has no bucket, quota or concurrency limit named %q", ErrUnknownTarget, p.Name, rule)
	case b != nil && b.ProviderLimit != nil:
		return OverrideTarget{}, fmt.Errorf("bucket %q stands for the provider account, which every identity shares; it has no limits per identity", rule)
	case len(pers) == 2 && pers[0] != pers[1]:
		return OverrideTarget{}, fmt.Errorf("%s %q is per %q and the %s of that name per %q: an override would key them by different identities (give them different names)",
			kinds[0], rule, pers[0], kinds[1], pers[1])
	}
	per := pers[0]
	if per == "" {
		return OverrideTarget{}, fmt.Errorf("%q is global (one limit for every request): change its limit in the configuration file", rule)
	}
	t := OverrideTarget{Per: per}
	for _, id := range p.Identities {
		if id.Name == per {
			t.Hash = id.Hash
		}
	}
	return t, nil
}

// validateLimits checks limits l given to rule of policy p, by an override
// or (tier) by a tier; path is where l sits ("" for the admin API). The
// rule itself was found by overrideTarget.
func (v *validator) validateLimits(path string, p *Policy, rule string, l Limits, tier bool) {
	b, c, q := p.bucket(rule), p.concurrency(rule), p.quota(rule)
	if !l.SetsBucket() && l.Max == 0 && !l.SetsQuota() {
		var want []string
		if b != nil {
			want = append(want, fmt.Sprintf("tokens_per_minute (and burst) for bucket %q", rule))
		}
		if q != nil && q.Cost != "" {
			want = append(want, fmt.Sprintf("cost for quota %q", rule))
		} else if q != nil {
			want = append(want, fmt.Sprintf("tokens for quota %q", rule))
		}
		if c != nil {
			want = append(want, fmt.Sprintf("max for concurrency limit %q", rule))
		}
		v.add(path, "sets no limit: give %s", strings.Join(want, ", or "))
		return
	}
	if tier && ((b != nil && b.Per == perModel) || (c != nil && c.Per == perModel) || (q != nil && q.Per == perModel)) {
		v.add(join(path, "rule"), "%q is per model, which every identity shares: a tier cannot change it", rule)
		return
	}
	// what names what rule is, for a field that does not apply to it,
	// and which fields do.
	what := func(not string) string {
		var kinds, fields []string
		switch {
		case b != nil:
			kinds, fields = append(kinds, "a bucket"), append(fields, "tokens_per_minute and burst")
		case q != nil && q.Cost != "":
			kinds, fields = append(kinds, "a quota of money"), append(fields, "cost")
		case q != nil:
			kinds, fields = append(kinds, "a quota of tokens"), append(fields, "tokens")
		}
		if c != nil {
			kinds, fields = append(kinds, "a concurrency limit"), append(fields, "max")
		}
		return fmt.Sprintf("%q is %s of policy %q, not %s: set %s", rule, strings.Join(kinds, " and "), p.Name, not, strings.Join(fields, ", or "))
	}
	if l.SetsBucket() {
		switch {
		case b == nil:
			v.add(join(path, "tokens_per_minute"), "%s", what("a bucket"))
		case l.TokensPerMinute == 0:
			v.add(join(path, "tokens_per_minute"), "is required with burst: the override replaces bucket %q's whole limit", rule)
		case v.validateRate(path, l.TokensPerMinute, l.Burst):
			nb := buckets.Bucket{Name: rule, Key: placeholderKey, Limit: l.Limit(), Hard: b.Hard, MaxDebt: b.MaxDebt}
			if err := nb.Validate(); err != nil {
				v.add(path, "the limit these values give is unusable: %v", err)
			}
		}
	}
	if l.Max != 0 {
		switch {
		case c == nil:
			v.add(join(path, "max"), "%s", what("a concurrency limit"))
		case l.Max < 1:
			v.add(join(path, "max"), "must be at least 1, got %d", l.Max)
		}
	}
	if l.Tokens != 0 {
		switch {
		case q == nil || q.Cost != "":
			v.add(join(path, "tokens"), "%s", what("a quota of tokens"))
		case l.Tokens < 1 || l.Tokens > maxQuotaTokens:
			v.add(join(path, "tokens"), "must be from 1 to %d, got %d", maxQuotaTokens, l.Tokens)
		}
	}
	if l.Cost != "" {
		switch {
		case q == nil || q.Cost == "":
			v.add(join(path, "cost"), "%s", what("a quota of money"))
		default:
			v.validateCost(join(path, "cost"), string(l.Cost))
		}
	}
}

const perModel = "model"

// validateTiers checks a policy's tier source and its tiers.
func (v *validator) validateTiers(path string, p *Policy) {
	tp := join(path, "tier")
	switch t := p.Tier; {
	case t != nil:
		v.validateSource(tp, t.Header, t.Metadata, t.Path, "payload.tier")
		if len(p.Tiers) == 0 {
			v.add(tp, "is set but the policy defines no tiers")
		}
	case len(p.Tiers) > 0:
		v.add(join(path, "tiers"), "need tier: where a request's tier is found (a header or a claim)")
	}
	names := map[string]int{}
	for i, t := range p.Tiers {
		ip := fmt.Sprintf("%s.tiers[%d]", path, i)
		switch j, dup := names[t.Name]; {
		case t.Name == "":
			v.add(join(ip, "name"), "is required (the tier value requests carry)")
		case strings.TrimSpace(t.Name) != t.Name:
			v.add(join(ip, "name"), "%q has spaces around it, which a request's value never has", t.Name)
		case dup:
			v.add(join(ip, "name"), "tier %q is already defined at tiers[%d]", t.Name, j)
		default:
			names[t.Name] = i
		}
		if len(t.Limits) == 0 {
			v.add(join(ip, "limits"), "at least one rule's limits are required")
		}
		rules := map[string]bool{}
		for j, rl := range t.Limits {
			lp := fmt.Sprintf("%s.limits[%d]", ip, j)
			if !v.overridable(lp, p, rl.Rule) {
				continue
			}
			if rules[rl.Rule] {
				v.add(join(lp, "rule"), "%q has limits twice in this tier", rl.Rule)
			}
			rules[rl.Rule] = true
			v.validateLimits(lp, p, rl.Rule, rl.Limits, true)
		}
	}
}

// validateOverrides checks a policy's overrides.
func (v *validator) validateOverrides(path string, p *Policy) {
	seen := map[[2]string]int{}
	for i, o := range p.Overrides {
		op := fmt.Sprintf("%s.overrides[%d]", path, i)
		if !v.overridable(op, p, o.Rule) {
			continue
		}
		t, _ := overrideTarget(p, o.Rule) // overridable found no error
		switch {
		case (o.Identity == "") == (o.IdentityKey == ""):
			v.add(op, "needs exactly one of identity (the value requests carry) or identity_key (its hashed form)")
		case o.IdentityKey != "" && !t.Hash:
			v.add(join(op, "identity_key"), "only applies to a hashed identity (hash: true); %q is keyed by %q: use identity", o.Rule, t.Per)
		case o.IdentityKey != "" && !ValidIdentityKey(o.IdentityKey):
			// Not repeated: a raw API key pasted here is a secret.
			v.add(join(op, "identity_key"), "is not a hashed identity: want h. and 32 hex digits, as tokengate limits get prints it (a raw value goes in identity)")
		case o.Identity != "" && strings.TrimSpace(o.Identity) == "":
			v.add(join(op, "identity"), "is blank")
		}
		// Spellings of one identity (a model's, a credential with its
		// bearer scheme, a hashed value and its identity_key) are one key.
		id := o.IdentityKey
		if id == "" {
			id = t.Key(o.Identity)
		}
		k := [2]string{o.Rule, id}
		if j, dup := seen[k]; dup {
			v.add(op, "overrides %q for the same identity as overrides[%d]", o.Rule, j)
		}
		seen[k] = i
		v.validateLimits(op, p, o.Rule, o.Limits, false)
	}
}

// overridable reports whether rule may have overrides and tier limits,
// and says why not at path.
func (v *validator) overridable(path string, p *Policy, rule string) bool {
	if rule == "" {
		v.add(join(path, "rule"), "is required (the name of a bucket or concurrency limit of this policy)")
		return false
	}
	if _, err := overrideTarget(p, rule); err != nil {
		v.add(join(path, "rule"), "%s", strings.TrimPrefix(err.Error(), ErrUnknownTarget.Error()+": "))
		return false
	}
	return true
}

// envNameRE is an environment variable name.
var envNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func (v *validator) validateAdminAPI(a *AdminAPI) {
	if a.TokenEnv != "" && !envNameRE.MatchString(a.TokenEnv) {
		v.add("admin_api.token_env", "%q is not an environment variable name (letters, digits and '_', not starting with a digit)", a.TokenEnv)
	}
}
