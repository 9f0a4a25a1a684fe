package metrics

import (
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/pricing"
)

// observed is one histogram series as gathered: its labels, count and sum.
type observed struct {
	Labels map[string]string
	Count  uint64
	Sum    float64
}

func gatherHistograms(t *testing.T, reg *prometheus.Registry, name string) []observed {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []observed
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		if mf.GetType() != dto.MetricType_HISTOGRAM {
			t.Fatalf("%s is a %s, want a histogram", name, mf.GetType())
		}
		for _, m := range mf.GetMetric() {
			o := observed{Labels: map[string]string{}, Count: m.GetHistogram().GetSampleCount(), Sum: m.GetHistogram().GetSampleSum()}
			for _, l := range m.GetLabel() {
				o.Labels[l.GetName()] = l.GetValue()
			}
			out = append(out, o)
		}
	}
	return out
}

func genAILabels(op, provider, req, resp string, kv ...string) map[string]string {
	m := map[string]string{"gen_ai_operation_name": op, "gen_ai_provider_name": provider, "gen_ai_request_model": req, "gen_ai_response_model": resp}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

func testPrices(t *testing.T) *pricing.Table {
	t.Helper()
	p, err := pricing.NewTable("USD", []pricing.Entry{{Model: "gpt-4o-mini", Input: "0.15", Output: "0.60", SharesSnapshots: true}, {Model: "claude-opus-5", Input: "5", Output: "25"}})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// gen_ai_client_token_usage by token type, the request duration and, for
// a stream, the time to first token and per output token, labelled by
// operation, provider and the models as the price table names them.
func TestGenAIMetricsOfAStream(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{Prices: testPrices(t)})
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", API: "chat", Model: "gpt-4o-mini", ResponseModel: "gpt-4o-mini-2024-07-18",
		InputTokens: 11, Output: 6, Status: 200, Usage: true, Streamed: true, Reserved: 100, Settled: 19,
		ProviderUsage: provider.Usage{InputTokens: 12, OutputTokens: 7, CachedInputTokens: 4, ReasoningTokens: 3},
		Duration:      2 * time.Second, FirstOutput: 500 * time.Millisecond})
	chat := func(kv ...string) map[string]string {
		return genAILabels("chat", "openai", "gpt-4o-mini", "gpt-4o-mini", kv...)
	}
	want := []observed{
		{chat("gen_ai_token_type", "cached_input"), 1, 4},
		{chat("gen_ai_token_type", "input"), 1, 12},
		{chat("gen_ai_token_type", "output"), 1, 7},
		{chat("gen_ai_token_type", "reasoning"), 1, 3},
	}
	if d := cmp.Diff(want, gatherHistograms(t, reg, "gen_ai_client_token_usage")); d != "" {
		t.Errorf("gen_ai_client_token_usage (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]observed{{chat("error_type", ""), 1, 2}}, gatherHistograms(t, reg, "gen_ai_server_request_duration_seconds")); d != "" {
		t.Errorf("gen_ai_server_request_duration_seconds (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]observed{{chat(), 1, 0.5}}, gatherHistograms(t, reg, "gen_ai_server_time_to_first_token_seconds")); d != "" {
		t.Errorf("gen_ai_server_time_to_first_token_seconds (-want +got):\n%s", d)
	}
	// 1.5s after the first of 7 output tokens: 0.25s for each of the other 6.
	if d := cmp.Diff([]observed{{chat(), 1, 0.25}}, gatherHistograms(t, reg, "gen_ai_server_time_per_output_token_seconds")); d != "" {
		t.Errorf("gen_ai_server_time_per_output_token_seconds (-want +got):\n%s", d)
	}
}

// Without reported usage the counts are tokengate's; an upstream error is a
// duration with its status as error_type and no tokens; a request that
// never reached the upstream is not a GenAI observation at all. Each API
// has its operation and provider.
func TestGenAIMetricsByAPIAndStatus(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{Prices: testPrices(t)})
	m.Finish(extproc.Outcome{Decision: "admitted", API: "messages", Model: "claude-opus-5", Status: 200, InputTokens: 30, Output: 9, Duration: time.Second,
		Usage: true, ProviderUsage: provider.Usage{InputTokens: 31, OutputTokens: 9, CacheCreationInputTokens: 5}, ResponseModel: "claude-opus-5"})
	m.Finish(extproc.Outcome{Decision: "admitted", API: "completions", Model: "gpt-4o-mini", Status: 200, InputTokens: 8, Output: 5, Duration: time.Second})
	m.Finish(extproc.Outcome{Decision: "unmetered", API: "gemini", Embedding: true, Model: "gpt-4o-mini", Status: 200, InputTokens: 3, Duration: time.Second})
	m.Finish(extproc.Outcome{Decision: "admitted", API: "chat", Model: "gpt-4o-mini", Status: 429, InputTokens: 8, Duration: time.Second})
	m.Finish(extproc.Outcome{Decision: "refused_tokens", API: "chat", Model: "gpt-4o-mini", InputTokens: 8})
	want := []observed{
		{genAILabels("chat", "anthropic", "claude-opus-5", "claude-opus-5", "gen_ai_token_type", "cache_creation_input"), 1, 5},
		{genAILabels("chat", "anthropic", "claude-opus-5", "claude-opus-5", "gen_ai_token_type", "input"), 1, 31},
		{genAILabels("chat", "anthropic", "claude-opus-5", "claude-opus-5", "gen_ai_token_type", "output"), 1, 9},
		{genAILabels("embeddings", "gcp.gemini", "gpt-4o-mini", "", "gen_ai_token_type", "input"), 1, 3},
		{genAILabels("text_completion", "openai", "gpt-4o-mini", "", "gen_ai_token_type", "input"), 1, 8},
		{genAILabels("text_completion", "openai", "gpt-4o-mini", "", "gen_ai_token_type", "output"), 1, 5},
	}
	if d := cmp.Diff(want, gatherHistograms(t, reg, "gen_ai_client_token_usage")); d != "" {
		t.Errorf("gen_ai_client_token_usage (-want +got):\n%s", d)
	}
	var errs []string
	for _, o := range gatherHistograms(t, reg, "gen_ai_server_request_duration_seconds") {
		errs = append(errs, o.Labels["gen_ai_operation_name"]+" "+o.Labels["error_type"])
	}
	slices.Sort(errs)
	if d := cmp.Diff([]string{"chat ", "chat 429", "embeddings ", "text_completion "}, errs); d != "" {
		t.Errorf("request durations by operation and error_type (-want +got):\n%s", d)
	}
	if n := len(gatherHistograms(t, reg, "gen_ai_server_time_to_first_token_seconds")); n != 0 {
		t.Errorf("%d time-to-first-token series without a stream", n)
	}
}

// Model labels stay bounded: names of the price table, then at most
// MaxModels names that an upstream answered successfully, then "other". A
// name a client invents and the upstream refuses takes no place.
func TestGenAIModelLabelsBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, Options{Prices: testPrices(t), MaxModels: 2})
	for _, c := range []struct {
		model  string
		status int
	}{
		{"invented-by-a-client", 404},
		{"llama-3.3-70b", 200},
		{"Mistral-Large-2411", 200},
		{"gpt-4o-mini-2024-07-18", 200},
		{"qwen-3", 200},
		{"invented-by-a-client", 200},
		{"a name with spaces", 200},
		{"llama-3.3-70b", 500},
	} {
		m.Finish(extproc.Outcome{Decision: "admitted", API: "chat", Model: c.model, Status: c.status, Duration: time.Second})
	}
	got := map[string]uint64{}
	for _, o := range gatherHistograms(t, reg, "gen_ai_server_request_duration_seconds") {
		got[o.Labels["gen_ai_request_model"]] += o.Count
	}
	want := map[string]uint64{"llama-3.3-70b": 2, "mistral-large-2411": 1, "gpt-4o-mini": 1, "other": 4}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("requests by gen_ai_request_model (-want +got):\n%s", d)
	}
}
