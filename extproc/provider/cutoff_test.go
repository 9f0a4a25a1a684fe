package provider

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	anthropic "github.com/anthropics/anthropic-sdk-go/v2"
	anthropicsse "github.com/anthropics/anthropic-sdk-go/v2/packages/ssestream"
	"github.com/google/go-cmp/cmp"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/responses"
	"google.golang.org/genai"

	"github.com/tokengate/tokengate/tokenizer"
)

// cutRun is what a client receives from a stream cut at a hard budget.
type cutRun struct {
	client    []byte // the bytes forwarded, then the closing events
	delivered string // the output text the client received (Event.Text)
	cut       bool
}

// cutAtBudget plays body, fed in the chunks that cuts mark, through a Framer
// and a Stream as the ext_proc server does at a hard budget (S14): events are
// forwarded until one whose output text takes the count past budget bytes;
// that one is withheld and the stream closed with the delivered usage.
func cutAtBudget(t testing.TB, api tokenizer.API, fr Framing, askUsage bool, body []byte, cuts []int, budget int) cutRun {
	t.Helper()
	var (
		f    Framer
		s    = NewFramedStream(api, fr, askUsage, false)
		out  cutRun
		text strings.Builder
	)
	f.Reset(fr)
	observe := func(ev []byte) bool {
		e, err := s.Observe(ev)
		if err != nil {
			t.Fatalf("Observe(%q): %v", ev, err)
		}
		if e.Text != "" && text.Len()+len(e.Text) > budget {
			s.Withhold()
			out.client = append(out.client, s.Close(delivered)...)
			out.cut = true
			return true
		}
		text.WriteString(e.Text)
		out.client = append(out.client, e.Forward...)
		return false
	}
	prev := 0
	for _, c := range slices.Concat(cuts, []int{len(body)}) {
		f.Feed(body[prev:c])
		prev = c
		for ev, ok := f.Next(); ok; ev, ok = f.Next() {
			if observe(ev) {
				out.delivered = text.String()
				return out
			}
		}
	}
	if tail := f.Flush(); tail != nil {
		observe(tail)
	}
	out.delivered = text.String()
	return out
}

// textBudgets returns, for each event of body that carries output text, the
// budget that cuts the stream at that event.
func textBudgets(t testing.TB, api tokenizer.API, fr Framing, body []byte) []int {
	t.Helper()
	var f Framer
	f.Reset(fr)
	f.Feed(body)
	s := NewFramedStream(api, fr, false, false)
	var budgets []int
	n := 0
	observe := func(ev []byte) {
		e, err := s.Observe(ev)
		if err != nil {
			t.Fatal(err)
		}
		if e.Text != "" {
			budgets = append(budgets, n)
			n += len(e.Text)
		}
	}
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		observe(ev)
	}
	if tail := f.Flush(); tail != nil {
		observe(tail)
	}
	return budgets
}

// sdkCheck parses what a cut-off client received with the provider's
// official SDK and checks the stream ended at a length limit with the
// content delivered.
type sdkCheck func(t *testing.T, run cutRun)

// checkChatSDK: the OpenAI SDK accumulates the chunks, every choice ends
// with finish_reason "length", and the deltas it reads are the delivered
// output.
func checkChatSDK(t *testing.T, run cutRun) {
	t.Helper()
	// The SDK's decoder dispatches comment-only blocks as empty events and
	// fails on them (router keep-alives): leave them out.
	stream := sdkStream[openai.ChatCompletionChunk](dropCommentBlocks(run.client))
	var (
		acc  openai.ChatCompletionAccumulator
		text strings.Builder
	)
	for stream.Next() {
		chunk := stream.Current()
		if !acc.AddChunk(chunk) {
			t.Fatalf("SDK accumulator refused chunk %s", chunk.RawJSON())
		}
		for _, c := range chunk.Choices {
			text.WriteString(c.Delta.Content)
			text.WriteString(c.Delta.Refusal)
			for _, tc := range c.Delta.ToolCalls {
				text.WriteString(tc.Function.Name)
				text.WriteString(tc.Function.Arguments)
			}
		}
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
	if text.String() != run.delivered {
		t.Errorf("SDK read output %q, delivered %q", text.String(), run.delivered)
	}
}

// checkCompletionsSDK: the SDK reads the legacy completion chunks, the open
// choice ends with "length", the text is the delivered output.
func checkCompletionsSDK(t *testing.T, run cutRun) {
	t.Helper()
	stream := sdkStream[openai.Completion](run.client)
	var (
		text   strings.Builder
		finish []string
	)
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			text.WriteString(c.Text)
			if c.FinishReason != "" {
				finish = append(finish, string(c.FinishReason))
			}
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("SDK stream error: %v", err)
	}
	if diff := cmp.Diff([]string{"length"}, finish); diff != "" {
		t.Errorf("finish reasons (-want +got):\n%s", diff)
	}
	if text.String() != run.delivered {
		t.Errorf("SDK read output %q, delivered %q", text.String(), run.delivered)
	}
}

// asmItem and asmPart assemble a Responses stream the way a client does.
type asmItem struct {
	typ     string
	parts   map[int64]*asmPart
	summary map[int64]*asmPart
	args    string
	done    string // raw item of output_item.done
}

type asmPart struct {
	text           string
	textEnd, ended bool
}

