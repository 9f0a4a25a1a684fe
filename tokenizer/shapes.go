package tokenizer

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
)

// body is the union of the top-level fields of every request shape this
// package counts (S22). Polymorphic fields stay raw and are decoded where
// they are counted.
type body struct {
	Model               string            `json:"model"`
	Messages            []message         `json:"messages"`
	Tools               []json.RawMessage `json:"tools"`
	Functions           []functionDef     `json:"functions"`
	Prompt              json.RawMessage   `json:"prompt"`
	Suffix              json.RawMessage   `json:"suffix"`
	Input               json.RawMessage   `json:"input"`
	Instructions        json.RawMessage   `json:"instructions"`
	System              json.RawMessage   `json:"system"`
	Contents            []geminiContent   `json:"contents"`
	SystemInstruction   *geminiContent    `json:"systemInstruction"`
	GenerationConfig    *generationConfig `json:"generationConfig"`
	ResponseFormat      json.RawMessage   `json:"response_format"`
	AnthropicVersion    json.RawMessage   `json:"anthropic_version"`
	PreviousResponseID  json.RawMessage   `json:"previous_response_id"`
	EncodingFormat      json.RawMessage   `json:"encoding_format"`
	Dimensions          json.RawMessage   `json:"dimensions"`
	Thinking            json.RawMessage   `json:"thinking"`
	MaxTokens           json.RawMessage   `json:"max_tokens"`
	MaxCompletionTokens json.RawMessage   `json:"max_completion_tokens"`
	MaxOutputTokens     json.RawMessage   `json:"max_output_tokens"`
	N                   json.RawMessage   `json:"n"`
	BestOf              json.RawMessage   `json:"best_of"`
	Stream              bool              `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

type message struct {
	Role         string          `json:"role"`
	Content      json.RawMessage `json:"content"`
	Name         string          `json:"name"`
	ToolCallID   string          `json:"tool_call_id"`
	ToolCalls    []toolCall      `json:"tool_calls"`
	FunctionCall *functionCall   `json:"function_call"`
	Refusal      *string         `json:"refusal"`
}

type toolCall struct {
	Function functionCall `json:"function"`
}

type functionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type functionDef struct {
	Name        string          `json:"name"`
	Description string          `json:"description"`
	Parameters  json.RawMessage `json:"parameters"`
	// Anthropic spelling of Parameters.
	InputSchema json.RawMessage `json:"input_schema"`
}

type geminiContent struct {
	Role  string       `json:"role"`
	Parts []geminiPart `json:"parts"`
}

type geminiPart struct {
	Text             *string         `json:"text"`
	InlineData       json.RawMessage `json:"inlineData"`
	FileData         json.RawMessage `json:"fileData"`
	FunctionCall     json.RawMessage `json:"functionCall"`
	FunctionResponse json.RawMessage `json:"functionResponse"`
}

type generationConfig struct {
	MaxOutputTokens json.RawMessage `json:"maxOutputTokens"`
	CandidateCount  json.RawMessage `json:"candidateCount"`
}

// contentPart is one element of a content array, in any of the shapes of
// OpenAI chat, Responses and Anthropic messages.
type contentPart struct {
	Type     string          `json:"type"`
	Text     *string         `json:"text"`
	Refusal  string          `json:"refusal"`
	Thinking string          `json:"thinking"`
	ImageURL json.RawMessage `json:"image_url"`
	Detail   string          `json:"detail"`
	Source   json.RawMessage `json:"source"`
	// Anthropic tool_use / tool_result
	Name    string          `json:"name"`
	Input   json.RawMessage `json:"input"`
	Content json.RawMessage `json:"content"`
	// Responses items
	Role      string          `json:"role"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
	Summary   []contentPart   `json:"summary"`
}

// tally accumulates the input tokens of one request.
type tally struct {
	v     *vocab
	w     *worker
	model string
	fam   family
	// n counts text tokens (and the exact chat overhead for OpenAI);
	// fixed counts tokens that are not scaled by the estimate factor
	// (images, documented framing).
	n, fixed int
}

func (t *tally) text(s string) { t.n += t.v.countText(t.w, s) }

// raw counts a JSON value as its compact text: the conservative choice for
// structures whose rendering the provider does not document.
func (t *tally) raw(r json.RawMessage) {
	if len(r) == 0 || string(r) == "null" {
		return
	}
	var buf bytes.Buffer
	if json.Compact(&buf, r) == nil {
		t.text(buf.String())
		return
	}
	t.text(string(r))
}

