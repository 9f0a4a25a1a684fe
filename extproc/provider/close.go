package provider

import (
	"strconv"

	"github.com/tokengate/tokengate/tokenizer"
)

// Close returns the events that end the stream now, at a length cut-off
// (S14), given the usage delivered to the client. The upstream's remaining
// output is not forwarded after them. Per format:
//
//   - OpenAI chat and legacy completions: for each choice still open (choice 0
//     when none was seen) a chunk with an empty delta (empty text) and
//     finish_reason "length", carrying the id, object, created and model of
//     the earlier chunks; then, when the client asked for include_usage and
//     has not had its usage chunk, a usage chunk built from delivered; then
//     data: [DONE].
//   - Anthropic Messages: content_block_stop for an open block, message_delta
//     with stop_reason "max_tokens" and usage.output_tokens, message_stop
//     (preceded by a message_start when the upstream sent none).
//   - OpenAI Responses: for each output item still open, the done events
//     of its open parts (output_text.done, refusal.done,
//     reasoning_summary_text.done and the part's content_part.done or
//     reasoning_summary_part.done) and of its arguments
//     (function_call_arguments.done and kin), each with what was delivered,
//     then output_item.done with status "incomplete"; then
//     response.incomplete with status "incomplete",
//     incomplete_details.reason "max_output_tokens", the delivered usage and
//     every item delivered as output, on the response object of
//     response.created. Sequence numbers follow the last one delivered.
//   - Gemini: a final chunk with finishReason "MAX_TOKENS" for each open
//     candidate and usageMetadata built from delivered; in a JSON array, as
//     its last element, followed by the closing bracket.
//
// SSE line ends follow the upstream's (LF, CRLF or CR; LF before any event).
// Close returns nil when the stream already ended (a terminal event was
// observed) or was already closed, and for formats that are not streamed.
func (s *Stream) Close(delivered Usage) []byte {
	if s.done {
		return nil
	}
	s.done = true
	le := s.lineEnd
	if le == "" {
		le = "\n"
	}
	w := eventWriter{le: le}
	switch s.api {
	case tokenizer.ChatCompletions, tokenizer.Completions:
		s.closeOpenAI(&w, delivered)
	case tokenizer.Messages:
		s.closeAnthropic(&w, delivered)
	case tokenizer.Responses:
		s.closeResponses(&w, delivered)
	case tokenizer.Gemini:
		if s.framing == JSONArray {
			s.closeGeminiArray(&w, delivered)
		} else {
			w.begin("")
			s.geminiChunk(&w, delivered)
			w.end()
		}
	default:
		return nil
	}
	return w.b
}

// eventWriter builds server-sent events.
type eventWriter struct {
	b  []byte
	le string
}

// begin starts an event, with an event field when name is not empty, and
// opens its data field.
func (w *eventWriter) begin(name string) {
	if name != "" {
		w.b = append(w.b, "event: "...)
		w.b = append(w.b, name...)
		w.b = append(w.b, w.le...)
	}
	w.b = append(w.b, "data: "...)
}

// end closes the data field and the event.
func (w *eventWriter) end() {
	w.b = append(w.b, w.le...)
	w.b = append(w.b, w.le...)
}

func (w *eventWriter) str(s string) { w.b = append(w.b, s...) }

// raw writes a raw JSON value kept from the upstream, or def when none was
// seen.
func (w *eventWriter) raw(v []byte, def string) {
	if len(v) == 0 {
		w.b = append(w.b, def...)
		return
	}
	w.b = append(w.b, v...)
}

func (w *eventWriter) int(n int) { w.b = strconv.AppendInt(w.b, int64(n), 10) }

// member writes `"key":n` preceded by a comma unless first.
func (w *eventWriter) member(first bool, key string, n int) {
	if !first {
		w.b = append(w.b, ',')
	}
	w.b = append(w.b, '"')
	w.b = append(w.b, key...)
	w.b = append(w.b, `":`...)
	w.int(n)
}

// openChoices returns the indexes of choices not yet finished; index 0 when
// none was seen.
func (s *Stream) openChoices() []int {
	if len(s.choices) == 0 {
		return []int{0}
	}
	var open []int
	for _, c := range s.choices {
		if !c.finished {
			open = append(open, c.index)
		}
	}
	return open
}