// checkResponsesSDK assembles a Responses stream from the SDK's events: each
// done event repeats exactly the deltas before it, every item and part that
// was opened is closed, the terminal event is response.incomplete with
// reason max_output_tokens, the delivered usage, and an output equal to the
// items delivered by output_item.done, in order.
func checkResponsesSDK(t *testing.T, run cutRun) {
	t.Helper()
	stream := sdkStream[responses.ResponseStreamEventUnion](run.client)
	var (
		items = map[int64]*asmItem{}
		order []int64
		text  strings.Builder
		seq   = int64(-1)
		last  responses.ResponseStreamEventUnion
		n     int
	)
	item := func(ev responses.ResponseStreamEventUnion) *asmItem {
		it := items[ev.OutputIndex]
		if it == nil {
			t.Fatalf("%s for output_index %d before output_item.added", ev.Type, ev.OutputIndex)
		}
		return it
	}
	part := func(ev responses.ResponseStreamEventUnion, summary bool) *asmPart {
		it := item(ev)
		ps, i := it.parts, ev.ContentIndex
		if summary {
			ps, i = it.summary, ev.SummaryIndex
		}
		if ps[i] == nil {
			ps[i] = &asmPart{}
		}
		return ps[i]
	}
	for stream.Next() {
		ev := stream.Current()
		n++
		if last.Type == "response.incomplete" {
			t.Fatalf("event %s after response.incomplete", ev.Type)
		}
		last = ev
		if ev.JSON.SequenceNumber.Valid() {
			// Older streams have no sequence numbers; the closing events
			// then number from 1.
			if seq >= 0 && ev.SequenceNumber != seq+1 {
				t.Errorf("%s has sequence_number %d after %d", ev.Type, ev.SequenceNumber, seq)
			}
			seq = ev.SequenceNumber
		}
		switch ev.Type {
		case "response.output_item.added":
			it := ev.AsResponseOutputItemAdded().Item
			items[ev.OutputIndex] = &asmItem{typ: it.Type, parts: map[int64]*asmPart{}, summary: map[int64]*asmPart{}}
			order = append(order, ev.OutputIndex)
			text.WriteString(it.Name)
		case "response.content_part.added":
			part(ev, false)
		case "response.reasoning_summary_part.added":
			part(ev, true)
		case "response.output_text.delta":
			d := ev.AsResponseOutputTextDelta().Delta
			part(ev, false).text += d
			text.WriteString(d)
		case "response.refusal.delta":
			d := ev.AsResponseRefusalDelta().Delta
			part(ev, false).text += d
			text.WriteString(d)
		case "response.reasoning_summary_text.delta":
			d := ev.AsResponseReasoningSummaryTextDelta().Delta
			part(ev, true).text += d
			text.WriteString(d)
		case "response.function_call_arguments.delta":
			d := ev.AsResponseFunctionCallArgumentsDelta().Delta
			item(ev).args += d
			text.WriteString(d)
		case "response.output_text.done", "response.refusal.done", "response.reasoning_summary_text.done":
			summary := ev.Type == "response.reasoning_summary_text.done"
			p := part(ev, summary)
			got := ev.Text
			if ev.Type == "response.refusal.done" {
				got = ev.Refusal
			}
			if got != p.text {
				t.Errorf("%s text %q, deltas %q", ev.Type, got, p.text)
			}
			p.textEnd = true
		case "response.content_part.done", "response.reasoning_summary_part.done":
			summary := ev.Type == "response.reasoning_summary_part.done"
			p := part(ev, summary)
			got := ev.Part.Text
			if ev.Part.Type == "refusal" {
				got = ev.Part.Refusal
			}
			if got != p.text || !p.textEnd {
				t.Errorf("%s part %q (text ended %v), deltas %q", ev.Type, got, p.textEnd, p.text)
			}
			p.ended = true
		case "response.function_call_arguments.done":
			if got, it := ev.AsResponseFunctionCallArgumentsDone().Arguments, item(ev); got != it.args {
				t.Errorf("arguments %q, deltas %q", got, it.args)
			}
		case "response.output_item.done":
			it := item(ev)
			done := ev.AsResponseOutputItemDone().Item
			checkItem(t, it, done)
			it.done = done.RawJSON()
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("SDK stream error after %d events: %v", n, err)
	}
	if last.Type != "response.incomplete" {
		t.Fatalf("last event %q, want response.incomplete", last.Type)
	}
	resp := last.AsResponseIncomplete().Response
	if resp.Status != "incomplete" || resp.IncompleteDetails.Reason != "max_output_tokens" {
		t.Errorf("status %q, reason %q; want incomplete, max_output_tokens", resp.Status, resp.IncompleteDetails.Reason)
	}
	if resp.ID == "" || resp.Model == "" || resp.CreatedAt == 0 {
		t.Errorf("response id %q, model %q, created_at %v: want those of response.created", resp.ID, resp.Model, resp.CreatedAt)
	}
	if u := resp.Usage; u.InputTokens != 40 || u.OutputTokens != 7 || u.TotalTokens != 47 ||
		u.InputTokensDetails.CachedTokens != 3 || u.OutputTokensDetails.ReasoningTokens != 2 {
		t.Errorf("usage = %s", u.RawJSON())
	}
	if len(resp.Output) != len(order) {
		t.Fatalf("response.incomplete has %d output items, %d were delivered", len(resp.Output), len(order))
	}
	var outputText strings.Builder
	for k, i := range order {
		it := items[i]
		if it.done == "" {
			t.Errorf("item %d (%s) was never closed with output_item.done", i, it.typ)
			continue
		}
		if diff := cmp.Diff(jsonValue(t, it.done), jsonValue(t, resp.Output[k].RawJSON())); diff != "" {
			t.Errorf("output[%d] differs from its output_item.done (-done +incomplete):\n%s", k, diff)
		}
		if it.typ == "message" {
			for _, c := range resp.Output[k].Content {
				outputText.WriteString(c.Text)
			}
		}
	}
	if got := resp.OutputText(); got != outputText.String() {
		t.Errorf("OutputText() = %q, want the delivered message text %q", got, outputText.String())
	}
	if text.String() != run.delivered {
		t.Errorf("SDK read output %q, delivered %q", text.String(), run.delivered)
	}
}

// checkItem checks that an item as output_item.done reports it holds the
// deltas delivered for it, and that every part opened was closed.
func checkItem(t *testing.T, it *asmItem, done responses.ResponseOutputItemUnion) {
	t.Helper()
	if done.Type != it.typ {
		t.Errorf("output_item.done type %q, added as %q", done.Type, it.typ)
	}
	if done.Status == "in_progress" {
		t.Errorf("%s item done with status in_progress", done.Type)
	}
	switch done.Type {
	case "message":
		if len(done.Content) != len(it.parts) {
			t.Errorf("message done with %d parts, %d were added", len(done.Content), len(it.parts))
		}
		for k, c := range done.Content {
			p := it.parts[int64(k)]
			got := c.Text
			if c.Type == "refusal" {
				got = c.Refusal
			}
			if p == nil || got != p.text || !p.ended {
				t.Errorf("message part %d = %q, deltas %+v", k, got, p)
			}
		}
	case "function_call":
		if done.Arguments != it.args {
			t.Errorf("function_call done with arguments %q, deltas %q", done.Arguments, it.args)
		}
	case "reasoning":
		if len(done.Summary) != len(it.summary) {
			t.Errorf("reasoning done with %d summary parts, %d were added", len(done.Summary), len(it.summary))
		}
		for k, sm := range done.Summary {
			if p := it.summary[int64(k)]; p == nil || sm.Text != p.text || !p.ended {
				t.Errorf("summary part %d = %q, deltas %+v", k, sm.Text, p)
			}
		}
	}
}

func jsonValue(t *testing.T, s string) any {
	t.Helper()
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		t.Fatalf("not JSON: %v: %s", err, s)
	}
	return v
}

