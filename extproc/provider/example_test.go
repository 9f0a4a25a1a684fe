package provider_test

import (
	"fmt"

	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/tokenizer"
)

// A response body arrives in arbitrary chunks: the Framer cuts it into
// events, the Stream reads each for output text and usage and says what to
// forward.
func ExampleStream() {
	chunks := []string{
		"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":17,\"cache_read_input_tokens\":3,\"output_tokens\":1}}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_bl",
		"ock_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n",
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":2}}\n\n",
	}
	var f provider.Framer
	s := provider.NewStream(tokenizer.Messages, false, false)
	for _, chunk := range chunks {
		f.Feed([]byte(chunk))
		for ev, ok := f.Next(); ok; ev, ok = f.Next() {
			e, err := s.Observe(ev)
			if err != nil {
				fmt.Println(err)
				continue
			}
			fmt.Printf("text %q, usage %v, forward %d bytes\n", e.Text, e.Usage, len(e.Forward))
		}
	}
	u, ok := s.Usage()
	fmt.Printf("input %d (cached %d), output %d, total %d, %v\n", u.InputTokens, u.CachedInputTokens, u.OutputTokens, u.Total(), ok)
	// Output:
	// text "", usage true, forward 139 bytes
	// text "Hello", usage false, forward 120 bytes
	// text "", usage true, forward 116 bytes
	// input 20 (cached 3), output 2, total 22, true
}

// At a hard budget the stream ends with finish_reason "length", the usage
// chunk the client asked for, and [DONE] (S14).
func ExampleStream_Close() {
	s := provider.NewStream(tokenizer.ChatCompletions, true, false)
	s.Observe([]byte(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1755137933,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}],"usage":null}` + "\n\n"))
	fmt.Print(string(s.Close(provider.Usage{InputTokens: 12, OutputTokens: 1})))
	// Output:
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1755137933,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}
	//
	// data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1755137933,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}
	//
	// data: [DONE]
}

func ExampleParseUsage() {
	body := []byte(`{"id":"resp_1","service_tier":"priority","usage":{"input_tokens":11,"input_tokens_details":{"cached_tokens":0},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":16}}`)
	u, ok, err := provider.ParseUsage(tokenizer.Responses, body)
	fmt.Printf("input %d, output %d (reasoning %d), billed at the %s tier, %v %v\n", u.InputTokens, u.OutputTokens, u.ReasoningTokens, u.ServiceTier, ok, err)
	// Output:
	// input 11, output 5 (reasoning 2), billed at the fast tier, true <nil>
}

// Gemini without alt=sse streams a JSON array. FramingOf tells the
// processor so from the path and content-type; the Framer then cuts the
// array into elements, and at a hard budget Close ends it with a MAX_TOKENS
// element and the closing bracket (S14).
func ExampleFramingOf() {
	fr := provider.FramingOf(tokenizer.Gemini, "/v1beta/models/gemini-2.0-flash:streamGenerateContent", "application/json; charset=UTF-8")
	var f provider.Framer
	f.Reset(fr)
	s := provider.NewFramedStream(tokenizer.Gemini, fr, false, false)
	f.Feed([]byte(`[{"candidates":[{"content":{"parts":[{"text":"Paris"}],"role":"model"},"index":0}]}` + "\n,\r\n" + `{"candidates":[{"content":{"par`))
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		e, err := s.Observe(ev)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Printf("forward %d bytes, text %q\n", len(e.Forward), e.Text)
	}
	fmt.Printf("pending %q\n", f.Pending())
	// The pending tail is dropped; the client's array ends here.
	fmt.Printf("%q\n", s.Close(provider.Usage{InputTokens: 5, OutputTokens: 1}))
	// Output:
	// forward 83 bytes, text "Paris"
	// pending "\n,\r\n{\"candidates\":[{\"content\":{\"par"
	// "\n,\r\n{\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"\"}],\"role\":\"model\"},\"finishReason\":\"MAX_TOKENS\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":5,\"candidatesTokenCount\":1,\"totalTokenCount\":6}}\n]"
}
