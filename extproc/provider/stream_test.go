package provider

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/tokengate/tokengate/tokenizer"
)

// TestObserveText checks, per format, which parts of an event count as live
// output (S13) and which events report usage or end the stream.
func TestObserveText(t *testing.T) {
	for _, tc := range []struct {
		name  string
		api   tokenizer.API
		event string
		want  Event // Forward is always the event here
	}{
		{
			name:  "chat content, refusal and reasoning",
			api:   tokenizer.ChatCompletions,
			event: `data: {"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"think ","content":"Hi","refusal":null}},{"index":1,"delta":{"refusal":"no"}}]}` + "\n\n",
			want:  Event{Text: "think Hino"},
		},
		{
			name:  "chat tool calls",
			api:   tokenizer.ChatCompletions,
			event: `data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"get","arguments":"{\"a\":"}},{"index":1,"function":{"arguments":"1}"}}]}}]}` + "\n\n",
			want:  Event{Text: `get{"a":1}`},
		},
		{
			name:  "chat escapes and surrogate pairs",
			api:   tokenizer.ChatCompletions,
			event: `data: {"choices":[{"delta":{"content":"caf\u00e9 \ud83d\ude00\n\"q\"\\ \ud800"}}]}` + "\n\n",
			want:  Event{Text: "café 😀\n\"q\"\\ \uFFFD"},
		},
		{
			name:  "chat usage chunk",
			api:   tokenizer.ChatCompletions,
			event: `data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}` + "\n\n",
			want:  Event{Usage: true},
		},
		{
			name:  "done sentinel",
			api:   tokenizer.ChatCompletions,
			event: "data: [DONE]\n\n",
			want:  Event{Done: true},
		},
		{
			name:  "data split over two data lines",
			api:   tokenizer.ChatCompletions,
			event: "data: {\"choices\":[{\"delta\":\ndata: {\"content\":\"x\"}}]}\n\n",
			want:  Event{Text: "x"},
		},
		{
			name:  "empty data field",
			api:   tokenizer.Responses,
			event: "data: \n\n",
		},
		{
			name:  "comment block",
			api:   tokenizer.ChatCompletions,
			event: ": OPENROUTER PROCESSING\n\n",
		},
		{
			name:  "legacy completions text",
			api:   tokenizer.Completions,
			event: `data: {"object":"text_completion","choices":[{"text":" fib","index":0,"logprobs":null,"finish_reason":null}]}` + "\n\n",
			want:  Event{Text: " fib"},
		},
		{
			name:  "anthropic tool_use start counts the name",
			api:   tokenizer.Messages,
			event: "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"lookup\",\"input\":{}}}\n\n",
			want:  Event{Text: "lookup"},
		},
		{
			name:  "anthropic thinking delta",
			api:   tokenizer.Messages,
			event: "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}   \n\n",
			want:  Event{Text: "hmm"},
		},
		{
			name:  "anthropic input_json delta",
			api:   tokenizer.Messages,
			event: "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"q\\\"\"}}\n\n",
			want:  Event{Text: `{"q"`},
		},
		{
			name:  "anthropic signature is not output",
			api:   tokenizer.Messages,
			event: "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"EqQB\"}}\n\n",
		},
		{
			name:  "anthropic message_stop",
			api:   tokenizer.Messages,
			event: "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
			want:  Event{Done: true},
		},
		{
			name:  "responses output text",
			api:   tokenizer.Responses,
			event: "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"delta\":\"Hello\"}\n\n",
			want:  Event{Text: "Hello"},
		},
		{
			name:  "responses function call name",
			api:   tokenizer.Responses,
			event: "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"function_call\",\"name\":\"multiply\",\"arguments\":\"\"}}\n\n",
			want:  Event{Text: "multiply"},
		},
		{
			name:  "responses audio delta is not text",
			api:   tokenizer.Responses,
			event: "data: {\"type\":\"response.audio.delta\",\"delta\":\"UklGRg==\"}\n\n",
		},
		{
			name:  "responses failed without usage",
			api:   tokenizer.Responses,
			event: "data: {\"type\":\"response.failed\",\"response\":{\"id\":\"r\",\"status\":\"failed\",\"usage\":null}}\n\n",
			want:  Event{Done: true},
		},
		{
			name:  "gemini thought, text and function call",
			api:   tokenizer.Gemini,
			event: "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"plan \",\"thought\": true},{\"text\": \"ok\"},{\"functionCall\": {\"name\": \"f\",\"args\": {\"x\": 1}}}]}}]}\r\n\r\n",
			want:  Event{Text: `plan okf{"x": 1}`},
		},
		{
			name:  "gemini finish with usage",
			api:   tokenizer.Gemini,
			event: "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \".\"}]},\"finishReason\": \"STOP\"}],\"usageMetadata\": {\"promptTokenCount\": 3}}\r\n\r\n",
			want:  Event{Text: ".", Usage: true, Done: true},
		},
		{
			name:  "embeddings pass through",
			api:   tokenizer.Embeddings,
			event: "data: not json\n\n",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NewStream(tc.api, false, false).Observe([]byte(tc.event))
			if err != nil {
				t.Fatalf("Observe: %v", err)
			}
			tc.want.Forward = []byte(tc.event)
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Observe (-want +got):\n%s", diff)
			}
		})
	}
}

