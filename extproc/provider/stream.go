package provider

import (
	"bytes"
	"fmt"

	"github.com/tokengate/tokengate/tokenizer"
)

// Event is what one complete server-sent event means to tokengate. It is a
// plain value; the zero Event forwards nothing.
type Event struct {
	// Text is the output text carried by this event, to count live (S13):
	// content, refusal, reasoning or thinking text, tool-call names and
	// arguments. Empty for events that carry no model output.
	Text string
	// Forward is the bytes to send on to the client: the event itself,
	// byte for byte, or a rewrite when tokengate injected include_usage that
	// the client did not ask for (S15): `"usage":null` members are dropped
	// and the usage-only chunk is dropped whole (Forward == nil).
	// Unless rewritten, Forward aliases the observed event: copy it before
	// the next Framer.Feed. A rewrite is the Stream's: copy it before the
	// next Observe.
	Forward []byte
	// Usage reports that this event carried usage; Stream.Usage has the
	// merged view.
	Usage bool
	// Done marks the terminal event: data: [DONE], Anthropic message_stop,
	// Responses response.completed, response.incomplete or response.failed;
	// for a Gemini JSON array its closing bracket, and for a Gemini event
	// stream, which has no terminal event, the chunk in which every
	// candidate seen has a finishReason.
	Done bool
}

// Stream follows one streamed response of one API: it reads each event for
// output text and usage, rewrites events to hide usage that tokengate asked
// for (S15), and remembers what it needs to end the stream cleanly at a
// length cut-off (S14).
//
// Create one with NewStream (or NewFramedStream) per response; the zero
// value reads nothing and forwards every event untouched. For the Responses
// API it keeps the output delivered, up to 1 MiB, to repeat it at a
// cut-off; other formats keep a few fields. A Stream is owned by one
// goroutine; it is not safe for concurrent use.
type Stream struct {
	api         tokenizer.API
	framing     Framing
	clientUsage bool // the client asked for include_usage
	hideUsage   bool // tokengate asked for it and the client must not see it

	text    []byte // Event.Text under construction
	joined  []byte // data of an event with several data lines
	lineEnd string // line end the upstream uses, once seen

	usage    Usage
	hasUsage bool
	// partial says the usage seen is a running figure, not yet the
	// provider's count of the whole answer: Anthropic's message_start until
	// message_delta, Gemini's usageMetadata until the chunk that ends every
	// candidate. noOutput says it counts no output at all: message_start's
	// output_tokens is a placeholder.
	partial, noOutput bool
	done              bool // a terminal event was seen or Close was called

	// Identity of the response, raw JSON values, for the closing events.
	// OpenAI: id, object, created, model. Anthropic: id, model. Responses:
	// id, created_at, model. Gemini: responseId, modelVersion.
	id, object, created, model []byte

	choices   []choice // OpenAI choices or Gemini candidates seen
	usageSent bool     // a usage chunk reached the client

	anthropic    anthropicUsage
	started      bool // Anthropic message_start seen
	blockOpen    bool // an Anthropic content block is open
	blockIndex   int
	stopReported bool // Anthropic message_delta with a stop_reason seen

	seq  int        // last Responses sequence_number
	resp respOutput // Responses output delivered, for the closing events

	// A Gemini JSON array's opening and closing brackets were delivered.
	arrayOpen, arrayClosed bool

	generalOnly bool       // read OpenAI chunks with the general reader only (tests)
	shape       chunkShape // the last OpenAI chunk's, see fastOpenAI
	rewritten   []byte     // the last event rewritten, see Event.Forward

	// saved is the client-visible state before the last Observe, restored
	// by Withhold.
	saved        clientState
	savedChoices []choice
}

// clientState is what Close needs to know about the events the client has
// received.
type clientState struct {
	done, started, blockOpen, stopReported, usageSent bool
	arrayOpen, arrayClosed                            bool
	blockIndex, seq                                   int
}

