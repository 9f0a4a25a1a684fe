package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/pricing"
)

// liveState is what serve changes while it runs: the configuration in
// force (Reload replaces its policies), the per-identity overrides, and the
// admin API that writes them and reports usage.
type liveState struct {
	cfg       atomic.Pointer[config.Config]
	raw       buckets.Store // the bucket store itself, unwrapped: it keeps the overrides
	overrides overrideStore
	live      *liveLimits
	// token is the SHA-256 digest of the admin API's bearer token; nil
	// disables the API.
	token    []byte
	tokenEnv string
}

// buildLimits sets up overrides and the admin API for p's server, and reads
// the stored overrides once (a store that does not answer is logged; the
// overrides follow as soon as it does).
func (p *parts) buildLimits(ctx context.Context, cfg *config.Config, logger *slog.Logger) error {
	p.cfg.Store(cfg)
	if rs, ok := p.raw.(*redisstore.Store); ok {
		p.overrides = rs.Overrides()
	} else {
		p.overrides = &buckets.MemoryOverrides{}
	}
	p.live = newLiveLimits(p.overrides, p.server, cfg, logger, p.metrics)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := p.live.sync(sctx); err != nil {
		logger.Warn("limit overrides not read from the store at start-up; they apply once it answers", "err", err)
	}
	if env := cfg.AdminAPI.TokenEnv; env != "" {
		tok, err := readAdminToken(env)
		if err != nil {
			return err
		}
		p.token, p.tokenEnv = tok, env
	}
	return nil
}

// readAdminToken reads the admin API's token from the environment variable
// env, as a digest: without surrounding whitespace (a token read from a
// secret file keeps its trailing newline), and refused when it is empty or
// has whitespace inside, which no Authorization header can carry as one
// credential. Only the digest is kept; requests' tokens are compared by
// their digests, in constant time whatever their length.
func readAdminToken(env string) ([]byte, error) {
	tok := strings.TrimSpace(os.Getenv(env))
	switch {
	case tok == "":
		return nil, fmt.Errorf("admin_api.token_env: environment variable %s is not set or empty (the admin API's bearer token)", env)
	case strings.ContainsFunc(tok, unicode.IsSpace):
		return nil, fmt.Errorf("admin_api.token_env: the token in %s has whitespace inside; a bearer token is one word", env)
	}
	d := sha256.Sum256([]byte(tok))
	return d[:], nil
}

// apply makes cfg the configuration in force: its policies for new
// requests, its overrides, and the stored overrides checked against it.
// cfg is validated and needs no restart (config.NeedsRestart).
func (p *parts) apply(cfg *config.Config) error {
	pols, err := policies(cfg)
	if err != nil {
		return err
	}
	p.server.Reload(pols, cfg.DefaultPolicy)
	p.cfg.Store(cfg)
	p.live.setConfig(cfg)
	return nil
}

// maxAdminBody bounds a request body of the admin API.
const maxAdminBody = 16 << 10

// identityHeader carries identity values to the admin API, which would
// otherwise travel in URLs, where the access logs of proxies keep them.
const identityHeader = "X-Tokengate-Identity"

// adminAPI registers the admin API on mux: /v1/limits (overrides) and
// /v1/usage, behind the bearer token. An override's identity is in the
// path or in the identity header.
func (p *parts) adminAPI(mux *http.ServeMux) {
	for _, one := range []string{"/v1/limits/{policy}/{rule}/{identity...}", "/v1/limits/{policy}/{rule}"} {
		mux.HandleFunc("PUT "+one, p.authorized(p.putLimit))
		mux.HandleFunc("GET "+one, p.authorized(p.getLimit))
		mux.HandleFunc("DELETE "+one, p.authorized(p.deleteLimit))
	}
	mux.HandleFunc("GET /v1/limits", p.authorized(p.listLimits))
	mux.HandleFunc("GET /v1/limits/{policy}", p.authorized(p.listLimits))
	mux.HandleFunc("GET /v1/usage", p.authorized(p.usage))
}

// apiError is the body of every admin API error.
type apiError struct {
	Error apiErrorDetail `json:"error"`
}

