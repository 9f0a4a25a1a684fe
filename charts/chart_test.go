package charts

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/yaml"

	"github.com/tokengate/tokengate/config"
)

const (
	chartDir = "tokengate"
	// The release and namespace the README's helm install uses, and that
	// the Envoy Gateway and Istio examples point at.
	releaseName = "tokengate"
	namespace   = "tokengate"
)

// valueSets are the chart's defaults and its real-world values files.
var valueSets = []string{
	"", // values.yaml alone
	"ci/single-memory.yaml",
	"ci/redis-fleet-mtls.yaml",
	"ci/redis-cluster.yaml",
	"ci/ratelimit-service.yaml",
}

var binary struct {
	once sync.Once
	path string
	err  error
}

// tokengateBinary builds the tokengate binary once, to validate rendered
// configurations as a user would.
func tokengateBinary(t *testing.T) string {
	t.Helper()
	binary.once.Do(func() {
		dir, err := os.MkdirTemp("", "tokengate-chart-")
		if err != nil {
			binary.err = err
			return
		}
		binary.path = filepath.Join(dir, "tokengate")
		out, err := exec.Command("go", "build", "-o", binary.path, "../cmd/tokengate").CombinedOutput()
		if err != nil {
			binary.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binary.err != nil {
		t.Fatal(binary.err)
	}
	return binary.path
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binary.path != "" {
		if err := os.RemoveAll(filepath.Dir(binary.path)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

func readValues(t *testing.T, file string) chartutil.Values {
	t.Helper()
	if file == "" {
		return chartutil.Values{}
	}
	v, err := chartutil.ReadValuesFile(filepath.Join(chartDir, file))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// render renders the chart with Helm's engine, as helm install does.
func render(ch *chart.Chart, vals chartutil.Values) (map[string]string, error) {
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{
		Name: releaseName, Namespace: namespace, Revision: 1, IsInstall: true,
	}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	return engine.Render(ch, rv)
}

// manifests are the objects of one render, decoded strictly into the
// Kubernetes API types: a field the type does not have is an error.
type manifests struct {
	deployment     *appsv1.Deployment
	service        *corev1.Service
	configMap      *corev1.ConfigMap
	secrets        []*corev1.Secret
	pdb            *policyv1.PodDisruptionBudget
	hpa            *autoscalingv2.HorizontalPodAutoscaler
	serviceMonitor *serviceMonitor
}

// serviceMonitor is the part of Prometheus Operator's ServiceMonitor
// (monitoring.coreos.com/v1) the chart writes; its Go types are not a
// dependency here, so this mirrors their JSON names, and strict decoding
// still refuses a field it does not know.
type serviceMonitor struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name   string            `json:"name"`
		Labels map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		Selector struct {
			MatchLabels map[string]string `json:"matchLabels"`
		} `json:"selector"`
		Endpoints []struct {
			Port      string `json:"port"`
			Path      string `json:"path"`
			Interval  string `json:"interval"`
			Scheme    string `json:"scheme"`
			TLSConfig *struct {
				InsecureSkipVerify bool `json:"insecureSkipVerify"`
			} `json:"tlsConfig"`
		} `json:"endpoints"`
	} `json:"spec"`
}

func decode(t *testing.T, files map[string]string) manifests {
	t.Helper()
	var m manifests
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if strings.HasSuffix(name, "NOTES.txt") || strings.HasSuffix(name, ".tpl") {
			continue
		}
		for _, doc := range strings.Split(files[name], "\n---") {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var head struct{ APIVersion, Kind string }
			if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
				t.Fatalf("%s: %v\n%s", name, err, doc)
			}
			var into any
			switch head.APIVersion + " " + head.Kind {
			case "apps/v1 Deployment":
				m.deployment = &appsv1.Deployment{}
				into = m.deployment
			case "v1 Service":
				m.service = &corev1.Service{}
				into = m.service
			case "v1 ConfigMap":
				m.configMap = &corev1.ConfigMap{}
				into = m.configMap
			case "v1 Secret":
				s := &corev1.Secret{}
				m.secrets = append(m.secrets, s)
				into = s
			case "policy/v1 PodDisruptionBudget":
				m.pdb = &policyv1.PodDisruptionBudget{}
				into = m.pdb
			case "autoscaling/v2 HorizontalPodAutoscaler":
				m.hpa = &autoscalingv2.HorizontalPodAutoscaler{}
				into = m.hpa
			case "monitoring.coreos.com/v1 ServiceMonitor":
				m.serviceMonitor = &serviceMonitor{}
				into = m.serviceMonitor
			default:
				t.Fatalf("%s: a %s %s the test does not know", name, head.APIVersion, head.Kind)
			}
			if err := yaml.UnmarshalStrict([]byte(doc), into); err != nil {
				t.Fatalf("%s: %s %s: %v\n%s", name, head.APIVersion, head.Kind, err, doc)
			}
		}
	}
	if m.deployment == nil || m.service == nil || m.configMap == nil {
		t.Fatalf("render lacks a Deployment, Service or ConfigMap: %v", names)
	}
	return m
}

// TestChartRendersAndValidates renders the chart with Helm's engine for
// the defaults and each real-world values file, decodes every manifest
// strictly into the Kubernetes types, runs the configuration in the
// ConfigMap through `tokengate validate` (the binary), and checks what an
// operator relies on: a restricted security context, probes on the admin
// listener, the admin token and Redis password from Secrets, every TLS file
// the configuration names mounted, and selectors that match the pods.
func TestChartRendersAndValidates(t *testing.T) {
	ch := loadChart(t)
	bin := tokengateBinary(t)
	for _, file := range valueSets {
		name := file
		if name == "" {
			name = "defaults"
		}
		t.Run(name, func(t *testing.T) {
			vals := readValues(t, file)
			files, err := render(ch, vals)
			if err != nil {
				t.Fatal(err)
			}
			m := decode(t, files)
			cfg := checkConfig(t, bin, m)
			checkDeployment(t, m, cfg)
			checkService(t, m)
			checkOptional(t, m, vals)
			checkRatelimitMetrics(t, m, cfg, vals)
		})
	}
}

// checkConfig runs the ConfigMap's configuration through the binary's
// validate and returns it parsed.
func checkConfig(t *testing.T, bin string, m manifests) *config.Config {
	t.Helper()
	text, ok := m.configMap.Data["tokengate.yaml"]
	if !ok {
		t.Fatalf("ConfigMap has no tokengate.yaml: %v", m.configMap.Data)
	}
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	if err := os.WriteFile(file, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, "validate", "--strict", file).CombinedOutput()
	if err != nil || !strings.Contains(string(out), ": valid tokengate configuration") {
		t.Fatalf("tokengate validate --strict: %v\n%s\n%s", err, out, text)
	}
	cfg, err := config.Parse("tokengate.yaml", []byte(text))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listeners.GRPC != "0.0.0.0:50051" || cfg.Listeners.Admin != "0.0.0.0:9090" {
		t.Errorf("listeners %q and %q, want every interface on the Service's ports", cfg.Listeners.GRPC, cfg.Listeners.Admin)
	}
	return cfg
}

func checkDeployment(t *testing.T, m manifests, cfg *config.Config) {
	t.Helper()
	d := m.deployment
	pod := d.Spec.Template.Spec
	if !selects(d.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
		t.Errorf("Deployment selector %v does not select its pods %v", d.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
	}
	psc := pod.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext %+v: want runAsNonRoot and seccomp RuntimeDefault", psc)
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("the pod mounts a service account token it never uses")
	}
	if len(pod.TopologySpreadConstraints) == 0 {
		t.Error("no topology spread constraints")
	}
	for _, c := range pod.TopologySpreadConstraints {
		if c.LabelSelector == nil || !selects(c.LabelSelector.MatchLabels, d.Spec.Template.Labels) {
			t.Errorf("topology spread on %s does not select the pods", c.TopologyKey)
		}
	}
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Containers))
	}
	c := pod.Containers[0]
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("container securityContext %+v: want readOnlyRootFilesystem, no privilege escalation, drop ALL, seccomp RuntimeDefault", sc)
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["grpc"] != 50051 || ports["admin"] != 9090 {
		t.Errorf("container ports %v, want grpc 50051 and admin 9090", ports)
	}
	for name, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		want := "/healthz"
		if name == "readiness" {
			want = "/readyz"
		}
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != want || p.HTTPGet.Port.String() != "admin" {
			t.Errorf("%s probe %+v, want GET %s on the admin port", name, p, want)
		}
	}
	env := map[string]*corev1.EnvVarSource{}
	for _, e := range c.Env {
		env[e.Name] = e.ValueFrom
	}
	secrets := map[string]bool{}
	for _, s := range m.secrets {
		secrets[s.Name] = true
	}
	for _, name := range []string{cfg.AdminAPI.TokenEnv, cfg.Store.Redis.PasswordEnv} {
		if name == "" {
			continue
		}
		src := env[name]
		if src == nil || src.SecretKeyRef == nil {
			t.Errorf("the configuration reads %s, which the container does not take from a Secret", name)
		}
	}
	if cfg.AdminAPI.TokenEnv != "" {
		if ref := env[cfg.AdminAPI.TokenEnv]; ref != nil && ref.SecretKeyRef != nil && len(m.secrets) > 0 && !secrets[ref.SecretKeyRef.Name] {
			t.Errorf("the admin token comes from Secret %s, which the chart does not render", ref.SecretKeyRef.Name)
		}
	}
	// Every file the configuration names is on a mounted Secret, and the
	// configuration itself where serve is told to read it.
	mounts := map[string]string{}
	for _, vm := range c.VolumeMounts {
		if !vm.ReadOnly {
			t.Errorf("volume %s is mounted writable", vm.Name)
		}
		mounts[vm.MountPath] = vm.Name
	}
	if !slices.Equal(c.Args, []string{"serve", "--config", "/etc/tokengate/tokengate.yaml"}) || mounts["/etc/tokengate/tokengate.yaml"] != "config" {
		t.Errorf("args %q, mounts %v: want serve reading the ConfigMap's file", c.Args, mounts)
	}
	for _, f := range configFiles(cfg) {
		covered := slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool {
			return strings.HasPrefix(f, vm.MountPath+"/") && vm.Name != "config"
		})
		if !covered {
			t.Errorf("the configuration reads %s, which no mounted Secret holds", f)
		}
	}
	if d.Spec.Replicas == nil && m.hpa == nil {
		t.Error("no replicas and no autoscaler")
	}
}

