package provider

import "fmt"

// The Responses API ends a stream cut at max_output_tokens with
// response.incomplete, whose response carries the whole output delivered
// (SDK final-response helpers read it), after closing every open output
// item with its done events. To do the same at a length cut-off (S14), a
// Stream keeps the output as the client received it: the items it was sent
// whole (output_item.done), and for items still open the item, its parts
// and the text deltas delivered so far.

// maxKeptOutput bounds the output a Stream keeps per Responses stream: the
// bytes of items, parts and delivered text. It is what the client received,
// so a hard output budget bounds it too. 1 MiB is some 250 000 tokens of
// English text, about twice the largest output cap of current models, but
// not always enough for a generated image (base64). Past it the Stream drops
// what it kept and keeps nothing more, and a cut-off ends the stream with
// response.incomplete alone, its output empty.
const maxKeptOutput = 1 << 20

// maxKeptResponse bounds the response object kept from response.created or
// response.in_progress (it echoes instructions and tools). A larger one is
// not kept, and response.incomplete then carries the identity and the
// fields a cut-off sets only.
const maxKeptResponse = 64 << 10

// responsesTextDeltas are the Responses API events whose delta is model
// output, and where the delta goes in the item. Audio deltas (base64) are
// not text.
var responsesTextDeltas = map[string]deltaTarget{
	`"response.output_text.delta"`:                toPart,
	`"response.refusal.delta"`:                    toPart,
	`"response.reasoning_text.delta"`:             toPart,
	`"response.reasoning_summary_text.delta"`:     toSummary,
	`"response.function_call_arguments.delta"`:    toArgs,
	`"response.custom_tool_call_input.delta"`:     toArgs,
	`"response.mcp_call_arguments.delta"`:         toArgs,
	`"response.code_interpreter_call_code.delta"`: toArgs,
	`"response.audio.transcript.delta"`:           toNothing,
}

type deltaTarget uint8

const (
	toNothing deltaTarget = iota
	toPart                // a content part's text, by content_index
	toSummary             // a reasoning summary part's text, by summary_index
	toArgs                // the item's arguments, input or code
)

// argsMember names the member of an item type that its argument deltas
// build, and the event that ends them.
var argsMember = map[string]struct{ key, done string }{
	"function_call":         {"arguments", "response.function_call_arguments.done"},
	"custom_tool_call":      {"input", "response.custom_tool_call_input.done"},
	"mcp_call":              {"arguments", "response.mcp_call_arguments.done"},
	"code_interpreter_call": {"code", "response.code_interpreter_call_code.done"},
}

// respOutput is the output of a Responses stream as delivered. The zero
// value holds nothing.
type respOutput struct {
	response []byte // raw response of the last response.created or in_progress
	items    []respItem
	kept     int  // bytes held by items, at most maxKeptOutput
	over     bool // the output outgrew maxKeptOutput: nothing is kept
	undo     respUndo
}

// respItem is one output item, by output_index.
type respItem struct {
	index   int
	typ     string
	id      []byte     // raw id
	added   []byte     // raw item of output_item.added
	done    []byte     // raw item of output_item.done, once delivered
	parts   []respPart // content parts
	summary []respPart // reasoning summary parts
	args    []byte     // delivered argument deltas, as JSON string contents
	argsEnd bool       // the arguments' done event was delivered
}

// respPart is one content or summary part.
type respPart struct {
	index       int
	typ         string
	added       []byte // raw part of *_part.added
	done        []byte // raw part of *_part.done, once delivered
	text        []byte // delivered text deltas, as JSON string contents
	textEnd     bool   // the text's done event was delivered
	annotations []byte // raw annotations added, comma-separated
	annotated   bool
}

// respUndo reverts the one change the last observed event made, for
// Withhold.
type respUndo struct {
	op         undoOp
	item, part int
	summary    bool
	n          int // previous length of the buffer grown
	kept       int // previous kept
}

type undoOp uint8

const (
	undoNothing    undoOp = iota
	undoItem              // drop items[item:]
	undoPart              // drop parts[part:] of items[item]
	undoText              // cut the part's text to n
	undoArgs              // cut the item's args to n
	undoTextEnd           // the part's text is open again
	undoPartDone          // the part is open again
	undoArgsEnd           // the arguments are open again
	undoItemDone          // the item is open again
	undoAnnotation        // cut the part's annotations to n
)

