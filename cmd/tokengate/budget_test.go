package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/tokengate/tokengate/admin"
)

// chromiumBinary is Debian's chromium. Without it the test is skipped,
// except in CI, where .ci/run installs it and its absence is a failure.
func chromiumBinary(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("chromium is not installed (apt-get install chromium; .ci/run and make test install it)")
		}
		t.Skip("chromium is not installed: apt-get install chromium, or run make test")
	}
	return bin
}

// servedDemo is `tokengate demo --serve` running as a process.
type servedDemo struct {
	base, admin, token string
	stdout, stderr     *syncBuffer
}

var demoHelpLines = regexp.MustCompile(`(?m)^tokengate demo stack listening on (\S+) .*\n(?:.*\n)*?budget page on (\S+)/budget \(sign in with the admin token (\w+)\)`)

// startServedDemo runs the binary's demo --serve on free ports and reads
// its addresses and admin token from what it prints.
func startServedDemo(t *testing.T) *servedDemo {
	t.Helper()
	cmd := exec.Command(tokengateBinary(t), "demo", "--serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--token-delay", "0s")
	d := &servedDemo{stdout: &syncBuffer{}, stderr: &syncBuffer{}}
	cmd.Stdout, cmd.Stderr = d.stdout, d.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGINT)
		if err := cmd.Wait(); err != nil {
			t.Errorf("demo --serve: %v\n%s", err, lastLines(d.stderr.String(), 10))
		}
	})
	poll(t, func() error {
		m := demoHelpLines.FindStringSubmatch(d.stdout.String())
		if m == nil {
			return fmt.Errorf("demo --serve printed no addresses yet:\n%s%s", d.stdout.String(), d.stderr.String())
		}
		d.base, d.admin, d.token = m[1], m[2], m[3]
		return nil
	})
	return d
}

// ask sends one chat request of user through the demo's stand-in (path
// picks the policy's route) and returns its status.
func (d *servedDemo) ask(t *testing.T, path, user string, maxTokens int) int {
	t.Helper()
	body := fmt.Sprintf(`{"model":"gpt-4o-mini","max_tokens":%d,"messages":[{"role":"user","content":"Tell me about token buckets."}]}`, maxTokens)
	req, err := http.NewRequest(http.MethodPost, d.base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	req.Header.Set("x-user-id", user)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode
}

// call asks the demo's admin listener with the admin token.
func (d *servedDemo) call(t *testing.T, path string, v any) string {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, d.admin+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("authorization", "Bearer "+d.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s %v\n%s", path, resp.Status, err, b)
	}
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("GET %s: %v\n%s", path, err, b)
		}
	}
	return string(b)
}

