package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"sync"

	"github.com/bytedance/sonic"
)

// DetectAPI returns the shape of a request body: from the HTTP path when it
// names a known endpoint, else from the body's top-level keys.
func DetectAPI(path string, reqBody []byte) (API, error) {
	if api, ok := apiFromPath(path); ok {
		return api, nil
	}
	var b body
	if err := decodeJSON(reqBody, &b); err != nil {
		return "", fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	return apiFromBody(&b)
}

// decodeJSON decodes request bodies. sonic parses them several times
// faster than encoding/json on amd64 (see the repository README) and falls back to an
// encoding/json-compatible decoder elsewhere. Invalid UTF-8 is kept and
// mapped to U+FFFD by the counter, as encoding/json would.
func decodeJSON(data []byte, v any) error {
	return sonic.ConfigDefault.Unmarshal(data, v)
}

// pretouchOnce compiles the decoders of the request types once per
// process, so the first request does not pay for it (~40 ms here).
var pretouchOnce sync.Once

func pretouch() {
	pretouchOnce.Do(func() {
		for _, v := range []any{body{}, []contentPart{}, functionDef{}} {
			// An error only means the type is compiled on first use.
			_ = sonic.Pretouch(reflect.TypeOf(v))
		}
	})
}

func apiFromPath(path string) (API, bool) {
	p, _, _ := strings.Cut(path, "?")
	p = strings.TrimSuffix(p, "/")
	switch {
	case strings.HasSuffix(p, "/chat/completions"):
		return ChatCompletions, true
	case strings.HasSuffix(p, "/completions"):
		return Completions, true
	case strings.HasSuffix(p, "/embeddings"):
		return Embeddings, true
	case strings.HasSuffix(p, "/responses"):
		return Responses, true
	case strings.HasSuffix(p, "/v1/messages"):
		return Messages, true
	case strings.HasSuffix(p, ":generateContent"), strings.HasSuffix(p, ":streamGenerateContent"):
		return Gemini, true
	}
	return "", false
}

// apiFromBody detects the API from the top-level fields a body has.
func apiFromBody(b *body) (API, error) {
	present := func(r json.RawMessage) bool { return len(r) > 0 }
	model := normalizeModel(b.Model)
	switch {
	case b.Contents != nil:
		return Gemini, nil
	case b.Messages != nil:
		if present(b.System) || present(b.AnthropicVersion) || strings.HasPrefix(model, "claude") {
			return Messages, nil
		}
		return ChatCompletions, nil
	case present(b.Prompt):
		return Completions, nil
	case present(b.Input):
		if present(b.Instructions) || present(b.MaxOutputTokens) || b.Tools != nil || present(b.PreviousResponseID) {
			return Responses, nil
		}
		if present(b.EncodingFormat) || present(b.Dimensions) || strings.HasPrefix(model, "text-embedding") {
			return Embeddings, nil
		}
		// An array of items (objects) is Responses; strings and token
		// arrays are Embeddings.
		in := bytes.TrimLeft(b.Input, " \t\r\n[")
		if len(in) > 0 && in[0] == '{' {
			return Responses, nil
		}
		return Embeddings, nil
	}
	return "", fmt.Errorf("%w: none of messages, contents, prompt or input at the top level", ErrUnknownAPI)
}

// Count returns what req will cost: its exact input tokens (an estimate for
// Anthropic and Gemini), its output cap and the output allowance (S7).
// Errors wrap ErrMalformed, ErrUnknownAPI, ErrUnknownModel or ErrInvalidCap.
func (c *Counter) Count(req Request) (Count, error) {
	var b body
	if err := decodeJSON(req.Body, &b); err != nil {
		return Count{}, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	api := req.API
	if api == "" {
		var ok bool
		if api, ok = apiFromPath(req.Path); !ok {
			var err error
			if api, err = apiFromBody(&b); err != nil {
				return Count{}, err
			}
		}
	}
	model := req.Model
	if model == "" {
		model = b.Model
	}
	if model == "" {
		model = modelFromPath(req.Path)
	}
	fam := familyOf(normalizeModel(model))
	switch api {
	case Messages:
		fam = familyAnthropic
	case Gemini:
		fam = familyGemini
	}
	var enc string
	var fallback bool
	if fam == familyOpenAI {
		var err error
		if enc, fallback, err = c.EncodingFor(model); err != nil {
			return Count{}, err
		}
	} else {
		enc = O200kBase
	}
	v, err := c.vocab(enc)
	if err != nil {
		return Count{}, err
	}
	w := c.getWorker()
	defer c.putWorker(w)
	t := &tally{v: v, w: w, model: normalizeModel(model), fam: fam}

	out := Count{API: api, Model: model, Encoding: enc, Fallback: fallback, Exact: fam == familyOpenAI}
	var caps []json.RawMessage
	multiplier := 1
	switch api {
	case ChatCompletions:
		err = t.chat(&b)
		caps = []json.RawMessage{b.MaxTokens, b.MaxCompletionTokens, b.MaxOutputTokens}
		multiplier, err = choices(err, b.N, "n")
	case Completions:
		var prompts int
		prompts, err = t.prompt(b.Prompt, "prompt")
		if err == nil && len(b.Suffix) > 0 {
			_, err = t.prompt(b.Suffix, "suffix")
		}
		caps = []json.RawMessage{b.MaxTokens, b.MaxCompletionTokens, b.MaxOutputTokens}
		multiplier, err = choices(err, b.N, "n")
		if bo, err2 := choices(err, b.BestOf, "best_of"); err2 == nil {
			multiplier = max(multiplier, bo)
		} else {
			err = err2
		}
		multiplier *= max(prompts, 1)
	case Embeddings:
		_, err = t.prompt(b.Input, "input")
	case Responses:
		err = t.responses(&b)
		caps = []json.RawMessage{b.MaxTokens, b.MaxCompletionTokens, b.MaxOutputTokens}
	case Messages:
		err = t.anthropic(&b)
		caps = []json.RawMessage{b.MaxTokens}
	case Gemini:
		err = t.gemini(&b)
		if b.GenerationConfig != nil {
			caps = []json.RawMessage{b.GenerationConfig.MaxOutputTokens}
			multiplier, err = choices(err, b.GenerationConfig.CandidateCount, "generationConfig.candidateCount")
		}
	default:
		return Count{}, fmt.Errorf("%w: %q", ErrUnknownAPI, api)
	}
	if err != nil {
		return Count{}, err
	}
	out.InputTokens = t.total()
	out.Stream = b.Stream
	if b.StreamOptions != nil {
		out.IncludeUsage = b.StreamOptions.IncludeUsage
	}
	if api == Embeddings {
		out.AllowanceSource = FromRequest
		return out, nil
	}
	capNames := []string{"max_tokens", "max_completion_tokens", "max_output_tokens"}
	if api == Gemini {
		capNames = []string{"generationConfig.maxOutputTokens"}
	}
	for i, raw := range caps {
		n, err := c.parseCap(raw, capNames[i])
		if err != nil {
			return Count{}, err
		}
		out.OutputCap = max(out.OutputCap, n)
	}
	switch {
	case out.OutputCap > 0:
		out.OutputAllowance, out.AllowanceSource = out.OutputCap, FromRequest
	case api == Completions:
		// The legacy completions endpoint defaults max_tokens to 16.
		out.OutputAllowance, out.AllowanceSource = 16, FromRequest
	default:
		if n, ok := c.est.estimate(estKey{req.Policy, normalizeModel(model)}); ok {
			out.OutputAllowance, out.AllowanceSource = min(n, c.opts.MaxOutputTokens), FromHistory
		} else {
			out.OutputAllowance, out.AllowanceSource = c.opts.DefaultOutputTokens, FromDefault
		}
	}
	out.OutputAllowance = satMul(out.OutputAllowance, multiplier)
	if multiplier > 1 {
		out.Choices = multiplier
	}
	return out, nil
}

func satMul(a, b int) int {
	if b > 0 && a > math.MaxInt32/b {
		return math.MaxInt32
	}
	return a * b
}

// parseCap reads one output cap: absent or null is 0, anything else must
// be a whole number in [1, MaxOutputTokens].
func (c *Counter) parseCap(raw json.RawMessage, name string) (int, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return 0, nil
	}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: %s is %s, want a whole number", ErrInvalidCap, name, raw)
	}
	if n <= 0 {
		return 0, fmt.Errorf("%w: %s is %d, want at least 1", ErrInvalidCap, name, n)
	}
	if n > int64(c.opts.MaxOutputTokens) {
		return 0, fmt.Errorf("%w: %s is %d, more than the limit of %d", ErrInvalidCap, name, n, c.opts.MaxOutputTokens)
	}
	return int(n), nil
}