// configFiles are the TLS files a configuration names.
func configFiles(cfg *config.Config) []string {
	var out []string
	for _, l := range []*config.ListenerTLS{cfg.Listeners.GRPCTLS, cfg.Listeners.AdminTLS} {
		if l != nil {
			out = append(out, l.CertFile, l.KeyFile, l.ClientCAFile)
		}
	}
	if r := cfg.Store.Redis.TLS; r != nil {
		out = append(out, r.CAFile, r.CertFile, r.KeyFile)
	}
	return slices.DeleteFunc(out, func(s string) bool { return s == "" })
}

func checkService(t *testing.T, m manifests) {
	t.Helper()
	s := m.service
	if s.Name != releaseName {
		t.Errorf("Service %q, want %q: the Envoy Gateway and Istio examples point at it", s.Name, releaseName)
	}
	if !selects(s.Spec.Selector, m.deployment.Spec.Template.Labels) {
		t.Errorf("Service selector %v does not select the pods", s.Spec.Selector)
	}
	ports := map[string]corev1.ServicePort{}
	for _, p := range s.Spec.Ports {
		ports[p.Name] = p
	}
	if g := ports["grpc"]; g.Port != 50051 || g.TargetPort.String() != "grpc" || g.AppProtocol == nil || *g.AppProtocol != "grpc" {
		t.Errorf("Service grpc port %+v, want 50051 to the grpc port, appProtocol grpc (HTTP/2 for ext_proc)", g)
	}
	if a := ports["admin"]; a.Port != 9090 || a.TargetPort.String() != "admin" {
		t.Errorf("Service admin port %+v, want 9090 to the admin port", a)
	}
}