// commit makes the last event's change final: an item that was delivered
// whole no longer needs what it was built from.
func (o *respOutput) commit() {
	if o.undo.op == undoItemDone {
		it := &o.items[o.undo.item]
		o.kept -= len(it.added) + len(it.args)
		for _, p := range [][]respPart{it.parts, it.summary} {
			for k := range p {
				o.kept -= p[k].size()
			}
		}
		// The id aliases added; closing events no longer need it.
		it.added, it.id, it.args, it.parts, it.summary = nil, nil, nil, nil, nil
	}
	o.undo = respUndo{}
}

func (o *respOutput) withhold() {
	u := o.undo
	o.undo = respUndo{}
	if u.op == undoNothing || o.over {
		return
	}
	o.kept = u.kept
	if u.op == undoItem {
		o.items = o.items[:u.item]
		return
	}
	it := &o.items[u.item]
	parts := &it.parts
	if u.summary {
		parts = &it.summary
	}
	switch u.op {
	case undoPart:
		*parts = (*parts)[:u.part]
	case undoText:
		(*parts)[u.part].text = (*parts)[u.part].text[:u.n]
	case undoArgs:
		it.args = it.args[:u.n]
	case undoTextEnd:
		(*parts)[u.part].textEnd = false
	case undoPartDone:
		(*parts)[u.part].done = nil
	case undoArgsEnd:
		it.argsEnd = false
	case undoItemDone:
		it.done = nil
	case undoAnnotation:
		p := &(*parts)[u.part]
		p.annotations = p.annotations[:u.n]
		p.annotated = u.n > 0
	}
}

// room reports whether n more bytes may be kept, and when not gives up
// keeping anything.
func (o *respOutput) room(n int) bool {
	if o.over {
		return false
	}
	if o.kept+n > maxKeptOutput {
		*o = respOutput{over: true}
		return false
	}
	return true
}

func (p *respPart) size() int {
	return len(p.added) + len(p.done) + len(p.text) + len(p.annotations)
}

// item returns the position of the item with output_index index, or -1.
func (o *respOutput) item(index int) int {
	for k := len(o.items) - 1; k >= 0; k-- {
		if o.items[k].index == index {
			return k
		}
	}
	return -1
}

// part returns the position of the part with the given index, or -1.
func findPart(parts []respPart, index int) int {
	for k := len(parts) - 1; k >= 0; k-- {
		if parts[k].index == index {
			return k
		}
	}
	return -1
}

// addItem records output_item.added.
func (o *respOutput) addItem(index int, raw []byte) {
	if index < 0 || !o.room(len(raw)) {
		return
	}
	o.undo = respUndo{op: undoItem, item: len(o.items), kept: o.kept}
	o.kept += len(raw)
	it := respItem{index: index, added: append([]byte(nil), raw...)}
	it.typ, it.id = typeAndID(it.added)
	o.items = append(o.items, it)
}

// itemDone records output_item.done: the item as delivered whole.
func (o *respOutput) itemDone(index int, raw []byte) {
	if index < 0 || !o.room(len(raw)) {
		return
	}
	k := o.item(index)
	if k < 0 {
		o.undo = respUndo{op: undoItem, item: len(o.items), kept: o.kept}
		o.items = append(o.items, respItem{index: index})
		k = len(o.items) - 1
	} else {
		o.undo = respUndo{op: undoItemDone, item: k, kept: o.kept}
	}
	o.kept += len(raw)
	it := &o.items[k]
	it.done = append([]byte(nil), raw...)
	if it.typ == "" {
		it.typ, it.id = typeAndID(it.done)
	}
}

// partOf returns the item and the parts list an event addresses, and the
// position of the part in it (-1 when not yet seen). ok is false when the
// item is unknown.
func (o *respOutput) partOf(index, partIndex int, summary bool) (k int, parts *[]respPart, p int, ok bool) {
	if index < 0 || partIndex < 0 || o.over {
		return 0, nil, 0, false
	}
	if k = o.item(index); k < 0 {
		return 0, nil, 0, false
	}
	parts = &o.items[k].parts
	if summary {
		parts = &o.items[k].summary
	}
	return k, parts, findPart(*parts, partIndex), true
}

