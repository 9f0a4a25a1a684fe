// Package admin is tokengate's admin HTTP server, the listener beside the
// ext_proc gRPC server: liveness (/healthz), readiness (/readyz),
// Prometheus metrics (/metrics), and behind the admin token the admin API
// (/v1/limits: per-identity limit overrides; /v1/usage: what an identity
// has used and has left) and the budget page (/budget: per policy and
// quota, who spent most of the current window).
//
// Overrides are data: the API writes them to an override store (the
// memory store's, or Redis's for a fleet), and a Server keeps the
// gateway's table of overrides in step with the store and with the
// configuration file (Run polls the store; a write applies on the gateway
// that took it before the answer).
//
// Package cmd/tokengate builds one Server per process and serves its
// Handler; everything else here is plain data and the gateway's own
// reports (extproc.Server.Usage, Spenders), so the API, the page and the
// command line read the same numbers.
package admin

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/metrics"
)

// OverrideStore keeps limit overrides: buckets.MemoryOverrides for one
// gateway, the Redis store's (redisstore.Store.Overrides) for a fleet.
type OverrideStore interface {
	Put(ctx context.Context, k buckets.OverrideKey, value []byte) (string, error)
	Get(ctx context.Context, k buckets.OverrideKey) ([]byte, bool, error)
	Delete(ctx context.Context, k buckets.OverrideKey) (bool, string, error)
	Version(ctx context.Context) (string, error)
	Load(ctx context.Context) (buckets.OverrideSet, error)
}

// Options configures a Server. Config, Gateway, Overrides and Metrics are
// required.
type Options struct {
	// Config is the validated configuration in force at start;
	// SetConfig replaces it.
	Config *config.Config
	// Gateway is the ext_proc server whose overrides the Server keeps and
	// whose usage it reports.
	Gateway *extproc.Server
	// OnOverrides, when set, is given every table of overrides the
	// Gateway is given, as it is given it: the rate-limit service's
	// (package rls) follow the same overrides. The table must not be
	// modified.
	OnOverrides func(extproc.Overrides)
	// Overrides is where the API keeps overrides.
	Overrides OverrideStore
	// Metrics counts the overrides in force and failed reads of the
	// store, and holds the refusals the budget page shows.
	Metrics *metrics.Metrics
	// Gatherer is what /metrics serves; nil serves nothing there.
	Gatherer prometheus.Gatherer
	// Ready says whether /readyz answers 200: nil, or why not. Nil
	// means always ready.
	Ready func() error
	// Token is the admin API's bearer token (see ReadToken); empty
	// disables the API and the budget page, which then answer 403. Only
	// its digest is kept.
	Token string
	// TokenSource names where the token comes from in the answer to a
	// request without it ("the value of TG_ADMIN_TOKEN").
	TokenSource string
	// RateLimitJSON, when set, serves POST /json: the rate-limit
	// service's (package rls) ShouldRateLimit over HTTP.
	RateLimitJSON http.Handler
	// Logger receives the overrides' warnings; nil discards them.
	Logger *slog.Logger
	// Now is the clock of sign-in sessions and of the page's "read at";
	// nil is time.Now.
	Now func() time.Time
}

// Server is the admin HTTP server of one gateway. It is safe for
// concurrent use. Use New; the zero value is not usable.
type Server struct {
	cfg       atomic.Pointer[config.Config]
	gateway   *extproc.Server
	overrides OverrideStore
	live      *liveLimits
	metrics   *metrics.Metrics
	// token is the SHA-256 digest of the bearer token; nil disables the
	// API and the page.
	token       []byte
	tokenSource string
	sessions    *sessions
	now         func() time.Time
	handler     http.Handler
}

// New returns the admin server of o.Gateway, with the overrides of
// o.Config and those of the store applied. A store that does not answer
// within two seconds is logged; its overrides follow as soon as it does
// (Run).
func New(ctx context.Context, o Options) *Server {
	logger := o.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	now := o.Now
	if now == nil {
		now = time.Now
	}
	s := &Server{gateway: o.Gateway, overrides: o.Overrides, metrics: o.Metrics, tokenSource: o.TokenSource, sessions: newSessions(now), now: now}
	if s.tokenSource == "" {
		s.tokenSource = "the admin token"
	}
	if o.Token != "" {
		d := sha256.Sum256([]byte(o.Token))
		s.token = d[:]
	}
	s.cfg.Store(o.Config)
	s.live = newLiveLimits(o.Overrides, o.Gateway, o.OnOverrides, o.Config, logger, o.Metrics)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := s.live.sync(sctx); err != nil {
		logger.Warn("limit overrides not read from the store at start-up; they apply once it answers", "err", err)
	}
	s.handler = s.routes(o.Gatherer, o.Ready, o.RateLimitJSON)
	return s
}