func (s *Stream) state() clientState {
	return clientState{
		done: s.done, started: s.started, blockOpen: s.blockOpen,
		stopReported: s.stopReported, usageSent: s.usageSent,
		arrayOpen: s.arrayOpen, arrayClosed: s.arrayClosed,
		blockIndex: s.blockIndex, seq: s.seq,
	}
}

// Withhold tells the Stream that the event last observed was not forwarded
// to the client, because it crossed a hard budget (S14): Close then ends the
// stream the client saw. Without it, an event that opened a content block or
// carried a finish reason would shape the closing events although the client
// never received it. Usage and text already read stay counted: the upstream
// generated them. Calling Withhold twice, or before any Observe, does
// nothing more.
func (s *Stream) Withhold() {
	st := s.saved
	s.done, s.started, s.blockOpen = st.done, st.started, st.blockOpen
	s.stopReported, s.usageSent = st.stopReported, st.usageSent
	s.blockIndex, s.seq = st.blockIndex, st.seq
	s.arrayOpen, s.arrayClosed = st.arrayOpen, st.arrayClosed
	s.choices = append(s.choices[:0], s.savedChoices...)
	s.resp.withhold()
	s.shape.forget() // what its last chunk set was taken back
}

// choice is one OpenAI choice or Gemini candidate and whether it has
// finished.
type choice struct {
	index    int
	finished bool
}

// NewStream returns a Stream for a server-sent event stream of api.
// clientAskedUsage reports that the client's request itself set
// stream_options.include_usage; injectedUsage that tokengate added it upstream
// (S15), in which case the Stream hides the usage from the client.
// injectedUsage only matters for the OpenAI chat and completions formats.
func NewStream(api tokenizer.API, clientAskedUsage bool, injectedUsage bool) *Stream {
	return NewFramedStream(api, SSE, clientAskedUsage, injectedUsage)
}

// NewFramedStream is NewStream for a response framed as FramingOf says: its
// events are those a Framer Reset to the same Framing returns. JSONArray is
// read for tokenizer.Gemini only; Unframed is read as SSE.
func NewFramedStream(api tokenizer.API, fr Framing, clientAskedUsage bool, injectedUsage bool) *Stream {
	if fr != JSONArray {
		fr = SSE
	}
	return &Stream{
		api:         api,
		framing:     fr,
		clientUsage: clientAskedUsage,
		hideUsage:   injectedUsage && !clientAskedUsage,
		blockIndex:  -1,
		saved:       clientState{blockIndex: -1},
	}
}

// Usage is the provider usage seen so far, merged by provider rules:
// Anthropic message_start overlaid with message_delta; Gemini's last
// usageMetadata wins; OpenAI's usage chunk. ok is false until the stream has
// reported usage; the caller then falls back to its live count (S8).
func (s *Stream) Usage() (u Usage, ok bool) {
	if s.api == tokenizer.Messages && s.hasUsage {
		return s.anthropic.usage(), true
	}
	return s.usage, s.hasUsage
}

// UsageFinal reports whether the usage seen is the provider's count of the
// whole answer. Until an Anthropic stream's message_delta, and a Gemini
// stream's chunk that ends every candidate, their usage is a running figure:
// what was counted live was generated too (S8).
func (s *Stream) UsageFinal() bool { return s.hasUsage && !s.partial }

// OutputReported reports whether the usage seen counts the output generated
// so far, hidden reasoning included: every usage but that of Anthropic's
// message_start, whose output_tokens is a placeholder.
func (s *Stream) OutputReported() bool { return s.hasUsage && !s.noOutput }