// checkAnthropicSDK: the Anthropic SDK accumulates the events into a
// Message whose stop_reason is max_tokens, whose usage is the delivered one,
// and whose content is the delivered output.
func checkAnthropicSDK(t *testing.T, run cutRun) {
	t.Helper()
	res := &http.Response{
		StatusCode: http.StatusOK,
		Header:     http.Header{"Content-Type": []string{"text/event-stream"}},
		Body:       io.NopCloser(bytes.NewReader(run.client)),
	}
	stream := anthropicsse.NewStream[anthropic.MessageStreamEventUnion](anthropicsse.NewDecoder(res), nil)
	var (
		msg    anthropic.Message
		last   string
		text   strings.Builder
		blocks = map[int64]string{} // text and thinking deltas per block
	)
	for stream.Next() {
		ev := stream.Current()
		if err := msg.Accumulate(ev); err != nil {
			t.Fatalf("Accumulate(%s): %v", ev.Type, err)
		}
		last = ev.Type
		switch ev.Type {
		case "content_block_start":
			b := ev.ContentBlock
			text.WriteString(b.Text + b.Thinking + b.Name)
			blocks[ev.Index] = b.Text + b.Thinking
		case "content_block_delta":
			d := ev.Delta
			text.WriteString(d.Text + d.Thinking + d.PartialJSON)
			blocks[ev.Index] += d.Text + d.Thinking
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("SDK stream error: %v", err)
	}
	if last != "message_stop" {
		t.Errorf("last event %q, want message_stop", last)
	}
	if msg.StopReason != anthropic.StopReasonMaxTokens {
		t.Errorf("stop_reason %q, want max_tokens", msg.StopReason)
	}
	if msg.Usage.OutputTokens != int64(delivered.OutputTokens) {
		t.Errorf("usage output_tokens %d, want %d", msg.Usage.OutputTokens, delivered.OutputTokens)
	}
	if len(msg.Content) != len(blocks) {
		t.Errorf("message has %d content blocks, %d were started", len(msg.Content), len(blocks))
	}
	for k, b := range msg.Content {
		if got := b.Text + b.Thinking; got != blocks[int64(k)] {
			t.Errorf("block %d holds %q, deltas %q", k, got, blocks[int64(k)])
		}
	}
	// A tool call cut mid-input is left with input {} by the SDK, by
	// design; the events still carried what was delivered.
	if text.String() != run.delivered {
		t.Errorf("SDK read output %q, delivered %q", text.String(), run.delivered)
	}
}

// geminiOutput checks the chunks a Gemini client read: the last one ends
// every candidate with MAX_TOKENS and reports the delivered usage, and the
// parts are the delivered output.
func geminiOutput(t *testing.T, run cutRun, chunks []*genai.GenerateContentResponse) {
	t.Helper()
	if len(chunks) == 0 {
		t.Fatal("no chunks")
	}
	var text strings.Builder
	for _, c := range chunks {
		for _, cand := range c.Candidates {
			if cand.Content == nil {
				continue
			}
			for _, p := range cand.Content.Parts {
				text.WriteString(p.Text)
				if p.FunctionCall != nil {
					text.WriteString(p.FunctionCall.Name)
				}
			}
		}
	}
	last := chunks[len(chunks)-1]
	if len(last.Candidates) == 0 {
		t.Fatal("last chunk has no candidate")
	}
	for _, cand := range last.Candidates {
		if cand.FinishReason != genai.FinishReasonMaxTokens {
			t.Errorf("candidate %d finishReason %q, want MAX_TOKENS", cand.Index, cand.FinishReason)
		}
	}
	u := last.UsageMetadata
	if u == nil || u.PromptTokenCount != 40 || u.CandidatesTokenCount+u.ThoughtsTokenCount != 7 || u.TotalTokenCount != 47 {
		t.Errorf("usageMetadata = %+v, want the delivered 40 + 7", u)
	}
	if text.String() != run.delivered {
		t.Errorf("SDK read output %q, delivered %q", text.String(), run.delivered)
	}
}

// checkGeminiSSE reads the stream with the genai client's own stream
// reader, served from a local test server.
func checkGeminiSSE(t *testing.T, run cutRun) {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		if _, err := w.Write(run.client); err != nil {
			t.Errorf("serving the stream: %v", err)
		}
	}))
	defer srv.Close()
	ctx := t.Context()
	client, err := genai.NewClient(ctx, &genai.ClientConfig{
		APIKey:      "test-key",
		Backend:     genai.BackendGeminiAPI,
		HTTPOptions: genai.HTTPOptions{BaseURL: srv.URL},
	})
	if err != nil {
		t.Fatal(err)
	}
	var chunks []*genai.GenerateContentResponse
	for resp, err := range client.Models.GenerateContentStream(ctx, "gemini-2.0-flash", genai.Text("hi"), nil) {
		if err != nil {
			t.Fatalf("genai stream: %v", err)
		}
		chunks = append(chunks, resp)
	}
	geminiOutput(t, run, chunks)
}

// checkGeminiArray: the client's bytes are one JSON array; each element
// decodes into genai.GenerateContentResponse. (The genai client always asks
// for alt=sse and has no reader for the array form.)
func checkGeminiArray(t *testing.T, run cutRun) {
	t.Helper()
	var elems []json.RawMessage
	if err := json.Unmarshal(run.client, &elems); err != nil {
		t.Fatalf("client body is not a JSON array: %v\n%s", err, run.client)
	}
	chunks := make([]*genai.GenerateContentResponse, len(elems))
	for k, e := range elems {
		chunks[k] = new(genai.GenerateContentResponse)
		if err := json.Unmarshal(e, chunks[k]); err != nil {
			t.Fatalf("element %d: %v", k, err)
		}
	}
	geminiOutput(t, run, chunks)
}