// addPart records content_part.added or reasoning_summary_part.added.
func (o *respOutput) addPart(index, partIndex int, summary bool, raw []byte) {
	k, parts, p, ok := o.partOf(index, partIndex, summary)
	if !ok || p >= 0 || !o.room(len(raw)) {
		return
	}
	o.undo = respUndo{op: undoPart, item: k, part: len(*parts), summary: summary, kept: o.kept}
	o.kept += len(raw)
	typ, _ := typeAndID(raw)
	*parts = append(*parts, respPart{index: partIndex, typ: typ, added: append([]byte(nil), raw...)})
}

// partDone records content_part.done or reasoning_summary_part.done.
func (o *respOutput) partDone(index, partIndex int, summary bool, raw []byte) {
	k, parts, p, ok := o.partOf(index, partIndex, summary)
	if !ok || !o.room(len(raw)) {
		return
	}
	if p < 0 {
		o.undo = respUndo{op: undoPart, item: k, part: len(*parts), summary: summary, kept: o.kept}
		typ, _ := typeAndID(raw)
		*parts = append(*parts, respPart{index: partIndex, typ: typ})
		p = len(*parts) - 1
	} else {
		o.undo = respUndo{op: undoPartDone, item: k, part: p, summary: summary, kept: o.kept}
	}
	o.kept += len(raw)
	(*parts)[p].done = append([]byte(nil), raw...)
}

// text records a text delta (the raw JSON string v) of a part.
func (o *respOutput) text(index, partIndex int, summary bool, typ string, v []byte) {
	k, parts, p, ok := o.partOf(index, partIndex, summary)
	if !ok || len(v) < 2 || !o.room(len(v)-2) {
		return
	}
	if p < 0 {
		// A delta before its part was announced: the part starts here.
		o.undo = respUndo{op: undoPart, item: k, part: len(*parts), summary: summary, kept: o.kept}
		*parts = append(*parts, respPart{index: partIndex, typ: typ})
		p = len(*parts) - 1
	} else {
		o.undo = respUndo{op: undoText, item: k, part: p, summary: summary, n: len((*parts)[p].text), kept: o.kept}
	}
	o.kept += len(v) - 2
	(*parts)[p].text = append((*parts)[p].text, v[1:len(v)-1]...)
}

// textEnd records output_text.done and its kin.
func (o *respOutput) textEnd(index, partIndex int, summary bool) {
	k, parts, p, ok := o.partOf(index, partIndex, summary)
	if !ok || p < 0 {
		return
	}
	o.undo = respUndo{op: undoTextEnd, item: k, part: p, summary: summary, kept: o.kept}
	(*parts)[p].textEnd = true
}

// annotate records output_text.annotation.added.
func (o *respOutput) annotate(index, partIndex int, raw []byte) {
	k, parts, p, ok := o.partOf(index, partIndex, false)
	if !ok || p < 0 || !o.room(len(raw)+1) {
		return
	}
	part := &(*parts)[p]
	o.undo = respUndo{op: undoAnnotation, item: k, part: p, n: len(part.annotations), kept: o.kept}
	if part.annotated {
		part.annotations = append(part.annotations, ',')
	}
	part.annotations = append(part.annotations, raw...)
	part.annotated = true
	o.kept += len(raw) + 1
}

// args records an argument delta (the raw JSON string v) of an item.
func (o *respOutput) args(index int, v []byte) {
	k := -1
	if index >= 0 && !o.over {
		k = o.item(index)
	}
	if k < 0 || len(v) < 2 || !o.room(len(v)-2) {
		return
	}
	it := &o.items[k]
	o.undo = respUndo{op: undoArgs, item: k, n: len(it.args), kept: o.kept}
	o.kept += len(v) - 2
	it.args = append(it.args, v[1:len(v)-1]...)
}

// argsEnd records function_call_arguments.done and its kin.
func (o *respOutput) argsEnd(index int) {
	k := -1
	if index >= 0 && !o.over {
		k = o.item(index)
	}
	if k < 0 {
		return
	}
	o.undo = respUndo{op: undoArgsEnd, item: k, kept: o.kept}
	o.items[k].argsEnd = true
}

// typeAndID reads the type and the raw id of an item or part.
func typeAndID(raw []byte) (typ string, id []byte) {
	obj, err := openObject(raw, 0)
	if err != nil {
		return "", nil
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := raw[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "type":
			if len(v) >= 2 && v[0] == '"' {
				typ = string(v[1 : len(v)-1])
			}
		case "id":
			id = v
		}
	}
	return typ, id
}

