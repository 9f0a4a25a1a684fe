package mockllm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

const providers = "../../testdata/providers"

func post(t *testing.T, url, path, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+path, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

type sseEvent struct{ name, data string }

func parseSSE(t *testing.T, b []byte) []sseEvent {
	t.Helper()
	var out []sseEvent
	var cur sseEvent
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			out = append(out, cur)
			cur = sseEvent{}
		case strings.HasPrefix(line, "event: "):
			cur.name = line[7:]
		case strings.HasPrefix(line, "data: "):
			cur.data = line[6:]
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	return out
}

func TestOpenAIStream(t *testing.T) {
	for _, tc := range []struct {
		name         string
		body         string
		wantN        int
		wantFinish   string
		includeUsage bool
	}{
		{"max_tokens with usage", `{"model":"gpt-4o","stream":true,"max_tokens":5,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`, 5, "length", true},
		{"larger cap counts", `{"model":"gpt-4o","stream":true,"max_tokens":2,"max_completion_tokens":4}`, 4, "length", false},
		{"default tokens", `{"stream":true}`, 3, "stop", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := New(Config{DefaultTokens: 3, PromptTokens: func([]byte) int { return 11 }})
			ts := httptest.NewServer(s)
			defer ts.Close()
			resp, b := post(t, ts.URL, "/v1/chat/completions", tc.body)
			if resp.StatusCode != 200 || resp.Header.Get("content-type") != "text/event-stream" {
				t.Fatalf("got %d %q", resp.StatusCode, resp.Header.Get("content-type"))
			}
			evs := parseSSE(t, b)
			if evs[len(evs)-1].data != "[DONE]" {
				t.Errorf("last event %q, want [DONE]", evs[len(evs)-1].data)
			}
			var content strings.Builder
			var finish string
			var usage map[string]int
			for _, e := range evs[:len(evs)-1] {
				var c struct {
					Choices []struct {
						Delta        struct{ Content string }
						FinishReason *string `json:"finish_reason"`
					}
					Usage map[string]int
				}
				if err := json.Unmarshal([]byte(e.data), &c); err != nil {
					t.Fatalf("event %q: %v", e.data, err)
				}
				for _, ch := range c.Choices {
					content.WriteString(ch.Delta.Content)
					if ch.FinishReason != nil {
						finish = *ch.FinishReason
					}
				}
				if c.Usage != nil {
					usage = c.Usage
				}
			}
			if want := text(tc.wantN); content.String() != want || finish != tc.wantFinish {
				t.Errorf("content %q finish %q, want %q %q", content.String(), finish, want, tc.wantFinish)
			}
			var wantUsage map[string]int
			if tc.includeUsage {
				wantUsage = map[string]int{"prompt_tokens": 11, "completion_tokens": tc.wantN, "total_tokens": 11 + tc.wantN}
			}
			if diff := cmp.Diff(wantUsage, usage); diff != "" {
				t.Errorf("usage (-want +got):\n%s", diff)
			}
			recs := s.Requests()
			if len(recs) != 1 || recs[0].TokensSent != tc.wantN || recs[0].Cancelled || recs[0].IncludeUsage != tc.includeUsage {
				t.Errorf("records = %+v", recs)
			}
		})
	}
}

