package tokenizer

import (
	"math"
	"strings"
)

// The functions below count each request shape (S22) from the fields of a
// parsed body (see request.go). Every object is read with exact keys and
// the last duplicate winning; a field of the wrong JSON type is refused
// with ErrMalformed, naming the field and its offset.

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
	// buf holds the canonical text of raw JSON values.
	buf []byte
	// pre holds string values counted as the body arrived, or is nil.
	pre *Precount
}

func (t *tally) text(s string) { t.n += t.v.countText(t.w, s) }

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
	if err := wantArray(b.Messages, "messages"); err != nil {
		return err
	}
	for m := range b.Messages.elems() {
		if m.kind() != '{' {
			return errShape("messages[]", m, "an object")
		}
		var role, name, content, refusal, toolCalls, functionCall jval
		for k, v := range m.members() {
			switch string(k) {
			case "role":
				role = v
			case "name":
				name = v
			case "content":
				content = v
			case "refusal":
				refusal = v
			case "tool_calls":
				toolCalls = v
			case "function_call":
				functionCall = v
			}
		}
		t.n += perMsg
		if err := t.textField(role, "messages[].role"); err != nil {
			return err
		}
		if err := t.content(content, "messages[].content"); err != nil {
			return err
		}
		if name.present() {
			s, err := stringField(name, "messages[].name")
			if err != nil {
				return err
			}
			if s != "" {
				t.text(s)
				t.n += perName
			}
		}
		if err := t.textField(refusal, "messages[].refusal"); err != nil {
			return err
		}
		if err := wantArray(toolCalls, "messages[].tool_calls"); err != nil {
			return err
		}
		for tc := range toolCalls.elems() {
			if tc.kind() != '{' {
				return errShape("messages[].tool_calls[]", tc, "an object")
			}
			var fn jval
			for k, v := range tc.members() {
				if string(k) == "function" {
					fn = v
				}
			}
			if err := t.callObject(fn, "messages[].tool_calls[].function"); err != nil {
				return err
			}
		}
		if functionCall.present() {
			if err := t.callObject(functionCall, "messages[].function_call"); err != nil {
				return err
			}
		}
	}
	defs, err := toolDefs(b.Tools)
	if err != nil {
		return err
	}
	if err := wantArray(b.Functions, "functions"); err != nil {
		return err
	}
	for f := range b.Functions.elems() {
		def, err := readFunctionDef(f, "functions[]")
		if err != nil {
			return err
		}
		defs = append(defs, def)
	}
	t.functions(defs)
	if len(defs) > 0 && reasoningModel(t.model) {
		t.fixed += reasoningChatToolPreamble
	}
	if b.ResponseFormat.kind() == '{' {
		for k, v := range b.ResponseFormat.members() {
			if string(k) == "type" && v.isString("json_schema") {
				t.raw(b.ResponseFormat)
				break
			}
		}
	}
	return nil
}

// wantArray checks that a field is an array, null or absent.
func wantArray(v jval, field ...string) error {
	if v.present() && v.kind() != '[' {
		return errShape(strings.Join(field, ""), v, "an array")
	}
	return nil
}

// value counts the string value v on its own, as a whole: the one way
// whole string values are counted, so that a Precount can stand in for it.
func (t *tally) value(v jval) {
	if n, ok := t.pre.tokens(v, t.v.name); ok {
		t.n += n
		return
	}
	t.text(v.str())
}

// textField counts a string field; absent or null counts nothing.
func (t *tally) textField(v jval, field ...string) error {
	if v.kind() == '"' {
		t.value(v)
		return nil
	}
	_, err := stringField(v, field...)
	return err
}

// callObject counts a {"name", "arguments"} tool call object.
func (t *tally) callObject(fn jval, field string) error {
	if fn.present() && fn.kind() != '{' {
		return errShape(field, fn, "an object")
	}
	var name, args jval
	if fn.kind() == '{' {
		for k, v := range fn.members() {
			switch string(k) {
			case "name":
				name = v
			case "arguments":
				args = v
			}
		}
	}
	n, err := stringField(name, field, ".name")
	if err != nil {
		return err
	}
	a, err := stringField(args, field, ".arguments")
	if err != nil {
		return err
	}
	t.call(n, a)
	return nil
}

// call counts a tool call made by the assistant. OpenAI does not document
// its rendering; name, arguments and 3 tokens of framing come close.
func (t *tally) call(name, args string) {
	t.text(name)
	t.text(args)
	t.n += 3
}

// functionDef is one tool or function definition.
type functionDef struct {
	Name, Description string
	// Parameters is the JSON schema; Anthropic spells it input_schema.
	Parameters jval
}

