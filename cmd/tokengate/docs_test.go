package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tokengate/tokengate/metrics"
)

// docFiles are the Markdown files a user reads: the README, docs/ and the
// examples' READMEs.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{filepath.Join(repoRoot, "README.md")}
	for _, pattern := range []string{"docs/*.md", "examples/*/README.md"} {
		m, err := filepath.Glob(filepath.Join(repoRoot, pattern))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	return files
}

// markdown is a Markdown file read for its links and headings; text inside
// code blocks and code spans is neither.
type markdown struct {
	links    []mdLink
	anchors  map[string]bool
	sections map[string]string // heading text → the lines under it
}

type mdLink struct {
	line   int
	target string
}

var (
	linkRE     = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)\)`)
	codeSpanRE = regexp.MustCompile("`[^`]*`")
)

func readMarkdown(t *testing.T, file string) markdown {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	md := markdown{anchors: map[string]bool{}, sections: map[string]string{}}
	seen := map[string]int{}
	fenced := false
	heading := ""
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			md.sections[heading] += line + "\n"
			continue
		}
		if fenced {
			md.sections[heading] += line + "\n"
			continue
		}
		if h, ok := headingText(line); ok {
			heading = h
			slug := githubSlug(h)
			if k := seen[slug]; k > 0 {
				md.anchors[fmt.Sprintf("%s-%d", slug, k)] = true
			} else {
				md.anchors[slug] = true
			}
			seen[slug]++
			continue
		}
		md.sections[heading] += line + "\n"
		for _, m := range linkRE.FindAllStringSubmatch(codeSpanRE.ReplaceAllString(line, ""), -1) {
			md.links = append(md.links, mdLink{n, m[1]})
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return md
}

func headingText(line string) (string, bool) {
	trimmed := strings.TrimLeft(line, "#")
	if n := len(line) - len(trimmed); n == 0 || n > 6 || !strings.HasPrefix(trimmed, " ") {
		return "", false
	}
	return strings.TrimSpace(trimmed), true
}

// githubSlug is the anchor GitHub gives a heading: its text without
// Markdown, lower case, with everything but letters, digits, spaces, '-' and
// '_' dropped and spaces turned into '-'.
func githubSlug(heading string) string {
	heading = linkRE.ReplaceAllStringFunc(heading, func(s string) string { return s[1:strings.Index(s, "](")] })
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

// Every relative link in the README, docs/ and the examples' READMEs points
// at a file or folder of the repository, and every #anchor at a heading of
// its file.
func TestDocLinks(t *testing.T) {
	root, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, file := range docFiles(t) {
		md := readMarkdown(t, file)
		for _, l := range md.links {
			if strings.Contains(l.target, "://") || strings.HasPrefix(l.target, "mailto:") {
				continue
			}
			checked++
			path, anchor, _ := strings.Cut(l.target, "#")
			target := file
			if path != "" {
				target = filepath.Join(filepath.Dir(file), path)
				abs, err := filepath.Abs(target)
				if err != nil {
					t.Fatal(err)
				}
				if rel, err := filepath.Rel(root, abs); err != nil || strings.HasPrefix(rel, "..") {
					t.Errorf("%s:%d: %s points outside the repository", file, l.line, l.target)
					continue
				}
				if _, err := os.Stat(target); err != nil {
					t.Errorf("%s:%d: %s: %v", file, l.line, l.target, err)
					continue
				}
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(target, ".md") {
				t.Errorf("%s:%d: %s: an anchor into a file that is not Markdown", file, l.line, l.target)
				continue
			}
			if !readMarkdown(t, target).anchors[anchor] {
				t.Errorf("%s:%d: %s: no heading with anchor #%s", file, l.line, l.target, anchor)
			}
		}
	}
	if checked < 30 {
		t.Errorf("checked only %d links", checked)
	}
}

// descRecorder is a prometheus.Registerer that keeps every description of
// what is registered on it.
type descRecorder struct {
	prometheus.Registerer
	descs []*prometheus.Desc
}

func (r *descRecorder) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		r.descs = append(r.descs, d)
	}
	return r.Registerer.Register(c)
}