// Estimation for families whose tokenizer is not public: o200k_base text
// counts scaled by a factor measured on the recorded traffic in
// testdata/providers (see the repository README), rounded up.
const (
	anthropicFactor = 1.15
	geminiFactor    = 1.10
	// anthropicToolPrompt is the documented system prompt Anthropic adds
	// when tools are present (346 tokens for tool_choice auto/none on
	// current models, the larger of the published values).
	anthropicToolPrompt = 346
	// anthropicHaiku4ToolPrompt is the tool framing measured on Claude
	// Haiku 4.5, which is larger than the published figure.
	anthropicHaiku4ToolPrompt = 620
	// anthropicThinkingPrompt is the framing measured when extended
	// thinking is enabled.
	anthropicThinkingPrompt = 30
	// Undocumented OpenAI tool framing, measured on the recorded traffic:
	// chat completions on reasoning models (gpt-5, o-series) and the
	// Responses API on gpt-4o-class models add a preamble when tools are
	// present that the published formula does not cover.
	reasoningChatToolPreamble = 85
	responsesToolPreamble     = 210
)

// reasoningModel reports whether a normalized OpenAI model name is of the
// gpt-5 or o-series families.
func reasoningModel(m string) bool {
	return strings.HasPrefix(m, "gpt-5") || strings.HasPrefix(m, "o1") || strings.HasPrefix(m, "o3") || strings.HasPrefix(m, "o4")
}

func (t *tally) total() int {
	switch t.fam {
	case familyAnthropic:
		return int(math.Ceil(float64(t.n)*anthropicFactor)) + t.fixed
	case familyGemini:
		return int(math.Ceil(float64(t.n)*geminiFactor)) + t.fixed
	}
	return t.n + t.fixed
}

// chat counts OpenAI chat completions with the overhead OpenAI documents in
// its cookbook: 3 tokens per message (4 for gpt-3.5-turbo-0301), 1 per name
// (-1 for 0301), 3 to prime the reply, plus the published tool formula.
func (t *tally) chat(b *body) error {
	perMsg, perName := 3, 1
	if strings.HasPrefix(t.model, "gpt-3.5-turbo-0301") {
		perMsg, perName = 4, -1
	}
	t.n += 3
	for i := range b.Messages {
		m := &b.Messages[i]
		t.n += perMsg
		t.text(m.Role)
		if err := t.content(m.Content, "messages.content"); err != nil {
			return err
		}
		if m.Name != "" {
			t.text(m.Name)
			t.n += perName
		}
		if m.Refusal != nil {
			t.text(*m.Refusal)
		}
		for _, tc := range m.ToolCalls {
			t.call(tc.Function.Name, tc.Function.Arguments)
		}
		if m.FunctionCall != nil {
			t.call(m.FunctionCall.Name, m.FunctionCall.Arguments)
		}
	}
	defs, err := toolDefs(b.Tools)
	if err != nil {
		return err
	}
	defs = append(defs, b.Functions...)
	t.functions(defs)
	if len(defs) > 0 && reasoningModel(t.model) {
		t.fixed += reasoningChatToolPreamble
	}
	if len(b.ResponseFormat) > 0 && bytes.Contains(b.ResponseFormat, []byte(`"json_schema"`)) {
		t.raw(b.ResponseFormat)
	}
	return nil
}

// call counts a tool call made by the assistant. OpenAI does not document
// its rendering; name, arguments and 3 tokens of framing come close.
func (t *tally) call(name, args string) {
	t.text(name)
	t.text(args)
	t.n += 3
}

// toolDefs extracts function definitions from a tools array in the chat
// ({"type":"function","function":{...}}) or Responses ({"type":"function",
// "name":...}) shape; other tools are counted as their JSON.
func toolDefs(tools []json.RawMessage) ([]functionDef, error) {
	var defs []functionDef
	for _, raw := range tools {
		var tool struct {
			Type     string       `json:"type"`
			Function *functionDef `json:"function"`
			functionDef
		}
		if err := decodeJSON(raw, &tool); err != nil {
			return nil, errShape("tools[]", raw)
		}
		switch {
		case tool.Function != nil:
			defs = append(defs, *tool.Function)
		case tool.Name != "":
			defs = append(defs, tool.functionDef)
		default:
			defs = append(defs, functionDef{Name: tool.Type, Parameters: raw})
		}
	}
	return defs, nil
}

