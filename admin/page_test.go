package admin

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/net/html"

	"github.com/tokengate/tokengate/extproc"
)

// A request without a session or the token gets no page: it is sent to
// the sign-in form, and no number of the store is in the answer; a wrong
// token is refused at sign-in and gets no cookie; without a configured
// token there is no page and no sign-in.
func TestBudgetPageWithoutTheTokenShowsNoData(t *testing.T) {
	f := newFixture(t, testConfig, testToken, false)
	f.spend(t, "team-monthly", "acme", 12_500_000)
	c := f.client(t)
	for _, tc := range []struct{ name, auth, cookie string }{
		{"nothing", "", ""},
		{"a wrong bearer token", "Bearer wrong", ""},
		{"the token without a bearer scheme", testToken, ""},
		{"a session cookie the server never made", "", "forged"},
	} {
		req, err := http.NewRequest(http.MethodGet, f.srv.URL+pagePath, nil)
		if err != nil {
			t.Fatal(err)
		}
		if tc.auth != "" {
			req.Header.Set("authorization", tc.auth)
		}
		if tc.cookie != "" {
			req.AddCookie(&http.Cookie{Name: cookieName, Value: tc.cookie})
		}
		a := do(t, c, req)
		if a.status != http.StatusSeeOther || a.header.Get("location") != signInPath || strings.Contains(a.body, "acme") {
			t.Errorf("GET /budget with %s: %d, location %q, body %q; want 303 to the sign-in form without data", tc.name, a.status, a.header.Get("location"), a.body)
		}
	}
	for _, tok := range []string{"wrong", "", testToken + "x", testToken[:len(testToken)-1]} {
		a := f.signIn(t, c, tok)
		if a.status != http.StatusUnauthorized || !strings.Contains(a.body, "That is not the admin token") ||
			a.header.Get("set-cookie") != "" || strings.Contains(a.body, "acme") {
			t.Errorf("sign-in with %q: %d, set-cookie %q; want 401, the form again, no cookie", tok, a.status, a.header.Get("set-cookie"))
		}
	}
	if a := f.get(t, c, pagePath, ""); a.status != http.StatusSeeOther {
		t.Errorf("after failed sign-ins GET /budget = %d, want 303", a.status)
	}

	off := newFixture(t, testConfig, "", false)
	if a := off.get(t, c, pagePath, "Bearer "+testToken); a.status != http.StatusForbidden || !strings.Contains(a.body, "admin_api.token_env") {
		t.Errorf("GET /budget without a configured token: %d %q, want 403 naming admin_api.token_env", a.status, a.body)
	}
	if a := off.signIn(t, c, testToken); a.status != http.StatusForbidden || a.header.Get("set-cookie") != "" {
		t.Errorf("sign-in without a configured token: %d, set-cookie %q; want 403 and no cookie", a.status, a.header.Get("set-cookie"))
	}
}

