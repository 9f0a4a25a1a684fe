package provider

import "github.com/tokengate/tokengate/tokenizer"

// Model is the model the stream's events name (OpenAI and Responses
// "model", Anthropic message_start's message.model, Gemini
// "modelVersion"), as the upstream wrote it; "" before one was read.
func (s *Stream) Model() string { return unquoted(s.model) }

// ResponseModel reads the model a complete non-streamed JSON response body
// of the given API names: the top-level "model" member, or "modelVersion"
// for tokenizer.Gemini (of the last element naming one, for a JSON array).
// It is "" when the body names none or is not a JSON object or array.
func ResponseModel(api tokenizer.API, body []byte) string {
	key := "model"
	if api == tokenizer.Gemini {
		key = "modelVersion"
	}
	i := skipSpace(body, 0)
	if i < len(body) && body[i] == '[' && api == tokenizer.Gemini {
		arr, err := openArray(body, i)
		if err != nil {
			return ""
		}
		model := ""
		for start, _, ok := arr.next(); ok; start, _, ok = arr.next() {
			if m := memberString(body, start, key); m != "" {
				model = m
			}
		}
		return model
	}
	return memberString(body, i, key)
}

// memberString is the string value of the member key of the object at
// b[i:], "" when there is none.
func memberString(b []byte, i int, key string) string {
	obj, err := openObject(b, i)
	if err != nil {
		return ""
	}
	for m, more := obj.next(); more; m, more = obj.next() {
		if string(m.key) == key {
			return unquoted(b[m.valueStart:m.valueEnd])
		}
	}
	return ""
}

// maxModelBytes bounds a model name read from an answer: the upstream
// writes it, and it travels on into logs and metrics.
const maxModelBytes = 256

// unquoted is the JSON string v decoded, "" when v is not a string or is
// longer than maxModelBytes.
func unquoted(v []byte) string {
	if len(v) < 2 || len(v) > maxModelBytes+2 || v[0] != '"' {
		return ""
	}
	s, err := appendUnquoted(nil, v)
	if err != nil {
		return ""
	}
	return string(s)
}
