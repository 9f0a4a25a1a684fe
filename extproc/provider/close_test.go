package provider

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/packages/ssestream"
	"github.com/openai/openai-go/responses"
	"github.com/tokengate/tokengate/tokenizer"
)

// cutAfter replays the first n dispatched events of a recording through a
// Stream and then closes it at a length cut-off (S14). It returns the bytes
// the client receives: what was forwarded, then the closing events.
func cutAfter(t *testing.T, r recording, askUsage, injected bool, n int, delivered Usage) (client, closing []byte, s *Stream) {
	t.Helper()
	var f Framer
	s = NewStream(r.api, askUsage, injected)
	f.Feed(r.body)
	seen := 0
	for seen < n {
		ev, ok := f.Next()
		if !ok {
			t.Fatalf("recording has fewer than %d events", n)
		}
		e, err := s.Observe(ev)
		if err != nil {
			t.Fatal(err)
		}
		client = append(client, e.Forward...)
		if dataEvents([]string{string(ev)}) == 1 {
			seen++
		}
	}
	closing = s.Close(delivered)
	if again := s.Close(delivered); again != nil {
		t.Errorf("second Close returned %q, want nil", again)
	}
	return append(client, closing...), closing, s
}

func recordingNamed(t *testing.T, name string) recording {
	t.Helper()
	for _, r := range streamRecordings(t) {
		if r.name == name {
			return r
		}
	}
	t.Fatalf("no recording %s", name)
	return recording{}
}

// sdkStream decodes body the way the official OpenAI Go SDK decodes an HTTP
// response stream.
func sdkStream[T any](body []byte) *ssestream.Stream[T] {
	res := &http.Response{
		StatusCode: http.StatusOK,
		Header:     http.Header{"Content-Type": []string{"text/event-stream"}},
		Body:       io.NopCloser(bytes.NewReader(body)),
	}
	return ssestream.NewStream[T](ssestream.NewDecoder(res), nil)
}

// dropCommentBlocks removes the blocks without a data field.
func dropCommentBlocks(b []byte) []byte {
	var f Framer
	f.Feed(b)
	var out []byte
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		if dataEvents([]string{string(ev)}) == 1 {
			out = append(out, ev...)
		}
	}
	return out
}

var delivered = Usage{InputTokens: 40, OutputTokens: 7, CachedInputTokens: 3, ReasoningTokens: 2}

// TestCloseChatSDK cuts real chat streams mid-answer and checks that the
// OpenAI SDK accepts what the client receives, sees finish_reason "length"
// on every choice, the delivered usage when the client asked for it, and the
// identity of the earlier chunks.
func TestCloseChatSDK(t *testing.T) {
	for _, tc := range []struct {
		name               string
		askUsage, injected bool
		wantUsage          bool
		events             int // dispatched events before the cut; 2 when 0
	}{
		{name: "openai/chat-stream-no-usage"},
		{name: "openai/chat-stream-tool-call-include-usage", askUsage: true, wantUsage: true},
		{name: "openai/chat-stream-tool-call-include-usage", injected: true},
		{name: "azure_openai/chat-stream-include-usage", askUsage: true, wantUsage: true},
		{name: "openrouter/chat-stream-comments-usage-cost", askUsage: true, wantUsage: true, events: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := recordingNamed(t, tc.name)
			n := tc.events
			if n == 0 {
				n = 2
			}
			client, closing, _ := cutAfter(t, r, tc.askUsage, tc.injected, n, delivered)
			if !bytes.HasSuffix(closing, []byte("data: [DONE]\n\n")) {
				t.Errorf("closing events do not end with data: [DONE]:\n%s", closing)
			}
			// The SDK's decoder dispatches comment-only blocks as empty
			// events and fails on them (router keep-alives): leave them out.
			client = dropCommentBlocks(client)
			stream := sdkStream[openai.ChatCompletionChunk](client)
			var (
				acc    openai.ChatCompletionAccumulator
				last   openai.ChatCompletionChunk
				usage  *openai.CompletionUsage
				chunks int
			)
			for stream.Next() {
				chunk := stream.Current()
				chunks++
				if !acc.AddChunk(chunk) {
					t.Fatalf("SDK accumulator refused chunk %d (id %q)", chunks, chunk.ID)
				}
				if chunk.JSON.Usage.Valid() && chunk.Usage.TotalTokens > 0 {
					u := chunk.Usage
					usage = &u
				}
				last = chunk
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("SDK stream error: %v", err)
			}
			if len(acc.Choices) == 0 {
				t.Fatal("no choices accumulated")
			}
			for _, c := range acc.Choices {
				if c.FinishReason != "length" {
					t.Errorf("choice %d finish_reason = %q, want length", c.Index, c.FinishReason)
				}
			}
			if last.ID != acc.ID || last.Model == "" || last.Created == 0 {
				t.Errorf("closing chunk identity = (%q, %q, %d), want the stream's id %q, model and created",
					last.ID, last.Model, last.Created, acc.ID)
			}
			if got := usage != nil; got != tc.wantUsage {
				t.Fatalf("usage chunk present = %v, want %v", got, tc.wantUsage)
			}
			if usage != nil {
				got := Usage{
					InputTokens:       int(usage.PromptTokens),
					OutputTokens:      int(usage.CompletionTokens),
					CachedInputTokens: int(usage.PromptTokensDetails.CachedTokens),
					ReasoningTokens:   int(usage.CompletionTokensDetails.ReasoningTokens),
				}
				if diff := cmp.Diff(delivered, got); diff != "" || usage.TotalTokens != int64(delivered.Total()) {
					t.Errorf("usage chunk (-want +got):\n%s\ntotal %d", diff, usage.TotalTokens)
				}
			}
		})
	}
}

