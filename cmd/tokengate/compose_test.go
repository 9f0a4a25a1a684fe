package main

import (
	"bufio"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/config"
)

// compose is what these tests read of docker-compose.yml.
type compose struct {
	Services map[string]struct {
		Image       string
		Build       *struct{ Context, Dockerfile string }
		PullPolicy  string `yaml:"pull_policy"`
		Command     []string
		Volumes     []string
		DependsOn   map[string]struct{ Condition string } `yaml:"depends_on"`
		Healthcheck *struct {
			Test []string
		}
	}
}

func readComposeFile(t *testing.T) compose {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var c compose
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	if len(c.Services) == 0 {
		t.Fatal("docker-compose.yml has no services")
	}
	return c
}

// Docker cannot run here, so the properties a user relies on are checked on
// the file: every service has an exec-form health check (the tokengate image
// has no shell), services start only when what they need is healthy, and one
// image is built once and reused.
func TestComposeHealthAndOrder(t *testing.T) {
	c := readComposeFile(t)
	for name, s := range c.Services {
		if s.Healthcheck == nil || len(s.Healthcheck.Test) < 2 || s.Healthcheck.Test[0] != "CMD" {
			t.Errorf("service %s: healthcheck %+v, want test: [\"CMD\", ...]", name, s.Healthcheck)
		}
		for dep, d := range s.DependsOn {
			if d.Condition != "service_healthy" {
				t.Errorf("service %s depends on %s with condition %q, want service_healthy", name, dep, d.Condition)
			}
		}
	}
	order := map[string][]string{}
	for name, s := range c.Services {
		for dep := range s.DependsOn {
			order[name] = append(order[name], dep)
		}
		slices.Sort(order[name])
	}
	want := map[string][]string{"envoy": {"mockllm", "tokengate"}, "tokengate": {"redis"}, "prometheus": {"tokengate"}, "grafana": {"prometheus"}}
	if d := cmp.Diff(want, order); d != "" {
		t.Errorf("depends_on (-want +got):\n%s", d)
	}

	// One image, built once.
	var builders []string
	for name, s := range c.Services {
		if s.Build != nil {
			builders = append(builders, name)
		}
	}
	if len(builders) != 1 || builders[0] != "tokengate" {
		t.Fatalf("services with a build section: %q, want only tokengate", builders)
	}
	tg, mock := c.Services["tokengate"], c.Services["mockllm"]
	if tg.Image == "" || mock.Image != tg.Image || tg.PullPolicy != "build" || mock.PullPolicy != "never" {
		t.Errorf("tokengate image %q (pull_policy %q), mockllm image %q (pull_policy %q): want mockllm to run the image tokengate builds, neither pulled",
			tg.Image, tg.PullPolicy, mock.Image, mock.PullPolicy)
	}
}

