package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// shapeBodies are request bodies whose cost is mostly JSON structure rather
// than text: many short messages, large tool schemas, escaped code, and the
// Anthropic, Responses and Gemini shapes.
func shapeBodies(tb testing.TB) map[string][]byte {
	code := benchInput(tb, "code", 64<<10)
	var msgs []map[string]string
	for i := range 2000 {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]string{"role": role, "content": fmt.Sprintf("message %d: short and sweet", i)})
	}
	var tools []any
	for i := range 64 {
		props := map[string]any{}
		for j := range 12 {
			props[fmt.Sprintf("arg%d", j)] = map[string]any{"type": "string", "description": "an argument of the tool", "enum": []string{"a", "b", "c"}}
		}
		tools = append(tools, map[string]any{"type": "function", "function": map[string]any{
			"name": fmt.Sprintf("tool_%d", i), "description": "does one thing well",
			"parameters": map[string]any{"type": "object", "properties": props, "required": []string{"arg0"}},
		}})
	}
	var blocks []any
	for i := range 500 {
		blocks = append(blocks, map[string]any{"role": "user", "content": []any{
			map[string]any{"type": "text", "text": fmt.Sprintf("block %d", i)},
			map[string]any{"type": "tool_result", "tool_use_id": "t", "content": "ok"},
		}})
	}
	var parts []any
	for i := range 500 {
		parts = append(parts, map[string]any{"role": "user", "parts": []any{map[string]any{"text": fmt.Sprintf("part %d", i)}}})
	}
	mustJSON := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			tb.Fatal(err)
		}
		return b
	}
	return map[string][]byte{
		"chat-2000-messages": mustJSON(map[string]any{"model": "gpt-4o", "messages": msgs, "max_tokens": 100}),
		"chat-64-tools":      mustJSON(map[string]any{"model": "gpt-4o", "messages": msgs[:2], "tools": tools}),
		"chat-escaped-code":  mustJSON(map[string]any{"model": "gpt-4o", "messages": []any{map[string]string{"role": "user", "content": strings.Repeat(code, 4)}}}),
		"anthropic-blocks":   mustJSON(map[string]any{"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": blocks}),
		"responses-items":    mustJSON(map[string]any{"model": "gpt-5", "input": msgs[:1000]}),
		"gemini-contents":    mustJSON(map[string]any{"contents": parts, "generationConfig": map[string]any{"maxOutputTokens": 100}}),
	}
}

// BenchmarkCountShapes counts structure-heavy bodies, parsing included.
// Compare two builds with benchstat:
//
//	go test ./tokenizer -run '^$' -bench 'CountShapes' -benchmem
func BenchmarkCountShapes(b *testing.B) {
	c := newTestCounter(b)
	paths := map[string]string{"gemini-contents": "/v1beta/models/gemini-2.0-flash:generateContent"}
	bodies := shapeBodies(b)
	for _, name := range []string{"chat-2000-messages", "chat-64-tools", "chat-escaped-code", "anthropic-blocks", "responses-items", "gemini-contents"} {
		body := bodies[name]
		req := Request{Path: paths[name], Body: body}
		if _, err := c.Count(req); err != nil {
			b.Fatalf("%s: %v", name, err)
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := c.Count(req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
