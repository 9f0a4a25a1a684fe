package tokenizer

import "errors"

// API names the shape of an LLM request body (S22).
type API string

const (
	ChatCompletions API = "chat"        // OpenAI /v1/chat/completions (also Azure, OpenRouter)
	Completions     API = "completions" // OpenAI legacy /v1/completions
	Embeddings      API = "embeddings"  // OpenAI /v1/embeddings
	Responses       API = "responses"   // OpenAI /v1/responses
	Messages        API = "messages"    // Anthropic /v1/messages
	Gemini          API = "gemini"      // Gemini generateContent / streamGenerateContent
)

// Errors that cross package lines. Each is wrapped with a specific message.
var (
	ErrMalformed    = errors.New("malformed request body")
	ErrUnknownAPI   = errors.New("unknown API shape")
	ErrUnknownModel = errors.New("unknown model and no fallback encoding configured")
	ErrInvalidCap   = errors.New("invalid output token cap")
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

// Count is what a request will cost before it is forwarded (S7).
type Count struct {
	API      API
	Model    string
	Encoding string
	// Fallback is true when the model was unknown and the configured
	// fallback encoding was used.
	Fallback bool
	// Exact is false for families whose tokenizer is not public
	// (Anthropic, Gemini): InputTokens is then a conservative estimate.
	Exact           bool
	InputTokens     int
	OutputCap       int // the largest cap in the body, 0 when none
	OutputAllowance int
	AllowanceSource AllowanceSource
	Stream          bool
	// IncludeUsage reports whether an OpenAI streaming request already asked
	// for stream_options.include_usage.
	IncludeUsage bool
	// Choices is how many completions the output allowance covers (n,
	// best_of, candidateCount, times the prompts of a completions batch);
	// 0 means 1. Per-choice output is the output divided by it.
	Choices int
}

// Reservation is the number of tokens to reserve: input plus output allowance.
func (c Count) Reservation() int { return c.InputTokens + c.OutputAllowance }