// TestCloseCompletionsSDK does the same for the legacy completions stream.
func TestCloseCompletionsSDK(t *testing.T) {
	r := recordingNamed(t, "openai/completions-stream-include-usage")
	client, _, _ := cutAfter(t, r, true, false, 3, delivered)
	stream := sdkStream[openai.Completion](client)
	var finish []string
	var usage openai.CompletionUsage
	for stream.Next() {
		c := stream.Current()
		for _, ch := range c.Choices {
			if ch.FinishReason != "" {
				finish = append(finish, string(ch.FinishReason))
			}
		}
		if c.Usage.TotalTokens > 0 {
			usage = c.Usage
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("SDK stream error: %v", err)
	}
	if diff := cmp.Diff([]string{"length"}, finish); diff != "" {
		t.Errorf("finish reasons (-want +got):\n%s", diff)
	}
	if usage.PromptTokens != 40 || usage.CompletionTokens != 7 || usage.TotalTokens != 47 {
		t.Errorf("usage = %+v, want 40/7/47", usage)
	}
}

// TestCloseResponsesSDK cuts a Responses API stream and checks the SDK reads
// a response.incomplete event with reason max_output_tokens.
func TestCloseResponsesSDK(t *testing.T) {
	r := recordingNamed(t, "openai/responses-stream-tool-call")
	client, _, _ := cutAfter(t, r, false, false, 6, delivered)
	stream := sdkStream[responses.ResponseStreamEventUnion](client)
	var last responses.ResponseStreamEventUnion
	var seq []int64
	for stream.Next() {
		last = stream.Current()
		seq = append(seq, last.SequenceNumber)
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("SDK stream error: %v", err)
	}
	if last.Type != "response.incomplete" {
		t.Fatalf("last event type = %q, want response.incomplete", last.Type)
	}
	inc := last.AsResponseIncomplete()
	resp := inc.Response
	if resp.Status != "incomplete" || resp.IncompleteDetails.Reason != "max_output_tokens" {
		t.Errorf("status %q, reason %q; want incomplete, max_output_tokens", resp.Status, resp.IncompleteDetails.Reason)
	}
	if resp.ID == "" || string(resp.Model) == "" {
		t.Errorf("response id %q model %q: want those of response.created", resp.ID, resp.Model)
	}
	if resp.Usage.InputTokens != 40 || resp.Usage.OutputTokens != 7 || resp.Usage.TotalTokens != 47 ||
		resp.Usage.InputTokensDetails.CachedTokens != 3 || resp.Usage.OutputTokensDetails.ReasoningTokens != 2 {
		t.Errorf("usage = %+v", resp.Usage)
	}
	if n := len(seq); n < 2 || seq[n-1] != seq[n-2]+1 {
		t.Errorf("sequence numbers %v: the closing event must follow the last one", seq)
	}
}

// sseEvent is one parsed event: its name and its data as generic JSON.
type sseEvent struct {
	Name string
	Data any
}

// parseEvents reads closing events strictly: every line is LF- or
// CRLF-terminated as wantLE, fields are event and data only.
func parseEvents(t *testing.T, b []byte, wantLE string) []sseEvent {
	t.Helper()
	var f Framer
	f.Feed(b)
	var out []sseEvent
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		if !bytes.HasSuffix(ev, []byte(wantLE+wantLE)) || (wantLE == "\n" && bytes.Contains(ev, []byte("\r"))) {
			t.Errorf("event %q does not use line end %q", ev, wantLE)
		}
		var e sseEvent
		for line := range strings.Lines(string(ev)) {
			line = strings.TrimRight(line, "\r\n")
			switch {
			case line == "":
			case strings.HasPrefix(line, "event: "):
				e.Name = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &e.Data); err != nil {
					t.Fatalf("data is not JSON: %v: %q", err, line)
				}
			default:
				t.Fatalf("unexpected line %q", line)
			}
		}
		out = append(out, e)
	}
	if len(f.Pending()) > 0 {
		t.Errorf("incomplete closing event %q", f.Pending())
	}
	return out
}