// observeResponses reads an OpenAI Responses API event.
func (s *Stream) observeResponses(ev *Event, data []byte) error {
	obj, err := openObject(data, 0)
	if err != nil {
		return err
	}
	var typ, delta, item, response, part, annotation []byte
	output, content, summary := -1, -1, -1
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := data[m.valueStart:m.valueEnd]
		var index *int
		switch string(m.key) {
		case "type":
			typ = v
		case "delta":
			delta = v
		case "item":
			item = v
		case "response":
			response = v
		case "part":
			part = v
		case "annotation":
			annotation = v
		case "output_index":
			index = &output
		case "content_index":
			index = &content
		case "summary_index":
			index = &summary
		case "sequence_number":
			n, err := parseCount(v)
			if err != nil {
				return fmt.Errorf("sequence_number: %w", err)
			}
			s.seq = max(s.seq, n)
		}
		if index != nil {
			if *index, err = parseCount(v); err != nil {
				return fmt.Errorf("%s: %w", m.key, err)
			}
		}
	}
	if err := obj.finish(); err != nil {
		return err
	}
	// After the end (or a cut-off) the output no longer needs keeping.
	track := !s.done
	t := string(typ)
	if target, ok := responsesTextDeltas[t]; ok {
		if err := s.appendString(delta); err != nil {
			return fmt.Errorf("delta: %w", err)
		}
		if !track || len(delta) == 0 || delta[0] != '"' {
			return nil
		}
		switch target {
		case toPart:
			s.resp.text(output, content, false, partType(t), delta)
		case toSummary:
			s.resp.text(output, summary, true, "summary_text", delta)
		case toArgs:
			s.resp.args(output, delta)
		}
		return nil
	}
	switch t {
	case `"response.output_item.added"`:
		// A tool call's name is output too; its arguments follow as deltas.
		if err := s.appendStrings(item, "name"); err != nil {
			return fmt.Errorf("item: %w", err)
		}
		if track && isObject(item) {
			s.resp.addItem(output, item)
		}
		return nil
	case `"response.output_item.done"`:
		if track && isObject(item) {
			s.resp.itemDone(output, item)
		}
		return nil
	case `"response.content_part.added"`, `"response.reasoning_summary_part.added"`:
		if track && isObject(part) {
			isSummary := t == `"response.reasoning_summary_part.added"`
			s.resp.addPart(output, pick(isSummary, summary, content), isSummary, part)
		}
		return nil
	case `"response.content_part.done"`, `"response.reasoning_summary_part.done"`:
		if track && isObject(part) {
			isSummary := t == `"response.reasoning_summary_part.done"`
			s.resp.partDone(output, pick(isSummary, summary, content), isSummary, part)
		}
		return nil
	case `"response.output_text.done"`, `"response.refusal.done"`, `"response.reasoning_text.done"`:
		if track {
			s.resp.textEnd(output, content, false)
		}
		return nil
	case `"response.reasoning_summary_text.done"`:
		if track {
			s.resp.textEnd(output, summary, true)
		}
		return nil
	case `"response.function_call_arguments.done"`, `"response.custom_tool_call_input.done"`,
		`"response.mcp_call_arguments.done"`, `"response.code_interpreter_call_code.done"`:
		if track {
			s.resp.argsEnd(output)
		}
		return nil
	case `"response.output_text.annotation.added"`:
		if track && len(annotation) > 0 {
			s.resp.annotate(output, content, annotation)
		}
		return nil
	case `"response.completed"`, `"response.incomplete"`, `"response.failed"`:
		s.done, ev.Done = true, true
	case `"response.created"`, `"response.in_progress"`:
		if track && isObject(response) {
			s.resp.response = s.resp.response[:0]
			if len(response) <= maxKeptResponse {
				s.resp.response = append(s.resp.response, response...)
			}
		}
	default:
		return nil
	}
	if response == nil || isNull(response) {
		return nil
	}
	if err := s.responseObject(ev, response); err != nil {
		return fmt.Errorf("response: %w", err)
	}
	return nil
}

func pick(cond bool, a, b int) int {
	if cond {
		return a
	}
	return b
}

func isObject(v []byte) bool { return len(v) > 0 && v[0] == '{' }

// partType is the type of the part a text delta event writes to.
func partType(event string) string {
	switch event {
	case `"response.refusal.delta"`:
		return "refusal"
	case `"response.reasoning_text.delta"`:
		return "reasoning_text"
	}
	return "output_text"
}