// cutFormat is one wire format: how to frame it and how its SDK checks a
// cut-off.
type cutFormat struct {
	api     tokenizer.API
	framing Framing
	check   sdkCheck
}

func formatOf(r recording) cutFormat {
	fr := SSE
	if !r.sse {
		fr = JSONArray
	}
	switch r.api {
	case tokenizer.ChatCompletions:
		return cutFormat{r.api, fr, checkChatSDK}
	case tokenizer.Completions:
		return cutFormat{r.api, fr, checkCompletionsSDK}
	case tokenizer.Responses:
		return cutFormat{r.api, fr, checkResponsesSDK}
	case tokenizer.Messages:
		return cutFormat{r.api, fr, checkAnthropicSDK}
	case tokenizer.Gemini:
		if fr == JSONArray {
			return cutFormat{r.api, fr, checkGeminiArray}
		}
		return cutFormat{r.api, fr, checkGeminiSSE}
	}
	return cutFormat{}
}

// cutRecordings are the recorded streams a cut-off applies to: every SSE
// stream and the Gemini JSON array.
func cutRecordings(t *testing.T) []recording {
	recs := streamRecordings(t)
	for _, r := range loadRecordings(t) {
		if r.name == "gemini/stream-json-array" {
			recs = append(recs, r)
		}
	}
	return recs
}

// TestCutEveryEventSDK cuts every recorded stream at each event that
// carries output (S14) and has the provider's official SDK read what the
// client receives.
func TestCutEveryEventSDK(t *testing.T) {
	for _, r := range cutRecordings(t) {
		if strings.Contains(r.name, "error-midstream") || r.name == "openai/chat-stream-include-usage-length" {
			// One ends with an error event; the other spent its output on
			// hidden reasoning and carries no text to cut at.
			continue
		}
		format := formatOf(r)
		t.Run(r.name, func(t *testing.T) {
			budgets := textBudgets(t, format.api, format.framing, r.body)
			if len(budgets) == 0 {
				t.Fatal("no event carries output")
			}
			for _, b := range budgets {
				run := cutAtBudget(t, format.api, format.framing, r.askUsage, r.body, nil, b)
				if !run.cut {
					t.Fatalf("budget %d: not cut", b)
				}
				t.Run(fmt.Sprintf("budget %d", b), func(t *testing.T) { format.check(t, run) })
			}
		})
	}
}

// TestCutEverySplit cuts one recording per format in the middle of its
// output, with the body fed in two chunks split at every byte and in
// one-byte chunks: the client receives the same bytes as from the whole
// body, and the SDK reads them.
func TestCutEverySplit(t *testing.T) {
	for _, name := range []string{
		"openai/chat-stream-gpt-4o-mini",
		"openai/completions-stream-no-usage",
		"openai/responses-stream-basic",
		"anthropic/messages-stream-text",
		"gemini/stream-sse-basic",
		"gemini/stream-json-array",
	} {
		t.Run(name, func(t *testing.T) {
			var r recording
			for _, c := range cutRecordings(t) {
				if c.name == name {
					r = c
				}
			}
			format := formatOf(r)
			budgets := textBudgets(t, format.api, format.framing, r.body)
			budget := budgets[len(budgets)/2]
			whole := cutAtBudget(t, format.api, format.framing, r.askUsage, r.body, nil, budget)
			if !whole.cut {
				t.Fatal("not cut")
			}
			format.check(t, whole)
			for k := 1; k < len(r.body); k++ {
				got := cutAtBudget(t, format.api, format.framing, r.askUsage, r.body, []int{k}, budget)
				if !bytes.Equal(got.client, whole.client) || got.delivered != whole.delivered {
					t.Fatalf("split at byte %d: client receives\n%q\nwant\n%q", k, got.client, whole.client)
				}
			}
			got := cutAtBudget(t, format.api, format.framing, r.askUsage, r.body, fixedCuts(len(r.body), 1), budget)
			if !bytes.Equal(got.client, whole.client) {
				t.Fatalf("one-byte chunks: client receives\n%q\nwant\n%q", got.client, whole.client)
			}
		})
	}
}

