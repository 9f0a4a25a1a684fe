package metrics

import (
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/modelname"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// The GenAI metrics follow OpenTelemetry's semantic conventions for
// generative AI (gen_ai.client.token.usage, gen_ai.server.request.duration,
// gen_ai.server.time_to_first_token, gen_ai.server.time_per_output_token;
// attributes gen_ai.operation.name, gen_ai.provider.name,
// gen_ai.request.model, gen_ai.response.model, gen_ai.token.type,
// error.type), rendered as OpenTelemetry's Prometheus exporter renders them
// and as Envoy AI Gateway exports them: dots become underscores, a unit of
// seconds adds _seconds, the token unit "{token}" adds nothing. Dashboards
// written for those gateways read tokengate's.
//
// They describe the exchange with the upstream, so only requests that
// reached it are observed (refusals are tokengate_requests_total's). Model
// labels are bounded by modelLabels.

// Token types, the values of gen_ai_token_type. input and output are the
// convention's; the others are the custom values Envoy AI Gateway uses for
// the parts of input and output billed at other rates. They overlap input
// and output: cached_input and cache_creation_input are part of input,
// reasoning is part of output, so a total adds input and output only.
const (
	tokenInput              = "input"
	tokenOutput             = "output"
	tokenCachedInput        = "cached_input"
	tokenCacheCreationInput = "cache_creation_input"
	tokenReasoning          = "reasoning"
)

// otherModel labels every model beyond the bound.
const otherModel = "other"

// Options configures New. The zero value labels every model "other".
type Options struct {
	// Prices names the models the GenAI metrics label by name: a model the
	// table prices (by name, alias or snapshot) is labelled with its
	// entry's name.
	Prices *pricing.Table
	// MaxModels is how many models beyond Prices are labelled by name: the
	// first ones an upstream answers with a 2xx status, as modelname.Key
	// reads them. A name an upstream accepted is one a provider serves, not
	// whatever a client writes; the rest are "other".
	MaxModels int
}

type genAI struct {
	tokens, duration, firstToken, perToken *prometheus.HistogramVec
	models                                 *modelLabels
}

func newGenAI(o Options) genAI {
	base := []string{"gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"}
	with := func(l string) []string { return append(base[:len(base):len(base)], l) }
	return genAI{
		tokens: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "gen_ai_client_token_usage",
			Help:    "Tokens per request that reached the upstream, by type (input, output; cached_input and cache_creation_input within input, reasoning within output): the provider's usage, else tokengate's count (OpenTelemetry gen_ai.client.token.usage).",
			Buckets: prometheus.ExponentialBuckets(1, 4, 14),
		}, with("gen_ai_token_type")),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "gen_ai_server_request_duration_seconds",
			Help:    "Time from a request's headers to the end of its answer, for requests that reached the upstream; error_type is the upstream's status from 400 up (OpenTelemetry gen_ai.server.request.duration).",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
		}, with("error_type")),
		firstToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "gen_ai_server_time_to_first_token_seconds",
			Help:    "Time from a request's headers to the first output of its stream, for successful streams (OpenTelemetry gen_ai.server.time_to_first_token).",
			Buckets: []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10},
		}, base),
		perToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "gen_ai_server_time_per_output_token_seconds",
			Help:    "Time per output token after the first, for successful streams of more than one output token (OpenTelemetry gen_ai.server.time_per_output_token).",
			Buckets: []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5},
		}, base),
		models: &modelLabels{prices: o.Prices, max: o.MaxModels, named: map[string]struct{}{}},
	}
}

func (g genAI) collectors() []prometheus.Collector {
	return []prometheus.Collector{g.tokens, g.duration, g.firstToken, g.perToken}
}

// finish observes one request that reached the upstream.
func (g genAI) finish(o extproc.Outcome) {
	if o.Status == 0 || o.API == "" || refuses[o.Decision] {
		return
	}
	ok := o.Status >= 200 && o.Status < 300
	op, provider := operation(tokenizer.API(o.API), o.Embedding)
	base := []string{op, provider, g.models.label(o.Model, ok), g.models.label(o.ResponseModel, ok)}
	with := func(l string) []string { return append(base[:len(base):len(base)], l) }
	errorType := ""
	if o.Status >= 400 {
		errorType = strconv.Itoa(o.Status)
	}
	g.duration.WithLabelValues(with(errorType)...).Observe(o.Duration.Seconds())
	if !ok {
		return // the provider bills no tokens for an error
	}
	input, output := o.InputTokens, o.Output
	if o.Usage {
		input, output = o.ProviderUsage.InputTokens, o.ProviderUsage.OutputTokens
	}
	g.tokens.WithLabelValues(with(tokenInput)...).Observe(float64(input))
	if !o.Embedding {
		g.tokens.WithLabelValues(with(tokenOutput)...).Observe(float64(output))
	}
	for typ, n := range map[string]int{
		tokenCachedInput:        o.ProviderUsage.CachedInputTokens,
		tokenCacheCreationInput: o.ProviderUsage.CacheCreationInputTokens,
		tokenReasoning:          o.ProviderUsage.ReasoningTokens,
	} {
		if n > 0 {
			g.tokens.WithLabelValues(with(typ)...).Observe(float64(n))
		}
	}
	if !o.Streamed || o.FirstOutput <= 0 {
		return
	}
	g.firstToken.WithLabelValues(base...).Observe(o.FirstOutput.Seconds())
	if rest := o.Duration - o.FirstOutput; output > 1 && rest > 0 {
		g.perToken.WithLabelValues(base...).Observe(rest.Seconds() / float64(output-1))
	}
}

// operation is the gen_ai.operation.name and gen_ai.provider.name of an
// API. The provider is the API's owner: an OpenAI-compatible endpoint
// (Azure OpenAI, OpenRouter, a local server) is "openai", as its wire
// format is.
func operation(api tokenizer.API, embedding bool) (op, provider string) {
	switch api {
	case tokenizer.Completions:
		return "text_completion", "openai"
	case tokenizer.Embeddings:
		return "embeddings", "openai"
	case tokenizer.Messages:
		return "chat", "anthropic"
	case tokenizer.Gemini:
		if embedding {
			return "embeddings", "gcp.gemini"
		}
		return "generate_content", "gcp.gemini"
	default: // chat completions and the Responses API
		return "chat", "openai"
	}
}

// modelLabels bounds the model labels: the price table's entry names, plus
// at most max names learned from successful answers, plus "other". It is
// safe for concurrent use.
type modelLabels struct {
	prices *pricing.Table
	max    int

	mu    sync.Mutex
	named map[string]struct{}
}

// label is the label of model; learn lets a name not yet labelled take one
// of the free places.
func (l *modelLabels) label(model string, learn bool) string {
	if model == "" {
		return ""
	}
	if l.prices != nil {
		if p, ok := l.prices.Price(model); ok {
			return p.Model
		}
	}
	key := modelname.Key(model)
	if strings.HasPrefix(key, "sha256:") {
		return otherModel // not a name a provider serves
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.named[key]; ok {
		return key
	}
	if learn && len(l.named) < l.max {
		l.named[key] = struct{}{}
		return key
	}
	return otherModel
}