func TestAnthropicStream(t *testing.T) {
	s := New(Config{PromptTokens: func([]byte) int { return 7 }})
	ts := httptest.NewServer(s)
	defer ts.Close()
	resp, b := post(t, ts.URL, "/v1/messages", `{"model":"claude","stream":true,"max_tokens":3,"messages":[]}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	var names []string
	var text strings.Builder
	var outTokens, inTokens int
	var stop string
	for _, e := range parseSSE(t, b) {
		names = append(names, e.name)
		var v struct {
			Type    string
			Message struct {
				Usage struct {
					InputTokens int `json:"input_tokens"`
				}
			}
			Delta struct {
				Text       string
				StopReason string `json:"stop_reason"`
			}
			Usage struct {
				OutputTokens int `json:"output_tokens"`
			}
		}
		if err := json.Unmarshal([]byte(e.data), &v); err != nil || v.Type != e.name {
			t.Fatalf("event %s %q: %v", e.name, e.data, err)
		}
		text.WriteString(v.Delta.Text)
		if e.name == "message_start" {
			inTokens = v.Message.Usage.InputTokens
		}
		if e.name == "message_delta" {
			outTokens, stop = v.Usage.OutputTokens, v.Delta.StopReason
		}
	}
	want := []string{"message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"}
	if diff := cmp.Diff(want, names); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if text.String() != "tok tok tok" || outTokens != 3 || inTokens != 7 || stop != "max_tokens" {
		t.Errorf("text %q out %d in %d stop %q", text.String(), outTokens, inTokens, stop)
	}
}

func TestNonStream(t *testing.T) {
	s := New(Config{PromptTokens: func([]byte) int { return 9 }})
	ts := httptest.NewServer(s)
	defer ts.Close()
	_, b := post(t, ts.URL, "/v1/chat/completions", `{"model":"m","max_completion_tokens":2}`)
	var oa struct {
		Object  string
		Choices []struct {
			Message      struct{ Content string }
			FinishReason string `json:"finish_reason"`
		}
		Usage map[string]int
	}
	if err := json.Unmarshal(b, &oa); err != nil {
		t.Fatal(err)
	}
	if oa.Object != "chat.completion" || oa.Choices[0].Message.Content != "tok tok" || oa.Choices[0].FinishReason != "length" ||
		!cmp.Equal(oa.Usage, map[string]int{"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}) {
		t.Errorf("openai = %s", b)
	}
	_, b = post(t, ts.URL, "/v1/messages", `{"model":"c","messages":[]}`, "x-mock-tokens", "4")
	var an struct {
		Type       string
		Content    []struct{ Text string }
		StopReason string `json:"stop_reason"`
		Usage      map[string]int
	}
	if err := json.Unmarshal(b, &an); err != nil {
		t.Fatal(err)
	}
	if an.Type != "message" || an.Content[0].Text != "tok tok tok tok" || an.StopReason != "end_turn" ||
		!cmp.Equal(an.Usage, map[string]int{"input_tokens": 9, "output_tokens": 4}) {
		t.Errorf("anthropic = %s", b)
	}
}

func TestScriptedErrors(t *testing.T) {
	s := New(Config{})
	ts := httptest.NewServer(s)
	defer ts.Close()
	for _, tc := range []struct {
		path, status, retry string
		wantCode            int
		wantRetry           string
		wantType            string
	}{
		{"/v1/chat/completions", "429", "", 429, "1", "rate_limit_error"},
		{"/v1/messages", "429", "7", 429, "7", "rate_limit_error"},
		{"/v1/chat/completions", "500", "", 500, "", "api_error"},
	} {
		resp, b := post(t, ts.URL, tc.path, `{"stream":true}`, "x-mock-status", tc.status, "x-mock-retry-after", tc.retry)
		if resp.StatusCode != tc.wantCode || resp.Header.Get("retry-after") != tc.wantRetry || !strings.Contains(string(b), tc.wantType) {
			t.Errorf("%s %s: got %d retry-after %q body %s", tc.path, tc.status, resp.StatusCode, resp.Header.Get("retry-after"), b)
		}
	}
	for body, want := range map[string]string{
		`{not json`:                        "invalid JSON body",
		`{"max_tokens":-1}`:                "output cap -1 outside 1..100000",
		`{"max_tokens":1e9}`:               "invalid JSON body",
		`{"max_completion_tokens":100001}`: "output cap 100001 outside",
	} {
		resp, b := post(t, ts.URL, "/v1/chat/completions", body)
		if resp.StatusCode != 400 || !strings.Contains(string(b), want) {
			t.Errorf("%s: %d %s, want 400 with %q", body, resp.StatusCode, b, want)
		}
	}
}

// A client that goes away mid-stream is recorded as cancelled, with the tokens sent so far.
func TestCancelRecorded(t *testing.T) {
	reached := make(chan struct{})
	s := New(Config{Pace: func(ctx context.Context, i int) error {
		if i == 2 {
			close(reached)
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}})
	ts := httptest.NewServer(s)
	defer ts.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/chat/completions", strings.NewReader(`{"stream":true,"max_tokens":10}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-reached:
	case <-time.After(10 * time.Second):
		t.Fatal("stream never reached token 2")
	}
	cancel()
	resp.Body.Close()
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	recs, err := s.WaitRequests(wctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !recs[0].Cancelled || recs[0].TokensSent != 2 || recs[0].TokensPlanned != 10 {
		t.Errorf("record = %+v", recs[0])
	}
}

// Every output word is one token in cl100k_base and o200k_base, so N words are N tokens.
func TestWordsAreOneTokenEach(t *testing.T) {
	tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
	for _, enc := range []string{"cl100k_base", "o200k_base"} {
		tk, err := tiktoken.GetEncoding(enc)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range []int{1, 2, 17, 300} {
			if got := len(tk.Encode(text(n), nil, nil)); got != n {
				t.Errorf("%s: %d words are %d tokens", enc, n, got)
			}
		}
	}
}

// Replay serves every recorded case byte for byte, whole and in chunks.
func TestReplay(t *testing.T) {
	metas, err := filepath.Glob(filepath.Join(providers, "*", "*", "meta.json"))
	if err != nil || len(metas) == 0 {
		t.Fatalf("no recorded cases under %s: %v", providers, err)
	}
	served := 0
	for _, meta := range metas {
		dir := filepath.Dir(meta)
		var m replayMeta
		raw, _ := os.ReadFile(meta)
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatalf("%s: %v", meta, err)
		}
		if m.Files.Response == nil {
			if _, err := Replay(dir, 0); err == nil {
				t.Errorf("%s: Replay accepted a case without a response", dir)
			}
			continue
		}
		want, _ := os.ReadFile(filepath.Join(dir, *m.Files.Response))
		chunks := []int{0, 13}
		if served < 2 {
			chunks = append(chunks, 1)
		}
		served++
		for _, chunk := range chunks {
			h, err := Replay(dir, chunk)
			if err != nil {
				t.Fatalf("%s: %v", dir, err)
			}
			ts := httptest.NewServer(h)
			resp, got := post(t, ts.URL, "/", "{}")
			ts.Close()
			if resp.StatusCode != m.Status || resp.Header.Get("content-type") != m.ResponseContentType || !bytes.Equal(got, want) {
				t.Errorf("%s chunk %d: got %d %q %d bytes, want %d %q %d bytes", dir, chunk, resp.StatusCode,
					resp.Header.Get("content-type"), len(got), m.Status, m.ResponseContentType, len(want))
			}
		}
	}
	if served < 50 {
		t.Errorf("only %d cases replayed", served)
	}
}

func TestReplayErrors(t *testing.T) {
	if _, err := Replay(t.TempDir(), 0); err == nil || !strings.Contains(err.Error(), "meta.json") {
		t.Errorf("missing case: %v", err)
	}
	if _, err := Replay(filepath.Join(providers, "openai", "chat-basic"), -1); err == nil {
		t.Error("negative chunk size accepted")
	}
}

// FuzzServe: any body gets a well-formed answer, never a panic.
func FuzzServe(f *testing.F) {
	f.Add("/v1/chat/completions", `{"stream":true,"max_tokens":3}`)
	f.Add("/v1/messages", `{"stream":true,"max_tokens":2,"messages":[{"role":"user","content":"x"}]}`)
	f.Add("/v1/chat/completions", `{"max_tokens":-5}`)
	f.Add("/v1/messages", `[]`)
	f.Fuzz(func(t *testing.T, path, body string) {
		if path != "/v1/messages" {
			path = "/v1/chat/completions"
		}
		s := New(Config{DefaultTokens: 2, MaxOutputTokens: 64})
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest("POST", path, strings.NewReader(body)))
		if rec.Code != 200 && rec.Code != 400 {
			t.Errorf("status %d for %q", rec.Code, body)
		}
		if rec.Code == 400 && !json.Valid(rec.Body.Bytes()) {
			t.Errorf("error body not JSON: %q", rec.Body.String())
		}
	})
}

func BenchmarkOpenAIStream(b *testing.B) {
	s := New(Config{})
	body := `{"stream":true,"max_tokens":256,"stream_options":{"include_usage":true}}`
	b.ReportAllocs()
	for b.Loop() {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body)))
		if rec.Code != 200 {
			b.Fatal(rec.Code)
		}
	}
}