func (r *descRecorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

var (
	descNameRE   = regexp.MustCompile(`fqName: "([^"]+)"`)
	descLabelsRE = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
	readmeMetric = regexp.MustCompile("`((?:tokengate|gen_ai)_[a-z_]+)(\\{([a-z_,]*)\\})?`")
)

// registeredMetrics are the metrics package metrics registers, by name,
// with their labels.
func registeredMetrics(t *testing.T) map[string]string {
	t.Helper()
	rec := &descRecorder{Registerer: prometheus.NewRegistry()}
	metrics.New(rec, metrics.Options{})
	code := map[string]string{}
	for _, d := range rec.descs {
		name := descNameRE.FindStringSubmatch(d.String())
		labels := descLabelsRE.FindStringSubmatch(d.String())
		if name == nil || labels == nil {
			t.Fatalf("cannot read %s", d)
		}
		code[name[1]] = labels[1]
	}
	return code
}

// Every tokengate metric that serve exports is registered by package
// metrics, so that TestReadmeMetrics sees it: none is registered
// elsewhere.
func TestServeExportsOnlyPackageMetrics(t *testing.T) {
	bin := tokengateBinary(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	if err := os.WriteFile(file, []byte(liveConfig("store: {type: memory}", 1000)), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken}, "--config", file)
	body, err := getBody(p.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	code := registeredMetrics(t)
	seen := 0
	for _, m := range regexp.MustCompile(`(?m)^# HELP ((?:tokengate|gen_ai)_[a-z_]+) `).FindAllStringSubmatch(body, -1) {
		seen++
		if _, ok := code[m[1]]; !ok {
			t.Errorf("serve exports %s, which package metrics does not register (the README's table cannot be checked against it)", m[1])
		}
	}
	// The metrics that exist before any request: the store's health, the
	// reload counter, the overrides in force.
	if seen < 4 {
		t.Errorf("serve exported %d tokengate metrics before any request:\n%s", seen, body)
	}
	p.stop(t)
}

// The README's metrics table lists exactly the metrics the code registers,
// each with its labels.
func TestReadmeMetrics(t *testing.T) {
	code := registeredMetrics(t)
	md := readMarkdown(t, filepath.Join(repoRoot, "README.md"))
	section := md.sections["Operating it"]
	i := strings.Index(section, "<!-- metrics:")
	if i < 0 {
		t.Fatal(`the README's "Operating it" section has no <!-- metrics: --> table`)
	}
	readme := map[string]string{}
	for _, m := range readmeMetric.FindAllStringSubmatch(section[i:], -1) {
		readme[m[1]] = m[3]
	}
	for name, labels := range code {
		got, ok := readme[name]
		switch {
		case !ok:
			t.Errorf("the README does not list %s{%s}", name, labels)
		case got != labels:
			t.Errorf("the README lists %s{%s}, the code labels it {%s}", name, got, labels)
		}
	}
	for name := range readme {
		if _, ok := code[name]; !ok {
			t.Errorf("the README lists %s, which the code does not register", name)
		}
	}
}

// The Envoy snippets the README tells users to paste pass `tokengate
// validate`.
func TestReadmeEnvoySnippets(t *testing.T) {
	bin := tokengateBinary(t)
	data, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	snippets := regexp.MustCompile("(?s)<!-- envoy-snippet:[^>]*-->\n```yaml\n(.*?)```").FindAllStringSubmatch(string(data), -1)
	if len(snippets) == 0 {
		t.Fatal("found no marked Envoy snippet in the README, want at least the filter")
	}
	for i, s := range snippets {
		file := filepath.Join(t.TempDir(), fmt.Sprintf("snippet-%d.yaml", i))
		if err := os.WriteFile(file, []byte(s[1]), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, "validate", file).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "valid Envoy configuration") {
			t.Errorf("README snippet %d: %v\n%s\n%s", i+1, err, out, s[1])
		}
	}
}

// demoVolatile are the parts of the demo's output that vary with timing;
// the README's excerpt and the output are compared without them.
var demoVolatile = []struct {
	re   *regexp.Regexp
	repl string
}{
	{regexp.MustCompile(`(Remaining-Tokens:?) \d+`), "$1 N"},
	{regexp.MustCompile(`(Reset-Tokens:?) [0-9hmsµ.]+`), "$1 T"},
	{regexp.MustCompile(`(Retry-After:?) \d+`), "$1 N"},
	{regexp.MustCompile(`had sent \d+ of`), "had sent N of"},
	{regexp.MustCompile(`remaining \d+`), "remaining N"},
}

func normalizeDemo(line string) string {
	for _, v := range demoVolatile {
		line = v.re.ReplaceAllString(line, v.repl)
	}
	return strings.TrimRight(line, " ")
}

// checkReadmeDemoExcerpt requires every line of the README's demo excerpt
// to appear in output, in order.
func checkReadmeDemoExcerpt(t *testing.T, output string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)<!-- demo-output:[^>]*-->\n```\n(.*?)```\n<!-- demo-output: end -->").FindStringSubmatch(string(data))
	if m == nil {
		t.Fatal("the README has no demo excerpt between <!-- demo-output: --> comments")
	}
	var got []string
	for _, l := range strings.Split(output, "\n") {
		got = append(got, normalizeDemo(l))
	}
	excerpt := strings.Split(strings.TrimRight(m[1], "\n"), "\n")
	at := 0
	for _, want := range excerpt {
		i := slices.Index(got[at:], normalizeDemo(want))
		if i < 0 {
			t.Errorf("the README's demo excerpt has a line the demo does not print (at this point of its output):\n  %s\noutput:\n%s", want, output)
			return
		}
		at += i + 1
	}
}