// TestObserveErrors: an event that is not what the API sends gets a clear
// error wrapping ErrMalformed, and the event is still forwarded unchanged.
func TestObserveErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		api     tokenizer.API
		event   string
		wantErr string
	}{
		{"not JSON", tokenizer.ChatCompletions, "data: hello\n\n", `chat event: invalid JSON at offset 0: want an object`},
		{"truncated", tokenizer.ChatCompletions, `data: {"choices":[{"delta":{"content":"x"}}` + "\n\n", `chat event: invalid JSON at offset 37: unexpected end of input, want ',' or ']'`},
		{"trailing data", tokenizer.Completions, "data: {} {}\n\n", `completions event: invalid JSON at offset 3: data after the JSON value`},
		{"negative usage", tokenizer.ChatCompletions, `data: {"choices":[],"usage":{"prompt_tokens":-3}}` + "\n\n", `chat event: usage: prompt_tokens: token count "-3" is not a non-negative integer`},
		{"usage not an object", tokenizer.ChatCompletions, `data: {"usage":"lots"}` + "\n\n", `chat event: usage: invalid JSON at offset 0: want an object`},
		{"bad escape", tokenizer.ChatCompletions, `data: {"choices":[{"delta":{"content":"\x"}}]}` + "\n\n", `chat event: invalid JSON at offset 34: invalid escape in a string`},
		{"anthropic start without message", tokenizer.Messages, `data: {"type":"message_start"}` + "\n\n", `messages event: message_start without message`},
		{"anthropic fractional count", tokenizer.Messages, `data: {"type":"message_delta","usage":{"output_tokens":1.5}}` + "\n\n", `messages event: usage: output_tokens: token count "1.5" is not a non-negative integer`},
		{"responses bad sequence", tokenizer.Responses, `data: {"type":"x","sequence_number":"7"}` + "\n\n", `responses event: sequence_number: token count "\"7\"" is not a non-negative integer`},
		{"gemini parts not an array", tokenizer.Gemini, `data: {"candidates":[{"content":{"parts":{}}}]}` + "\n\n", `gemini event: candidates: content: parts: invalid JSON at offset 0: want an array`},
		{"deep nesting", tokenizer.Gemini, "data: " + strings.Repeat("[", 600) + "\n\n", `gemini event: invalid JSON at offset 0: want an object`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev, err := NewStream(tc.api, false, false).Observe([]byte(tc.event))
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Observe error = %v, want one wrapping ErrMalformed", err)
			}
			if want := "malformed provider response: " + tc.wantErr; err.Error() != want {
				t.Errorf("error = %q\nwant    %q", err, want)
			}
			if string(ev.Forward) != tc.event || ev.Text != "" || ev.Usage || ev.Done {
				t.Errorf("event on error = %+v, want only Forward = the event", ev)
			}
		})
	}
}