// functions applies OpenAI's published tool-definition formula (cookbook
// "How to count tokens with tiktoken"): per function 7 tokens on o200k_base
// (10 on cl100k_base) plus "name:description"; 3 for the properties and per
// property 3 plus "key:type:description"; an enum costs -3 plus 3 and its
// text per item; 12 to close. Nested schemas, which the formula does not
// cover, are added as their JSON.
func (t *tally) functions(defs []functionDef) {
	if len(defs) == 0 {
		return
	}
	funcInit := 7
	if t.v.name == Cl100kBase {
		funcInit = 10
	}
	for _, f := range defs {
		t.n += funcInit
		t.text(f.Name + ":" + strings.TrimSuffix(f.Description, "."))
		params := f.Parameters
		if len(params) == 0 {
			params = f.InputSchema
		}
		var schema struct {
			Properties map[string]json.RawMessage `json:"properties"`
		}
		if decodeJSON(params, &schema) != nil {
			t.raw(params)
			continue
		}
		if len(schema.Properties) == 0 {
			continue
		}
		t.n += 3
		for key, raw := range schema.Properties {
			t.n += 3
			var p struct {
				Type        json.RawMessage   `json:"type"`
				Description string            `json:"description"`
				Enum        []json.RawMessage `json:"enum"`
				Properties  json.RawMessage   `json:"properties"`
				Items       json.RawMessage   `json:"items"`
				AnyOf       json.RawMessage   `json:"anyOf"`
			}
			if decodeJSON(raw, &p) != nil {
				t.raw(raw)
				continue
			}
			if len(p.Enum) > 0 {
				t.n -= 3
				for _, item := range p.Enum {
					t.n += 3
					var s string
					if decodeJSON(item, &s) == nil {
						t.text(s)
					} else {
						t.raw(item)
					}
				}
			}
			typ := ""
			if decodeJSON(p.Type, &typ) != nil {
				typ = string(p.Type)
			}
			t.text(key + ":" + typ + ":" + strings.TrimSuffix(p.Description, "."))
			t.raw(p.Properties)
			t.raw(p.Items)
			t.raw(p.AnyOf)
		}
	}
	t.n += 12
}

// content counts a message content: a string, null, or an array of parts.
func (t *tally) content(raw json.RawMessage, field string) error {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := decodeJSON(raw, &s); err != nil {
			return errShape(field, raw)
		}
		t.text(s)
		return nil
	case '[':
		var parts []contentPart
		if err := decodeJSON(raw, &parts); err != nil {
			return errShape(field, raw)
		}
		for i := range parts {
			if err := t.part(&parts[i], field); err != nil {
				return err
			}
		}
		return nil
	}
	return errShape(field, raw)
}

// part counts one content part of any shape.
func (t *tally) part(p *contentPart, field string) error {
	switch p.Type {
	case "image_url", "input_image", "image":
		t.fixed += t.image(p)
		return nil
	case "tool_use":
		t.text(p.Name)
		t.raw(p.Input)
		return nil
	case "tool_result":
		return t.content(p.Content, field+".tool_result")
	}
	if p.Text != nil {
		t.text(*p.Text)
	}
	t.text(p.Refusal)
	t.text(p.Thinking)
	if len(p.Content) > 0 {
		return t.content(p.Content, field)
	}
	return nil
}

// Image bounds. OpenAI documents a tile formula for the gpt-4o family: 85
// tokens at low detail, else 85 + 170 per 512-px tile of the image scaled
// into 2048x2048 and to 768 px on its short side, at most 8 tiles
// (1445); gpt-4o-mini bills the same tiles at 2833 + 5667 each. Without
// the image's size the largest value is reserved. Anthropic documents
// about (w*h)/750 tokens with images scaled to about 1.15 megapixels:
// at most 1600. Gemini bills 258 tokens per 768x768 tile; 6 tiles bound
// the usual sizes.
const (
	openAIImageMax     = 85 + 8*170
	openAIMiniImageMax = 2833 + 8*5667
	anthropicImageMax  = 1600
	geminiImageMax     = 6 * 258
)

func (t *tally) image(p *contentPart) int {
	switch t.fam {
	case familyAnthropic:
		return anthropicImageMax
	case familyGemini:
		return geminiImageMax
	}
	detail := p.Detail
	var iu struct {
		Detail string `json:"detail"`
	}
	if decodeJSON(p.ImageURL, &iu) == nil && iu.Detail != "" {
		detail = iu.Detail
	}
	mini := strings.HasPrefix(t.model, "gpt-4o-mini")
	if detail == "low" {
		if mini {
			return 2833
		}
		return 85
	}
	if mini {
		return openAIMiniImageMax
	}
	return openAIImageMax
}

