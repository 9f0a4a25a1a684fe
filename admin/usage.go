package admin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/pricing"
)

// UsageReport is the answer of GET /v1/usage, and what the budget page
// shows of each identity.
type UsageReport struct {
	Policy     string            `json:"policy"`
	Identities map[string]string `json:"identities"` // stored forms: hashed for hashed identities
	Model      string            `json:"model,omitempty"`
	Tier       string            `json:"tier,omitempty"`
	// Currency is the unit of quotas of money.
	Currency string      `json:"currency,omitempty"`
	Rules    []UsageRule `json:"rules"`
}

// UsageRule is one rule of a usage report. Amounts of money are in units of
// the currency (exact to the micro-unit).
type UsageRule struct {
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

// refusal is an answer of the API that is not a report: its status, code
// and message.
type refusal struct {
	status int
	code   string
	msg    string
}

func (r *refusal) Error() string { return r.msg }

func refuse(status int, code, format string, args ...any) *refusal {
	return &refusal{status, code, fmt.Sprintf(format, args...)}
}

// answer writes err, a *refusal or a store's error, in the API's shape.
func answer(w http.ResponseWriter, err error) {
	var r *refusal
	if errors.As(err, &r) {
		fail(w, r.status, r.code, "%s", r.msg)
		return
	}
	storeFailed(w, err)
}

// usage answers GET /v1/usage?policy=P&identity=NAME=VALUE... (each
// identity also in an identity header): per rule of the chain those
// requests pass, its limit in force, what remains, what a
// quota's window has spent and when it resets.
func (s *Server) usage(w http.ResponseWriter, r *http.Request) {
	cfg, q := s.cfg.Load(), r.URL.Query()
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
	ids := map[string]string{}
	for _, v := range slices.Concat(q["identity"], r.Header.Values(IdentityHeader)) {
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
		ids[name] = key
	}
	rep, err := s.report(r.Context(), extproc.UsageQuery{Policy: policy, Identities: ids, Model: q.Get("model"), Tier: q.Get("tier")})
	if err != nil {
		answer(w, err)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

// report is the usage report of q, whose identities are in their stored
// forms: the answer of GET /v1/usage, and a row of the budget page.
func (s *Server) report(ctx context.Context, q extproc.UsageQuery) (UsageReport, error) {
	rep := UsageReport{Policy: q.Policy, Identities: q.Identities, Model: q.Model, Tier: q.Tier, Rules: []UsageRule{}}
	u, err := s.gateway.Usage(ctx, q)
	switch {
	case errors.Is(err, extproc.ErrUnknownPolicy):
		// The configuration was reloaded meanwhile.
		return rep, refuse(http.StatusNotFound, "not_found", "policy %q is not defined", q.Policy)
	case errors.Is(err, extproc.ErrUnknownIdentity):
		return rep, refuse(http.StatusBadRequest, "invalid_identity", "%v", err)
	case errors.Is(err, errors.ErrUnsupported):
		return rep, refuse(http.StatusNotImplemented, "not_supported", "this bucket store cannot report usage")
	case err != nil:
		return rep, err
	}
	rep.Currency = u.Currency
	for _, ru := range u.Rules {
		rep.Rules = append(rep.Rules, usageRuleOf(ru, u))
	}
	return rep, nil
}

// usageRuleOf is one rule of u in the report's terms.
func usageRuleOf(ru extproc.RuleUsage, u extproc.Usage) UsageRule {
	out := UsageRule{Rule: ru.Name, Kind: ru.Kind, Per: ru.Per, Source: ru.Source}
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