// TestHideInjectedUsage checks the S15 rewrite on the member positions that
// occur: usage first, in the middle, last, alone, null or an object beside
// choices, and data spread over several lines.
func TestHideInjectedUsage(t *testing.T) {
	for _, tc := range []struct {
		name, event, want string
		wantUsage         bool
	}{
		{"null in the middle", `data: {"id":"a","choices":[],"usage":null,"x":1}` + "\n\n", `data: {"id":"a","choices":[],"x":1}` + "\n\n", false},
		{"null last", `data: {"choices":[{"delta":{}}],"usage":null}` + "\r\n\r\n", `data: {"choices":[{"delta":{}}]}` + "\r\n\r\n", false},
		{"null first", `data: { "usage" : null , "id":"a"}` + "\n\n", `data: { "id":"a"}` + "\n\n", false},
		{"null alone", `data: {"usage":null}` + "\n\n", `data: {}` + "\n\n", false},
		{"usage-only chunk dropped", `data: {"choices":[],"usage":{"prompt_tokens":1}}` + "\n\n", "", true},
		{"usage beside choices kept without it", `data: {"choices":[{"index":0,"delta":{}}],"usage":{"prompt_tokens":1}}` + "\n\n", `data: {"choices":[{"index":0,"delta":{}}]}` + "\n\n", true},
		{"several data lines", "id: 9\ndata: {\"choices\":[],\ndata: \"usage\":null}\n\n", "id: 9\ndata: {\"choices\":[]}\n\n", false},
		{"no usage member", `data: {"choices":[]}` + "\n\n", `data: {"choices":[]}` + "\n\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev, err := NewStream(tokenizer.ChatCompletions, false, true).Observe([]byte(tc.event))
			if err != nil {
				t.Fatal(err)
			}
			if string(ev.Forward) != tc.want || (ev.Forward == nil) != (tc.want == "") {
				t.Errorf("Forward = %q, want %q", ev.Forward, tc.want)
			}
			if ev.Usage != tc.wantUsage {
				t.Errorf("Usage = %v, want %v", ev.Usage, tc.wantUsage)
			}
			// The client that asked itself gets the event untouched.
			ev, _ = NewStream(tokenizer.ChatCompletions, true, true).Observe([]byte(tc.event))
			if string(ev.Forward) != tc.event {
				t.Errorf("client asked for usage: Forward = %q, want the event", ev.Forward)
			}
		})
	}
}

// TestStreamUsageMerge steps through usage reports and checks the merged
// view after each (S22): Anthropic overlays message_delta on message_start,
// Gemini and OpenAI take the last report.
func TestStreamUsageMerge(t *testing.T) {
	type step struct {
		event string
		want  Usage
		ok    bool
	}
	for _, tc := range []struct {
		api   tokenizer.API
		steps []step
	}{
		{tokenizer.Messages, []step{
			{"data: {\"type\":\"ping\"}\n\n", Usage{}, false},
			{"data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"cache_creation_input_tokens\":10,\"cache_read_input_tokens\":20,\"output_tokens\":1}}}\n\n",
				Usage{InputTokens: 33, OutputTokens: 1, CachedInputTokens: 20, CacheCreationInputTokens: 10}, true},
			{"data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15,\"input_tokens\":null}}\n\n",
				Usage{InputTokens: 33, OutputTokens: 15, CachedInputTokens: 20, CacheCreationInputTokens: 10}, true},
			{"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":18}}\n\n",
				Usage{InputTokens: 33, OutputTokens: 18, CachedInputTokens: 20, CacheCreationInputTokens: 10}, true},
		}},
		{tokenizer.Gemini, []step{
			{"data: {\"usageMetadata\":{\"promptTokenCount\":15,\"totalTokenCount\":15}}\n\n", Usage{InputTokens: 15}, true},
			{"data: {\"usageMetadata\":{\"promptTokenCount\":13,\"candidatesTokenCount\":8,\"thoughtsTokenCount\":4,\"toolUsePromptTokenCount\":2,\"cachedContentTokenCount\":6}}\n\n",
				Usage{InputTokens: 15, OutputTokens: 12, ReasoningTokens: 4, CachedInputTokens: 6}, true},
		}},
		{tokenizer.Responses, []step{
			{"data: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n", Usage{}, false},
			{"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"input_tokens_details\":{\"cached_tokens\":4},\"output_tokens\":5,\"output_tokens_details\":{\"reasoning_tokens\":3}}}}\n\n",
				Usage{InputTokens: 9, OutputTokens: 5, CachedInputTokens: 4, ReasoningTokens: 3}, true},
		}},
	} {
		t.Run(string(tc.api), func(t *testing.T) {
			s := NewStream(tc.api, false, false)
			for i, st := range tc.steps {
				if _, err := s.Observe([]byte(st.event)); err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
				got, ok := s.Usage()
				if diff := cmp.Diff(st.want, got); diff != "" || ok != st.ok {
					t.Errorf("step %d: Usage() ok=%v want %v (-want +got):\n%s", i, ok, st.ok, diff)
				}
			}
		})
	}
}