// Observe reads one complete event as returned by Framer.Next or
// Framer.Flush. Blocks without data (comments, keep-alives) are forwarded
// untouched. An event that is not what the API sends yields an error
// wrapping ErrMalformed together with an Event that forwards the bytes
// unchanged, so the caller may pass on what it cannot read. When the caller
// does not forward the event after all (a hard budget ran out), it calls
// Withhold before Close.
func (s *Stream) Observe(event []byte) (Event, error) {
	s.saved = s.state()
	s.savedChoices = append(s.savedChoices[:0], s.choices...)
	s.resp.commit()
	if s.framing == JSONArray {
		return s.observeElement(event)
	}
	ev := Event{Forward: event}
	data, off, n := s.eventData(event)
	if n == 0 {
		return ev, nil
	}
	if s.lineEnd == "" {
		s.lineEnd = lineEndOf(event)
	}
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) == 0 {
		return ev, nil // an empty data field: a keep-alive, nothing to read
	}
	if string(trimmed) == "[DONE]" {
		s.done = true
		ev.Done = true
		return ev, nil
	}
	s.text = s.text[:0]
	var err error
	switch s.api {
	case tokenizer.ChatCompletions, tokenizer.Completions:
		err = s.observeOpenAI(&ev, event, data, off, n)
	case tokenizer.Messages:
		err = s.observeAnthropic(&ev, data)
	case tokenizer.Responses:
		err = s.observeResponses(&ev, data)
	case tokenizer.Gemini:
		err = s.observeGemini(&ev, data)
	default:
		// Embeddings and unknown shapes are not streamed: nothing to read.
		return ev, nil
	}
	if err != nil {
		return Event{Forward: event}, fmt.Errorf("%w: %s event: %w", ErrMalformed, s.api, err)
	}
	if len(s.text) > 0 {
		ev.Text = string(s.text)
	}
	return ev, nil
}

// eventData returns the event's data: the value of its one data field as a
// slice of event starting at off, or the values of several data fields
// joined by LF (WHATWG) in scratch space. n is the number of data fields.
func (s *Stream) eventData(event []byte) (data []byte, off, n int) {
	// lf and cr are the offsets of the next LF and CR at or after i
	// (len(event) when there is none), found with one search each.
	lf, cr := -1, -1
	for i := 0; i < len(event); {
		if lf < i {
			lf = len(event)
			if k := bytes.IndexByte(event[i:], '\n'); k >= 0 {
				lf = i + k
			}
		}
		if cr < i {
			cr = len(event)
			if k := bytes.IndexByte(event[i:], '\r'); k >= 0 {
				cr = i + k
			}
		}
		j := min(lf, cr)
		line := event[i:j]
		next := j + 1
		if j < len(event) && event[j] == '\r' && next < len(event) && event[next] == '\n' {
			next++
		}
		if isDataLine(line) {
			v, voff := line[min(4, len(line)):], i+min(4, len(line))
			if len(v) > 0 { // skip the colon and one optional space
				v, voff = v[1:], voff+1
				if len(v) > 0 && v[0] == ' ' {
					v, voff = v[1:], voff+1
				}
			}
			switch n++; n {
			case 1:
				data, off = v, voff
			case 2:
				s.joined = append(append(append(s.joined[:0], data...), '\n'), v...)
				data = s.joined
			default:
				s.joined = append(append(s.joined, '\n'), v...)
				data = s.joined
			}
		}
		i = next
	}
	return data, off, n
}

// lineEndOf returns the line end of the first line of event.
func lineEndOf(event []byte) string {
	i := bytes.IndexAny(event, "\r\n")
	switch {
	case i < 0 || event[i] == '\n':
		return "\n"
	case i+1 < len(event) && event[i+1] == '\n':
		return "\r\n"
	}
	return "\r"
}

// appendString appends the decoded JSON string v to s.text; other values
// (null) add nothing.
func (s *Stream) appendString(v []byte) error {
	if len(v) == 0 || v[0] != '"' {
		return nil
	}
	var err error
	s.text, err = appendUnquoted(s.text, v)
	return err
}

// appendStrings appends the string members named in keys of the object v.
func (s *Stream) appendStrings(v []byte, keys ...string) error {
	if len(v) == 0 || v[0] != '{' {
		return nil
	}
	obj, err := openObject(v, 0)
	if err != nil {
		return err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		for _, k := range keys {
			if string(m.key) == k {
				if err := s.appendString(v[m.valueStart:m.valueEnd]); err != nil {
					return fmt.Errorf("%s: %w", k, err)
				}
			}
		}
	}
	return obj.err
}