// The health checks probe what each service serves: tokengate's admin
// listener from its mounted configuration, which binds every interface so
// Envoy's container can reach tokengate; the mock LLM's --listen port; the
// Envoy admin port of the mounted envoy.yaml.
func TestComposeHealthChecksProbeTheRightPorts(t *testing.T) {
	c := readComposeFile(t)
	tg := c.Services["tokengate"]
	mounted := hostPath(t, tg.Volumes, "/etc/tokengate/tokengate.yaml")
	cfg, err := config.Load(filepath.Join(repoRoot, mounted))
	if err != nil {
		t.Fatal(err)
	}
	for field, addr := range map[string]string{"grpc": cfg.Listeners.GRPC, "admin": cfg.Listeners.Admin} {
		if host, _, err := net.SplitHostPort(addr); err != nil || host != "0.0.0.0" {
			t.Errorf("%s: listeners.%s is %q, want 0.0.0.0:PORT inside the container", mounted, field, addr)
		}
	}
	_, adminPort, err := net.SplitHostPort(cfg.Listeners.Admin)
	if err != nil {
		t.Fatal(err)
	}
	checkProbe(t, "tokengate", tg.Healthcheck.Test, adminPort, "/readyz")

	mock := c.Services["mockllm"]
	i := slices.Index(mock.Command, "--listen")
	if i < 0 || i+1 >= len(mock.Command) {
		t.Fatalf("mockllm command %q has no --listen", mock.Command)
	}
	_, mockPort, err := net.SplitHostPort(mock.Command[i+1])
	if err != nil {
		t.Fatal(err)
	}
	checkProbe(t, "mockllm", mock.Healthcheck.Test, mockPort, "/healthz")

	envoy := c.Services["envoy"]
	envoyYAML, err := os.ReadFile(filepath.Join(repoRoot, hostPath(t, envoy.Volumes, "/etc/envoy/envoy.yaml")))
	if err != nil {
		t.Fatal(err)
	}
	var bootstrap struct {
		Admin struct {
			Address struct {
				SocketAddress struct {
					PortValue int `yaml:"port_value"`
				} `yaml:"socket_address"`
			}
		}
	}
	if err := yaml.Unmarshal(envoyYAML, &bootstrap); err != nil {
		t.Fatal(err)
	}
	probe := strings.Join(envoy.Healthcheck.Test, " ")
	port := bootstrap.Admin.Address.SocketAddress.PortValue
	if port == 0 || !strings.Contains(probe, "/dev/tcp/127.0.0.1/"+strconv.Itoa(port)) || !strings.Contains(probe, "GET /ready ") {
		t.Errorf("envoy healthcheck %q, want GET /ready on the admin port %d", probe, port)
	}
}

// hostPath returns the host side of the volume mounted at container.
func hostPath(t *testing.T, volumes []string, container string) string {
	t.Helper()
	for _, v := range volumes {
		parts := strings.Split(v, ":")
		if len(parts) >= 2 && parts[1] == container {
			return strings.TrimPrefix(parts[0], "./")
		}
	}
	t.Fatalf("nothing mounted at %s: %q", container, volumes)
	return ""
}

// checkProbe requires test to run the image's tokengate binary as
// `tokengate health --url http://127.0.0.1:PORT/PATH`.
func checkProbe(t *testing.T, service string, test []string, port, path string) {
	t.Helper()
	want := []string{"CMD", "/usr/local/bin/tokengate", "health", "--url", "http://127.0.0.1:" + port + path}
	if d := cmp.Diff(want, test); d != "" {
		t.Errorf("%s healthcheck (-want +got):\n%s", service, d)
	}
}

// The mock LLM's probe works: the built binary's mock-llm answers the
// binary's health command on /healthz. (tokengate's own probe is run
// against every shipped configuration in TestShippedConfigsServe.)
func TestComposeMockLLMProbeWorks(t *testing.T) {
	bin := tokengateBinary(t)
	mock := exec.Command(bin, "mock-llm", "--listen", "127.0.0.1:0")
	stdout, err := mock.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := mock.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := mock.Process.Kill(); err != nil {
			t.Error(err)
		}
		if err := mock.Wait(); err == nil {
			t.Error("the mock LLM exited cleanly after being killed")
		}
	}()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	fields := strings.Fields(line) // mock LLM listening on ADDR (...)
	if len(fields) < 5 {
		t.Fatalf("mock-llm printed %q", line)
	}
	probe := (&url.URL{Scheme: "http", Host: fields[4], Path: "/healthz"}).String()
	if out, err := exec.Command(bin, "health", "--url", probe).CombinedOutput(); err != nil {
		t.Errorf("tokengate health --url %s: %v: %s", probe, err, out)
	}
	if out, err := exec.Command(bin, "health", "--url", strings.TrimSuffix(probe, "/healthz")+"/nothing").CombinedOutput(); err == nil {
		t.Errorf("the probe of a missing path succeeded: %s", out)
	}
}