func jsonOf(t *testing.T, s string) any {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestCloseAnthropic checks the documented Messages event sequence at a
// cut-off: content_block_stop for an open block, message_delta with
// stop_reason max_tokens, message_stop.
func TestCloseAnthropic(t *testing.T) {
	r := recordingNamed(t, "anthropic/messages-stream-tool-use-haiku")
	blockStop := sseEvent{"content_block_stop", jsonOf(t, `{"type":"content_block_stop","index":0}`)}
	delta := sseEvent{"message_delta", jsonOf(t, `{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"output_tokens":7}}`)}
	stop := sseEvent{"message_stop", jsonOf(t, `{"type":"message_stop"}`)}
	for _, tc := range []struct {
		name   string
		events int // dispatched events before the cut
		want   []sseEvent
	}{
		{"inside first text block", 4, []sseEvent{blockStop, delta, stop}},
		{"between blocks", 17, []sseEvent{delta, stop}},
		{"inside tool_use block", 19, []sseEvent{{"content_block_stop", jsonOf(t, `{"type":"content_block_stop","index":1}`)}, delta, stop}},
		{"after message_delta", 25, []sseEvent{stop}},
		{"after message_stop", 26, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, closing, _ := cutAfter(t, r, false, false, tc.events, delivered)
			if diff := cmp.Diff(tc.want, parseEvents(t, closing, "\n")); diff != "" {
				t.Errorf("closing events (-want +got):\n%s", diff)
			}
		})
	}
}

// TestCloseGemini checks the final MAX_TOKENS chunk and that it keeps the
// upstream's CRLF line ends.
func TestCloseGemini(t *testing.T) {
	r := recordingNamed(t, "gemini/stream-sse-basic")
	_, closing, _ := cutAfter(t, r, false, false, 2, delivered)
	want := []sseEvent{{"", jsonOf(t, `{"candidates":[{"content":{"parts":[{"text":""}],"role":"model"},"finishReason":"MAX_TOKENS","index":0}],
		"usageMetadata":{"promptTokenCount":40,"candidatesTokenCount":5,"thoughtsTokenCount":2,"cachedContentTokenCount":3,"totalTokenCount":47},
		"modelVersion":"gemini-2.0-flash-exp","responseId":"w1peaMz6INOvnvgPgYfPiQY"}`)}}
	if diff := cmp.Diff(want, parseEvents(t, closing, "\r\n")); diff != "" {
		t.Errorf("closing events (-want +got):\n%s", diff)
	}
	// Read back, the closing chunk reports the delivered usage.
	s := NewStream(tokenizer.Gemini, false, false)
	ev, err := s.Observe(closing)
	if err != nil || !ev.Usage || !ev.Done {
		t.Fatalf("Observe(closing) = %+v, %v; want usage and done", ev, err)
	}
	if got, _ := s.Usage(); got != delivered {
		t.Errorf("usage read back = %+v, want %+v", got, delivered)
	}
}