// responsesOpenItems is a Responses stream, shaped as the API documents
// its events, with a reasoning summary, a message of two text parts (the
// first annotated) and a refusal, and a function call.
const responsesOpenItems = `event: response.created
data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","created_at":1750000000,"status":"in_progress","instructions":null,"model":"gpt-5","output":[],"parallel_tool_calls":true,"tool_choice":"auto","tools":[],"usage":null,"metadata":{}}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[]}}

event: response.reasoning_summary_part.added
data: {"type":"response.reasoning_summary_part.added","sequence_number":2,"item_id":"rs_1","output_index":0,"summary_index":0,"part":{"type":"summary_text","text":""}}

event: response.reasoning_summary_text.delta
data: {"type":"response.reasoning_summary_text.delta","sequence_number":3,"item_id":"rs_1","output_index":0,"summary_index":0,"delta":"Think"}

event: response.reasoning_summary_text.delta
data: {"type":"response.reasoning_summary_text.delta","sequence_number":4,"item_id":"rs_1","output_index":0,"summary_index":0,"delta":"ing \"hard\""}

event: response.reasoning_summary_text.done
data: {"type":"response.reasoning_summary_text.done","sequence_number":5,"item_id":"rs_1","output_index":0,"summary_index":0,"text":"Thinking \"hard\""}

event: response.reasoning_summary_part.done
data: {"type":"response.reasoning_summary_part.done","sequence_number":6,"item_id":"rs_1","output_index":0,"summary_index":0,"part":{"type":"summary_text","text":"Thinking \"hard\""}}

event: response.output_item.done
data: {"type":"response.output_item.done","sequence_number":7,"output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[{"type":"summary_text","text":"Thinking \"hard\""}]}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":8,"output_index":1,"item":{"id":"msg_1","type":"message","status":"in_progress","content":[],"role":"assistant"}}

event: response.content_part.added
data: {"type":"response.content_part.added","sequence_number":9,"item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","annotations":[],"logprobs":[],"text":""}}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":10,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"Paris \u00e9t\u00e9","logprobs":[]}

event: response.output_text.annotation.added
data: {"type":"response.output_text.annotation.added","sequence_number":11,"item_id":"msg_1","output_index":1,"content_index":0,"annotation_index":0,"annotation":{"type":"url_citation","start_index":0,"end_index":5,"title":"Paris","url":"https://example.org/paris"}}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":12,"item_id":"msg_1","output_index":1,"content_index":0,"delta":" is big.\n","logprobs":[]}

event: response.output_text.done
data: {"type":"response.output_text.done","sequence_number":13,"item_id":"msg_1","output_index":1,"content_index":0,"text":"Paris \u00e9t\u00e9 is big.\n","logprobs":[]}

event: response.content_part.done
data: {"type":"response.content_part.done","sequence_number":14,"item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","annotations":[{"type":"url_citation","start_index":0,"end_index":5,"title":"Paris","url":"https://example.org/paris"}],"logprobs":[],"text":"Paris \u00e9t\u00e9 is big.\n"}}

event: response.content_part.added
data: {"type":"response.content_part.added","sequence_number":15,"item_id":"msg_1","output_index":1,"content_index":1,"part":{"type":"output_text","annotations":[],"logprobs":[],"text":""}}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":16,"item_id":"msg_1","output_index":1,"content_index":1,"delta":"It has ","logprobs":[]}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":17,"item_id":"msg_1","output_index":1,"content_index":1,"delta":"many","logprobs":[]}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":18,"item_id":"msg_1","output_index":1,"content_index":1,"delta":" 😀 cafés.","logprobs":[]}

event: response.output_text.done
data: {"type":"response.output_text.done","sequence_number":19,"item_id":"msg_1","output_index":1,"content_index":1,"text":"It has many 😀 cafés.","logprobs":[]}

event: response.content_part.done
data: {"type":"response.content_part.done","sequence_number":20,"item_id":"msg_1","output_index":1,"content_index":1,"part":{"type":"output_text","annotations":[],"logprobs":[],"text":"It has many 😀 cafés."}}

event: response.content_part.added
data: {"type":"response.content_part.added","sequence_number":21,"item_id":"msg_1","output_index":1,"content_index":2,"part":{"type":"refusal","refusal":""}}

event: response.refusal.delta
data: {"type":"response.refusal.delta","sequence_number":22,"item_id":"msg_1","output_index":1,"content_index":2,"delta":"No more."}

event: response.refusal.done
data: {"type":"response.refusal.done","sequence_number":23,"item_id":"msg_1","output_index":1,"content_index":2,"refusal":"No more."}

event: response.content_part.done
data: {"type":"response.content_part.done","sequence_number":24,"item_id":"msg_1","output_index":1,"content_index":2,"part":{"type":"refusal","refusal":"No more."}}

event: response.output_item.done
data: {"type":"response.output_item.done","sequence_number":25,"output_index":1,"item":{"id":"msg_1","type":"message","status":"completed","content":[{"type":"output_text","annotations":[{"type":"url_citation","start_index":0,"end_index":5,"title":"Paris","url":"https://example.org/paris"}],"logprobs":[],"text":"Paris \u00e9t\u00e9 is big.\n"},{"type":"output_text","annotations":[],"logprobs":[],"text":"It has many 😀 cafés."},{"type":"refusal","refusal":"No more."}],"role":"assistant"}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":26,"output_index":2,"item":{"id":"fc_1","type":"function_call","status":"in_progress","arguments":"","call_id":"call_1","name":"lookup"}}

event: response.function_call_arguments.delta
data: {"type":"response.function_call_arguments.delta","sequence_number":27,"item_id":"fc_1","output_index":2,"delta":"{\"city\":"}

event: response.function_call_arguments.delta
data: {"type":"response.function_call_arguments.delta","sequence_number":28,"item_id":"fc_1","output_index":2,"delta":"\"Paris\"}"}

event: response.function_call_arguments.done
data: {"type":"response.function_call_arguments.done","sequence_number":29,"item_id":"fc_1","output_index":2,"arguments":"{\"city\":\"Paris\"}"}

event: response.output_item.done
data: {"type":"response.output_item.done","sequence_number":30,"output_index":2,"item":{"id":"fc_1","type":"function_call","status":"completed","arguments":"{\"city\":\"Paris\"}","call_id":"call_1","name":"lookup"}}

event: response.completed
data: {"type":"response.completed","sequence_number":31,"response":{"id":"resp_1","object":"response","created_at":1750000000,"status":"completed","model":"gpt-5","output":[],"usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":30,"output_tokens_details":{"reasoning_tokens":10},"total_tokens":39}}}

`

// TestCutResponsesOpenItems cuts a Responses stream with several item and
// part kinds at every event that carries output, in one-byte chunks, and
// checks with the SDK that each open part and item is closed with the text
// delivered and that response.incomplete repeats the whole output.
func TestCutResponsesOpenItems(t *testing.T) {
	body := []byte(responsesOpenItems)
	whole := play(tokenizer.Responses, false, false, body, nil)
	if len(whole.Errors) > 0 || whole.Done != 1 {
		t.Fatalf("the stream does not read cleanly: errors %q, done %d", whole.Errors, whole.Done)
	}
	for _, b := range textBudgets(t, tokenizer.Responses, SSE, body) {
		t.Run(fmt.Sprintf("budget %d", b), func(t *testing.T) {
			run := cutAtBudget(t, tokenizer.Responses, SSE, false, body, fixedCuts(len(body), 1), b)
			if !run.cut {
				t.Fatal("not cut")
			}
			checkResponsesSDK(t, run)
		})
	}
}

