package provider

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/tokengate/tokengate/tokenizer"
)

// compareReaders observes the events of stream with the one-pass reader and
// with the general reader alone, and fails on any difference in what
// Observe returns, in the Stream's state, its usage or its closing events.
func compareReaders(t *testing.T, api tokenizer.API, clientUsage, injected bool, stream []byte) {
	t.Helper()
	fast := NewStream(api, clientUsage, injected)
	general := NewStream(api, clientUsage, injected)
	general.generalOnly = true
	var fr Framer
	fr.Feed(stream)
	events := [][]byte{}
	for ev, ok := fr.Next(); ok; ev, ok = fr.Next() {
		events = append(events, ev)
	}
	if tail := fr.Flush(); tail != nil {
		events = append(events, tail)
	}
	opts := cmp.Options{
		cmp.AllowUnexported(Stream{}, choice{}, clientState{}, anthropicUsage{}, respOutput{}, respUndo{}),
		cmpopts.IgnoreFields(Stream{}, "generalOnly", "shape", "rewritten", "text", "joined"),
		cmpopts.EquateEmpty(),
	}
	for k, ev := range events {
		gotEv, gotErr := fast.Observe(ev)
		wantEv, wantErr := general.Observe(ev)
		if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
			t.Fatalf("event %d %q: error %v, general reader %v", k, ev, gotErr, wantErr)
		}
		if diff := cmp.Diff(wantEv, gotEv, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("event %d %q: Event differs from the general reader (-want +got):\n%s", k, ev, diff)
		}
		if diff := cmp.Diff(general, fast, opts); diff != "" {
			t.Fatalf("event %d %q: Stream differs from the general reader (-want +got):\n%s", k, ev, diff)
		}
	}
	gu, gok := general.Usage()
	fu, fok := fast.Usage()
	if gu != fu || gok != fok {
		t.Fatalf("Usage = %+v, %v; general reader %+v, %v", fu, fok, gu, gok)
	}
	d := Usage{InputTokens: 3, OutputTokens: 4}
	if got, want := fast.Close(d), general.Close(d); !bytes.Equal(got, want) {
		t.Fatalf("Close = %q, general reader %q", got, want)
	}
}

var fastSeeds = []string{
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" w"},"finish_reason":null}]}` + "\n\n",
	`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n",
	`data: {"usage":null,"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"id":""}` + "\n\n" +
		`data: {"id":"c1","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}` + "\n\n" + "data: [DONE]\n\n",
	`data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{\"a\":"}}]}},{"index":1,"delta":{"function_call":{"name":"g"}}}]}` + "\n\n",
	`data: {"choices":[{"text":"x\u00e9\ud83d","index":1,"finish_reason":null}],"id":"0","model":null}` + "\n\n",
	"data: {\"choices\":\r\ndata: [{\"delta\":{\"content\":\"a\"}}],\r\ndata: \"usage\":null}\r\n\r\n",
	`data: {"choices":[{"index":0,"delta":{"content":"a"}}],"choices":null,"choices":[{"index":2,"delta":null,"index":3}]}` + "\n\n",
	`data: {"choices":[{"index":"x"}]}` + "\n\n" + `data: {"choices":[1]}` + "\n\n" + `data: {"choices":[{"delta":"x"}]}` + "\n\n",
	`data: {"choices":[{"delta":{"tool_calls":{}}}]}` + "\n\n" + `data: {"ch\u006fices":[{"delta":{"content":"a"}}]}` + "\n\n",
	`data: {"choices":[{}, {} ,{"delta":{"content":"a"}}],}` + "\n\n" + `data: {"choices":[{"delta":{"content":"a"}}]} x` + "\n\n",
	`data: {"choices":[{"index":0,"delta":{"audio":{"transcript":"t"}}}]}` + "\n\n" + `data: {"choices":[{"delta":{"content":"a"}}` + "\n\n",
	`data: {"choices":[` + strings.Repeat(`{"index":0},`, 9) + `{}]}` + "\n\n",
	`data: {"choices":[{"delta":{"x":` + strings.Repeat("[", 509) + strings.Repeat("]", 509) + `}}]}` + "\n\n",
	`data: {"choices":[{"delta":{"x":` + strings.Repeat("[", 510) + strings.Repeat("]", 510) + `}}]}` + "\n\n",
	`data: {"choices":[{"x":` + strings.Repeat("[", 510) + strings.Repeat("]", 510) + `}]}` + "\n\n",
	`data: {"choices":[{"x":` + strings.Repeat("[", 511) + strings.Repeat("]", 511) + `}]}` + "\n\n",
	// Chunks of one shape (chunkShape): the same bytes but for the text
	// and the padding, then chunks that differ elsewhere, or in what is
	// in the holes.
	shaped(`{"choices":[{"delta":{"content":%s},"finish_reason":null,"index":0}],"id":"c1","obfuscation":%s,"usage":null}`,
		`"a"`, `"xyz"`, `" bc"`, `""`, `"\u00e9\n"`, `"d"`, `"k"`, `null`, `"e"`, `"q"`, `"f"`, `1`, `"g\"`, `"x"`),
	shaped(`{"obfuscation":%s,"id":"c1","usage":null,"choices":[{"index":0,"delta":{"content":%s}}]}`,
		`"p"`, `"a"`, `""`, `"bb"`, `"ppp"`, `"\ud83d"`, `"p"`, `"c"`),
	shaped(`{"id":"c1","choices":[{"index":0,"delta":{"content":%s},"finish_reason":%s}],"usage":null}`,
		`"a"`, `null`, `"b"`, `null`, `"c"`, `"stop"`, `"d"`, `null`),
	shaped(`{"id":%s,"choices":[{"index":0,"delta":{"content":%s}}],"obfuscation":"o","obfuscation":"p"}`,
		`"c1"`, `"a"`, `"c1"`, `"b"`, `"c2"`, `"c"`, `"c1"`, `"d"`),
	shaped(`{"choices":[{"index":0,"delta":{"content":%s,"refusal":%s}}]}`, `"a"`, `null`, `"b"`, `null`, `"c"`, `"r"`),
	shaped(`{"choices":[{"index":%s,"delta":{"content":%s}}]}`, `0`, `"a"`, `0`, `"b"`, `1`, `"c"`, `0`, `"d"`),
}