// FuzzObserve feeds arbitrary events to a Stream of every API: it never
// panics, errors wrap ErrMalformed and forward the event unchanged, the
// event is forwarded byte for byte unless usage is hidden, and Close always
// yields complete events.
func FuzzObserve(f *testing.F) {
	f.Add(uint8(0), []byte(`data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}`+"\n\n"), true)
	f.Add(uint8(1), []byte(`data: {"choices":[{"text":"x","index":1,"finish_reason":null}]}`+"\n\n"), false)
	f.Add(uint8(3), []byte("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n"), false)
	f.Add(uint8(4), []byte("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":1}}}\n\n"), false)
	f.Add(uint8(5), []byte("data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"a\"}]}}]}\r\n\r\n"), false)
	apis := []tokenizer.API{tokenizer.ChatCompletions, tokenizer.Completions, tokenizer.Embeddings,
		tokenizer.Responses, tokenizer.Messages, tokenizer.Gemini}
	f.Fuzz(func(t *testing.T, which uint8, event []byte, injected bool) {
		api := apis[int(which)%len(apis)]
		s := NewStream(api, false, injected)
		ev, err := s.Observe(event)
		if err != nil {
			if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), string(api)+" event: ") {
				t.Fatalf("error %q does not wrap ErrMalformed or name the API", err)
			}
			if string(ev.Forward) != string(event) {
				t.Fatalf("on error Forward = %q, want the event", ev.Forward)
			}
		}
		if !injected && string(ev.Forward) != string(event) {
			t.Fatalf("Forward = %q, want the event unchanged", ev.Forward)
		}
		if u, ok := s.Usage(); ok && (u.InputTokens < 0 || u.OutputTokens < 0) {
			t.Fatalf("negative usage %+v", u)
		}
		closing := s.Close(Usage{InputTokens: 1, OutputTokens: 2})
		var fr Framer
		fr.Feed(closing)
		for _, ok := fr.Next(); ok; _, ok = fr.Next() {
		}
		// With CR line ends the last event waits for Flush: CR LF is one
		// line end.
		if tail := fr.Flush(); tail != nil && !endsWithBlankLine(tail) {
			t.Fatalf("Close left an incomplete event %q", tail)
		}
	})
}

// S8: usage seen before a stream's end is a running figure where the
// provider says so: Anthropic's message_start (its output_tokens a
// placeholder, counting no output) until message_delta, Gemini's
// usageMetadata until the chunk that finishes every candidate. OpenAI's
// usage chunk and the Responses API's terminal usage are final at once.
func TestStreamUsageFinalOnlyAtTheEnd(t *testing.T) {
	type step struct {
		event          string
		final, outputs bool
	}
	for _, tc := range []struct {
		api   tokenizer.API
		steps []step
	}{
		{tokenizer.Messages, []step{
			{"data: {\"type\":\"ping\"}\n\n", false, false},
			{"data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"cache_read_input_tokens\":20,\"output_tokens\":1}}}\n\n", false, false},
			{"data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n", false, false},
			{"data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n", true, true},
		}},
		{tokenizer.Gemini, []step{
			{"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"a\"}]},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":13,\"candidatesTokenCount\":1,\"thoughtsTokenCount\":40}}\n\n", false, true},
			{"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"b\"}]},\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":13,\"candidatesTokenCount\":2,\"thoughtsTokenCount\":40}}\n\n", true, true},
		}},
		{tokenizer.ChatCompletions, []step{
			{"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n", false, false},
			{"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1,\"total_tokens\":10}}\n\n", true, true},
		}},
		{tokenizer.Responses, []step{
			{"data: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n", false, false},
			{"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":5}}}\n\n", true, true},
		}},
	} {
		t.Run(string(tc.api), func(t *testing.T) {
			s := NewStream(tc.api, true, false)
			for i, st := range tc.steps {
				if _, err := s.Observe([]byte(st.event)); err != nil {
					t.Fatalf("step %d: %v", i, err)
				}
				if s.UsageFinal() != st.final || s.OutputReported() != st.outputs {
					t.Errorf("step %d: UsageFinal %v, OutputReported %v; want %v, %v", i, s.UsageFinal(), s.OutputReported(), st.final, st.outputs)
				}
			}
		})
	}
}

// Every recorded stream that reports usage ends with the provider's final
// count: the running figures of Anthropic and Gemini are final by the end.
func TestRecordedStreamsEndWithFinalUsage(t *testing.T) {
	for _, r := range streamRecordings(t) {
		s := NewStream(r.api, r.askUsage, false)
		observe := func(ev []byte) {
			if _, err := s.Observe(ev); err != nil {
				t.Errorf("%s: %v", r.name, err)
			}
		}
		var f Framer
		f.Feed(r.body)
		for ev, ok := f.Next(); ok; ev, ok = f.Next() {
			observe(ev)
		}
		if tail := f.Flush(); len(tail) > 0 {
			observe(tail)
		}
		if _, ok := s.Usage(); ok && !s.UsageFinal() {
			t.Errorf("%s: the usage at the end of the stream is not final", r.name)
		}
	}
}