// prompt counts a completions prompt or an embeddings input: a string, an
// array of strings, an array of token ids, or an array of token arrays. It
// returns the number of prompts.
func (t *tally) prompt(raw json.RawMessage, field string) (int, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return 0, nil
	}
	var s string
	if decodeJSON(raw, &s) == nil {
		t.text(s)
		return 1, nil
	}
	var items []json.RawMessage
	if err := decodeJSON(raw, &items); err != nil {
		return 0, errShape(field, raw)
	}
	allInts := true
	for _, it := range items {
		if len(it) == 0 || (it[0] != '-' && (it[0] < '0' || it[0] > '9')) {
			allInts = false
		}
	}
	if allInts {
		t.n += len(items)
		return 1, nil
	}
	for _, it := range items {
		if decodeJSON(it, &s) == nil {
			t.text(s)
			continue
		}
		var ids []json.RawMessage
		if err := decodeJSON(it, &ids); err != nil {
			return 0, errShape(field+"[]", it)
		}
		t.n += len(ids)
	}
	return len(items), nil
}

// responses counts the Responses API. Its framing is not documented; items
// are counted like chat messages, which the recorded traffic shows to be
// close (see the repository README).
func (t *tally) responses(b *body) error {
	t.n += 3
	if len(b.Instructions) > 0 && string(b.Instructions) != "null" {
		t.n += 3 + 1 // a developer message
		if err := t.content(b.Instructions, "instructions"); err != nil {
			return err
		}
	}
	if len(b.Input) > 0 && b.Input[0] == '"' {
		t.n += 3
		t.text("user")
		return t.finishResponses(b, t.content(b.Input, "input"))
	}
	if len(b.Input) > 0 && string(b.Input) != "null" {
		var items []contentPart
		if err := decodeJSON(b.Input, &items); err != nil {
			return errShape("input", b.Input)
		}
		for i := range items {
			it := &items[i]
			switch it.Type {
			case "", "message":
				t.n += 3
				t.text(it.Role)
				if err := t.content(it.Content, "input[].content"); err != nil {
					return err
				}
			case "function_call":
				t.call(it.Name, it.Arguments)
			case "function_call_output":
				t.n += 3
				var s string
				if decodeJSON(it.Output, &s) == nil {
					t.text(s)
				} else {
					t.raw(it.Output)
				}
			case "reasoning":
				for j := range it.Summary {
					if err := t.part(&it.Summary[j], "input[].summary"); err != nil {
						return err
					}
				}
			default:
				if err := t.part(it, "input[]"); err != nil {
					return err
				}
			}
		}
	}
	return t.finishResponses(b, nil)
}

func (t *tally) finishResponses(b *body, err error) error {
	if err != nil {
		return err
	}
	defs, err := toolDefs(b.Tools)
	if err != nil {
		return err
	}
	t.functions(defs)
	if len(defs) > 0 && !reasoningModel(t.model) {
		t.fixed += responsesToolPreamble
	}
	return nil
}

// anthropic counts Anthropic messages: system, messages with content
// blocks, and tool definitions, as o200k_base text scaled by
// anthropicFactor, plus per-message framing and the documented tool prompt.
func (t *tally) anthropic(b *body) error {
	if err := t.content(b.System, "system"); err != nil {
		return err
	}
	for i := range b.Messages {
		m := &b.Messages[i]
		t.n += 4
		if err := t.content(m.Content, "messages.content"); err != nil {
			return err
		}
	}
	if bytes.Contains(b.Thinking, []byte(`"enabled"`)) {
		t.fixed += anthropicThinkingPrompt
	}
	if len(b.Tools) > 0 {
		if strings.HasPrefix(t.model, "claude-haiku-4") {
			t.fixed += anthropicHaiku4ToolPrompt
		} else {
			t.fixed += anthropicToolPrompt
		}
		for _, raw := range b.Tools {
			var f functionDef
			if decodeJSON(raw, &f) != nil || f.Name == "" {
				t.raw(raw) // server tools (web search, code execution)
				continue
			}
			t.text(f.Name)
			t.text(f.Description)
			t.raw(f.InputSchema)
			t.n += 4
		}
	}
	return nil
}

// gemini counts generateContent: systemInstruction, contents and tools, as
// o200k_base text scaled by geminiFactor.
func (t *tally) gemini(b *body) error {
	count := func(c *geminiContent) {
		for _, p := range c.Parts {
			if p.Text != nil {
				t.text(*p.Text)
			}
			if len(p.InlineData) > 0 || len(p.FileData) > 0 {
				t.fixed += geminiImageMax
			}
			t.raw(p.FunctionCall)
			t.raw(p.FunctionResponse)
		}
	}
	if b.SystemInstruction != nil {
		count(b.SystemInstruction)
	}
	for i := range b.Contents {
		count(&b.Contents[i])
	}
	for _, raw := range b.Tools {
		t.raw(raw)
	}
	return nil
}
