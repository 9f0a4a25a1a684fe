package admin

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"errors"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
)

// The budget page: per policy and quota, the identities that spent most
// of the current window, against their budget, with what is left and when
// the window resets, and the refusals this gateway counted. It is served
// on the admin listener behind the admin token, as the API is; a browser
// gives the token once in the sign-in form and carries a session cookie
// afterwards (session.go). Every value is escaped by html/template; the
// chart is inline SVG drawn here; the page has no script and loads
// nothing, and its Content-Security-Policy allows nothing else.
const (
	pagePath    = "/budget"
	signInPath  = "/budget/sign-in"
	signOutPath = "/budget/sign-out"
	cookieName  = "tokengate_session"
	// pageTop is how many identities the page shows per quota unless the
	// query asks for another number (?top=, at most maxPageTop).
	pageTop    = 10
	maxPageTop = 100
	// maxSignInBody bounds the sign-in form.
	maxSignInBody = 4 << 10
)

//go:embed page.html
var pageFS embed.FS

var pageTemplates = template.Must(template.New("").Funcs(template.FuncMap{
	"percent": func(f float64) string { return strconv.FormatFloat(100*f, 'f', 0, 64) + "%" },
}).ParseFS(pageFS, "page.html"))

// contentPolicy allows the page its one inline style sheet, by digest, and
// nothing else: no script, no image, no frame, forms only to itself.
var contentPolicy = func() string {
	src, err := pageFS.ReadFile("page.html")
	if err != nil {
		panic(err)
	}
	s := string(src)
	i, j := strings.Index(s, "<style>"), strings.Index(s, "</style>")
	sum := sha256.Sum256([]byte(s[i+len("<style>") : j]))
	return "default-src 'none'; style-src 'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) +
		"'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
}()

// page registers the budget page and its sign-in on mux. The forms post
// only same-origin: a cross-origin POST (Sec-Fetch-Site, or Origin against
// Host) is refused before it is read, beside the cookie's SameSite=Strict.
func (s *Server) page(mux *http.ServeMux) {
	csrf := http.NewCrossOriginProtection()
	mux.HandleFunc("GET "+pagePath, s.budgetPage)
	mux.HandleFunc("GET "+signInPath, s.signInForm)
	mux.Handle("POST "+signInPath, csrf.Handler(http.HandlerFunc(s.signIn)))
	mux.Handle("POST "+signOutPath, csrf.Handler(http.HandlerFunc(s.signOut)))
}

// render writes one of the page's templates with the page's headers.
func render(w http.ResponseWriter, status int, name string, data any) {
	h := w.Header()
	h.Set("content-type", "text/html; charset=utf-8")
	h.Set("content-security-policy", contentPolicy)
	h.Set("cache-control", "no-store")
	h.Set("referrer-policy", "no-referrer")
	h.Set("x-content-type-options", "nosniff")
	w.WriteHeader(status)
	_ = pageTemplates.ExecuteTemplate(w, name, data) // the client went away: nothing to do
}

// signInView is the sign-in form's data.
type signInView struct {
	Disabled string // why there is no sign-in
	Wrong    bool   // the last attempt was not the token
	Source   string // where the token comes from
}

// session is r's session cookie's value, "" without one.
func session(r *http.Request) string {
	c, err := r.Cookie(cookieName)
	if err != nil {
		return ""
	}
	return c.Value
}

func (s *Server) signInForm(w http.ResponseWriter, r *http.Request) {
	if s.token == nil {
		render(w, http.StatusForbidden, "sign-in", signInView{Disabled: disabled})
		return
	}
	if s.sessions.valid(session(r)) {
		http.Redirect(w, r, pagePath, http.StatusSeeOther)
		return
	}
	render(w, http.StatusOK, "sign-in", signInView{Source: s.tokenSource})
}

func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	if s.token == nil {
		render(w, http.StatusForbidden, "sign-in", signInView{Disabled: disabled})
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxSignInBody)
	if err := r.ParseForm(); err != nil {
		render(w, http.StatusBadRequest, "sign-in", signInView{Wrong: true, Source: s.tokenSource})
		return
	}
	tok, _ := extproc.Credential(r.PostForm.Get("token"))
	if tok == "" || !s.tokenIs(tok) {
		render(w, http.StatusUnauthorized, "sign-in", signInView{Wrong: true, Source: s.tokenSource})
		return
	}
	id, exp := s.sessions.start()
	http.SetCookie(w, &http.Cookie{
		Name: cookieName, Value: id, Path: pagePath, Expires: exp, MaxAge: int(sessionTTL.Seconds()),
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil,
	})
	http.Redirect(w, r, pagePath, http.StatusSeeOther)
}

