package extproc

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/tokengate/tokengate/tokenizer"
)

// capFields lists, per API, the body fields that cap output, and the one to
// add when the body has none.
var capFields = map[tokenizer.API]struct {
	fields []string
	add    string
}{
	tokenizer.ChatCompletions: {[]string{"max_tokens", "max_completion_tokens"}, "max_completion_tokens"},
	tokenizer.Completions:     {[]string{"max_tokens"}, "max_tokens"},
	tokenizer.Responses:       {[]string{"max_output_tokens"}, "max_output_tokens"},
	tokenizer.Messages:        {[]string{"max_tokens"}, "max_tokens"},
}

// rewriteBody returns body with stream_options.include_usage set when
// injectUsage (S15), and every output cap lowered to clamp when clamp > 0
// (adding one where the body has none). The body was already parsed by the
// tokenizer, so an error here means a shape the rewrite cannot handle.
func rewriteBody(api tokenizer.API, body []byte, injectUsage bool, clamp int) ([]byte, error) {
	if injectUsage && clamp <= 0 && !bytes.Contains(body, []byte(`"stream_options"`)) {
		// The common case needs no re-encoding: insert the member first.
		if i := bytes.IndexByte(body, '{'); i >= 0 && len(bytes.TrimSpace(body[:i])) == 0 && json.Valid(body) {
			const member = `"stream_options":{"include_usage":true}`
			out := make([]byte, 0, len(body)+len(member)+1)
			out = append(out, body[:i+1]...)
			out = append(out, member...)
			if rest := bytes.TrimLeft(body[i+1:], " \t\r\n"); len(rest) > 0 && rest[0] != '}' {
				out = append(out, ',')
			}
			return append(out, body[i+1:]...), nil
		}
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return nil, fmt.Errorf("rewrite request body: %w", err)
	}
	if injectUsage {
		opts := map[string]json.RawMessage{}
		if raw, ok := top["stream_options"]; ok && string(raw) != "null" {
			if err := json.Unmarshal(raw, &opts); err != nil {
				return nil, fmt.Errorf("rewrite request body: stream_options: %w", err)
			}
		}
		opts["include_usage"] = json.RawMessage("true")
		raw, err := json.Marshal(opts)
		if err != nil {
			return nil, fmt.Errorf("rewrite request body: stream_options: %w", err)
		}
		top["stream_options"] = raw
	}
	if clamp > 0 {
		if api == tokenizer.Gemini {
			if err := clampGemini(top, clamp); err != nil {
				return nil, err
			}
		} else if cf, ok := capFields[api]; ok {
			clampFields(top, cf.fields, cf.add, clamp)
		}
	}
	return json.Marshal(top)
}

func clampFields(obj map[string]json.RawMessage, fields []string, add string, clamp int) {
	found := false
	for _, f := range fields {
		raw, ok := obj[f]
		if !ok || string(raw) == "null" {
			continue
		}
		found = true
		if v, err := strconv.ParseFloat(string(raw), 64); err == nil && v <= float64(clamp) {
			continue
		}
		obj[f] = json.RawMessage(strconv.Itoa(clamp))
	}
	if !found {
		obj[add] = json.RawMessage(strconv.Itoa(clamp))
	}
}

func clampGemini(top map[string]json.RawMessage, clamp int) error {
	gc := map[string]json.RawMessage{}
	if raw, ok := top["generationConfig"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &gc); err != nil {
			return fmt.Errorf("rewrite request body: generationConfig: %w", err)
		}
	}
	clampFields(gc, []string{"maxOutputTokens"}, "maxOutputTokens", clamp)
	raw, err := json.Marshal(gc)
	if err != nil {
		return fmt.Errorf("rewrite request body: generationConfig: %w", err)
	}
	top["generationConfig"] = raw
	return nil
}