// sample is the value of one sample line of a Prometheus text exposition.
func sample(metricsText, line string) int {
	for _, l := range strings.Split(metricsText, "\n") {
		if v, ok := strings.CutPrefix(l, line+" "); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return 0
}

// pageQuota is one quota's section of the budget page as the browser
// shows it.
type pageQuota struct {
	Policy, Quota, Refused string
	Rows                   [][]string // per identity: its cells
}

// The budget page, in a real headless Chromium, on `tokengate demo
// --serve` after a scripted load of several tenants: without a session it
// shows the sign-in form and no data; a wrong token is refused; the right
// one signs in with an HttpOnly, SameSite=Strict cookie that scripts
// cannot read; every identity's numbers are those GET /v1/usage answers
// for it, and the refusals those of /metrics; a screenshot of the page is
// kept; signing out shows the form again.
func TestBudgetPageInABrowser(t *testing.T) {
	chromium := chromiumBinary(t)
	d := startServedDemo(t)

	// The load: four tenants on the demo route, one on the capped one;
	// bob until his 1000-token bucket refuses.
	type tenant struct {
		policy, path, user string
		asks               []int // max_tokens of each request
	}
	tenants := []tenant{
		{"demo", "/v1/chat/completions", "alice", []int{50, 50, 120}},
		{"demo", "/v1/chat/completions", "bob", []int{300, 300, 300, 300}},
		{"demo", "/v1/chat/completions", "carol", []int{200, 400}},
		{"demo", "/v1/chat/completions", "erin", []int{20}},
		{"capped", "/capped/v1/chat/completions", "dave", []int{60, 60}},
	}
	sent, refused := 0, 0
	for _, tn := range tenants {
		for _, n := range tn.asks {
			switch st := d.ask(t, tn.path, tn.user, n); st {
			case http.StatusOK:
			case http.StatusTooManyRequests:
				refused++
			default:
				t.Fatalf("%s asking for %d tokens: %d", tn.user, n, st)
			}
			sent++
		}
	}
	if refused == 0 {
		t.Fatal("the load was never refused: bob's bucket should have been emptied")
	}
	// Every request has finished and settled once the metrics count it.
	var metricsText string
	poll(t, func() error {
		metricsText = d.call(t, "/metrics", nil)
		n := 0
		for _, p := range []string{"demo", "capped"} {
			for _, dec := range []string{"admitted", "refused_tokens"} {
				n += sample(metricsText, fmt.Sprintf(`tokengate_requests_total{decision=%q,policy=%q}`, dec, p))
			}
		}
		if n != sent {
			return fmt.Errorf("%d of %d requests counted", n, sent)
		}
		return nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	actx, acancel := chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(chromium),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1100, 900),
	)
	defer acancel()
	bctx, bcancel := chromedp.NewContext(actx)
	defer bcancel()
	page := d.admin + "/budget"

	// No session: the sign-in form, and none of the tenants.
	must(t, "open the page", chromedp.Do(bctx, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.CSS("#sign-in"))))
	if loc := browse(t, bctx, chromedp.Location()); loc != d.admin+"/budget/sign-in" {
		t.Errorf("without a session the page went to %s, want the sign-in form", loc)
	}
	noData := func(step string) {
		t.Helper()
		body := browse(t, bctx, chromedp.Evaluate[string]("document.body.innerText"))
		for _, tn := range tenants {
			if strings.Contains(body, tn.user) {
				t.Errorf("%s: the page shows %s:\n%s", step, tn.user, body)
			}
		}
	}
	noData("before signing in")

	// A wrong token.
	must(t, "sign in with a wrong token", chromedp.Do(bctx,
		chromedp.SendKeys(chromedp.CSS("input[name=token]"), "not-"+d.token),
		chromedp.Click(chromedp.CSS("#sign-in")),
		chromedp.WaitVisible(chromedp.CSS("#wrong")),
	))
	noData("after a wrong token")
	if cs := cookies(t, bctx, d.admin); len(cs) != 0 {
		t.Errorf("a wrong token got cookies: %+v", cs)
	}

	// The right one.
	must(t, "sign in", chromedp.Do(bctx,
		chromedp.SendKeys(chromedp.CSS("input[name=token]"), d.token),
		chromedp.Click(chromedp.CSS("#sign-in")),
		chromedp.WaitVisible(chromedp.CSS("#sign-out")),
	))
	if loc := browse(t, bctx, chromedp.Location()); loc != page {
		t.Errorf("after signing in the browser is at %s, want %s", loc, page)
	}
	cs := cookies(t, bctx, page)
	if len(cs) != 1 || cs[0].Name != "tokengate_session" || !cs[0].HTTPOnly || cs[0].SameSite != network.CookieSameSiteStrict || cs[0].Secure {
		t.Errorf("session cookies %+v; want one tokengate_session, HttpOnly, SameSite=Strict, not Secure on plain HTTP", cs)
	}
	if c := browse(t, bctx, chromedp.Evaluate[string]("document.cookie")); c != "" {
		t.Errorf("a script reads the cookie %q", c)
	}

	// The numbers: each row as GET /v1/usage answers for that identity.
	quotas := browse(t, bctx, chromedp.Evaluate[[]pageQuota](`[...document.querySelectorAll(".quota")].map(q => ({
		Policy: q.closest(".policy").dataset.policy, Quota: q.dataset.quota,
		Refused: q.querySelector(".quota-refused").textContent.trim(),
		Rows: [...q.querySelectorAll("tr.row")].map(r => [...r.cells].map(c => c.textContent.trim())),
	}))`))
	shown := map[string][]string{}
	for _, q := range quotas {
		for _, row := range q.Rows {
			if len(row) != 7 {
				t.Fatalf("%s/%s: a row of %d cells: %q", q.Policy, q.Quota, len(row), row)
			}
			shown[q.Policy] = append(shown[q.Policy], row[0])
			var rep admin.UsageReport
			d.call(t, "/v1/usage?policy="+q.Policy+"&identity=user="+row[0], &rep)
			i := slices.IndexFunc(rep.Rules, func(u admin.UsageRule) bool { return u.Rule == q.Quota })
			if i < 0 || rep.Rules[i].Spent == nil {
				t.Fatalf("usage of %s has no quota %s: %+v", row[0], q.Quota, rep)
			}
			u := rep.Rules[i]
			want := []string{
				row[0],
				strconv.FormatFloat(*u.Spent, 'f', -1, 64) + " tokens",
				strconv.Itoa(u.Limit.Tokens) + " tokens",
				strconv.FormatFloat(u.Remaining, 'f', -1, 64) + " tokens",
			}
			if !slices.Equal(row[:4], want) || row[5] != u.Source || *u.Spent <= 0 {
				t.Errorf("%s/%s row %q; GET /v1/usage says %q from %s", q.Policy, q.Quota, row, want, u.Source)
			}
		}
		want := strconv.Itoa(sample(metricsText, fmt.Sprintf(`tokengate_quota_exhausted_total{policy=%q,quota=%q}`, q.Policy, q.Quota)))
		if q.Refused != want {
			t.Errorf("%s/%s: the page says %s refused, /metrics %s", q.Policy, q.Quota, q.Refused, want)
		}
	}
	if want := []string{"bob", "carol", "alice", "erin"}; !slices.Equal(shown["demo"], want) {
		t.Errorf("demo's spenders on the page %q, want %q (most first)", shown["demo"], want)
	}
	if want := []string{"dave"}; !slices.Equal(shown["capped"], want) {
		t.Errorf("capped's spenders on the page %q, want %q", shown["capped"], want)
	}
	got := browse(t, bctx, chromedp.Evaluate[string](`document.querySelector('.policy[data-policy="demo"] .refusal[data-decision="refused_tokens"] b').textContent`))
	if want := strconv.Itoa(sample(metricsText, `tokengate_requests_total{decision="refused_tokens",policy="demo"}`)); got != want || got != strconv.Itoa(refused) {
		t.Errorf("the page says demo refused_tokens %s; /metrics %s, the load saw %d", got, want, refused)
	}

	// The screenshot, kept.
	shot := browse(t, bctx, chromedp.FullScreenshot(100))
	img, err := png.Decode(bytes.NewReader(shot))
	if err != nil || img.Bounds().Dx() < 600 || img.Bounds().Dy() < 600 {
		t.Fatalf("screenshot: %v, %v", err, img)
	}
	file := filepath.Join(t.ArtifactDir(), "budget-page.png")
	if err := os.WriteFile(file, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot of the budget page (%dx%d): %s (kept with go test -artifacts)", img.Bounds().Dx(), img.Bounds().Dy(), file)

	// Sign out: the form again, the session gone.
	must(t, "sign out", chromedp.Do(bctx,
		chromedp.Click(chromedp.CSS("#sign-out")),
		chromedp.WaitVisible(chromedp.CSS("#sign-in")),
		chromedp.Navigate(page),
		chromedp.WaitVisible(chromedp.CSS("#sign-in")),
	))
	noData("after signing out")
	if cs := cookies(t, bctx, page); len(cs) != 0 {
		t.Errorf("cookies after signing out: %+v", cs)
	}
}

func must(t *testing.T, step string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", step, err)
	}
}

func browse[T any](t *testing.T, ctx context.Context, a chromedp.Action[T]) T {
	t.Helper()
	v, err := chromedp.Run(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func cookies(t *testing.T, ctx context.Context, u string) []*network.Cookie {
	t.Helper()
	res, err := chromedp.Call(ctx, network.GetCookies, network.GetCookiesParams{URLs: []string{u}})
	if err != nil {
		t.Fatal(err)
	}
	return res.Cookies
}