func checkOptional(t *testing.T, m manifests, vals chartutil.Values) {
	t.Helper()
	pods := m.deployment.Spec.Template.Labels
	if m.pdb == nil || m.pdb.Spec.Selector == nil || !selects(m.pdb.Spec.Selector.MatchLabels, pods) || m.pdb.Spec.MaxUnavailable == nil {
		t.Errorf("PodDisruptionBudget %+v: want one with maxUnavailable selecting the pods", m.pdb)
	}
	autoscaling, _ := vals.Table("autoscaling")
	if enabled, _ := autoscaling["enabled"].(bool); enabled {
		if m.hpa == nil || m.hpa.Spec.ScaleTargetRef.Name != m.deployment.Name || m.deployment.Spec.Replicas != nil {
			t.Errorf("autoscaling enabled: HPA %+v, Deployment replicas %v; want the HPA scaling the Deployment, which sets none", m.hpa, m.deployment.Spec.Replicas)
		}
	} else if m.hpa != nil {
		t.Error("an HPA without autoscaling.enabled")
	}
	monitor, _ := vals.Table("serviceMonitor")
	if enabled, _ := monitor["enabled"].(bool); enabled {
		sm := m.serviceMonitor
		if sm == nil || !selects(sm.Spec.Selector.MatchLabels, m.service.Labels) || len(sm.Spec.Endpoints) == 0 ||
			sm.Spec.Endpoints[0].Port != "admin" || sm.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor %+v: want /metrics on the Service's admin port", sm)
		}
	} else if m.serviceMonitor != nil {
		t.Error("a ServiceMonitor without serviceMonitor.enabled")
	}
}