func (s *Server) signOut(w http.ResponseWriter, r *http.Request) {
	s.sessions.end(session(r))
	http.SetCookie(w, &http.Cookie{
		Name: cookieName, Value: "", Path: pagePath, MaxAge: -1,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil,
	})
	http.Redirect(w, r, signInPath, http.StatusSeeOther)
}

// budgetPage answers GET /budget: the page for a signed-in browser or a
// request with the bearer token, the sign-in form for anyone else.
func (s *Server) budgetPage(w http.ResponseWriter, r *http.Request) {
	if s.token == nil {
		render(w, http.StatusForbidden, "sign-in", signInView{Disabled: disabled})
		return
	}
	signedIn := s.sessions.valid(session(r))
	if !signedIn && !s.bearer(r) {
		http.Redirect(w, r, signInPath, http.StatusSeeOther)
		return
	}
	top := pageTop
	if v := r.URL.Query().Get("top"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxPageTop {
			http.Error(w, "top is a number from 1 to "+strconv.Itoa(maxPageTop), http.StatusBadRequest)
			return
		}
		top = n
	}
	render(w, http.StatusOK, "page", s.budgetView(r.Context(), top, signedIn))
}

// pageView is the budget page's data.
type pageView struct {
	At       time.Time
	SignedIn bool // by a session: the page offers to sign out
	Top      int
	Policies []policyView
}

type policyView struct {
	Name string
	// Refusals are this gateway's, by decision, since it started.
	Refusals []refusalCount
	Quotas   []quotaView
	// Tiered policies give some identities other budgets by a tier their
	// requests carry, which the page cannot know.
	Tiered bool
}

type refusalCount struct {
	Decision string
	N        int
}

type quotaView struct {
	Name, Per, Window string
	// Budget is the rule's budget per window; an identity's may differ
	// (an override: its row says so).
	Budget string
	Reset  string // when the window ends
	// Refused counts the requests this quota refused on this gateway.
	Refused int
	Rows    []rowView
	// Read is how many identities with spend the store read; Complete,
	// whether that is all of them.
	Read     int
	Complete bool
	// Problem says why the quota's spenders could not be read.
	Problem string
	Chart   chartView
}

// rowView is one identity of a quota: its usage report's numbers.
type rowView struct {
	Identity   string // the stored form: hashed for a hashed identity
	Spent      string
	Budget     string
	Remaining  string
	Source     string // rule, tier or override
	Fraction   float64
	Overspent  bool
	ResetHuman string
}

// chartView is a quota's bar chart: one bar per row, spent against budget.
type chartView struct {
	Width, Height int
	// BarX is where bars start, FullWidth a whole budget's bar, ValueX
	// where the percentage is written.
	BarX, FullWidth, ValueX int
	Bars                    []barView
}

type barView struct {
	Y, Width  int
	Label     string
	Value     string
	Overspent bool
}

// Chart geometry, in pixels.
const (
	chartLabel = 180 // the identity's column
	chartBar   = 320 // a full budget
	chartValue = 60  // the percentage after the bar
	chartRow   = 22
)

func (s *Server) budgetView(ctx context.Context, top int, signedIn bool) pageView {
	cfg := s.cfg.Load()
	refusals := s.metrics.Refusals()
	v := pageView{At: s.now().UTC().Truncate(time.Second), SignedIn: signedIn, Top: top}
	for _, p := range cfg.Policies {
		pv := policyView{Name: p.Name, Tiered: len(p.Tiers) > 0}
		for d, n := range refusals.Decisions[p.Name] {
			pv.Refusals = append(pv.Refusals, refusalCount{d, n})
		}
		slices.SortFunc(pv.Refusals, func(a, b refusalCount) int { return strings.Compare(a.Decision, b.Decision) })
		for _, q := range p.Quotas {
			qv := s.quotaView(ctx, cfg, p, q, top)
			qv.Refused = refusals.Quotas[p.Name][q.Name]
			pv.Quotas = append(pv.Quotas, qv)
		}
		v.Policies = append(v.Policies, pv)
	}
	return v
}