// readFunctionDef reads {"name", "description", "parameters"|"input_schema"}.
func readFunctionDef(v jval, field string) (functionDef, error) {
	if v.kind() == 'n' {
		return functionDef{}, nil
	}
	if v.kind() != '{' {
		return functionDef{}, errShape(field, v, "an object")
	}
	var name, desc, params, schema jval
	for k, m := range v.members() {
		switch string(k) {
		case "name":
			name = m
		case "description":
			desc = m
		case "parameters":
			params = m
		case "input_schema":
			schema = m
		}
	}
	var f functionDef
	var err error
	if f.Name, err = stringField(name, field, ".name"); err != nil {
		return f, err
	}
	if f.Description, err = stringField(desc, field, ".description"); err != nil {
		return f, err
	}
	f.Parameters = params
	if params.absent() {
		f.Parameters = schema
	}
	return f, nil
}

// toolDefs extracts function definitions from a tools array in the chat
// ({"type":"function","function":{...}}) or Responses ({"type":"function",
// "name":...}) shape; other tools are counted as their JSON.
func toolDefs(tools jval) ([]functionDef, error) {
	if err := wantArray(tools, "tools"); err != nil {
		return nil, err
	}
	var defs []functionDef
	for tool := range tools.elems() {
		if tool.kind() != '{' && tool.kind() != 'n' {
			return nil, errShape("tools[]", tool, "an object")
		}
		var typ, fn jval
		if tool.kind() == '{' {
			for k, v := range tool.members() {
				switch string(k) {
				case "type":
					typ = v
				case "function":
					fn = v
				}
			}
		}
		typeName, err := stringField(typ, "tools[].type")
		if err != nil {
			return nil, err
		}
		if fn.present() {
			def, err := readFunctionDef(fn, "tools[].function")
			if err != nil {
				return nil, err
			}
			defs = append(defs, def)
			continue
		}
		def, err := readFunctionDef(tool, "tools[]")
		if err != nil {
			return nil, err
		}
		if def.Name == "" {
			def = functionDef{Name: typeName, Parameters: tool}
		}
		defs = append(defs, def)
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
		props, ok := schemaProperties(f.Parameters)
		if !ok {
			t.raw(f.Parameters)
			continue
		}
		if len(props) == 0 {
			continue
		}
		t.n += 3
		for _, p := range props {
			t.n += 3
			t.property(p.key, p.v)
		}
	}
	t.n += 12
}

// schemaProperties returns the members of a schema's "properties", the
// last of duplicate keys winning; ok is false when the schema is not an
// object with an object (or no) "properties".
func schemaProperties(schema jval) (props []member, ok bool) {
	switch schema.kind() {
	case 'n':
		return nil, true
	case '{':
	default:
		return nil, false
	}
	var pv jval
	for k, v := range schema.members() {
		if string(k) == "properties" {
			pv = v
		}
	}
	switch pv.kind() {
	case 0, 'n':
		return nil, true
	case '{':
	default:
		return nil, false
	}
	return objectMembers(pv), true
}

// property counts one schema property: "key:type:description", its enum,
// and its nested schemas as JSON. A property of an unexpected shape is
// counted as its JSON.
func (t *tally) property(key string, raw jval) {
	if raw.kind() != '{' && raw.kind() != 'n' {
		t.raw(raw)
		return
	}
	var typ, desc, enum, props, items, anyOf jval
	if raw.kind() == '{' {
		for k, v := range raw.members() {
			switch string(k) {
			case "type":
				typ = v
			case "description":
				desc = v
			case "enum":
				enum = v
			case "properties":
				props = v
			case "items":
				items = v
			case "anyOf":
				anyOf = v
			}
		}
	}
	description, err := stringField(desc, "")
	if err != nil || enum.present() && enum.kind() != '[' {
		t.raw(raw)
		return
	}
	if enum.kind() == '[' {
		first := true
		for item := range enum.elems() {
			if first {
				t.n -= 3
				first = false
			}
			t.n += 3
			if item.kind() == '"' {
				t.value(item)
			} else {
				t.raw(item)
			}
		}
	}
	typeName := ""
	if typ.kind() == '"' {
		typeName = typ.str()
	} else if typ.present() {
		typeName = string(canonicalJSON(nil, typ))
	}
	t.text(key + ":" + typeName + ":" + strings.TrimSuffix(description, "."))
	t.raw(props)
	t.raw(items)
	t.raw(anyOf)
}

// content counts a message content: a string, null, or an array of parts.
func (t *tally) content(v jval, field string) error {
	switch v.kind() {
	case 0, 'n':
		return nil
	case '"':
		t.value(v)
		return nil
	case '[':
		for p := range v.elems() {
			part, err := readPart(p, field)
			if err != nil {
				return err
			}
			if err := t.part(&part, field); err != nil {
				return err
			}
		}
		return nil
	}
	return errShape(field, v, "a string, an array or null")
}