// checkRatelimitMetrics: with ports.ratelimitMetrics the configuration
// serves the rate-limit service's stats on every interface at that port
// (listeners.ratelimit_metrics), which the pod, the Service and the
// ServiceMonitor (when enabled) expose at the configured path; without it,
// none of them names it.
func checkRatelimitMetrics(t *testing.T, m manifests, cfg *config.Config, vals chartutil.Values) {
	t.Helper()
	port := int32(0)
	if ports, err := vals.Table("ports"); err == nil {
		if p, ok := ports["ratelimitMetrics"].(float64); ok {
			port = int32(p)
		}
	}
	var container, service int32
	for _, p := range m.deployment.Spec.Template.Spec.Containers[0].Ports {
		if p.Name == "rl-metrics" {
			container = p.ContainerPort
		}
	}
	for _, p := range m.service.Spec.Ports {
		if p.Name == "rl-metrics" {
			service = p.Port
			if p.TargetPort.String() != "rl-metrics" {
				t.Errorf("Service rl-metrics targets %s, want the container's rl-metrics", p.TargetPort.String())
			}
		}
	}
	var scraped []string
	if sm := m.serviceMonitor; sm != nil {
		for _, e := range sm.Spec.Endpoints {
			if e.Port == "rl-metrics" {
				scraped = append(scraped, e.Path)
			}
		}
	}
	if port == 0 {
		if cfg.Listeners.RatelimitMetrics != "" || container != 0 || service != 0 || len(scraped) > 0 {
			t.Errorf("without ports.ratelimitMetrics: listener %q, container port %d, Service port %d, scraped %v; want none", cfg.Listeners.RatelimitMetrics, container, service, scraped)
		}
		return
	}
	if want := fmt.Sprintf("0.0.0.0:%d", port); cfg.Listeners.RatelimitMetrics != want {
		t.Errorf("listeners.ratelimit_metrics %q, want %q", cfg.Listeners.RatelimitMetrics, want)
	}
	if container != port || service != port {
		t.Errorf("rl-metrics: container port %d, Service port %d, want %d", container, service, port)
	}
	if m.serviceMonitor != nil && !slices.Equal(scraped, []string{cfg.Listeners.RatelimitMetricsAt()}) {
		t.Errorf("ServiceMonitor scrapes rl-metrics at %v, want %s", scraped, cfg.Listeners.RatelimitMetricsAt())
	}
}

// The chart sets listeners.ratelimit_metrics from ports.ratelimitMetrics,
// as it sets the other listeners: one set in config instead would serve a
// port no Service exposes, so the render refuses it and says what to set.
func TestChartRefusesItsOwnRatelimitMetricsListener(t *testing.T) {
	vals := chartutil.Values{"config": map[string]any{
		"store":     map[string]any{"type": "memory"},
		"listeners": map[string]any{"ratelimit_metrics": "0.0.0.0:19001"},
	}}
	_, err := render(loadChart(t), vals)
	if err == nil || !strings.Contains(err.Error(), "set ports.ratelimitMetrics instead") {
		t.Errorf("render with config.listeners.ratelimit_metrics: %v, want it refused naming ports.ratelimitMetrics", err)
	}
}

// selects reports whether every label of sel is on labels.
func selects(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// The chart refuses at render time what tokengate cannot do: replicas of
// the memory store each keep buckets of their own.
func TestChartRefusesReplicasOfTheMemoryStore(t *testing.T) {
	ch := loadChart(t)
	for _, vals := range []chartutil.Values{
		{"replicaCount": 3},
		{"autoscaling": map[string]any{"enabled": true}},
	} {
		_, err := render(ch, vals)
		if err == nil || !strings.Contains(err.Error(), "config.store.type memory keeps the buckets in each pod") {
			t.Errorf("render with %v: %v, want the memory store refused", vals, err)
		}
	}
}

// Helm's own lint (the linter behind helm lint) finds nothing, not even a
// warning (helm lint --strict), for every value set.
func TestChartLint(t *testing.T) {
	for _, file := range valueSets {
		res := lint.All(chartDir, readValues(t, file), namespace, false)
		for _, m := range res.Messages {
			if m.Severity >= support.WarningSev {
				t.Errorf("helm lint %s: %s", file, m)
			}
		}
	}
}

// The Envoy Gateway and Istio examples send ext_proc to the Service the
// chart renders when installed as the README shows.
func TestExamplesPointAtTheChartsService(t *testing.T) {
	files, err := render(loadChart(t), chartutil.Values{})
	if err != nil {
		t.Fatal(err)
	}
	svc := decode(t, files).service
	host := fmt.Sprintf("%s.%s.svc.cluster.local", svc.Name, namespace)
	for file, want := range map[string][]string{
		"../examples/envoy-gateway/tokengate-policy.yaml": {"hostname: " + host},
		"../examples/istio/tokengate-mesh.yaml":           {"- " + host, "host: " + host},
		"../examples/istio/envoyfilter.yaml":              {"cluster_name: outbound|50051||" + host},
	} {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range want {
			if !strings.Contains(string(data), w) {
				t.Errorf("%s does not contain %q", file, w)
			}
		}
	}
}