// keep stores the raw value v in *dst unless it is empty ("", 0, null), so
// that Azure's leading chunk with empty id and model does not erase what
// later chunks report. It copies only when the value changed.
func keep(dst *[]byte, v []byte) {
	if !keepable(v) || bytes.Equal(*dst, v) {
		return
	}
	*dst = append((*dst)[:0], v...)
}

// keepable reports whether keep stores the raw value v.
func keepable(v []byte) bool {
	return len(v) > 0 && !isNull(v) && string(v) != `""` && string(v) != "0"
}

// markChoice records that choice index was seen, and finished if so.
func (s *Stream) markChoice(index int, finished bool) {
	for k := range s.choices {
		if s.choices[k].index == index {
			s.choices[k].finished = s.choices[k].finished || finished
			return
		}
	}
	s.choices = append(s.choices, choice{index: index, finished: finished})
}

// allFinished reports whether every choice seen has finished.
func (s *Stream) allFinished() bool {
	for _, c := range s.choices {
		if !c.finished {
			return false
		}
	}
	return len(s.choices) > 0
}

// observeOpenAI reads an OpenAI chat.completion.chunk or text_completion
// chunk (also Azure OpenAI and OpenAI-compatible routers).
func (s *Stream) observeOpenAI(ev *Event, event, data []byte, off, n int) error {
	if !s.generalOnly && s.fastOpenAI(ev, event, data, off, n) {
		return nil
	}
	obj, err := openObject(data, 0)
	if err != nil {
		return err
	}
	var (
		af           answerFields
		usage        member
		hasUsage     bool
		usagePrevEnd = -1 // end of the value before the usage member
		prevEnd      = -1
		choices      = 0
	)
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := data[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "id":
			keep(&s.id, v)
		case "object":
			keep(&s.object, v)
		case "created":
			keep(&s.created, v)
		case "model":
			keep(&s.model, v)
		case "choices":
			if choices, err = s.openAIChoices(v); err != nil {
				return fmt.Errorf("choices: %w", err)
			}
		case "usage":
			usage, hasUsage, usagePrevEnd = m, true, prevEnd
		default:
			af.read(m.key, v) // the usage chunk names its own service_tier
		}
		prevEnd = m.valueEnd
	}
	if err := obj.finish(); err != nil {
		return err
	}
	if !hasUsage {
		return nil
	}
	v := data[usage.valueStart:usage.valueEnd]
	if !isNull(v) {
		u, err := readOpenAIUsage(v)
		if err != nil {
			return fmt.Errorf("usage: %w", err)
		}
		af.apply(&u)
		s.usage, s.hasUsage, ev.Usage = u, true, true
	}
	switch {
	case !s.hideUsage:
		s.usageSent = s.usageSent || ev.Usage
	case ev.Usage && choices == 0:
		// The usage-only chunk exists only because tokengate asked.
		ev.Forward = nil
	default:
		ev.Forward = s.cutMember(event, data, off, n, usage, usagePrevEnd)
	}
	return nil
}

// openAIChoices reads the choices array of a chunk and returns its length.
func (s *Stream) openAIChoices(v []byte) (int, error) {
	if isNull(v) {
		return 0, nil
	}
	arr, err := openArray(v, 0)
	if err != nil {
		return 0, err
	}
	n := 0
	for start, end, ok := arr.next(); ok; start, end, ok = arr.next() {
		n++
		obj, err := openObject(v[:end], start)
		if err != nil {
			return n, err
		}
		index, finished := 0, false
		for m, ok := obj.next(); ok; m, ok = obj.next() {
			cv := v[m.valueStart:m.valueEnd]
			switch string(m.key) {
			case "index":
				if index, err = parseCount(cv); err != nil {
					return n, fmt.Errorf("index: %w", err)
				}
			case "finish_reason":
				finished = !isNull(cv)
			case "text": // legacy completions
				err = s.appendString(cv)
			case "delta":
				err = s.chatDelta(cv)
			}
			if err != nil {
				return n, fmt.Errorf("%s: %w", m.key, err)
			}
		}
		if obj.err != nil {
			return n, obj.err
		}
		s.markChoice(index, finished)
	}
	return n, arr.err
}

