package tokenizer

import (
	"errors"

	"github.com/tokengate/tokengate/internal/billing"
)

// API names the shape of an LLM request body (S22).
type API string

const (
	ChatCompletions API = "chat"        // OpenAI /v1/chat/completions (also Azure, OpenRouter)
	Completions     API = "completions" // OpenAI legacy /v1/completions
	Embeddings      API = "embeddings"  // OpenAI /v1/embeddings
	Responses       API = "responses"   // OpenAI /v1/responses
	Messages        API = "messages"    // Anthropic /v1/messages
	// Gemini covers generateContent and streamGenerateContent, and the
	// embedContent and batchEmbedContents endpoints (Count.Embedding).
	Gemini API = "gemini"
)

// Errors that cross package lines. Each is wrapped with a specific message
// that names body fields and byte offsets, never values from the body, so
// it is safe to log and to return to the client.
var (
	ErrMalformed    = errors.New("malformed request body")
	ErrUnknownAPI   = errors.New("unknown API shape")
	ErrUnknownModel = errors.New("unknown model and no fallback encoding configured")
	ErrInvalidCap   = errors.New("invalid output token cap")
	// ErrFreeEndpoint is returned by Count for a path that Classify calls
	// Free: the request generates nothing, so there is nothing to count.
	ErrFreeEndpoint = errors.New("endpoint generates no tokens")
)

// Request is one request body to count.
type Request struct {
	// API is the body's shape; empty means detect it from Path and the body.
	API API
	// Path is the HTTP :path, used to detect the API and, for Gemini and
	// Azure, the model when the body does not name it.
	Path string
	// Model overrides the model named in the body when non-empty.
	Model string
	// Policy keys the learned output estimate together with the model.
	Policy string
	Body   []byte
}

// AllowanceSource says where an output allowance came from (S7).
type AllowanceSource string

const (
	FromRequest AllowanceSource = "request" // the request's own cap
	FromHistory AllowanceSource = "history" // learned from comparable requests
	FromDefault AllowanceSource = "default" // the configured default
)

// Count is what a request will cost before it is forwarded (S7). It is
// plain data.
type Count struct {
	API API
	// Model is the model the request names (Request.Model, else the body,
	// else the path; for Gemini the path first), as written.
	Model string
	// ModelKey is the model the provider bills and rate-limits, in a
	// canonical spelling to key per-model buckets and the learned
	// estimate: lower case, without a router prefix (openai/) or
	// fine-tune wrapping (ft:…:org::id), without a dated snapshot suffix
	// (gpt-4o-2024-08-06 → gpt-4o, claude-3-5-sonnet-20241022 →
	// claude-3-5-sonnet, gemini-1.5-pro-002 → gemini-1.5-pro); for Azure
	// the deployment in the path. Names longer than 64 bytes or with
	// characters outside [a-z0-9._:-] are replaced by a hash, so a client
	// cannot grow a key. Empty when the request names no model.
	ModelKey string
	// Deployment is the Azure OpenAI deployment the path names
	// (/openai/deployments/NAME/…) when Request.Model is empty: Azure
	// serves and bills the deployment's model, whatever the body's model
	// says.
	Deployment string
	Encoding   string
	// Fallback is true when the model was unknown and the configured
	// fallback encoding was used.
	Fallback bool
	// Exact is false for families whose tokenizer is not public
	// (Anthropic, Gemini): InputTokens is then a conservative estimate.
	Exact       bool
	InputTokens int
	// OutputCap is the largest per-choice cap in the body, rounded up; 0
	// when none, or when every cap is zero or below (which the provider
	// answers: see Counter.Count).
	OutputCap int
	// OutputAllowance is what the whole request may generate:
	// ChoiceAllowance × Choices.
	OutputAllowance int
	AllowanceSource AllowanceSource
	// Choices is how many outputs the request generates, each up to its
	// own cap: chat n, Gemini candidateCount, completions prompts × the
	// larger of n and best_of; 1 otherwise.
	Choices int
	// ChoiceAllowance is the output allowance of one choice: the cap, the
	// learned estimate or the default. 0 for embeddings.
	ChoiceAllowance int
	// Embedding is true for requests that generate no output (OpenAI
	// embeddings, Gemini embedContent and batchEmbedContents).
	Embedding bool
	// CapFields lists the output-cap fields the body sets to a number, as
	// dotted paths in the body's own spelling ("max_tokens",
	// "generationConfig.maxOutputTokens", "generation_config.max_output_tokens").
	CapFields []string
	// AddCapField is the field to add to cap the output when CapFields is
	// empty, in the spelling the body uses; "" for embeddings.
	AddCapField string
	// CapFloor is the least cap the provider accepts: 16 for Responses,
	// thinking.budget_tokens + 1 for Anthropic extended thinking, else 1.
	CapFloor int
	Stream   bool
	// HiddenReasoning reports that the model may bill, as output, reasoning
	// that the answer does not show: OpenAI's gpt-5 and o-series, Anthropic
	// with extended thinking (Claude 4 streams only a summary of it),
	// Gemini 2.5 and later (which think by default). Only the provider's
	// usage tells how much.
	HiddenReasoning bool
	// IncludeUsage reports whether an OpenAI streaming request already asked
	// for stream_options.include_usage.
	IncludeUsage bool
	// ServiceTier is the service tier the request asks for, as its
	// provider reads it (billing.OpenAI of service_tier, billing.Anthropic
	// of speed; Standard for Gemini): billing.Auto leaves it to the OpenAI
	// project, billing.Unknown is a value not known. It chooses the prices
	// a request is reserved at (pricing.Price.AtTier).
	ServiceTier billing.Tier
	// ExtendedCacheRetention is true when an OpenAI request asks for the
	// longer prompt-cache retention (prompt_cache_retention "24h"), whose
	// cache writes are billed at the extended rate.
	ExtendedCacheRetention bool
}

// Reservation is the number of tokens to reserve: input plus output allowance.
func (c Count) Reservation() int { return c.InputTokens + c.OutputAllowance }

// ChoiceCap returns the per-choice cap that keeps the whole request's
// output within total tokens, the value clamp_output writes into each of
// CapFields (lowering, never raising, what the client set) or into
// AddCapField: total / Choices, rounded down, but never below CapFloor.
// ok is false for requests without an output cap to write (embeddings).
func (c Count) ChoiceCap(total int) (perChoice int, ok bool) {
	if c.Embedding || c.AddCapField == "" && len(c.CapFields) == 0 {
		return 0, false
	}
	perChoice = total / max(c.Choices, 1)
	return max(perChoice, c.CapFloor, 1), true
}