func (s *Stream) closeOpenAI(w *eventWriter, u Usage) {
	completions := s.api == tokenizer.Completions
	object := `"chat.completion.chunk"`
	if completions {
		object = `"text_completion"`
	}
	head := func() {
		w.begin("")
		w.str(`{"id":`)
		w.raw(s.id, `""`)
		w.str(`,"object":`)
		w.raw(s.object, object)
		w.str(`,"created":`)
		w.raw(s.created, "0")
		w.str(`,"model":`)
		w.raw(s.model, `""`)
	}
	for _, i := range s.openChoices() {
		head()
		if completions {
			w.str(`,"choices":[{"text":"","index":`)
			w.int(i)
			w.str(`,"logprobs":null,"finish_reason":"length"}]}`)
		} else {
			w.str(`,"choices":[{"index":`)
			w.int(i)
			w.str(`,"delta":{},"finish_reason":"length"}]}`)
		}
		w.end()
	}
	if s.clientUsage && !s.usageSent {
		head()
		w.str(`,"choices":[],"usage":{`)
		w.member(true, "prompt_tokens", u.InputTokens)
		w.member(false, "completion_tokens", u.OutputTokens)
		w.member(false, "total_tokens", u.Total())
		if !completions {
			w.str(`,"prompt_tokens_details":{`)
			w.member(true, "cached_tokens", u.CachedInputTokens)
			w.str(`},"completion_tokens_details":{`)
			w.member(true, "reasoning_tokens", u.ReasoningTokens)
			w.str(`}`)
		}
		w.str(`}}`)
		w.end()
	}
	w.begin("")
	w.str("[DONE]")
	w.end()
}

func (s *Stream) closeAnthropic(w *eventWriter, u Usage) {
	if !s.started {
		// A client must see message_start before anything else.
		w.begin("message_start")
		w.str(`{"type":"message_start","message":{"id":`)
		w.raw(s.id, `""`)
		w.str(`,"type":"message","role":"assistant","content":[],"model":`)
		w.raw(s.model, `""`)
		w.str(`,"stop_reason":null,"stop_sequence":null,"usage":{`)
		w.member(true, "input_tokens", u.InputTokens-u.CachedInputTokens-u.CacheCreationInputTokens)
		w.member(false, "cache_creation_input_tokens", u.CacheCreationInputTokens)
		w.member(false, "cache_read_input_tokens", u.CachedInputTokens)
		w.member(false, "output_tokens", 0)
		w.str(`}}}`)
		w.end()
	}
	if s.blockOpen {
		w.begin("content_block_stop")
		w.str(`{"type":"content_block_stop","index":`)
		w.int(s.blockIndex)
		w.str(`}`)
		w.end()
	}
	if !s.stopReported {
		w.begin("message_delta")
		w.str(`{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{`)
		w.member(true, "output_tokens", u.OutputTokens)
		w.str(`}}`)
		w.end()
	}
	w.begin("message_stop")
	w.str(`{"type":"message_stop"}`)
	w.end()
}

// closeGeminiArray ends a JSON array: the final chunk as its next element
// (its first when the opening bracket was not delivered), unless every
// candidate has finished already, then the closing bracket. The separators
// are those Gemini sends.
func (s *Stream) closeGeminiArray(w *eventWriter, u Usage) {
	switch {
	case !s.arrayOpen:
		w.str("[")
		s.geminiChunk(w, u)
	case !s.allFinished():
		w.str("\n,\r\n")
		s.geminiChunk(w, u)
	}
	w.str("\n]")
}

// geminiChunk writes the final chunk: finishReason MAX_TOKENS for each
// open candidate and usageMetadata built from u.
func (s *Stream) geminiChunk(w *eventWriter, u Usage) {
	w.str(`{"candidates":[`)
	for k, i := range s.openChoices() {
		if k > 0 {
			w.str(",")
		}
		w.str(`{"content":{"parts":[{"text":""}],"role":"model"},"finishReason":"MAX_TOKENS","index":`)
		w.int(i)
		w.str(`}`)
	}
	w.str(`],"usageMetadata":{`)
	w.member(true, "promptTokenCount", u.InputTokens)
	w.member(false, "candidatesTokenCount", u.OutputTokens-u.ReasoningTokens)
	if u.ReasoningTokens > 0 {
		w.member(false, "thoughtsTokenCount", u.ReasoningTokens)
	}
	if u.CachedInputTokens > 0 {
		w.member(false, "cachedContentTokenCount", u.CachedInputTokens)
	}
	w.member(false, "totalTokenCount", u.Total())
	w.str(`}`)
	if len(s.model) > 0 {
		w.str(`,"modelVersion":`)
		w.raw(s.model, "")
	}
	if len(s.id) > 0 {
		w.str(`,"responseId":`)
		w.raw(s.id, "")
	}
	w.str(`}`)
}