// TestCloseBeforeAnyEvent: a cut-off before the upstream sent anything still
// yields a well-formed end of stream.
func TestCloseBeforeAnyEvent(t *testing.T) {
	for _, tc := range []struct {
		api  tokenizer.API
		want []string // event names, or data for unnamed events
	}{
		{tokenizer.ChatCompletions, []string{`{"id":"","object":"chat.completion.chunk","created":0,"model":"","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`, "[DONE]"}},
		{tokenizer.Completions, []string{`{"id":"","object":"text_completion","created":0,"model":"","choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}]}`, "[DONE]"}},
		{tokenizer.Messages, []string{"message_start", "message_delta", "message_stop"}},
		{tokenizer.Responses, []string{"response.incomplete"}},
		{tokenizer.Gemini, []string{`{"candidates":[{"content":{"parts":[{"text":""}],"role":"model"},"finishReason":"MAX_TOKENS","index":0}],"usageMetadata":{"promptTokenCount":0,"candidatesTokenCount":0,"totalTokenCount":0}}`}},
		{tokenizer.Embeddings, nil},
	} {
		t.Run(string(tc.api), func(t *testing.T) {
			closing := NewStream(tc.api, false, false).Close(Usage{})
			var f Framer
			f.Feed(closing)
			var got []string
			for ev, ok := f.Next(); ok; ev, ok = f.Next() {
				if name, ok := bytes.CutPrefix(ev, []byte("event: ")); ok {
					got = append(got, string(name[:bytes.IndexByte(name, '\n')]))
					continue
				}
				data, _, _ := (&Stream{}).eventData(ev)
				got = append(got, string(data))
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("closing events (-want +got):\n%s", diff)
			}
		})
	}
}

// TestWithhold: an event observed but kept from the client (it crossed a
// hard budget, S14) does not shape the closing events.
func TestWithhold(t *testing.T) {
	for _, tc := range []struct {
		name   string
		api    tokenizer.API
		events []string // the last one is withheld
		want   []string // names or data of the closing events
	}{
		{
			name: "chat chunk with content and finish_reason",
			api:  tokenizer.ChatCompletions,
			events: []string{
				`data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}` + "\n\n",
				`data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}` + "\n\n",
			},
			want: []string{`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`, "[DONE]"},
		},
		{
			name: "anthropic tool_use block start",
			api:  tokenizer.Messages,
			events: []string{
				"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":3}}}\n\n",
				"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
				"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"name\":\"lookup\"}}\n\n",
			},
			want: []string{"message_delta", "message_stop"},
		},
		{
			name: "gemini finishing chunk",
			api:  tokenizer.Gemini,
			events: []string{
				"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"a\"}]}}]}\r\n\r\n",
				"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"b\"}]},\"finishReason\":\"STOP\"}]}\r\n\r\n",
			},
			want: []string{`{"candidates":[{"content":{"parts":[{"text":""}],"role":"model"},"finishReason":"MAX_TOKENS","index":0}],"usageMetadata":{"promptTokenCount":0,"candidatesTokenCount":0,"totalTokenCount":0}}`},
		},
		{
			name: "responses delta",
			api:  tokenizer.Responses,
			events: []string{
				"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"r\"}}\n\n",
				"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"x\"}\n\n",
			},
			want: []string{"response.incomplete"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStream(tc.api, false, false)
			for _, ev := range tc.events {
				if _, err := s.Observe([]byte(ev)); err != nil {
					t.Fatal(err)
				}
			}
			s.Withhold()
			s.Withhold()
			closing := s.Close(Usage{})
			var f Framer
			f.Feed(closing)
			var got []string
			for ev, ok := f.Next(); ok; ev, ok = f.Next() {
				if name, ok := bytes.CutPrefix(ev, []byte("event: ")); ok {
					got = append(got, string(name[:bytes.IndexByte(name, '\n')]))
					if tc.api == tokenizer.Responses && !bytes.Contains(ev, []byte(`"sequence_number":1,`)) {
						t.Errorf("closing event %q does not follow the last delivered sequence number 0", ev)
					}
					continue
				}
				data, _, _ := (&Stream{}).eventData(ev)
				got = append(got, string(data))
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("closing events (-want +got):\n%s", diff)
			}
		})
	}
}
