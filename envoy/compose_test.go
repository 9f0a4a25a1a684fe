package envoy

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"
)

// repoRoot is the repository root, seen from this package's directory.
const repoRoot = ".."

// composeFile is the part of the Compose specification the stack uses.
// Decoding is strict, so a misspelt key in docker-compose.yml fails here.
type composeFile struct {
	Name     string                    `json:"name"`
	Services map[string]composeService `json:"services"`
}

type composeService struct {
	Image       string                       `json:"image"`
	Build       *composeBuild                `json:"build"`
	PullPolicy  string                       `json:"pull_policy"`
	Command     []string                     `json:"command"`
	Volumes     []string                     `json:"volumes"`
	Ports       []string                     `json:"ports"`
	DependsOn   map[string]composeDependency `json:"depends_on"`
	Healthcheck *composeHealthcheck          `json:"healthcheck"`
	Environment map[string]string            `json:"environment"`
}

type composeDependency struct {
	Condition string `json:"condition"`
}

type composeHealthcheck struct {
	Test        []string `json:"test"`
	Interval    string   `json:"interval"`
	Timeout     string   `json:"timeout"`
	Retries     int      `json:"retries"`
	StartPeriod string   `json:"start_period"`
}

type composeBuild struct {
	Context    string `json:"context"`
	Dockerfile string `json:"dockerfile"`
}

func readCompose(t *testing.T) composeFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var c composeFile
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	return c
}

// pinnedTag matches an image pinned to a full release: name:1.2.3 or
// name:v1.2.3, with an optional variant suffix (-alpine).
var pinnedTag = regexp.MustCompile(`^[a-z0-9./_-]+:v?\d+\.\d+\.\d+(-[a-z0-9.]+)?$`)

