package provider

import (
	"errors"
	"fmt"

	"github.com/tokengate/tokengate/internal/billing"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// ErrMalformed is wrapped by every error about a response body or event that
// is not what its API sends: invalid JSON, a usage member of the wrong type, a
// negative token count.
var ErrMalformed = errors.New("malformed provider response")

// Usage is the one shape provider usage is read into (S22), the shape the
// price table prices: docs/wire-formats.md has the table of where each
// field comes from per provider.
type Usage = pricing.Usage

// ParseUsage reads usage from a complete non-streamed JSON response body of
// the given API (S22). ok is false when the body reports none, as error bodies
// do. err wraps ErrMalformed when the body is not JSON of the expected shape.
//
// For tokenizer.Gemini the body may also be the JSON array that
// streamGenerateContent sends without alt=sse; the last element carrying
// usageMetadata counts, as in a stream.
func ParseUsage(api tokenizer.API, body []byte) (u Usage, ok bool, err error) {
	u, ok, err = parseUsage(api, body)
	if err != nil {
		return Usage{}, false, fmt.Errorf("%w: %s body: %w", ErrMalformed, api, err)
	}
	return u, ok, nil
}

func parseUsage(api tokenizer.API, body []byte) (Usage, bool, error) {
	read, key := usageReader(api)
	if read == nil {
		return Usage{}, false, fmt.Errorf("unknown API %q", string(api))
	}
	i := skipSpace(body, 0)
	if api == tokenizer.Gemini && i < len(body) && body[i] == '[' {
		return parseGeminiArray(body, i)
	}
	end, err := skipValue(body, i)
	if err != nil {
		return Usage{}, false, err
	}
	if j := skipSpace(body, end); j != len(body) {
		return Usage{}, false, errAt(j, "data after the JSON value")
	}
	obj, err := openObject(body, i)
	if err != nil {
		return Usage{}, false, err
	}
	var (
		u  Usage
		ok bool
		af answerFields
	)
	for m, more := obj.next(); more; m, more = obj.next() {
		v := body[m.valueStart:m.valueEnd]
		if af.read(m.key, v) || string(m.key) != key {
			continue
		}
		if isNull(v) {
			u, ok = Usage{}, false
			continue
		}
		if u, err = read(v); err != nil {
			return Usage{}, false, fmt.Errorf("%s: %w", key, err)
		}
		ok = true
	}
	if ok {
		af.apply(&u)
	}
	return u, ok, obj.err
}

// answerFields are the members of an OpenAI answer beside its usage that
// say how its tokens were billed: service_tier, the tier the request was
// processed in (every chat chunk and Responses object carries it), and
// prompt_cache_retention (Responses objects echo the request's). They are
// kept read, not as text: an answer carries them in every event.
type answerFields struct {
	tier     billing.Tier // "" when the answer names no tier the table knows
	extended bool
}

// read keeps the member key: v if it is one of them, and reports whether it
// was.
func (af *answerFields) read(key, v []byte) bool {
	var buf [maxShortString]byte
	switch string(key) {
	case "service_tier":
		af.tier = ""
		switch t := billing.OpenAI(string(shortString(buf[:0], v))); t {
		case billing.Standard, billing.Fast, billing.Flex:
			af.tier = t
		}
	case "prompt_cache_retention":
		af.extended = billing.ExtendedRetention(string(shortString(buf[:0], v)))
	default:
		return false
	}
	return true
}

// apply marks u's tokens as the fields say they were billed: at the tier
// the answer names; every cache write of a request with the longer
// retention is an extended one.
func (af answerFields) apply(u *Usage) {
	if af.tier != "" {
		u.ServiceTier = af.tier
	}
	if af.extended {
		u.CacheCreationExtendedInputTokens = u.CacheCreationInputTokens
	}
}

// maxShortString bounds the strings shortString decodes: the values it
// reads are short names.
const maxShortString = 64

// shortString appends the JSON string v decoded to dst, or nothing when v
// is no string (null included), does not decode or is longer than any
// value read this way.
func shortString(dst, v []byte) []byte {
	if len(v) > maxShortString+2 {
		return dst
	}
	b, err := appendUnquoted(dst, v)
	if err != nil {
		return dst
	}
	return b
}

// parseGeminiArray reads the usage of a streamGenerateContent body sent as a
// JSON array: the last element with usageMetadata wins.
func parseGeminiArray(body []byte, i int) (Usage, bool, error) {
	arr, err := openArray(body, i)
	if err != nil {
		return Usage{}, false, err
	}
	var (
		u  Usage
		ok bool
	)
	for s, e, more := arr.next(); more; s, e, more = arr.next() {
		obj, err := openObject(body[:e], s)
		if err != nil {
			return Usage{}, false, err
		}
		for m, more := obj.next(); more; m, more = obj.next() {
			if string(m.key) != "usageMetadata" || isNull(body[m.valueStart:m.valueEnd]) {
				continue
			}
			if u, err = readGeminiUsage(body[m.valueStart:m.valueEnd]); err != nil {
				return Usage{}, false, fmt.Errorf("usageMetadata: %w", err)
			}
			ok = true
		}
		if obj.err != nil {
			return Usage{}, false, obj.err
		}
	}
	if arr.err != nil {
		return Usage{}, false, arr.err
	}
	if j := skipSpace(body, arr.i); j != len(body) {
		return Usage{}, false, errAt(j, "data after the JSON value")
	}
	return u, ok, nil
}

// usageReader returns the reader for api's usage object and the member that
// holds it.
func usageReader(api tokenizer.API) (read func([]byte) (Usage, error), key string) {
	switch api {
	case tokenizer.ChatCompletions, tokenizer.Completions, tokenizer.Embeddings:
		return readOpenAIUsage, "usage"
	case tokenizer.Responses:
		return readResponsesUsage, "usage"
	case tokenizer.Messages:
		return func(v []byte) (Usage, error) {
			var a anthropicUsage
			if err := a.overlay(v); err != nil {
				return Usage{}, err
			}
			return a.usage(), nil
		}, "usage"
	case tokenizer.Gemini:
		return readGeminiUsage, "usageMetadata"
	}
	return nil, ""
}

// countField reads the member value v as a token count into *dst, naming key
// in the error.
func countField(dst *int, key, v []byte) error {
	n, err := parseCount(v)
	if err != nil {
		return fmt.Errorf("%s: %w", key, err)
	}
	*dst = n
	return nil
}

// readNested reads the counts named in keys from the object v.
func readNested(key, v []byte, keys []string, dsts []*int) error {
	if isNull(v) {
		return nil
	}
	obj, err := openObject(v, 0)
	if err != nil {
		return fmt.Errorf("%s: %w", key, err)
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		for k, name := range keys {
			if string(m.key) == name {
				if err := countField(dsts[k], m.key, v[m.valueStart:m.valueEnd]); err != nil {
					return fmt.Errorf("%s: %w", key, err)
				}
			}
		}
	}
	if obj.err != nil {
		return fmt.Errorf("%s: %w", key, obj.err)
	}
	return nil
}

// readOpenAIUsage reads an OpenAI chat, completions or embeddings usage
// object (also Azure OpenAI and OpenAI-compatible routers).
func readOpenAIUsage(v []byte) (Usage, error) {
	var u Usage
	obj, err := openObject(v, 0)
	if err != nil {
		return u, err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		val := v[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "prompt_tokens":
			err = countField(&u.InputTokens, m.key, val)
		case "completion_tokens":
			err = countField(&u.OutputTokens, m.key, val)
		case "prompt_tokens_details":
			err = readNested(m.key, val, []string{"cached_tokens", "cache_write_tokens", "audio_tokens"},
				[]*int{&u.CachedInputTokens, &u.CacheCreationInputTokens, &u.AudioInputTokens})
		case "completion_tokens_details":
			err = readNested(m.key, val, []string{"reasoning_tokens", "audio_tokens"}, []*int{&u.ReasoningTokens, &u.AudioOutputTokens})
		}
		if err != nil {
			return Usage{}, err
		}
	}
	return u, obj.err
}

// readResponsesUsage reads an OpenAI Responses API usage object.
func readResponsesUsage(v []byte) (Usage, error) {
	var u Usage
	obj, err := openObject(v, 0)
	if err != nil {
		return u, err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		val := v[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "input_tokens":
			err = countField(&u.InputTokens, m.key, val)
		case "output_tokens":
			err = countField(&u.OutputTokens, m.key, val)
		case "input_tokens_details":
			err = readNested(m.key, val, []string{"cached_tokens", "cache_write_tokens", "audio_tokens"},
				[]*int{&u.CachedInputTokens, &u.CacheCreationInputTokens, &u.AudioInputTokens})
		case "output_tokens_details":
			err = readNested(m.key, val, []string{"reasoning_tokens"}, []*int{&u.ReasoningTokens})
		}
		if err != nil {
			return Usage{}, err
		}
	}
	return u, obj.err
}

// anthropicUsage is Anthropic's usage as sent: input_tokens excludes both
// cache counts, and a stream reports it in two parts. cache_creation splits
// the cache writes by retention.
type anthropicUsage struct {
	input, output, cacheCreation, cacheRead int
	// written5m and written1h are cache_creation's
	// ephemeral_5m_input_tokens and ephemeral_1h_input_tokens.
	written5m, written1h int
	// speed is the tier the usage's speed names: Fast for a request served
	// in fast mode; "" when it names none.
	speed billing.Tier
}

// overlay sets the fields present and non-null in the usage object v, as a
// message_delta's usage overlays message_start's.
func (a *anthropicUsage) overlay(v []byte) error {
	obj, err := openObject(v, 0)
	if err != nil {
		return err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		val := v[m.valueStart:m.valueEnd]
		var dst *int
		switch string(m.key) {
		case "input_tokens":
			dst = &a.input
		case "output_tokens":
			dst = &a.output
		case "cache_creation_input_tokens":
			dst = &a.cacheCreation
		case "cache_read_input_tokens":
			dst = &a.cacheRead
		case "cache_creation":
			if err := readNested(m.key, val, []string{"ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"},
				[]*int{&a.written5m, &a.written1h}); err != nil {
				return err
			}
		case "speed":
			if isNull(val) {
				continue
			}
			var buf [maxShortString]byte
			a.speed = ""
			if t := billing.Anthropic(string(shortString(buf[:0], val))); t != billing.Unknown {
				a.speed = t
			}
		}
		if dst == nil || isNull(val) {
			continue
		}
		if err := countField(dst, m.key, val); err != nil {
			return err
		}
	}
	return obj.err
}

func (a anthropicUsage) usage() Usage {
	// cache_creation_input_tokens is the sum of the split; a split that
	// says more than the sum is billed as the split says.
	written := max(a.cacheCreation, a.written5m+a.written1h)
	return Usage{
		ServiceTier:                      a.speed,
		InputTokens:                      a.input + written + a.cacheRead,
		OutputTokens:                     a.output,
		CachedInputTokens:                a.cacheRead,
		CacheCreationInputTokens:         written,
		CacheCreationExtendedInputTokens: a.written1h,
	}
}

// readGeminiUsage reads a Gemini usageMetadata object. Thinking tokens are
// billed as output but reported beside candidatesTokenCount, not inside it.
func readGeminiUsage(v []byte) (Usage, error) {
	var (
		u                       Usage
		prompt, toolUse, output int
	)
	obj, err := openObject(v, 0)
	if err != nil {
		return u, err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		val := v[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "promptTokenCount":
			err = countField(&prompt, m.key, val)
		case "toolUsePromptTokenCount":
			err = countField(&toolUse, m.key, val)
		case "candidatesTokenCount":
			err = countField(&output, m.key, val)
		case "thoughtsTokenCount":
			err = countField(&u.ReasoningTokens, m.key, val)
		case "cachedContentTokenCount":
			err = countField(&u.CachedInputTokens, m.key, val)
		}
		if err != nil {
			return Usage{}, err
		}
	}
	u.InputTokens = prompt + toolUse
	u.OutputTokens = output + u.ReasoningTokens
	return u, obj.err
}