// shaped is a stream of chunks made from format, each of the values
// filling its holes in turn.
func shaped(format string, values ...string) string {
	holes := strings.Count(format, "%s")
	var b strings.Builder
	for i := 0; i+holes <= len(values); i += holes {
		args := make([]any, holes)
		for k := range args {
			args[k] = values[i+k]
		}
		b.WriteString("data: " + fmt.Sprintf(format, args...) + "\n\n")
	}
	return b.String()
}

// TestFastReaderMatchesGeneral checks that the one-pass reader of OpenAI
// chunks changes nothing Observe reports (S13, S14, S15): on crafted chunks
// and on every recorded OpenAI-format stream.
func TestFastReaderMatchesGeneral(t *testing.T) {
	for k, seed := range fastSeeds {
		for _, api := range []tokenizer.API{tokenizer.ChatCompletions, tokenizer.Completions} {
			for _, injected := range []bool{false, true} {
				t.Run(fmt.Sprintf("seed%d/%s/%v", k, api, injected), func(t *testing.T) {
					compareReaders(t, api, false, injected, []byte(seed))
				})
			}
		}
	}
	files, err := filepath.Glob(filepath.Join(recordingsDir, "*", "*", "*"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil || !bytes.Contains(b, []byte("data: ")) || !bytes.Contains(b, []byte(`"choices"`)) {
			continue
		}
		n++
		for _, api := range []tokenizer.API{tokenizer.ChatCompletions, tokenizer.Completions} {
			for _, injected := range []bool{false, true} {
				compareReaders(t, api, !injected, injected, b)
			}
		}
	}
	if n == 0 {
		t.Fatalf("no recorded OpenAI-format stream under %s", recordingsDir)
	}
}

// FuzzFastReader compares the one-pass reader with the general reader on
// arbitrary streams.
func FuzzFastReader(f *testing.F) {
	for _, s := range fastSeeds {
		f.Add([]byte(s), uint8(0))
	}
	f.Fuzz(func(t *testing.T, stream []byte, flags uint8) {
		api := tokenizer.ChatCompletions
		if flags&4 != 0 {
			api = tokenizer.Completions
		}
		compareReaders(t, api, flags&1 != 0, flags&2 != 0, stream)
	})
}

// TestFastReaderTakesCommonChunks checks that the common chunks do take the
// one-pass reader, and that a chunk it must not read leaves the general
// reader to report the error.
func TestFastReaderTakesCommonChunks(t *testing.T) {
	for _, tc := range []struct {
		data string
		want bool
	}{
		{`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" w"},"finish_reason":null}]}`, true},
		{`{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}`, true},
		{`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}`, true},
		{`{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`, false},
		{`{"choices":[{"index":-1}]}`, false},
		{`{"choices":[{"delta":{"content":"a"}}]`, false},
	} {
		s := NewStream(tokenizer.ChatCompletions, false, true)
		ev := Event{}
		if got := s.fastOpenAI(&ev, []byte("data: "+tc.data+"\n\n"), []byte(tc.data), 6, 1); got != tc.want {
			t.Errorf("fastOpenAI(%s) = %v, want %v", tc.data, got, tc.want)
		}
	}
}

// TestShapedChunksReadByTheirStrings: once a chunk of one text string (and
// one padding) has been read whole, the next that is the same bytes but
// for those strings is read by its strings alone, with the same text and
// the same cut of its usage member as the one-pass reader gives.
func TestShapedChunksReadByTheirStrings(t *testing.T) {
	const format = `{"choices":[{"delta":{"content":%q},"index":0}],"id":"c1","obfuscation":%q,"usage":null}`
	s := NewStream(tokenizer.ChatCompletions, false, true)
	if _, err := s.Observe([]byte("data: " + fmt.Sprintf(format, "a", "xy") + "\n\n")); err != nil {
		t.Fatal(err)
	}
	data := fmt.Sprintf(format, "b\u00e9", "z")
	ev := Event{}
	s.text = s.text[:0]
	event := []byte("data: " + data + "\n\n")
	if !s.fastShaped(&ev, event, []byte(data), 6) {
		t.Fatal("a chunk of the last chunk's shape was not read by its strings")
	}
	if got := string(s.text); got != "bé" {
		t.Errorf("text %q, want %q", got, "bé")
	}
	want := "data: " + strings.Replace(data, `,"usage":null`, "", 1) + "\n\n"
	if string(ev.Forward) != want {
		t.Errorf("forwarded %q, want %q", ev.Forward, want)
	}
	other := strings.Replace(data, `"c1"`, `"c2"`, 1)
	if s.fastShaped(&ev, []byte("data: "+other+"\n\n"), []byte(other), 6) {
		t.Error("a chunk with another id was read by the shape")
	}
}