// contentPart is one element of a content array, in any of the shapes of
// OpenAI chat, Responses and Anthropic messages.
type contentPart struct {
	Type, Refusal, Thinking, Detail string
	Text                            jval // a string, null or absent
	ImageURL                        jval
	// Anthropic tool_use / tool_result
	Name           string
	Input, Content jval
	// Responses items
	Role, Arguments string
	Output, Summary jval
}

// readPart reads one content part or Responses item, an element of the
// array field.
func readPart(v jval, field string) (contentPart, error) {
	var p contentPart
	if v.kind() == 'n' {
		return p, nil
	}
	if v.kind() != '{' {
		return p, errShape(field+"[]", v, "an object")
	}
	var typ, text, refusal, thinking, detail, name, role, args jval
	for k, m := range v.members() {
		switch string(k) {
		case "type":
			typ = m
		case "text":
			text = m
		case "refusal":
			refusal = m
		case "thinking":
			thinking = m
		case "detail":
			detail = m
		case "image_url":
			p.ImageURL = m
		case "name":
			name = m
		case "input":
			p.Input = m
		case "content":
			p.Content = m
		case "role":
			role = m
		case "arguments":
			args = m
		case "output":
			p.Output = m
		case "summary":
			p.Summary = m
		}
	}
	for _, f := range []struct {
		dst  *string
		v    jval
		name string
	}{
		{&p.Type, typ, "[].type"}, {&p.Refusal, refusal, "[].refusal"}, {&p.Thinking, thinking, "[].thinking"},
		{&p.Detail, detail, "[].detail"}, {&p.Name, name, "[].name"}, {&p.Role, role, "[].role"}, {&p.Arguments, args, "[].arguments"},
	} {
		s, err := stringField(f.v, field, f.name)
		if err != nil {
			return p, err
		}
		*f.dst = s
	}
	if text.present() && text.kind() != '"' {
		return p, errShape(field+"[].text", text, "a string")
	}
	p.Text = text
	if err := wantArray(p.Summary, field, "[].summary"); err != nil {
		return p, err
	}
	return p, nil
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
		return t.content(p.Content, field) // errors name the outer field; the offset points inside
	}
	if p.Text.kind() == '"' {
		t.value(p.Text)
	}
	t.text(p.Refusal)
	t.text(p.Thinking)
	if !p.Content.absent() {
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
	if p.ImageURL.kind() == '{' {
		for k, v := range p.ImageURL.members() {
			if string(k) == "detail" && v.kind() == '"' {
				if s := v.str(); s != "" {
					detail = s
				}
			}
		}
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
func (t *tally) prompt(v jval, field string) (int, error) {
	switch v.kind() {
	case 0, 'n':
		return 0, nil
	case '"':
		t.value(v)
		return 1, nil
	case '[':
	default:
		return 0, errShape(field, v, "a string or an array")
	}
	allInts, items := true, 0
	for it := range v.elems() {
		items++
		if it.kind() != '0' {
			allInts = false
		}
	}
	if allInts {
		t.n += items
		return 1, nil
	}
	for it := range v.elems() {
		switch it.kind() {
		case '"':
			t.value(it)
		case '[':
			for range it.elems() {
				t.n++
			}
		default:
			return 0, errShape(field+"[]", it, "a string or an array")
		}
	}
	return items, nil
}

// responses counts the Responses API. Its framing is not documented; items
// are counted like chat messages, which the recorded traffic shows to be
// close (see the repository README).
func (t *tally) responses(b *body) error {
	t.n += 3
	if b.Instructions.present() {
		t.n += 3 + 1 // a developer message
		if err := t.content(b.Instructions, "instructions"); err != nil {
			return err
		}
	}
	switch b.Input.kind() {
	case '"':
		t.n += 3
		t.text("user")
		t.value(b.Input)
	case '[':
		for v := range b.Input.elems() {
			it, err := readPart(v, "input")
			if err != nil {
				return err
			}
			if err := t.item(&it); err != nil {
				return err
			}
		}
	case 0, 'n':
	default:
		return errShape("input", b.Input, "a string or an array")
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

// item counts one Responses input item.
func (t *tally) item(it *contentPart) error {
	switch it.Type {
	case "", "message":
		t.n += 3
		t.text(it.Role)
		return t.content(it.Content, "input[].content")
	case "function_call":
		t.call(it.Name, it.Arguments)
	case "function_call_output":
		t.n += 3
		if it.Output.kind() == '"' {
			t.value(it.Output)
		} else {
			t.raw(it.Output)
		}
	case "reasoning":
		for v := range it.Summary.elems() {
			s, err := readPart(v, "input[].summary")
			if err != nil {
				return err
			}
			if err := t.part(&s, "input[].summary"); err != nil {
				return err
			}
		}
	default:
		return t.part(it, "input[]")
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
	if err := wantArray(b.Messages, "messages"); err != nil {
		return err
	}
	for m := range b.Messages.elems() {
		if m.kind() != '{' {
			return errShape("messages[]", m, "an object")
		}
		var content jval
		for k, v := range m.members() {
			if string(k) == "content" {
				content = v
			}
		}
		t.n += 4
		if err := t.content(content, "messages[].content"); err != nil {
			return err
		}
	}
	if _, enabled := thinking(b.Thinking); enabled {
		t.fixed += anthropicThinkingPrompt
	}
	if err := wantArray(b.Tools, "tools"); err != nil {
		return err
	}
	tools := 0
	for tool := range b.Tools.elems() {
		tools++
		f, err := readFunctionDef(tool, "tools[]")
		if err != nil || f.Name == "" {
			t.raw(tool) // server tools (web search, code execution)
			continue
		}
		t.text(f.Name)
		t.text(f.Description)
		t.raw(f.Parameters)
		t.n += 4
	}
	if tools > 0 {
		if strings.HasPrefix(t.model, "claude-haiku-4") {
			t.fixed += anthropicHaiku4ToolPrompt
		} else {
			t.fixed += anthropicToolPrompt
		}
	}
	return nil
}

// gemini counts generateContent: systemInstruction, contents and tools, as
// o200k_base text scaled by geminiFactor. Every field may be spelled in
// camelCase or snake_case; both spellings are counted.
func (t *tally) gemini(b *body) error {
	for i, name := range [2]string{"systemInstruction", "system_instruction"} {
		if err := t.geminiContent(b.SystemInstruction[i], name); err != nil {
			return err
		}
	}
	if err := wantArray(b.Contents, "contents"); err != nil {
		return err
	}
	for c := range b.Contents.elems() {
		if err := t.geminiContent(c, "contents[]"); err != nil {
			return err
		}
	}
	if err := wantArray(b.Tools, "tools"); err != nil {
		return err
	}
	for tool := range b.Tools.elems() {
		t.raw(tool)
	}
	return nil
}

// geminiContent counts one Content: {"role", "parts": [Part]}.
func (t *tally) geminiContent(c jval, field string) error {
	switch c.kind() {
	case 0, 'n':
		return nil
	case '{':
	default:
		return errShape(field, c, "an object")
	}
	var parts jval
	for k, v := range c.members() {
		if string(k) == "parts" {
			parts = v
		}
	}
	if err := wantArray(parts, field, ".parts"); err != nil {
		return err
	}
	for p := range parts.elems() {
		if p.kind() == 'n' {
			continue
		}
		if p.kind() != '{' {
			return errShape(field+".parts[]", p, "an object")
		}
		var text jval
		var media, calls [4]jval
		for k, v := range p.members() {
			switch string(k) {
			case "text":
				text = v
			case "inlineData":
				media[0] = v
			case "inline_data":
				media[1] = v
			case "fileData":
				media[2] = v
			case "file_data":
				media[3] = v
			case "functionCall":
				calls[0] = v
			case "function_call":
				calls[1] = v
			case "functionResponse":
				calls[2] = v
			case "function_response":
				calls[3] = v
			}
		}
		if err := t.textField(text, field, ".parts[].text"); err != nil {
			return err
		}
		for _, m := range media {
			if m.present() {
				t.fixed += geminiImageMax
				break
			}
		}
		for _, c := range calls {
			t.raw(c)
		}
	}
	return nil
}

// geminiEmbed counts embedContent ({"content", "title"}) and
// batchEmbedContents ({"requests": [{"content", "title"}]}).
func (t *tally) geminiEmbed(b *body) error {
	if b.Content.present() {
		if err := t.geminiContent(b.Content, "content"); err != nil {
			return err
		}
		if err := t.textField(b.Title, "title"); err != nil {
			return err
		}
	}
	if err := wantArray(b.Requests, "requests"); err != nil {
		return err
	}
	for r := range b.Requests.elems() {
		if r.kind() != '{' {
			return errShape("requests[]", r, "an object")
		}
		var content, title jval
		for k, v := range r.members() {
			switch string(k) {
			case "content":
				content = v
			case "title":
				title = v
			}
		}
		if err := t.geminiContent(content, "requests[].content"); err != nil {
			return err
		}
		if err := t.textField(title, "requests[].title"); err != nil {
			return err
		}
	}
	return nil
}

// raw counts a JSON value as its canonical compact text: the conservative
// choice for structures whose rendering the provider does not document.
// Canonical, so that what is counted is the value the provider parses,
// not the client's spelling of it (see canonicalJSON).
func (t *tally) raw(v jval) {
	if !v.present() {
		return
	}
	t.buf = canonicalJSON(t.buf[:0], v)
	t.text(string(t.buf))
}