// chatDelta appends the output text of a chat delta: content, refusal,
// reasoning (routers and DeepSeek-style reasoning_content), tool-call names
// and arguments, the legacy function_call, and audio transcripts.
func (s *Stream) chatDelta(v []byte) error {
	if isNull(v) {
		return nil
	}
	obj, err := openObject(v, 0)
	if err != nil {
		return err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		dv := v[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "content", "refusal", "reasoning", "reasoning_content":
			err = s.appendString(dv)
		case "function_call":
			err = s.appendStrings(dv, "name", "arguments")
		case "audio":
			err = s.appendStrings(dv, "transcript")
		case "tool_calls":
			err = s.toolCalls(dv)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", m.key, err)
		}
	}
	return obj.err
}

func (s *Stream) toolCalls(v []byte) error {
	if isNull(v) {
		return nil
	}
	arr, err := openArray(v, 0)
	if err != nil {
		return err
	}
	for start, end, ok := arr.next(); ok; start, end, ok = arr.next() {
		obj, err := openObject(v[:end], start)
		if err != nil {
			return err
		}
		for m, ok := obj.next(); ok; m, ok = obj.next() {
			if string(m.key) == "function" {
				if err := s.appendStrings(v[m.valueStart:m.valueEnd], "name", "arguments"); err != nil {
					return fmt.Errorf("function: %w", err)
				}
			}
		}
		if obj.err != nil {
			return obj.err
		}
	}
	return arr.err
}

// cutMember returns a copy of event without the JSON member m of data, and
// without the comma that joined it to its neighbours, in the Stream's
// buffer for rewritten events (see Event.Forward). prevEnd is the end of
// the value before m, or -1 when m is the first member. data starts at off
// in event when the event has one data field (n == 1); otherwise the event
// is rebuilt with one data field.
func (s *Stream) cutMember(event, data []byte, off, n int, m member, prevEnd int) []byte {
	s.rewritten = cutMember(s.rewritten[:0], event, data, off, n, m, prevEnd)
	return s.rewritten
}

func cutMember(out, event, data []byte, off, n int, m member, prevEnd int) []byte {
	from, to := prevEnd, m.valueEnd
	if prevEnd < 0 {
		from, to = m.start, skipSpace(data, m.valueEnd)
		if to < len(data) && data[to] == ',' {
			to = skipSpace(data, to+1)
		}
	}
	if n == 1 {
		out = append(out, event[:off+from]...)
		return append(out, event[off+to:]...)
	}
	// Several data fields: keep the other lines, then one data field.
	le := lineEndOf(event)
	for i := 0; i < len(event); {
		j := i
		for j < len(event) && event[j] != '\n' && event[j] != '\r' {
			j++
		}
		next := j + 1
		if j < len(event) && event[j] == '\r' && next < len(event) && event[next] == '\n' {
			next++
		}
		if line := event[i:j]; len(line) > 0 && !isDataLine(line) {
			out = append(append(out, line...), le...)
		}
		i = next
	}
	out = append(out, "data: "...)
	out = append(out, data[:from]...)
	out = append(out, data[to:]...)
	return append(append(out, le...), le...)
}