// The image carries the same probe for `docker run`: the Dockerfile's
// HEALTHCHECK runs the installed binary's health command in exec form.
func TestDockerfileHealthcheck(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var healthcheck, installed bool
	for _, line := range strings.Split(string(data), "\n") {
		switch {
		case strings.HasPrefix(line, "HEALTHCHECK ") &&
			strings.Contains(line, `CMD ["/usr/local/bin/tokengate", "health", "--url", "http://127.0.0.1:9090/readyz"]`):
			healthcheck = true
		case strings.HasPrefix(line, "COPY --from=build ") && strings.HasSuffix(line, " /usr/local/bin/tokengate"):
			installed = true
		}
	}
	if !healthcheck || !installed {
		t.Errorf("Dockerfile: HEALTHCHECK with tokengate health %v, binary at /usr/local/bin/tokengate %v", healthcheck, installed)
	}
}

// The compose stack's Prometheus scrapes tokengate's admin listener with the
// shipped configuration, and its Grafana is provisioned with that
// Prometheus as data source and the shipped dashboard in the folder its
// dashboard provider reads. (TestDashboardPanelsOnPrometheus runs the same
// Prometheus configuration and dashboard against the binary.)
func TestComposeProvisionsTheDashboard(t *testing.T) {
	c := readComposeFile(t)
	cfg, err := config.Load(filepath.Join(repoRoot, hostPath(t, c.Services["tokengate"].Volumes, "/etc/tokengate/tokengate.yaml")))
	if err != nil {
		t.Fatal(err)
	}
	_, adminPort, err := net.SplitHostPort(cfg.Listeners.Admin)
	if err != nil {
		t.Fatal(err)
	}
	prom := c.Services["prometheus"]
	if !slices.Contains(prom.Command, "--config.file=/etc/prometheus/prometheus.yaml") {
		t.Errorf("prometheus command %q does not read the mounted configuration", prom.Command)
	}
	var scrape struct {
		ScrapeConfigs []struct {
			MetricsPath   string                       `yaml:"metrics_path"`
			StaticConfigs []struct{ Targets []string } `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	readYAML(t, hostPath(t, prom.Volumes, "/etc/prometheus/prometheus.yaml"), &scrape)
	if len(scrape.ScrapeConfigs) != 1 || scrape.ScrapeConfigs[0].MetricsPath != "/metrics" || len(scrape.ScrapeConfigs[0].StaticConfigs) != 1 ||
		!slices.Equal(scrape.ScrapeConfigs[0].StaticConfigs[0].Targets, []string{"tokengate:" + adminPort}) {
		t.Errorf("prometheus scrapes %+v, want /metrics of tokengate:%s", scrape.ScrapeConfigs, adminPort)
	}

	grafana := c.Services["grafana"]
	var ds struct {
		Datasources []struct{ Type, URL string } `yaml:"datasources"`
	}
	readYAML(t, hostPath(t, grafana.Volumes, "/etc/grafana/provisioning/datasources/tokengate.yaml"), &ds)
	if len(ds.Datasources) != 1 || ds.Datasources[0].Type != "prometheus" || ds.Datasources[0].URL != "http://prometheus:9090" {
		t.Errorf("grafana data sources %+v, want the prometheus service", ds.Datasources)
	}
	var dash struct {
		Providers []struct {
			Type    string
			Options struct{ Path string }
		}
	}
	readYAML(t, hostPath(t, grafana.Volumes, "/etc/grafana/provisioning/dashboards/tokengate.yaml"), &dash)
	if len(dash.Providers) != 1 || dash.Providers[0].Type != "file" {
		t.Fatalf("grafana dashboard providers %+v, want one of type file", dash.Providers)
	}
	if got := hostPath(t, grafana.Volumes, dash.Providers[0].Options.Path+"/tokengate.json"); got != dashboardFile {
		t.Errorf("grafana's dashboard folder holds %s, want %s", got, dashboardFile)
	}
}

// readYAML decodes the repository's file into v.
func readYAML(t *testing.T, file string, v any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, file))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
}