// choices reads a choice count (n, best_of, candidateCount): absent means 1.
func choices(err error, raw json.RawMessage, name string) (int, error) {
	if err != nil {
		return 1, err
	}
	if len(raw) == 0 || string(raw) == "null" {
		return 1, nil
	}
	n, perr := strconv.Atoi(string(raw))
	if perr != nil || n < 1 || n > 128 {
		return 1, fmt.Errorf("%w: %s is %s, want a whole number from 1 to 128", ErrMalformed, name, raw)
	}
	return n, nil
}

// modelFromPath finds the model in an Azure deployment path
// (/openai/deployments/NAME/...) or a Gemini path (.../models/NAME:verb).
func modelFromPath(path string) string {
	p, _, _ := strings.Cut(path, "?")
	if _, rest, ok := strings.Cut(p, "/deployments/"); ok {
		name, _, _ := strings.Cut(rest, "/")
		return name
	}
	if _, rest, ok := strings.Cut(p, "/models/"); ok {
		name, _, _ := strings.Cut(rest, ":")
		name, _, _ = strings.Cut(name, "/")
		return name
	}
	return ""
}

// errShape reports a body field of an unexpected JSON type.
func errShape(field string, raw json.RawMessage) error {
	s := string(raw)
	if len(s) > 40 {
		s = s[:40] + "…"
	}
	return fmt.Errorf("%w: %s has an unexpected shape: %s", ErrMalformed, field, s)
}