// observeAnthropic reads an Anthropic Messages event.
func (s *Stream) observeAnthropic(ev *Event, data []byte) error {
	obj, err := openObject(data, 0)
	if err != nil {
		return err
	}
	var typ, message, index, block, delta, usage []byte
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := data[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "type":
			typ = v
		case "message":
			message = v
		case "index":
			index = v
		case "content_block":
			block = v
		case "delta":
			delta = v
		case "usage":
			usage = v
		}
	}
	if err := obj.finish(); err != nil {
		return err
	}
	switch string(typ) {
	case `"message_start"`:
		if message == nil {
			return fmt.Errorf("message_start without message")
		}
		return s.anthropicStart(ev, message)
	case `"content_block_start"`:
		i, err := parseCount(index)
		if err != nil {
			return fmt.Errorf("index: %w", err)
		}
		s.blockOpen, s.blockIndex = true, i
		if err := s.appendStrings(block, "text", "thinking", "name"); err != nil {
			return fmt.Errorf("content_block: %w", err)
		}
	case `"content_block_delta"`:
		if err := s.appendStrings(delta, "text", "thinking", "partial_json"); err != nil {
			return fmt.Errorf("delta: %w", err)
		}
	case `"content_block_stop"`:
		s.blockOpen = false
	case `"message_delta"`:
		if delta != nil && !isNull(delta) {
			if err := s.anthropicStop(delta); err != nil {
				return fmt.Errorf("delta: %w", err)
			}
		}
		if usage != nil && !isNull(usage) {
			if err := s.anthropic.overlay(usage); err != nil {
				return fmt.Errorf("usage: %w", err)
			}
			s.hasUsage, ev.Usage = true, true
			s.partial, s.noOutput = false, false
		}
	case `"message_stop"`:
		s.done, ev.Done = true, true
	}
	return nil
}

func (s *Stream) anthropicStart(ev *Event, message []byte) error {
	obj, err := openObject(message, 0)
	if err != nil {
		return fmt.Errorf("message: %w", err)
	}
	s.started = true
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := message[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "id":
			keep(&s.id, v)
		case "model":
			keep(&s.model, v)
		case "usage":
			if isNull(v) {
				continue
			}
			s.anthropic = anthropicUsage{}
			if err := s.anthropic.overlay(v); err != nil {
				return fmt.Errorf("message: usage: %w", err)
			}
			s.hasUsage, ev.Usage = true, true
			s.partial, s.noOutput = true, true
		}
	}
	if obj.err != nil {
		return fmt.Errorf("message: %w", obj.err)
	}
	return nil
}

func (s *Stream) anthropicStop(delta []byte) error {
	obj, err := openObject(delta, 0)
	if err != nil {
		return err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		if string(m.key) == "stop_reason" && !isNull(delta[m.valueStart:m.valueEnd]) {
			s.stopReported = true
		}
	}
	return obj.err
}

// observeGemini reads a Gemini GenerateContentResponse chunk.
func (s *Stream) observeGemini(ev *Event, data []byte) error {
	obj, err := openObject(data, 0)
	if err != nil {
		return err
	}
	finishedHere := false
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		v := data[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "candidates":
			if finishedHere, err = s.geminiCandidates(v); err != nil {
				return fmt.Errorf("candidates: %w", err)
			}
		case "usageMetadata":
			if isNull(v) {
				continue
			}
			u, err := readGeminiUsage(v)
			if err != nil {
				return fmt.Errorf("usageMetadata: %w", err)
			}
			s.usage, s.hasUsage, ev.Usage = u, true, true
		case "responseId":
			keep(&s.id, v)
		case "modelVersion":
			keep(&s.model, v)
		}
	}
	if err := obj.finish(); err != nil {
		return err
	}
	if ev.Usage {
		s.partial = !s.allFinished()
	}
	if finishedHere && s.allFinished() && s.framing != JSONArray {
		s.done, ev.Done = true, true
	}
	return nil
}

