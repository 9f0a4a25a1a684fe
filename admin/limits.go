package admin

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
)

// limitsAPI registers /v1/limits (overrides) on mux, behind the bearer
// token. An override's identity is in the path or in the identity header.
func (s *Server) limitsAPI(mux *http.ServeMux) {
	for _, one := range []string{"/v1/limits/{policy}/{rule}/{identity...}", "/v1/limits/{policy}/{rule}"} {
		mux.HandleFunc("PUT "+one, s.authorized(s.putLimit))
		mux.HandleFunc("GET "+one, s.authorized(s.getLimit))
		mux.HandleFunc("DELETE "+one, s.authorized(s.deleteLimit))
	}
	mux.HandleFunc("GET /v1/limits", s.authorized(s.listLimits))
	mux.HandleFunc("GET /v1/limits/{policy}", s.authorized(s.listLimits))
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
func (s *Server) target(w http.ResponseWriter, r *http.Request) (limitTarget, bool) {
	cfg := s.cfg.Load()
	policy, rule, raw := r.PathValue("policy"), r.PathValue("rule"), r.PathValue("identity")
	switch hs := r.Header.Values(IdentityHeader); {
	case len(hs) > 1 || len(hs) == 1 && raw != "":
		fail(w, http.StatusBadRequest, "invalid_identity", "name the identity once: in the path or in one %s header", IdentityHeader)
		return limitTarget{}, false
	case len(hs) == 1:
		raw = hs[0]
	case raw == "":
		fail(w, http.StatusBadRequest, "invalid_identity", "name the identity in the %s header (or in the path)", IdentityHeader)
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
		id = IdentityKey(t, raw)
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

// LimitBody is the admin API's view of one override.
type LimitBody struct {
	Policy   string          `json:"policy"`
	Rule     string          `json:"rule"`
	Identity string          `json:"identity"` // the stored form: hashed for a hashed identity
	Limits   json.RawMessage `json:"limits,omitempty"`
	// Problem says why a stored override is not in force (listings only).
	Problem string `json:"problem,omitempty"`
	Deleted bool   `json:"deleted,omitempty"`
	Version string `json:"version,omitempty"`
}

func bodyOf(k buckets.OverrideKey, limits []byte) LimitBody {
	return LimitBody{Policy: k.Policy, Rule: k.Rule, Identity: k.Identity, Limits: limits}
}

func storeFailed(w http.ResponseWriter, err error) {
	if errors.Is(err, buckets.ErrInvalidRequest) {
		fail(w, http.StatusBadRequest, "invalid_request", "%v", err)
		return
	}
	fail(w, http.StatusServiceUnavailable, "store_unavailable", "the override store did not answer; retry shortly")
}

func (s *Server) putLimit(w http.ResponseWriter, r *http.Request) {
	t, ok := s.target(w, r)
	if !ok {
		return
	}
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		fail(w, http.StatusRequestEntityTooLarge, "body_too_large", "the body is larger than %d bytes", maxBody)
		return
	}
	lim, err := config.DecodeLimits(data)
	if err == nil {
		err = t.cfg.CheckOverride(t.key.Policy, t.key.Rule, lim)
	}
	var ps config.Problems
	if errors.As(err, &ps) {
		e := APIErrorDetail{Code: "invalid_limits", Message: "the limits cannot apply to this rule"}
		for _, pr := range ps {
			e.Problems = append(e.Problems, APIProblem{Field: pr.Field, Message: pr.Msg})
		}
		writeJSON(w, http.StatusBadRequest, APIError{e})
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
	version, err := s.overrides.Put(r.Context(), t.key, canonical)
	if err != nil {
		storeFailed(w, err)
		return
	}
	// This gateway applies it before answering; the others within a poll.
	if err := s.live.sync(r.Context()); err != nil {
		fail(w, http.StatusServiceUnavailable, "store_unavailable", "stored, but not read back: it applies once the store answers")
		return
	}
	b := bodyOf(t.key, canonical)
	b.Version = version
	writeJSON(w, http.StatusOK, b)
}

func (s *Server) getLimit(w http.ResponseWriter, r *http.Request) {
	t, ok := s.target(w, r)
	if !ok {
		return
	}
	v, found, err := s.overrides.Get(r.Context(), t.key)
	switch {
	case err != nil:
		storeFailed(w, err)
	case !found:
		fail(w, http.StatusNotFound, "not_found", "no stored override of %s/%s for this identity (overrides in the configuration file are not listed here)", t.key.Policy, t.key.Rule)
	default:
		writeJSON(w, http.StatusOK, bodyOf(t.key, v))
	}
}

func (s *Server) deleteLimit(w http.ResponseWriter, r *http.Request) {
	t, ok := s.target(w, r)
	if !ok {
		return
	}
	deleted, version, err := s.overrides.Delete(r.Context(), t.key)
	switch {
	case err != nil:
		storeFailed(w, err)
	case !deleted:
		fail(w, http.StatusNotFound, "not_found", "no stored override of %s/%s for this identity", t.key.Policy, t.key.Rule)
	default:
		if err := s.live.sync(r.Context()); err != nil {
			fail(w, http.StatusServiceUnavailable, "store_unavailable", "deleted, but not read back: it applies once the store answers")
			return
		}
		b := bodyOf(t.key, nil)
		b.Deleted, b.Version = true, version
		writeJSON(w, http.StatusOK, b)
	}
}

// LimitList is the answer of GET /v1/limits[/{policy}].
type LimitList struct {
	Version   string      `json:"version"`
	Overrides []LimitBody `json:"overrides"`
}

func (s *Server) listLimits(w http.ResponseWriter, r *http.Request) {
	cfg := s.cfg.Load()
	policy := r.PathValue("policy")
	if _, ok := cfg.Policy(policy); policy != "" && !ok {
		fail(w, http.StatusNotFound, "not_found", "policy %q is not defined", policy)
		return
	}
	set, err := s.overrides.Load(r.Context())
	if err != nil {
		storeFailed(w, err)
		return
	}
	out := LimitList{Version: set.Version, Overrides: []LimitBody{}}
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
	slices.SortFunc(out.Overrides, func(a, b LimitBody) int {
		return strings.Compare(a.Policy+"\x00"+a.Rule+"\x00"+a.Identity, b.Policy+"\x00"+b.Rule+"\x00"+b.Identity)
	})
	writeJSON(w, http.StatusOK, out)
}