// quotaView reads the top spenders of quota q and each one's usage
// report, the same report GET /v1/usage answers for that identity.
func (s *Server) quotaView(ctx context.Context, cfg *config.Config, p config.Policy, q config.Quota, top int) quotaView {
	qv := quotaView{Name: q.Name, Per: q.Per, Window: q.Window + " (" + q.Timezone + ")", Budget: budgetOf(q, cfg)}
	if qv.Per == "" {
		qv.Per = "everyone (global)"
	}
	list, err := s.gateway.Spenders(ctx, p.Name, q.Name, top)
	switch {
	case errors.Is(err, errors.ErrUnsupported):
		qv.Problem = "this bucket store cannot list spend"
		return qv
	case errors.Is(err, buckets.ErrStore):
		qv.Problem = "the bucket store is unreachable"
		return qv
	case err != nil:
		qv.Problem = "the bucket store did not answer"
		return qv
	}
	qv.Read, qv.Complete = list.Read, list.Complete
	qv.Reset = list.Window.End.UTC().Format(time.RFC3339) + " (window " + list.Window.ID + ")"
	for _, ks := range list.Top {
		qv.Rows = append(qv.Rows, s.row(ctx, p, q, ks))
	}
	qv.Chart = chartOf(qv.Rows)
	return qv
}

// row is spender ks of quota q, with the numbers of its usage report.
func (s *Server) row(ctx context.Context, p config.Policy, q config.Quota, ks buckets.KeySpend) rowView {
	rv := rowView{Identity: shownIdentity(ks.Key), Spent: "—", Budget: "—", Remaining: "—", Source: "—"}
	query := extproc.UsageQuery{Policy: p.Name, Identities: map[string]string{}}
	switch q.Per {
	case "":
	case "model":
		query.Model = rv.Identity
	default:
		query.Identities[q.Per] = ks.Key
	}
	rep, err := s.report(ctx, query)
	if err != nil {
		return rv
	}
	i := slices.IndexFunc(rep.Rules, func(u UsageRule) bool { return u.Kind == extproc.KindQuota && u.Rule == q.Name })
	if i < 0 || rep.Rules[i].Spent == nil {
		return rv
	}
	u := rep.Rules[i]
	// The report's amounts are tokens, or units of the currency.
	budget, money, _ := u.Limit.Budgets()
	rv.Budget = strconv.Itoa(u.Limit.Tokens) + " tokens"
	if u.Limit.Cost != "" {
		budget, rv.Budget = money/1e6, string(u.Limit.Cost)+" "+u.Unit
	}
	rv.Spent, rv.Remaining = amount(*u.Spent, u.Unit), amount(u.Remaining, u.Unit)
	rv.Source = u.Source
	if budget > 0 {
		rv.Fraction = *u.Spent / budget
	}
	rv.Overspent = u.Remaining < 0
	if u.ResetSeconds != nil {
		rv.ResetHuman = "in " + time.Duration(*u.ResetSeconds*float64(time.Second)).Round(time.Second).String()
	}
	return rv
}

// amount prints an amount of a report as its JSON does, with its unit.
func amount(f float64, unit string) string {
	return strconv.FormatFloat(f, 'f', -1, 64) + " " + unit
}

// budgetOf is the rule's budget per window, in words.
func budgetOf(q config.Quota, cfg *config.Config) string {
	if q.Cost != "" {
		currency := ""
		if t := cfg.Prices(); t != nil {
			currency = " " + t.Currency()
		}
		return q.Cost + currency
	}
	return strconv.Itoa(q.Tokens) + " tokens"
}

// shownIdentity is a stored identity as the page shows it: a hashed one
// (h.…, or !h.… for a long value) as it is, any other unescaped from its
// key form.
func shownIdentity(key string) string {
	if strings.HasPrefix(key, "h.") || strings.HasPrefix(key, "!") {
		return key
	}
	if v, err := url.QueryUnescape(key); err == nil {
		return v
	}
	return key
}

// shortLabel fits an identity in the chart's label column; the table
// beside it shows it whole.
func shortLabel(id string) string {
	const most = 22
	if r := []rune(id); len(r) > most {
		return string(r[:most-1]) + "…"
	}
	return id
}

func chartOf(rows []rowView) chartView {
	c := chartView{Width: chartLabel + chartBar + chartValue, Height: chartRow*len(rows) + 4,
		BarX: chartLabel, FullWidth: chartBar, ValueX: chartLabel + chartBar + 6}
	for i, r := range rows {
		c.Bars = append(c.Bars, barView{
			Y:         i*chartRow + 2,
			Width:     max(1, int(min(r.Fraction, 1)*chartBar)),
			Label:     shortLabel(r.Identity),
			Value:     strconv.FormatFloat(100*r.Fraction, 'f', 0, 64) + "%",
			Overspent: r.Overspent,
		})
	}
	return c
}