// observeElement reads one event of a Gemini JSON array as cut by a Framer:
// an element with the opening bracket or the separator before it, or the
// closing bracket.
func (s *Stream) observeElement(event []byte) (Event, error) {
	ev := Event{Forward: event}
	data := bytes.TrimLeft(event, " \t\r\n")
	if len(data) > 0 && data[0] == '[' {
		s.arrayOpen = true
		data = bytes.TrimLeft(data[1:], " \t\r\n")
	} else if len(data) > 0 && data[0] == ',' {
		data = bytes.TrimLeft(data[1:], " \t\r\n")
	}
	data = bytes.TrimRight(data, " \t\r\n")
	switch {
	case len(data) == 0:
		return ev, nil
	case string(data) == "]":
		s.arrayClosed, s.done, ev.Done = true, true, true
		return ev, nil
	case s.api != tokenizer.Gemini:
		return ev, nil
	}
	s.text = s.text[:0]
	if err := s.observeGemini(&ev, data); err != nil {
		return Event{Forward: event}, fmt.Errorf("%w: %s array element: %w", ErrMalformed, s.api, err)
	}
	if len(s.text) > 0 {
		ev.Text = string(s.text)
	}
	return ev, nil
}

// geminiCandidates reads the candidates of a chunk and reports whether one
// of them finished in it.
func (s *Stream) geminiCandidates(v []byte) (finishedHere bool, err error) {
	if isNull(v) {
		return false, nil
	}
	arr, err := openArray(v, 0)
	if err != nil {
		return false, err
	}
	for pos := 0; ; pos++ {
		start, end, ok := arr.next()
		if !ok {
			break
		}
		obj, err := openObject(v[:end], start)
		if err != nil {
			return false, err
		}
		index, finished := pos, false
		for m, ok := obj.next(); ok; m, ok = obj.next() {
			cv := v[m.valueStart:m.valueEnd]
			switch string(m.key) {
			case "index":
				if index, err = parseCount(cv); err != nil {
					return false, fmt.Errorf("index: %w", err)
				}
			case "finishReason":
				finished = !isNull(cv)
			case "content":
				if err := s.geminiContent(cv); err != nil {
					return false, fmt.Errorf("content: %w", err)
				}
			}
		}
		if obj.err != nil {
			return false, obj.err
		}
		s.markChoice(index, finished)
		finishedHere = finishedHere || finished
	}
	return finishedHere, arr.err
}

// geminiContent appends the output of a candidate's content: text parts
// (thoughts included), function-call names and arguments, executable code.
func (s *Stream) geminiContent(v []byte) error {
	if isNull(v) {
		return nil
	}
	obj, err := openObject(v, 0)
	if err != nil {
		return err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		if string(m.key) != "parts" || isNull(v[m.valueStart:m.valueEnd]) {
			continue
		}
		parts := v[m.valueStart:m.valueEnd]
		arr, err := openArray(parts, 0)
		if err != nil {
			return fmt.Errorf("parts: %w", err)
		}
		for start, end, ok := arr.next(); ok; start, end, ok = arr.next() {
			part, err := openObject(parts[:end], start)
			if err != nil {
				return fmt.Errorf("parts: %w", err)
			}
			for pm, ok := part.next(); ok; pm, ok = part.next() {
				pv := parts[pm.valueStart:pm.valueEnd]
				switch string(pm.key) {
				case "text":
					err = s.appendString(pv)
				case "functionCall":
					err = s.geminiFunctionCall(pv)
				case "executableCode":
					err = s.appendStrings(pv, "code")
				}
				if err != nil {
					return fmt.Errorf("parts: %s: %w", pm.key, err)
				}
			}
			if part.err != nil {
				return fmt.Errorf("parts: %w", part.err)
			}
		}
		if arr.err != nil {
			return fmt.Errorf("parts: %w", arr.err)
		}
	}
	return obj.err
}

// geminiFunctionCall appends a function call's name and its arguments as
// the JSON text the model produced.
func (s *Stream) geminiFunctionCall(v []byte) error {
	if isNull(v) {
		return nil
	}
	obj, err := openObject(v, 0)
	if err != nil {
		return err
	}
	for m, ok := obj.next(); ok; m, ok = obj.next() {
		fv := v[m.valueStart:m.valueEnd]
		switch string(m.key) {
		case "name":
			if err := s.appendString(fv); err != nil {
				return fmt.Errorf("name: %w", err)
			}
		case "args":
			if !isNull(fv) {
				s.text = append(s.text, fv...)
			}
		}
	}
	return obj.err
}