// ReadToken reads the admin token from the environment variable env:
// without surrounding whitespace (a token read from a secret file keeps
// its trailing newline), and refused when it is empty or has whitespace
// inside, which no Authorization header can carry as one credential.
func ReadToken(env string) (string, error) {
	tok := strings.TrimSpace(os.Getenv(env))
	switch {
	case tok == "":
		return "", fmt.Errorf("admin_api.token_env: environment variable %s is not set or empty (the admin API's bearer token)", env)
	case strings.ContainsFunc(tok, unicode.IsSpace):
		return "", fmt.Errorf("admin_api.token_env: the token in %s has whitespace inside; a bearer token is one word", env)
	}
	return tok, nil
}

// Handler serves the admin listener.
func (s *Server) Handler() http.Handler { return s.handler }

// Config is the configuration in force.
func (s *Server) Config() *config.Config { return s.cfg.Load() }

// SetConfig makes cfg, validated and applied to the gateway's policies,
// the configuration the API and the page read, applies its overrides, and
// checks the stored ones against it again.
func (s *Server) SetConfig(cfg *config.Config) {
	s.cfg.Store(cfg)
	s.live.setConfig(cfg)
}

// DefaultPoll is how often Run reads the override store's version: a
// change made on any gateway of the fleet applies on every other within
// this, plus the time to load the overrides.
const DefaultPoll = 250 * time.Millisecond

// Run keeps the overrides in force in step with the store, reading its
// version every interval until ctx ends. A failed read keeps the overrides
// in force; it is logged once until reads succeed again.
func (s *Server) Run(ctx context.Context, every time.Duration) { s.live.run(ctx, every) }

func (s *Server) routes(g prometheus.Gatherer, ready func() error, rlsJSON http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if ready != nil {
			if err := ready(); err != nil {
				http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		w.Write([]byte("ready\n"))
	})
	// envoyproxy/ratelimit's health check, which Envoy Gateway's probes
	// ask (docs/envoy-ratelimit.md §3.7): /readyz's answer in its words,
	// 200 "OK" or 500.
	mux.HandleFunc("GET /healthcheck", func(w http.ResponseWriter, r *http.Request) {
		if ready != nil {
			if err := ready(); err != nil {
				http.Error(w, "not ready: "+err.Error(), http.StatusInternalServerError)
				return
			}
		}
		w.Write([]byte("OK"))
	})
	if g != nil {
		// A registry also counts the handler's own errors.
		reg, _ := g.(prometheus.Registerer)
		mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{Registry: reg}))
	}
	if rlsJSON != nil {
		mux.Handle("POST /json", rlsJSON)
	}
	s.limitsAPI(mux)
	mux.HandleFunc("GET /v1/usage", s.authorized(s.usage))
	s.page(mux)
	return mux
}

// maxBody bounds a request body of the admin API.
const maxBody = 16 << 10

// IdentityHeader carries identity values to the admin API, which would
// otherwise travel in URLs, where the access logs of proxies keep them.
const IdentityHeader = "X-Tokengate-Identity"

// APIError is the body of every admin API error.
type APIError struct {
	Error APIErrorDetail `json:"error"`
}

// APIErrorDetail says what went wrong: a code a program can test, a
// message for people, and for invalid limits the problem of each field.
type APIErrorDetail struct {
	Code     string       `json:"code"`
	Message  string       `json:"message"`
	Problems []APIProblem `json:"problems,omitempty"`
}

// APIProblem is one field's problem.
type APIProblem struct {
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
	writeJSON(w, status, APIError{APIErrorDetail{Code: code, Message: fmt.Sprintf(format, args...)}})
}

// disabled is the answer of the API and the page without a token.
const disabled = "the admin API is disabled: set admin_api.token_env in the configuration to the name of an environment variable holding its bearer token"

// bearer reports whether r carries the bearer token.
func (s *Server) bearer(r *http.Request) bool {
	got, bearer := extproc.Credential(r.Header.Get("authorization"))
	return bearer && s.tokenIs(got)
}

// tokenIs compares tok with the token by their digests, in constant time
// whatever their lengths.
func (s *Server) tokenIs(tok string) bool {
	d := sha256.Sum256([]byte(tok))
	return subtle.ConstantTimeCompare(d[:], s.token) == 1
}

// authorized refuses a request without the bearer token (401), and every
// request when no token is configured (403): the admin API changes limits.
func (s *Server) authorized(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.token == nil {
			fail(w, http.StatusForbidden, "admin_api_disabled", disabled)
			return
		}
		if !s.bearer(r) {
			w.Header().Set("www-authenticate", `Bearer realm="tokengate admin"`)
			fail(w, http.StatusUnauthorized, "unauthorized", "this needs the admin API's bearer token (Authorization: Bearer <token>, %s)", s.tokenSource)
			return
		}
		h(w, r)
	}
}