// TestCutResponsesOutput spells out the closing events of a cut inside the
// second text part of a message: the part's text done events carry the
// text delivered, the message is done with status incomplete, and
// response.incomplete keeps the created response's fields and lists the
// reasoning item and the message.
func TestCutResponsesOutput(t *testing.T) {
	body := []byte(responsesOpenItems)
	// Cut at " 😀 cafés.": "It has many" was delivered.
	budget := len("Thinking \"hard\"") + len("Paris été is big.\n") + len("It has many")
	run := cutAtBudget(t, tokenizer.Responses, SSE, false, body, nil, budget)
	msg := `{"id":"msg_1","type":"message","status":"incomplete","content":[` +
		`{"type":"output_text","annotations":[{"type":"url_citation","start_index":0,"end_index":5,"title":"Paris","url":"https://example.org/paris"}],"logprobs":[],"text":"Paris \u00e9t\u00e9 is big.\n"},` +
		`{"type":"output_text","annotations":[],"logprobs":[],"text":"It has many"}],"role":"assistant"}`
	want := []sseEvent{
		{"response.output_text.done", jsonOf(t, `{"type":"response.output_text.done","sequence_number":18,"item_id":"msg_1","output_index":1,"content_index":1,"text":"It has many","logprobs":[]}`)},
		{"response.content_part.done", jsonOf(t, `{"type":"response.content_part.done","sequence_number":19,"item_id":"msg_1","output_index":1,"content_index":1,"part":{"type":"output_text","annotations":[],"logprobs":[],"text":"It has many"}}`)},
		{"response.output_item.done", jsonOf(t, `{"type":"response.output_item.done","sequence_number":20,"output_index":1,"item":`+msg+`}`)},
		{"response.incomplete", jsonOf(t, `{"type":"response.incomplete","sequence_number":21,"response":{"id":"resp_1","object":"response","created_at":1750000000,"status":"incomplete","instructions":null,"model":"gpt-5",`+
			`"output":[{"id":"rs_1","type":"reasoning","summary":[{"type":"summary_text","text":"Thinking \"hard\""}]},`+msg+`],`+
			`"parallel_tool_calls":true,"tool_choice":"auto","tools":[],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":3},"output_tokens":7,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":47},"metadata":{},"incomplete_details":{"reason":"max_output_tokens"}}}`)},
	}
	closing := run.client[bytes.Index(run.client, []byte("event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"sequence_number\":18")):]
	if diff := cmp.Diff(want, parseEvents(t, closing, "\n")); diff != "" {
		t.Errorf("closing events (-want +got):\n%s", diff)
	}
	checkResponsesSDK(t, run)
}