// Signing in sets a session cookie that scripts cannot read (HttpOnly),
// that no other site's request carries (SameSite=Strict), scoped to the
// page, Secure when the listener has TLS; signing out ends the session,
// on the server too: the old cookie no longer opens the page.
func TestSignInCookieIsHttpOnlyStrictAndSignOutEndsIt(t *testing.T) {
	for _, tls := range []bool{false, true} {
		f := newFixture(t, testConfig, testToken, tls)
		f.spend(t, "team-monthly", "acme", 12_500_000)
		c := f.client(t)
		a := f.signIn(t, c, "  "+testToken+"\n") // pasted with space around it
		if a.status != http.StatusSeeOther || a.header.Get("location") != pagePath {
			t.Fatalf("sign-in (TLS %v): %d, location %q; want 303 to the page", tls, a.status, a.header.Get("location"))
		}
		cookies := (&http.Response{Header: a.header}).Cookies()
		if len(cookies) != 1 {
			t.Fatalf("sign-in set %d cookies, want one: %q", len(cookies), a.header.Values("set-cookie"))
		}
		ck := cookies[0]
		if ck.Name != cookieName || !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != pagePath || ck.Secure != tls ||
			ck.MaxAge != int(sessionTTL.Seconds()) || len(ck.Value) < 40 {
			t.Errorf("session cookie (TLS %v) = %+v; want HttpOnly, SameSite=Strict, Path=/budget, Secure only with TLS, 8h, a long random value", tls, ck)
		}
		if a := f.get(t, c, pagePath, ""); a.status != http.StatusOK || !strings.Contains(a.body, "acme") || !strings.Contains(a.body, `id="sign-out"`) {
			t.Fatalf("GET /budget signed in: %d; want the page with acme and a sign-out button:\n%s", a.status, a.body)
		}
		req, err := http.NewRequest(http.MethodPost, f.srv.URL+signOutPath, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("origin", f.srv.URL)
		if a := do(t, c, req); a.status != http.StatusSeeOther || a.header.Get("location") != signInPath {
			t.Errorf("sign-out: %d, location %q; want 303 to the sign-in form", a.status, a.header.Get("location"))
		}
		req, err = http.NewRequest(http.MethodGet, f.srv.URL+pagePath, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.AddCookie(ck) // the old cookie, kept by someone
		if a := do(t, f.client(t), req); a.status != http.StatusSeeOther || strings.Contains(a.body, "acme") {
			t.Errorf("GET /budget with the cookie of a session signed out: %d; want 303 to the sign-in form", a.status)
		}
	}
}

// A form posted from another origin is refused before it is read: a
// sign-in from another site gets no cookie, and a sign-out from another
// site does not end the session.
func TestSignInAndOutRefuseCrossOriginPosts(t *testing.T) {
	f := newFixture(t, testConfig, testToken, false)
	c := f.client(t)
	if a := f.signIn(t, c, testToken); a.status != http.StatusSeeOther {
		t.Fatalf("sign-in: %d", a.status)
	}
	for _, path := range []string{signInPath, signOutPath} {
		for _, h := range []map[string]string{
			{"sec-fetch-site": "cross-site", "origin": "https://evil.example"},
			{"origin": "https://evil.example"},
		} {
			req, err := http.NewRequest(http.MethodPost, f.srv.URL+path, strings.NewReader("token="+testToken))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("content-type", "application/x-www-form-urlencoded")
			for k, v := range h {
				req.Header.Set(k, v)
			}
			if a := do(t, c, req); a.status != http.StatusForbidden || a.header.Get("set-cookie") != "" {
				t.Errorf("POST %s with %v: %d, set-cookie %q; want 403 and no cookie", path, h, a.status, a.header.Get("set-cookie"))
			}
		}
	}
	if a := f.get(t, c, pagePath, ""); a.status != http.StatusOK {
		t.Errorf("after a cross-site sign-out the session ended: GET /budget = %d", a.status)
	}
}

// Sessions last sessionTTL and are bounded in number: past maxSessions
// the one that expires first makes room.
func TestSessionsExpireAndAreBounded(t *testing.T) {
	now := time.Date(2026, 3, 31, 12, 0, 0, 0, time.UTC)
	ss := newSessions(func() time.Time { return now })
	first, _ := ss.start()
	if !ss.valid(first) || ss.valid("") || ss.valid(first+"x") {
		t.Fatal("a new session is not valid, or a wrong one is")
	}
	now = now.Add(sessionTTL - time.Second)
	if !ss.valid(first) {
		t.Error("a session ended before its TTL")
	}
	now = now.Add(time.Second)
	if ss.valid(first) {
		t.Error("a session outlived its TTL")
	}
	ids := make([]string, maxSessions+1)
	for i := range ids {
		ids[i], _ = ss.start()
		now = now.Add(time.Second)
	}
	if ss.valid(ids[0]) || !ss.valid(ids[1]) || !ss.valid(ids[maxSessions]) {
		t.Error("past maxSessions the oldest session was not the one ended")
	}
	if n := len(ss.m); n != maxSessions {
		t.Errorf("%d sessions kept, want at most %d", n, maxSessions)
	}
	ss.end(ids[1])
	if ss.valid(ids[1]) {
		t.Error("a session ended is still valid")
	}
}

// The page shows, per policy and quota, the identities that spent most of
// the current window, largest first, each with the numbers of its usage
// report, the one GET /v1/usage answers: spent, budget (an override's
// where there is one), remaining (below zero when overspent), and where
// the limit comes from; hashed identities hashed, never raw; every value
// escaped; the refusals this gateway counted. It has no script.
func TestBudgetPageShowsTopSpendersAsTheUsageReportHas(t *testing.T) {
	f := newFixture(t, testConfig, testToken, false)
	alice, bob, carol := extproc.IdentityKey("sk-alice", true), extproc.IdentityKey("sk-bob", true), extproc.IdentityKey("sk-carol", true)
	f.spend(t, "key-daily", alice, 600)
	f.spend(t, "key-daily", bob, 1200)
	f.spend(t, "key-daily", carol, 50)
	f.spend(t, "team-monthly", "acme", 12_500_000)
	f.spend(t, "team-monthly", "globex", 3_000_000)
	evil := "<b>evil</b>"
	f.spend(t, "team-monthly", extproc.IdentityKey(evil, false), 1_000_000)
	if a := f.put(t, "/v1/limits/teams/team-monthly/globex", `{"cost":"200"}`); a.status != http.StatusOK {
		t.Fatalf("override: %d %s", a.status, a.body)
	}
	for _, o := range []extproc.Outcome{
		{Policy: "teams", Decision: "refused_budget", Budget: "team-monthly"},
		{Policy: "teams", Decision: "refused_budget", Budget: "team-monthly"},
		{Policy: "teams", Decision: "refused_tokens"},
	} {
		f.metrics.Finish(o)
	}

	c := f.client(t)
	if a := f.signIn(t, c, testToken); a.status != http.StatusSeeOther {
		t.Fatalf("sign-in: %d", a.status)
	}
	a := f.get(t, c, pagePath+"?top=2", "")
	if a.status != http.StatusOK {
		t.Fatalf("GET /budget: %d %s", a.status, a.body)
	}
	if csp := a.header.Get("content-security-policy"); !strings.Contains(csp, "default-src 'none'") || strings.Contains(csp, "unsafe") {
		t.Errorf("content-security-policy %q; want default-src 'none' and nothing unsafe", csp)
	}
	for _, bad := range []string{"<script", "sk-alice", "sk-bob", evil, "http://", "https://"} {
		if strings.Contains(a.body, bad) {
			t.Errorf("the page contains %q", bad)
		}
	}
	p := parsePage(t, a.body)

	keys := p.quotas["teams/key-daily"]
	if got := identities(keys.rows); !slices.Equal(got, []string{bob, alice}) {
		t.Errorf("key-daily rows %q, want the two largest, bob then alice, hashed", got)
	}
	if keys.shown != "Showing 2 of 3 identities with spend, most first." {
		t.Errorf("key-daily note %q", keys.shown)
	}
	teams := p.quotas["teams/team-monthly"]
	if got := identities(teams.rows); !slices.Equal(got, []string{"acme", "globex"}) {
		t.Errorf("team-monthly rows %q, want acme then globex", got)
	}
	if teams.refused != "2" || keys.refused != "0" {
		t.Errorf("refused by team-monthly %q and key-daily %q, want 2 and 0", teams.refused, keys.refused)
	}
	if want := map[string]string{"refused_budget": "2", "refused_tokens": "1"}; !cmp.Equal(p.refusals["teams"], want) {
		t.Errorf("teams' refusals %v, want %v", p.refusals["teams"], want)
	}
	if !strings.Contains(p.text, "No quotas") {
		t.Error("the policy without quotas does not say so")
	}

	// Every row says what GET /v1/usage says of that identity.
	for _, r := range keys.rows {
		want := usageRow(t, f.usage(t, "policy=teams&hashed=true&identity=key="+r["identity"]), "key-daily")
		if d := cmp.Diff(want, r); d != "" {
			t.Errorf("key-daily row of %s (-usage +page):\n%s", r["identity"], d)
		}
	}
	for _, r := range teams.rows {
		want := usageRow(t, f.usage(t, "policy=teams&identity=team="+r["identity"]), "team-monthly")
		if d := cmp.Diff(want, r); d != "" {
			t.Errorf("team-monthly row of %s (-usage +page):\n%s", r["identity"], d)
		}
	}
	if r := keys.rows[0]; r["remaining"] != "-200 tokens" || r["budget"] != "1000 tokens" {
		t.Errorf("bob's row %v; want 1000 tokens of budget and -200 remaining", r)
	}
	if r := teams.rows[1]; r["source"] != "override" || r["budget"] != "200.00 USD" || r["spent"] != "3 USD" {
		t.Errorf("globex's row %v; want the override's 200.00 USD, 3 USD spent", r)
	}

	// The escaped name is there, as text.
	all := f.get(t, c, pagePath, "")
	if got := identities(parsePage(t, all.body).quotas["teams/team-monthly"].rows); !slices.Contains(got, evil) {
		t.Errorf("team-monthly rows %q do not show the team %q as text", got, evil)
	}
	if !strings.Contains(all.body, "&lt;b&gt;evil&lt;/b&gt;") || strings.Contains(all.body, evil) {
		t.Error("the team name is not escaped")
	}
	if a := f.get(t, c, pagePath+"?top=0", ""); a.status != http.StatusBadRequest {
		t.Errorf("top=0: %d, want 400", a.status)
	}
}

// "Refused on this gateway" lists the requests this gateway refused, by
// decision (docs/operations.md, The budget page): not those it let on,
// admitted or passed unmetered (a GET without a body).
func TestBudgetPageListsOnlyRefusals(t *testing.T) {
	f := newFixture(t, testConfig, testToken, false)
	for _, o := range []extproc.Outcome{
		{Policy: "teams", Decision: "unmetered"},
		{Policy: "teams", Decision: "unmetered"},
		{Policy: "teams", Decision: "admitted"},
		{Policy: "teams", Decision: "refused_tokens"},
		{Policy: "teams", Decision: "bad_request"},
		{Policy: "plain", Decision: "unmetered"},
	} {
		f.metrics.Finish(o)
	}
	a := f.get(t, f.srv.Client(), pagePath, "Bearer "+testToken)
	if a.status != http.StatusOK {
		t.Fatalf("GET /budget: %d %s", a.status, a.body)
	}
	want := map[string]map[string]string{
		"teams": {"refused_tokens": "1", "bad_request": "1"},
		"plain": {},
	}
	if d := cmp.Diff(want, parsePage(t, a.body).refusals); d != "" {
		t.Errorf("refused on this gateway (-want +got):\n%s", d)
	}
}

func (f *fixture) put(t *testing.T, path, body string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, f.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("authorization", "Bearer "+testToken)
	return do(t, f.srv.Client(), req)
}

// usageRow is a quota's rule of rep as the page's table shows it.
func usageRow(t *testing.T, rep UsageReport, quota string) map[string]string {
	t.Helper()
	for _, u := range rep.Rules {
		if u.Rule != quota {
			continue
		}
		budget := strconv.Itoa(u.Limit.Tokens) + " tokens"
		if u.Limit.Cost != "" {
			budget = string(u.Limit.Cost) + " " + u.Unit
		}
		id := ""
		for _, v := range rep.Identities {
			id = shownIdentity(v)
		}
		return map[string]string{
			"identity": id, "spent": strconv.FormatFloat(*u.Spent, 'f', -1, 64) + " " + u.Unit, "budget": budget,
			"remaining": strconv.FormatFloat(u.Remaining, 'f', -1, 64) + " " + u.Unit, "source": u.Source,
		}
	}
	t.Fatalf("no rule %q in %+v", quota, rep)
	return nil
}

// page is what a parsed budget page shows.
type page struct {
	text     string
	quotas   map[string]pageQuota         // policy/quota → its section
	refusals map[string]map[string]string // policy → decision → count
}

type pageQuota struct {
	rows    []map[string]string // identity, spent, budget, remaining, source
	shown   string
	refused string
}

func identities(rows []map[string]string) []string {
	var out []string
	for _, r := range rows {
		out = append(out, r["identity"])
	}
	return out
}

func attr(n *html.Node, key string) string {
	for _, a := range n.Attr {
		if a.Key == key {
			return a.Val
		}
	}
	return ""
}

func hasClass(n *html.Node, class string) bool {
	return n.Type == html.ElementNode && slices.Contains(strings.Fields(attr(n, "class")), class)
}

func text(n *html.Node) string {
	var b strings.Builder
	for d := range n.Descendants() {
		if d.Type == html.TextNode {
			b.WriteString(d.Data)
		}
	}
	return strings.Join(strings.Fields(b.String()), " ")
}

func parsePage(t *testing.T, body string) page {
	t.Helper()
	doc, err := html.Parse(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	p := page{text: text(doc), quotas: map[string]pageQuota{}, refusals: map[string]map[string]string{}}
	for sec := range doc.Descendants() {
		if !hasClass(sec, "policy") {
			continue
		}
		policy := attr(sec, "data-policy")
		p.refusals[policy] = map[string]string{}
		for n := range sec.Descendants() {
			switch {
			case hasClass(n, "refusal"):
				for b := range n.Descendants() {
					if b.Type == html.ElementNode && b.Data == "b" {
						p.refusals[policy][attr(n, "data-decision")] = text(b)
					}
				}
			case hasClass(n, "quota"):
				var q pageQuota
				for m := range n.Descendants() {
					switch {
					case hasClass(m, "shown"):
						q.shown = text(m)
					case hasClass(m, "quota-refused"):
						q.refused = text(m)
					case hasClass(m, "row"):
						r := map[string]string{}
						var cells []*html.Node
						for td := range m.Descendants() {
							if td.Type == html.ElementNode && td.Data == "td" {
								cells = append(cells, td)
							}
						}
						if len(cells) != 7 {
							t.Fatalf("a row with %d cells", len(cells))
						}
						r["identity"], r["spent"], r["budget"], r["remaining"], r["source"] = text(cells[0]), text(cells[1]), text(cells[2]), text(cells[3]), text(cells[5])
						if attr(m, "data-identity") != r["identity"] {
							t.Errorf("row data-identity %q, cell %q", attr(m, "data-identity"), r["identity"])
						}
						q.rows = append(q.rows, r)
					}
				}
				p.quotas[policy+"/"+attr(n, "data-quota")] = q
			}
		}
	}
	return p
}