type apiErrorDetail struct {
	Code     string       `json:"code"`
	Message  string       `json:"message"`
	Problems []apiProblem `json:"problems,omitempty"`
}

type apiProblem struct {
	Field   string `json:"field,omitempty"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("content-type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // the client went away: nothing to do
}

func fail(w http.ResponseWriter, status int, code, format string, args ...any) {
	writeJSON(w, status, apiError{apiErrorDetail{Code: code, Message: fmt.Sprintf(format, args...)}})
}

// authorized refuses a request without the bearer token (401), and every
// request when no token is configured (403): the admin API changes limits.
func (p *parts) authorized(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if p.token == nil {
			fail(w, http.StatusForbidden, "admin_api_disabled",
				"the admin API is disabled: set admin_api.token_env in the configuration to the name of an environment variable holding its bearer token")
			return
		}
		got, bearer := extproc.Credential(r.Header.Get("authorization"))
		d := sha256.Sum256([]byte(got))
		if !bearer || subtle.ConstantTimeCompare(d[:], p.token) != 1 {
			w.Header().Set("www-authenticate", `Bearer realm="tokengate admin"`)
			fail(w, http.StatusUnauthorized, "unauthorized", "this needs the admin API's bearer token (Authorization: Bearer <token>, the value of %s)", p.tokenEnv)
			return
		}
		h(w, r)
	}
}

// limitTarget is the override a /v1/limits/{policy}/{rule}/{identity}
// request names, with the identity in its stored form.
type limitTarget struct {
	key buckets.OverrideKey
	cfg *config.Config
}

// target reads the override named by r's path, and its identity from the
// path or from the identity header (one of the two). The identity is the
// value requests carry, or with ?hashed=true the hashed form (h. and 32
// hex digits) that listings show. It answers the error itself when it
// fails.
func (p *parts) target(w http.ResponseWriter, r *http.Request) (limitTarget, bool) {
	cfg := p.cfg.Load()
	policy, rule, raw := r.PathValue("policy"), r.PathValue("rule"), r.PathValue("identity")
	switch hs := r.Header.Values(identityHeader); {
	case len(hs) > 1 || len(hs) == 1 && raw != "":
		fail(w, http.StatusBadRequest, "invalid_identity", "name the identity once: in the path or in one %s header", identityHeader)
		return limitTarget{}, false
	case len(hs) == 1:
		raw = hs[0]
	case raw == "":
		fail(w, http.StatusBadRequest, "invalid_identity", "name the identity in the %s header (or in the path)", identityHeader)
		return limitTarget{}, false
	}
	t, err := cfg.OverrideTarget(policy, rule)
	switch {
	case errors.Is(err, config.ErrUnknownTarget):
		fail(w, http.StatusNotFound, "not_found", "%s", strings.TrimPrefix(err.Error(), config.ErrUnknownTarget.Error()+": "))
		return limitTarget{}, false
	case err != nil:
		fail(w, http.StatusBadRequest, "not_overridable", "%v", err)
		return limitTarget{}, false
	}
	var id string
	switch r.URL.Query().Get("hashed") {
	case "", "false":
		id = identityKey(t, raw)
	case "true":
		if !t.Hash || !config.ValidIdentityKey(raw) {
			fail(w, http.StatusBadRequest, "invalid_identity",
				"with hashed=true the identity is the hashed form of a hashed identity: h. and 32 hex digits (%q is keyed by %q, hashed: %v)", rule, t.Per, t.Hash)
			return limitTarget{}, false
		}
		id = raw
	default:
		fail(w, http.StatusBadRequest, "invalid_query", "hashed is true or false")
		return limitTarget{}, false
	}
	if id == "" {
		fail(w, http.StatusBadRequest, "invalid_identity", "the identity is blank")
		return limitTarget{}, false
	}
	return limitTarget{key: buckets.OverrideKey{Policy: policy, Rule: rule, Identity: id}, cfg: cfg}, true
}

// limitBody is the admin API's view of one override.
type limitBody struct {
	Policy   string          `json:"policy"`
	Rule     string          `json:"rule"`
	Identity string          `json:"identity"` // the stored form: hashed for a hashed identity
	Limits   json.RawMessage `json:"limits,omitempty"`
	// Problem says why a stored override is not in force (listings only).
	Problem string `json:"problem,omitempty"`
	Deleted bool   `json:"deleted,omitempty"`
	Version string `json:"version,omitempty"`
}

func bodyOf(k buckets.OverrideKey, limits []byte) limitBody {
	return limitBody{Policy: k.Policy, Rule: k.Rule, Identity: k.Identity, Limits: limits}
}

func (p *parts) storeFailed(w http.ResponseWriter, err error) {
	if errors.Is(err, buckets.ErrInvalidRequest) {
		fail(w, http.StatusBadRequest, "invalid_request", "%v", err)
		return
	}
	fail(w, http.StatusServiceUnavailable, "store_unavailable", "the override store did not answer; retry shortly")
}

func (p *parts) putLimit(w http.ResponseWriter, r *http.Request) {
	t, ok := p.target(w, r)
	if !ok {
		return
	}
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBody))
	if err != nil {
		fail(w, http.StatusRequestEntityTooLarge, "body_too_large", "the body is larger than %d bytes", maxAdminBody)
		return
	}
	lim, err := config.DecodeLimits(data)
	if err == nil {
		err = t.cfg.CheckOverride(t.key.Policy, t.key.Rule, lim)
	}
	var ps config.Problems
	if errors.As(err, &ps) {
		e := apiErrorDetail{Code: "invalid_limits", Message: "the limits cannot apply to this rule"}
		for _, pr := range ps {
			e.Problems = append(e.Problems, apiProblem{Field: pr.Field, Message: pr.Msg})
		}
		writeJSON(w, http.StatusBadRequest, apiError{e})
		return
	}
	if err != nil {
		fail(w, http.StatusBadRequest, "invalid_limits", "%v", err)
		return
	}
	canonical, err := json.Marshal(lim)
	if err != nil {
		fail(w, http.StatusInternalServerError, "internal", "%v", err)
		return
	}
	version, err := p.overrides.Put(r.Context(), t.key, canonical)
	if err != nil {
		p.storeFailed(w, err)
		return
	}
	// This gateway applies it before answering; the others within a poll.
	if err := p.live.sync(r.Context()); err != nil {
		fail(w, http.StatusServiceUnavailable, "store_unavailable", "stored, but not read back: it applies once the store answers")
		return
	}
	b := bodyOf(t.key, canonical)
	b.Version = version
	writeJSON(w, http.StatusOK, b)
}

func (p *parts) getLimit(w http.ResponseWriter, r *http.Request) {
	t, ok := p.target(w, r)
	if !ok {
		return
	}
	v, found, err := p.overrides.Get(r.Context(), t.key)
	switch {
	case err != nil:
		p.storeFailed(w, err)
	case !found:
		fail(w, http.StatusNotFound, "not_found", "no stored override of %s/%s for this identity (overrides in the configuration file are not listed here)", t.key.Policy, t.key.Rule)
	default:
		writeJSON(w, http.StatusOK, bodyOf(t.key, v))
	}
}

func (p *parts) deleteLimit(w http.ResponseWriter, r *http.Request) {
	t, ok := p.target(w, r)
	if !ok {
		return
	}
	deleted, version, err := p.overrides.Delete(r.Context(), t.key)
	switch {
	case err != nil:
		p.storeFailed(w, err)
	case !deleted:
		fail(w, http.StatusNotFound, "not_found", "no stored override of %s/%s for this identity", t.key.Policy, t.key.Rule)
	default:
		if err := p.live.sync(r.Context()); err != nil {
			fail(w, http.StatusServiceUnavailable, "store_unavailable", "deleted, but not read back: it applies once the store answers")
			return
		}
		b := bodyOf(t.key, nil)
		b.Deleted, b.Version = true, version
		writeJSON(w, http.StatusOK, b)
	}
}

// limitList is the answer of GET /v1/limits[/{policy}].
type limitList struct {
	Version   string      `json:"version"`
	Overrides []limitBody `json:"overrides"`
}

func (p *parts) listLimits(w http.ResponseWriter, r *http.Request) {
	cfg := p.cfg.Load()
	policy := r.PathValue("policy")
	if _, ok := cfg.Policy(policy); policy != "" && !ok {
		fail(w, http.StatusNotFound, "not_found", "policy %q is not defined", policy)
		return
	}
	set, err := p.overrides.Load(r.Context())
	if err != nil {
		p.storeFailed(w, err)
		return
	}
	out := limitList{Version: set.Version, Overrides: []limitBody{}}
	for k, v := range set.Values {
		if policy != "" && k.Policy != policy {
			continue
		}
		b := bodyOf(k, v)
		lim, err := config.DecodeLimits(v)
		if err == nil {
			err = cfg.CheckOverride(k.Policy, k.Rule, lim)
		}
		if err != nil {
			b.Problem = "not in force: " + err.Error()
		}
		out.Overrides = append(out.Overrides, b)
	}
	slices.SortFunc(out.Overrides, func(a, b limitBody) int {
		return strings.Compare(a.Policy+"\x00"+a.Rule+"\x00"+a.Identity, b.Policy+"\x00"+b.Rule+"\x00"+b.Identity)
	})
	writeJSON(w, http.StatusOK, out)
}

// usageReport is the answer of GET /v1/usage.
type usageReport struct {
	Policy     string            `json:"policy"`
	Identities map[string]string `json:"identities"` // stored forms: hashed for hashed identities
	Model      string            `json:"model,omitempty"`
	Tier       string            `json:"tier,omitempty"`
	// Currency is the unit of quotas of money.
	Currency string      `json:"currency,omitempty"`
	Rules    []usageRule `json:"rules"`
}

// usageRule is one rule of a usage report. Amounts of money are in units of
// the currency (exact to the micro-unit).
type usageRule struct {
	Rule   string `json:"rule"`
	Kind   string `json:"kind"` // bucket, quota or concurrency
	Per    string `json:"per,omitempty"`
	Source string `json:"source"` // where the limit comes from: rule, tier or override
	// Limit is the limit in force, in the words of an override: a
	// bucket's tokens_per_minute and burst, a quota's tokens or cost, a
	// concurrency limit's max.
	Limit config.Limits `json:"limit"`
	// Unit is what a quota counts: "tokens", or the currency's code.
	Unit string `json:"unit,omitempty"`
	// Remaining is tokens for a bucket, free slots for a concurrency
	// limit, what is left of the window's budget for a quota (below zero
	// when the window is overspent).
	Remaining float64 `json:"remaining"`
	// Spent is what a quota's current window has spent, reservations of
	// requests in flight included.
	Spent *float64 `json:"spent,omitempty"`
	// Window names a quota's current window (2026-03, 2026-W13,
	// 2026-03-31).
	Window string `json:"window,omitempty"`
	InUse  *int   `json:"in_use,omitempty"`
	// Reset is when a bucket is full again, or a quota's window ends.
	Reset        *time.Time `json:"reset,omitempty"`
	ResetSeconds *float64   `json:"reset_seconds,omitempty"`
}

// usage answers GET /v1/usage?policy=P&identity=NAME=VALUE... (each
// identity also in an identity header): per rule of the chain those
// requests pass, its limit in force, what remains, what a
// quota's window has spent and when it resets.
func (p *parts) usage(w http.ResponseWriter, r *http.Request) {
	cfg, q := p.cfg.Load(), r.URL.Query()
	policy := q.Get("policy")
	if policy == "" {
		policy = cfg.DefaultPolicy
	}
	pol, ok := cfg.Policy(policy)
	if !ok {
		fail(w, http.StatusNotFound, "not_found", "policy %q is not defined", policy)
		return
	}
	hashed := q.Get("hashed") == "true"
	rep := usageReport{Policy: policy, Identities: map[string]string{}, Model: q.Get("model"), Tier: q.Get("tier"), Rules: []usageRule{}}
	for _, v := range slices.Concat(q["identity"], r.Header.Values(identityHeader)) {
		name, value, ok := strings.Cut(v, "=")
		if !ok {
			if len(pol.Identities) != 1 {
				fail(w, http.StatusBadRequest, "invalid_identity", "policy %q has %d identities: name one as identity=NAME=VALUE", policy, len(pol.Identities))
				return
			}
			name, value = pol.Identities[0].Name, v
		}
		i := slices.IndexFunc(pol.Identities, func(id config.Identity) bool { return id.Name == name })
		if i < 0 {
			fail(w, http.StatusBadRequest, "invalid_identity", "policy %q has no identity %q", policy, name)
			return
		}
		key := extproc.IdentityKey(value, pol.Identities[i].Hash)
		if hashed && pol.Identities[i].Hash {
			if !config.ValidIdentityKey(value) {
				fail(w, http.StatusBadRequest, "invalid_identity", "with hashed=true a hashed identity is h. and 32 hex digits")
				return
			}
			key = value
		}
		if key == "" {
			fail(w, http.StatusBadRequest, "invalid_identity", "identity %q is blank", name)
			return
		}
		rep.Identities[name] = key
	}
	u, err := p.server.Usage(r.Context(), extproc.UsageQuery{Policy: policy, Identities: rep.Identities, Model: rep.Model, Tier: rep.Tier})
	switch {
	case errors.Is(err, extproc.ErrUnknownPolicy):
		// The configuration was reloaded meanwhile.
		fail(w, http.StatusNotFound, "not_found", "policy %q is not defined", policy)
		return
	case errors.Is(err, extproc.ErrUnknownIdentity):
		fail(w, http.StatusBadRequest, "invalid_identity", "%v", err)
		return
	case errors.Is(err, errors.ErrUnsupported):
		fail(w, http.StatusNotImplemented, "not_supported", "this bucket store cannot report usage")
		return
	case err != nil:
		p.storeFailed(w, err)
		return
	}
	rep.Currency = u.Currency
	for _, ru := range u.Rules {
		rep.Rules = append(rep.Rules, usageRuleOf(ru, u))
	}
	writeJSON(w, http.StatusOK, rep)
}

// usageRuleOf is one rule of u in the report's terms.
func usageRuleOf(ru extproc.RuleUsage, u extproc.Usage) usageRule {
	out := usageRule{Rule: ru.Name, Kind: ru.Kind, Per: ru.Per, Source: ru.Source}
	reset := func(d, precision time.Duration) {
		at, secs := u.At.Add(d).UTC().Round(precision), d.Seconds()
		out.Reset, out.ResetSeconds = &at, &secs
	}
	switch {
	case ru.Bucket != nil:
		st := ru.Bucket
		// Rounded to a millionth: a rate per second back to per minute is
		// not exact in binary.
		out.Limit = config.Limits{TokensPerMinute: math.Round(st.Limit.Rate*60*1e6) / 1e6, Burst: st.Limit.Capacity}
		out.Remaining = st.Remaining
		reset(st.Reset, time.Millisecond)
	case ru.Quota != nil:
		st := ru.Quota
		spent := st.Spent
		out.Unit, out.Window, out.Remaining = "tokens", st.Window, st.Remaining
		out.Limit = config.Limits{Tokens: int(st.Limit)}
		if st.Unit == buckets.Money {
			// Micro-units to units: exact in decimal for any amount below
			// a billion (15 significant digits).
			out.Unit, out.Remaining, spent = u.Currency, st.Remaining/1e6, spent/1e6
			out.Limit = config.Limits{Cost: config.Amount(pricing.Micros(st.Limit).String())}
		}
		out.Spent = &spent
		// A window ends on a whole second (time zones' offsets are whole
		// seconds); the store read its clock a moment after At.
		reset(st.Reset, time.Second)
	case ru.Slot != nil:
		n := ru.Slot.InUse
		out.Limit, out.Remaining, out.InUse = config.Limits{Max: ru.Slot.Max}, float64(max(ru.Slot.Max-n, 0)), &n
	}
	return out
}