// TestResponsesKeptOutputBound: past maxKeptOutput bytes of output a
// Responses stream keeps nothing more, and a cut-off still ends it with a
// response.incomplete the SDK reads, its output empty.
func TestResponsesKeptOutputBound(t *testing.T) {
	s := NewStream(tokenizer.Responses, false, false)
	obs := func(ev string) {
		t.Helper()
		if _, err := s.Observe([]byte(ev)); err != nil {
			t.Fatal(err)
		}
	}
	obs("event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"created_at\":1,\"model\":\"m\",\"output\":[]}}\n\n")
	obs("event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"sequence_number\":1,\"output_index\":0,\"item\":{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"in_progress\",\"content\":[],\"role\":\"assistant\"}}\n\n")
	obs("event: response.content_part.added\ndata: {\"type\":\"response.content_part.added\",\"sequence_number\":2,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"annotations\":[],\"text\":\"\"}}\n\n")
	delta := strings.Repeat("x", 64<<10)
	seq := 3
	for ; s.resp.kept <= maxKeptOutput-len(delta); seq++ {
		obs(fmt.Sprintf("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":%q}\n\n", seq, delta))
		if s.resp.over {
			t.Fatalf("gave up keeping at %d bytes, below the bound", s.resp.kept)
		}
	}
	obs(fmt.Sprintf("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":%q}\n\n", seq, delta))
	if !s.resp.over || s.resp.kept != 0 || s.resp.items != nil {
		t.Fatalf("past the bound: over %v, kept %d, %d items; want nothing kept", s.resp.over, s.resp.kept, len(s.resp.items))
	}
	stream := sdkStream[responses.ResponseStreamEventUnion](s.Close(delivered))
	var evs []string
	var last responses.ResponseStreamEventUnion
	for stream.Next() {
		last = stream.Current()
		evs = append(evs, last.Type)
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	resp := last.AsResponseIncomplete().Response
	if diff := cmp.Diff([]string{"response.incomplete"}, evs); diff != "" || resp.ID != "resp_1" || len(resp.Output) != 0 ||
		resp.IncompleteDetails.Reason != "max_output_tokens" || last.SequenceNumber != int64(seq+1) {
		t.Errorf("closing events %v (-want +got):\n%s\nresponse %s", evs, diff, resp.RawJSON())
	}
}

// TestResponsesWithholdRestoresOutput: an event withheld at the budget does
// not reach the output the closing events repeat, whatever it changed.
func TestResponsesWithholdRestoresOutput(t *testing.T) {
	body := []byte(responsesOpenItems)
	var f Framer
	f.Feed(body)
	var events [][]byte
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		events = append(events, bytes.Clone(ev))
	}
	for n := 1; n < len(events); n++ {
		// Close after n events, and after n+1 events with the last withheld:
		// the two must end the stream the same way.
		a := NewStream(tokenizer.Responses, false, false)
		b := NewStream(tokenizer.Responses, false, false)
		for k, ev := range events[:n+1] {
			if k < n {
				if _, err := a.Observe(ev); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := b.Observe(ev); err != nil {
				t.Fatal(err)
			}
		}
		b.Withhold()
		if got, want := b.Close(delivered), a.Close(delivered); !bytes.Equal(got, want) {
			t.Fatalf("withholding event %d %q:\nclosing %q\nwant %q", n, events[n], got, want)
		}
	}
}

// TestFramingOf: how the processor decides a response is a stream.
func TestFramingOf(t *testing.T) {
	for _, tc := range []struct {
		api               tokenizer.API
		path, contentType string
		want              Framing
	}{
		{tokenizer.ChatCompletions, "/v1/chat/completions", "text/event-stream; charset=utf-8", SSE},
		{tokenizer.ChatCompletions, "/v1/chat/completions", "Text/Event-Stream", SSE},
		{tokenizer.ChatCompletions, "/v1/chat/completions", "application/json", Unframed},
		{tokenizer.Gemini, "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", "text/event-stream", SSE},
		{tokenizer.Gemini, "/v1beta/models/gemini-flash-latest:streamGenerateContent", "application/json; charset=UTF-8", JSONArray},
		{tokenizer.Gemini, "/v1beta/models/gemini-flash-latest:streamGenerateContent?key=k", "application/json", JSONArray},
		{tokenizer.Gemini, "/v1beta/models/gemini-flash-latest:generateContent", "application/json", Unframed},
		{tokenizer.Gemini, "/v1beta/models/gemini-flash-latest:streamGenerateContent", "text/html", Unframed},
		{tokenizer.Gemini, "/v1beta/models/gemini-flash-latest:streamGenerateContent", "", Unframed},
	} {
		if got := FramingOf(tc.api, tc.path, tc.contentType); got != tc.want {
			t.Errorf("FramingOf(%s, %q, %q) = %d, want %d", tc.api, tc.path, tc.contentType, got, tc.want)
		}
	}
}

// TestCloseGeminiArray spells out the end of a cut JSON array at each
// point: before anything was delivered, after elements, after every
// candidate finished, and after the closing bracket.
func TestCloseGeminiArray(t *testing.T) {
	chunk := `{"candidates":[{"content":{"parts":[{"text":""}],"role":"model"},"finishReason":"MAX_TOKENS","index":0}],"usageMetadata":{"promptTokenCount":40,"candidatesTokenCount":5,"thoughtsTokenCount":2,"cachedContentTokenCount":3,"totalTokenCount":47}}`
	for _, tc := range []struct {
		name   string
		events []string
		want   string
	}{
		{"nothing delivered", nil, "[" + chunk + "\n]"},
		{"opening bracket with element", []string{`[{"candidates":[{"content":{"parts":[{"text":"a"}]}}]}`}, "\n,\r\n" + chunk + "\n]"},
		{"every candidate finished", []string{`[{"candidates":[{"content":{"parts":[{"text":"a"}]},"finishReason":"STOP"}]}`}, "\n]"},
		{"closed", []string{`[{"candidates":[{"content":{"parts":[{"text":"a"}]},"finishReason":"STOP"}]}`, "\n]"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewFramedStream(tokenizer.Gemini, JSONArray, false, false)
			var client []byte
			for _, ev := range tc.events {
				e, err := s.Observe([]byte(ev))
				if err != nil {
					t.Fatal(err)
				}
				client = append(client, e.Forward...)
			}
			closing := s.Close(delivered)
			if string(closing) != tc.want {
				t.Errorf("Close = %q, want %q", closing, tc.want)
			}
			if client = append(client, closing...); !json.Valid(client) {
				t.Errorf("client body is not JSON: %q", client)
			}
		})
	}
}

// TestFramerJSONArray frames a JSON array fed in steps.
func TestFramerJSONArray(t *testing.T) {
	type step struct {
		feed    string
		events  []string
		pending string
	}
	for _, tc := range []struct {
		name  string
		steps []step
		flush string
	}{
		{
			name: "elements with Gemini's separators",
			steps: []step{
				{feed: "[{\"a\":[1,{\"b\":\"}]\"}]}", events: []string{"[{\"a\":[1,{\"b\":\"}]\"}]}"}},
				{feed: "\n,\r\n{\"c\":\"x\\\"", pending: "\n,\r\n{\"c\":\"x\\\""},
				{feed: "}\"}", events: []string{"\n,\r\n{\"c\":\"x\\\"}\"}"}},
				{feed: "\n]", events: []string{"\n]"}},
				{feed: "\n", pending: "\n"},
			},
			flush: "\n",
		},
		{
			name: "escaped backslash before a quote, split",
			steps: []step{
				{feed: `[{"a":"\\`, pending: `[{"a":"\\`},
				{feed: `"}`, events: []string{`[{"a":"\\"}`}},
				{feed: `]`, events: []string{`]`}},
			},
		},
		{
			name:  "empty array",
			steps: []step{{feed: " [ ] ", events: []string{" [ ]"}, pending: " "}},
			flush: " ",
		},
		{
			name:  "a top-level object is one event",
			steps: []step{{feed: `{"candidates":[{"a":1}],"b":{}}`, events: []string{`{"candidates":[{"a":1}],"b":{}}`}}},
		},
		{
			name:  "scalars stay with the next element",
			steps: []step{{feed: `[1,"]",{}]`, events: []string{`[1,"]",{}`, `]`}}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f Framer
			f.Reset(JSONArray)
			for i, st := range tc.steps {
				f.Feed([]byte(st.feed))
				var got []string
				for ev, ok := f.Next(); ok; ev, ok = f.Next() {
					got = append(got, string(ev))
				}
				if diff := cmp.Diff(st.events, got); diff != "" {
					t.Errorf("step %d: events (-want +got):\n%s", i, diff)
				}
				if p := string(f.Pending()); p != st.pending {
					t.Errorf("step %d: Pending() = %q, want %q", i, p, st.pending)
				}
			}
			if got := string(f.Flush()); got != tc.flush {
				t.Errorf("Flush() = %q, want %q", got, tc.flush)
			}
		})
	}
}

// TestGeminiArrayRecording replays the recorded JSON array in every chunk
// size from 1 to 64 bytes: the elements, text and usage do not depend on
// chunking, the bytes forwarded are the body, and the usage is meta.json's.
func TestGeminiArrayRecording(t *testing.T) {
	var r recording
	for _, c := range loadRecordings(t) {
		if c.name == "gemini/stream-json-array" {
			r = c
		}
	}
	playArray := func(cuts []int) (events []string, forwarded []byte, text string, u Usage, done int) {
		var f Framer
		f.Reset(JSONArray)
		s := NewFramedStream(tokenizer.Gemini, JSONArray, false, false)
		var b strings.Builder
		observe := func(ev []byte) {
			events = append(events, string(ev))
			e, err := s.Observe(ev)
			if err != nil {
				t.Fatalf("Observe(%q): %v", ev, err)
			}
			forwarded = append(forwarded, e.Forward...)
			b.WriteString(e.Text)
			if e.Done {
				done++
			}
		}
		prev := 0
		for _, c := range slices.Concat(cuts, []int{len(r.body)}) {
			f.Feed(r.body[prev:c])
			prev = c
			for ev, ok := f.Next(); ok; ev, ok = f.Next() {
				observe(ev)
			}
		}
		if tail := f.Flush(); tail != nil {
			observe(tail)
		}
		u, _ = s.Usage()
		return events, forwarded, b.String(), u, done
	}
	events, forwarded, text, u, done := playArray(nil)
	if len(events) != 4 || done != 1 {
		t.Errorf("%d events (3 elements and the closing bracket), %d done; want 4 and 1", len(events), done)
	}
	if !bytes.Equal(forwarded, r.body) || text == "" {
		t.Errorf("forwarded %d of %d bytes, text %q", len(forwarded), len(r.body), text)
	}
	if diff := cmp.Diff(r.meta.UsageNormalized.usage(), u, notNormalized); diff != "" {
		t.Errorf("usage (-meta +got):\n%s", diff)
	}
	for size := 1; size <= 64; size++ {
		e2, _, t2, u2, _ := playArray(fixedCuts(len(r.body), size))
		if !cmp.Equal(events, e2) || t2 != text || u2 != u {
			t.Fatalf("chunk size %d changes the replay", size)
		}
	}
}

// FuzzFramerJSONArray feeds arbitrary bytes in arbitrary chunks to a Framer
// framing a JSON array: it never panics, the events followed by the pending
// tail re-join to the input, each event ends with a closing bracket or
// brace, and the events do not depend on the chunking.
func FuzzFramerJSONArray(f *testing.F) {
	f.Add([]byte("[{\"a\":\"}\\\"]\"}\n,\r\n{\"b\":[1]}\n]"), []byte{1, 2, 3})
	f.Add([]byte(`]]}{"x":[[[`), []byte{0})
	f.Fuzz(func(t *testing.T, stream, sizes []byte) {
		frame := func(cuts []byte) (events [][]byte, tail []byte) {
			var fr Framer
			fr.Reset(JSONArray)
			rest := stream
			for k := 0; len(rest) > 0; k++ {
				n := len(rest)
				if len(cuts) > 0 {
					n = min(n, 1+int(cuts[k%len(cuts)]))
				}
				fr.Feed(rest[:n])
				rest = rest[n:]
				for ev, ok := fr.Next(); ok; ev, ok = fr.Next() {
					events = append(events, bytes.Clone(ev))
				}
			}
			return events, bytes.Clone(fr.Flush())
		}
		whole, wholeTail := frame(nil)
		events, tail := frame(sizes)
		var joined []byte
		for _, ev := range events {
			if c := ev[len(ev)-1]; c != '}' && c != ']' {
				t.Fatalf("event %q does not end with a closing bracket", ev)
			}
			joined = append(joined, ev...)
		}
		if joined = append(joined, tail...); !bytes.Equal(joined, stream) {
			t.Fatalf("events re-join to %q, want %q", joined, stream)
		}
		if !cmp.Equal(whole, events) || !bytes.Equal(wholeTail, tail) {
			t.Fatalf("chunking changed the events:\nwhole %q + %q\nchunked %q + %q", whole, wholeTail, events, tail)
		}
	})
}

// FuzzCloseResponses observes an arbitrary Responses event stream, cuts it
// after an arbitrary event (withheld or not) and checks that every closing
// event is one JSON object the SDK decodes, of a response.* type.
func FuzzCloseResponses(f *testing.F) {
	f.Add([]byte(responsesOpenItems), uint8(12), true)
	f.Add([]byte(responsesOpenItems), uint8(17), false)
	f.Add([]byte("event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"output_index\":0,\"item\":{\"type\":\"message\",\"id\":\"m\"}}\n\ndata: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"content_index\":3,\"delta\":\"\\ud83d\"}\n\n"), uint8(2), false)
	f.Fuzz(func(t *testing.T, stream []byte, cutAfter uint8, withhold bool) {
		var fr Framer
		fr.Feed(stream)
		s := NewStream(tokenizer.Responses, false, false)
		for n := 0; n < int(cutAfter); n++ {
			ev, ok := fr.Next()
			if !ok {
				break
			}
			if _, err := s.Observe(ev); err != nil {
				continue
			}
			if withhold && n == int(cutAfter)-1 {
				s.Withhold()
			}
		}
		closing := s.Close(Usage{InputTokens: 1, OutputTokens: 2})
		var cf Framer
		cf.Feed(closing)
		var events [][]byte
		for ev, ok := cf.Next(); ok; ev, ok = cf.Next() {
			events = append(events, ev)
		}
		// With CR line ends the last event waits for Flush: CR LF is one
		// line end.
		if tail := cf.Flush(); tail != nil {
			if !endsWithBlankLine(tail) {
				t.Fatalf("incomplete closing event %q", tail)
			}
			events = append(events, tail)
		}
		for _, ev := range events {
			data, _, n := (&Stream{}).eventData(ev)
			if n != 1 || !json.Valid(data) {
				t.Fatalf("closing event is not one JSON data field: %q", ev)
			}
			var e responses.ResponseStreamEventUnion
			if err := json.Unmarshal(data, &e); err != nil || !strings.HasPrefix(e.Type, "response.") {
				t.Fatalf("SDK cannot read closing event %q: %v", data, err)
			}
		}
	})
}

// FuzzGeminiArrayCut frames an arbitrary body as a Gemini JSON array and
// cuts it after an arbitrary element, withheld or not: errors wrap
// ErrMalformed, events are forwarded unchanged, and when the body is a JSON
// array of objects, what the client receives is a JSON array too.
func FuzzGeminiArrayCut(f *testing.F) {
	f.Add([]byte("[{\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"a\"}]}}]}\n,\r\n{\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"b\"}]},\"finishReason\":\"STOP\"}]}\n]"), uint8(1), false)
	f.Add([]byte("[{\"candidates\":[{\"index\":1},{\"index\":0,\"finishReason\":\"STOP\"}]}]"), uint8(1), true)
	f.Add([]byte(" [ ] "), uint8(3), false)
	f.Fuzz(func(t *testing.T, body []byte, cutAfter uint8, withhold bool) {
		var fr Framer
		fr.Reset(JSONArray)
		fr.Feed(body)
		s := NewFramedStream(tokenizer.Gemini, JSONArray, false, false)
		var client []byte
		for n := 0; n < int(cutAfter); n++ {
			ev, ok := fr.Next()
			if !ok {
				break
			}
			e, err := s.Observe(ev)
			if err != nil && !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			if !bytes.Equal(e.Forward, ev) {
				t.Fatalf("Forward = %q, want the event %q", e.Forward, ev)
			}
			if withhold && n == int(cutAfter)-1 {
				s.Withhold()
				break
			}
			client = append(client, ev...)
		}
		client = append(client, s.Close(Usage{InputTokens: 1, OutputTokens: 2})...)
		var objects []map[string]any
		if json.Unmarshal(body, &objects) == nil && !json.Valid(client) {
			t.Fatalf("body %q cut after %d events gives the client %q, not JSON", body, cutAfter, client)
		}
	})
}