// responseObject reads the identity and usage of a Responses response
// object.
func (s *Stream) responseObject(ev *Event, r []byte) error {
	obj, err := openObject(r, 0)
	if err != nil {
		return err
	}
	var af answerFields
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := r[m.valueStart:m.valueEnd]
		if af.read(m.key, v) {
			continue
		}
		switch string(m.key) {
		case "id":
			keep(&s.id, v)
		case "created_at":
			keep(&s.created, v)
		case "model":
			keep(&s.model, v)
		case "usage":
			if isNull(v) {
				continue
			}
			u, err := readResponsesUsage(v)
			if err != nil {
				return fmt.Errorf("usage: %w", err)
			}
			s.usage, s.hasUsage, ev.Usage = u, true, true
		}
	}
	if ev.Usage {
		af.apply(&s.usage)
	}
	return obj.err
}

// closeResponses ends a Responses stream as the API does at
// max_output_tokens: each open output item in order gets the done events of
// its open parts and arguments and an output_item.done with status
// "incomplete" and what was delivered of it; then response.incomplete
// carries the response with every item delivered.
func (s *Stream) closeResponses(w *eventWriter, u Usage) {
	o := &s.resp
	var output []byte
	for k := range o.items {
		it := &o.items[k]
		start := len(output)
		if k > 0 {
			output = append(output, ',')
		}
		if len(it.done) > 0 {
			output = append(output, it.done...)
			continue
		}
		output = it.final(output)
		s.closeItem(w, it, output[start+min(k, 1):])
	}
	w.begin("response.incomplete")
	w.str(`{"type":"response.incomplete","sequence_number":`)
	s.seq++
	w.int(s.seq)
	w.str(`,"response":`)
	base := o.response
	if len(base) == 0 {
		base = append(base, `{"id":`...)
		base = appendRaw(base, s.id, `""`)
		base = append(base, `,"object":"response","created_at":`...)
		base = appendRaw(base, s.created, "0")
		base = append(base, `,"model":`...)
		base = appendRaw(base, s.model, `""`)
		base = append(base, '}')
	}
	usage := eventWriter{}
	usage.str(`{`)
	usage.member(true, "input_tokens", u.InputTokens)
	usage.str(`,"input_tokens_details":{`)
	usage.member(true, "cached_tokens", u.CachedInputTokens)
	usage.str(`}`)
	usage.member(false, "output_tokens", u.OutputTokens)
	usage.str(`,"output_tokens_details":{`)
	usage.member(true, "reasoning_tokens", u.ReasoningTokens)
	usage.str(`}`)
	usage.member(false, "total_tokens", u.Total())
	usage.str(`}`)
	w.b = patchObject(w.b, base, []kv{
		{"status", []byte(`"incomplete"`)},
		{"incomplete_details", []byte(`{"reason":"max_output_tokens"}`)},
		{"output", append(append([]byte{'['}, output...), ']')},
		{"usage", usage.b},
	})
	w.str(`}`)
	w.end()
}

// closeItem writes the done events of an open item: those of its open
// parts, of its arguments, and output_item.done with final, the item as
// ended.
func (s *Stream) closeItem(w *eventWriter, it *respItem, final []byte) {
	id := it.id
	if len(id) == 0 {
		id = []byte(`""`)
	}
	head := func(name string) {
		w.begin(name)
		w.str(`{"type":"`)
		w.str(name)
		w.str(`","sequence_number":`)
		s.seq++
		w.int(s.seq)
		w.str(`,"item_id":`)
		w.raw(id, `""`)
		w.str(`,"output_index":`)
		w.int(it.index)
	}
	for _, summary := range []bool{false, true} {
		parts, indexKey := it.parts, `,"content_index":`
		if summary {
			parts, indexKey = it.summary, `,"summary_index":`
		}
		for k := range parts {
			p := &parts[k]
			if len(p.done) > 0 {
				continue
			}
			if !p.textEnd {
				name, key := textDone(p.typ, summary)
				head(name)
				w.str(indexKey)
				w.int(p.index)
				w.str(`,"`)
				w.str(key)
				w.str(`":"`)
				w.b = append(w.b, p.text...)
				w.str(`"`)
				if name == "response.output_text.done" {
					w.str(`,"logprobs":[]`)
				}
				w.str(`}`)
				w.end()
			}
			if summary {
				head("response.reasoning_summary_part.done")
			} else {
				head("response.content_part.done")
			}
			w.str(indexKey)
			w.int(p.index)
			w.str(`,"part":`)
			w.b = p.final(w.b)
			w.str(`}`)
			w.end()
		}
	}
	if a, ok := argsMember[it.typ]; ok && !it.argsEnd {
		head(a.done)
		w.str(`,"`)
		w.str(a.key)
		w.str(`":"`)
		w.b = append(w.b, it.args...)
		w.str(`"}`)
		w.end()
	}
	w.begin("response.output_item.done")
	w.str(`{"type":"response.output_item.done","sequence_number":`)
	s.seq++
	w.int(s.seq)
	w.str(`,"output_index":`)
	w.int(it.index)
	w.str(`,"item":`)
	w.b = append(w.b, final...)
	w.str(`}`)
	w.end()
}