func TestComposeServices(t *testing.T) {
	c := readCompose(t)
	var names []string
	for n := range c.Services {
		names = append(names, n)
	}
	slices.Sort(names)
	if diff := cmp.Diff([]string{"envoy", "grafana", "mockllm", "prometheus", "redis", "tokengate"}, names); diff != "" {
		t.Fatalf("services (-want +got):\n%s", diff)
	}
	for name, s := range c.Services {
		switch {
		case s.Build != nil:
			if s.Build.Dockerfile != "" {
				if _, err := os.Stat(filepath.Join(repoRoot, s.Build.Context, s.Build.Dockerfile)); err != nil {
					t.Errorf("service %s: build file: %v", name, err)
				}
			}
		case slices.ContainsFunc(names, func(n string) bool { return c.Services[n].Build != nil && c.Services[n].Image == s.Image }):
			// the image another service of the stack builds
		case !pinnedTag.MatchString(s.Image):
			t.Errorf("service %s: image %q is not pinned to a full release tag", name, s.Image)
		}
		for dep := range s.DependsOn {
			if _, ok := c.Services[dep]; !ok {
				t.Errorf("service %s depends on unknown service %q", name, dep)
			}
		}
	}

	envoy := c.Services["envoy"]
	if m := regexp.MustCompile(`^envoyproxy/envoy:v1\.37\.(\d+)$`).FindStringSubmatch(envoy.Image); m == nil {
		t.Errorf("envoy image = %q, want envoyproxy/envoy:v1.37.<patch>", envoy.Image)
	} else if patch, _ := strconv.Atoi(m[1]); patch < 6 {
		t.Errorf("envoy image = %q, want 1.37.6 or later (ext_proc lifetime and duplex body fixes)", envoy.Image)
	}
	if !slices.ContainsFunc(envoy.Ports, func(p string) bool { return strings.HasSuffix(p, ":10000") && !strings.HasPrefix(p, "127.") }) {
		t.Errorf("envoy ports = %q, want 10000 published", envoy.Ports)
	}
	if !strings.HasPrefix(c.Services["redis"].Image, "redis:") {
		t.Errorf("redis image = %q, want the official redis image", c.Services["redis"].Image)
	}

	tg, mock := c.Services["tokengate"], c.Services["mockllm"]
	if tg.Image != mock.Image || tg.Build == nil {
		t.Errorf("tokengate (image %q) must be built here and mockllm must run the same image (got %q)", tg.Image, mock.Image)
	}
	if diff := cmp.Diff([]string{"serve", "--config", "/etc/tokengate/tokengate.yaml"}, tg.Command); diff != "" {
		t.Errorf("tokengate command (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"mock-llm", "--listen", ":9000"}, mock.Command); diff != "" {
		t.Errorf("mockllm command (-want +got):\n%s", diff)
	}
	if !slices.Contains(tg.Volumes, "./examples/compose/tokengate.yaml:/etc/tokengate/tokengate.yaml:ro") {
		t.Errorf("tokengate volumes = %q, want examples/compose/tokengate.yaml mounted at /etc/tokengate/tokengate.yaml", tg.Volumes)
	}
}

// TestComposeFilesExist: every host file a service mounts is in the
// repository; Envoy YAML among them validates without errors.
func TestComposeFilesExist(t *testing.T) {
	c := readCompose(t)
	for name, s := range c.Services {
		for _, v := range s.Volumes {
			host, _, ok := strings.Cut(v, ":")
			if !ok || !strings.HasPrefix(host, "./") {
				t.Errorf("service %s: volume %q: want ./relative/host/path:/container/path", name, v)
				continue
			}
			data, err := os.ReadFile(filepath.Join(repoRoot, host))
			if err != nil {
				t.Errorf("service %s: volume %q: %v", name, v, err)
				continue
			}
			if LooksLikeEnvoy(data) {
				for _, p := range Validate(host, data) {
					if p.Severity == Error {
						t.Errorf("service %s: %v", name, p)
					}
				}
			}
		}
	}
}

// TestComposeAddressesMatch: the clusters of the mounted Envoy config reach
// the compose services on the ports they listen on.
func TestComposeAddressesMatch(t *testing.T) {
	c := readCompose(t)
	var b bootstrapv3.Bootstrap
	js, err := yaml.YAMLToJSON(Recommended())
	if err != nil {
		t.Fatal(err)
	}
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, cl := range b.GetStaticResources().GetClusters() {
		for _, e := range cl.GetLoadAssignment().GetEndpoints() {
			for _, lb := range e.GetLbEndpoints() {
				sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
				got[cl.GetName()] = sa.GetAddress() + ":" + strconv.Itoa(int(sa.GetPortValue()))
			}
		}
	}
	_, mockPort, _ := strings.Cut(c.Services["mockllm"].Command[len(c.Services["mockllm"].Command)-1], ":")
	want := map[string]string{
		"llm":       "mockllm:" + mockPort,
		"tokengate": "tokengate:50051",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("cluster addresses (-want +got):\n%s", diff)
	}
	for cluster, addr := range got {
		host, _, _ := strings.Cut(addr, ":")
		if _, ok := c.Services[host]; !ok {
			t.Errorf("cluster %s targets %s, which is not a compose service", cluster, addr)
		}
	}
}

// TestDockerfile checks the build the compose stack relies on.
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var froms []string
	var runs []string
	var entry, cmd string
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		word, rest, _ := strings.Cut(line, " ")
		switch strings.ToUpper(word) {
		case "FROM":
			froms = append(froms, rest)
		case "RUN":
			runs = append(runs, rest)
		case "ENTRYPOINT":
			entry = rest
		case "CMD":
			cmd = rest
		}
	}
	if len(froms) != 2 {
		t.Fatalf("FROM lines = %q, want a builder and a runtime stage", froms)
	}
	goVersion := goDirective(t)
	if !strings.HasPrefix(froms[0], "golang:"+goVersion) {
		t.Errorf("builder = %q, want golang:%s (go.mod)", froms[0], goVersion)
	}
	if !strings.Contains(froms[1], "distroless/static") && !strings.HasPrefix(froms[1], "alpine:") {
		t.Errorf("runtime = %q, want distroless/static or alpine", froms[1])
	}
	build := slices.IndexFunc(runs, func(r string) bool { return strings.Contains(r, "go build") })
	switch {
	case build < 0:
		t.Errorf("no RUN go build in %q", runs)
	case !strings.Contains(runs[build], "CGO_ENABLED=0") || !strings.Contains(runs[build], "./cmd/tokengate"):
		t.Errorf("build step %q, want CGO_ENABLED=0 and ./cmd/tokengate", runs[build])
	}
	if _, err := os.Stat(filepath.Join(repoRoot, "cmd", "tokengate")); err != nil {
		t.Errorf("the Dockerfile builds ./cmd/tokengate: %v", err)
	}
	if !strings.Contains(entry, "tokengate") {
		t.Errorf("ENTRYPOINT %s, want the tokengate binary (compose passes subcommands)", entry)
	}
	if cmd != `["serve", "--config", "/etc/tokengate/tokengate.yaml"]` {
		t.Errorf("CMD %s, want serve --config /etc/tokengate/tokengate.yaml", cmd)
	}
}

// goDirective returns the major.minor of go.mod's go line ("1.26").
func goDirective(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(data)
	if m == nil {
		t.Fatal("go.mod has no go directive")
	}
	return string(m[1])
}

// TestComposePolicyNames: every policy the Envoy config names through
// x-tokengate-policy exists in the tokengate config the stack mounts.
func TestComposePolicyNames(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "examples", "compose", "tokengate.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Policies []struct {
			Name string `json:"name"`
		} `json:"policies"`
	}
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	var have []string
	for _, p := range cfg.Policies {
		have = append(have, p.Name)
	}
	named := regexp.MustCompile(`key: x-tokengate-policy\s+value: (\S+)`).FindAllStringSubmatch(string(Recommended()), -1)
	if len(named) < 2 {
		t.Fatalf("found %d x-tokengate-policy entries in %s, want the default and per-route ones", len(named), RecommendedFile)
	}
	for _, m := range named {
		if !slices.Contains(have, m[1]) {
			t.Errorf("%s names policy %q; examples/compose/tokengate.yaml has %q", RecommendedFile, m[1], have)
		}
	}
}