// textDone names the event that ends the text of a part of type typ, and
// the member that carries the text.
func textDone(typ string, summary bool) (event, key string) {
	switch {
	case summary:
		return "response.reasoning_summary_text.done", "text"
	case typ == "refusal":
		return "response.refusal.done", "refusal"
	case typ == "reasoning_text":
		return "response.reasoning_text.done", "text"
	}
	return "response.output_text.done", "text"
}

// final appends the item as it stands at a cut-off: status "incomplete",
// its parts and arguments as delivered.
func (it *respItem) final(dst []byte) []byte {
	set := []kv{{"status", []byte(`"incomplete"`)}}
	parts := func(ps []respPart) []byte {
		b := []byte{'['}
		for k := range ps {
			if k > 0 {
				b = append(b, ',')
			}
			b = ps[k].final(b)
		}
		return append(b, ']')
	}
	switch it.typ {
	case "message":
		set = append(set, kv{"content", parts(it.parts)})
	case "reasoning":
		set = append(set, kv{"summary", parts(it.summary)})
		if len(it.parts) > 0 {
			set = append(set, kv{"content", parts(it.parts)})
		}
	}
	if a, ok := argsMember[it.typ]; ok {
		set = append(set, kv{a.key, quoted(it.args)})
	}
	base := it.added
	if len(base) == 0 {
		base = []byte(`{"type":"message","role":"assistant"}`)
	}
	return patchObject(dst, base, set)
}

// final appends the part as it stands at a cut-off: the text delivered, and
// the annotations added.
func (p *respPart) final(dst []byte) []byte {
	if len(p.done) > 0 {
		return append(dst, p.done...)
	}
	key := "text"
	if p.typ == "refusal" {
		key = "refusal"
	}
	set := []kv{{key, quoted(p.text)}}
	if p.annotated {
		set = append(set, kv{"annotations", append(append([]byte{'['}, p.annotations...), ']')})
	}
	base := p.added
	if len(base) == 0 {
		switch p.typ {
		case "output_text":
			base = []byte(`{"type":"output_text","annotations":[],"logprobs":[]}`)
		default:
			base = append(append([]byte(`{"type":"`), p.typ...), `"}`...)
		}
	}
	return patchObject(dst, base, set)
}

func quoted(contents []byte) []byte {
	b := make([]byte, 0, len(contents)+2)
	b = append(b, '"')
	b = append(b, contents...)
	return append(b, '"')
}

// appendRaw appends the raw JSON value v, or def when v is empty.
func appendRaw(dst, v []byte, def string) []byte {
	if len(v) == 0 {
		return append(dst, def...)
	}
	return append(dst, v...)
}

// kv is an object member to set: its key and raw JSON value.
type kv struct {
	key string
	val []byte
}

// patchObject appends the JSON object raw with the members named in set
// given their new values, in place, and those it lacks added at the end.
func patchObject(dst, raw []byte, set []kv) []byte {
	used := make([]bool, len(set))
	dst = append(dst, '{')
	first := true
	put := func(k int) {
		if !first {
			dst = append(dst, ',')
		}
		first = false
		dst = append(dst, '"')
		dst = append(dst, set[k].key...)
		dst = append(dst, `":`...)
		dst = append(dst, set[k].val...)
		used[k] = true
	}
	if obj, err := openObject(raw, 0); err == nil {
	members:
		for m, ok := obj.next(); ok; m, ok = obj.next() {
			for k := range set {
				if string(m.key) == set[k].key {
					put(k)
					continue members
				}
			}
			if !first {
				dst = append(dst, ',')
			}
			first = false
			dst = append(dst, raw[m.start:m.valueEnd]...)
		}
	}
	for k := range set {
		if !used[k] {
			put(k)
		}
	}
	return append(dst, '}')
}
