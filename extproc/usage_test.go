package extproc

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/buckets"
)

// anthropicStream is a messages stream whose message_start reports
// output_tokens 1, as Anthropic's does, followed by n one-token deltas and
// no end.
func anthropicStream(n int) []byte {
	var b strings.Builder
	b.WriteString("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-x\",\"content\":[],\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n")
	b.WriteString("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	for range n {
		b.WriteString("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" w\"}}\n\n")
	}
	return []byte(b.String())
}

// geminiStream is a Gemini stream whose running usageMetadata lags behind
// what it sent: every chunk reports one candidate token.
func geminiStream(n int) []byte {
	var b strings.Builder
	for range n {
		b.WriteString(`data: {"candidates":[{"content":{"parts":[{"text":" w"}],"role":"model"},"index":0}],"usageMetadata":{"promptTokenCount":12,"candidatesTokenCount":1,"totalTokenCount":13}}` + "\n\n")
	}
	return []byte(b.String())
}

// disconnectAfterFirstByte sends body to path and leaves once the first
// byte of the answer arrived (every event of the upstream's first chunk has
// then been counted).
func disconnectAfterFirstByte(t *testing.T, r *rig, path, body string) {
	t.Helper()
	req, err := http.NewRequest("POST", r.front.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
}

// S8: a stream that ends without its end charges the larger of the usage
// reported so far and the live count: Anthropic's message_start says
// output_tokens 1 and Gemini's usage runs behind, while 50 tokens were
// counted. The reported prompt stands.
func TestAbortedStreamChargesLiveCountOverEarlyUsage(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		stream           []byte
	}{
		{"anthropic", "/v1/messages", `{"model":"claude-x","stream":true,"max_tokens":500,"messages":[]}`, anthropicStream(50)},
		{"gemini", "/v1beta/models/gemini-x:streamGenerateContent?alt=sse", `{"model":"gemini-x","stream":true,"max_tokens":500}`, geminiStream(50)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := &upstream{Chunks: [][]byte{tc.stream}, Hang: true}
			r := newRig(t, u, rigOptions{})
			disconnectAfterFirstByte(t, r, tc.path, tc.body)
			o := r.outcome(t)
			if o.SettleOutcome != "aborted" || o.Output != 50 || o.Settled != 12+50 {
				t.Errorf("outcome %+v, want aborted, 50 counted, 62 settled (12 reported input + 50 counted output)", o)
			}
		})
	}
}

// A reported usage beyond what the model can do is settled at the bound:
// prompt at most UsageMargin × the model's context window + UsageSlack,
// output at most UsageMargin × its maximum output (or the request's cap,
// when lower) × choices + UsageSlack, never below what was counted here.
// Model "m" is in no table: the defaults bound it. The outcome says so (for
// the metric), and a warning names the numbers and nothing of the request.
func TestImplausibleUsageSettlesTheBound(t *testing.T) {
	const capacity = 1e6
	promptBound := defaultUsageContextWindow*defaultUsageMargin + defaultUsageSlack
	outputBound := defaultUsageMaxOutputTokens*defaultUsageMargin + defaultUsageSlack
	for _, tc := range []struct {
		name     string
		body     string
		response []byte
		sse      bool
		want     int
	}{
		{"prompt of 2^53-1 tokens", `{"model":"m","max_tokens":50,"messages":[{"role":"user","content":"secret prompt"}]}`,
			[]byte(`{"choices":[],"usage":{"prompt_tokens":9007199254740991,"completion_tokens":20,"total_tokens":9007199254741011}}`), false,
			promptBound + 20},
		{"output beyond the cap", `{"model":"m","max_tokens":50,"messages":[{"role":"user","content":"secret prompt"}]}`,
			[]byte(`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":1000000,"total_tokens":1000010}}`), false,
			10 + 50*defaultUsageMargin + defaultUsageSlack},
		{"uncapped stream claiming 2^53-1 output tokens", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"secret prompt"}]}`,
			streamOf(append(words(5), `{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":9007199254740991,"total_tokens":9007199254741001}}`)...), true,
			10 + outputBound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ct := "application/json"
			if tc.sse {
				ct = ""
			}
			var logs syncBuffer
			u := &upstream{ContentType: ct, Chunks: [][]byte{tc.response}}
			pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "model", Per: perModel, Limit: buckets.Limit{Capacity: capacity, Rate: 1e-9}}}}
			r := newRig(t, u, rigOptions{policies: []Policy{pol}, logger: slog.New(slog.NewJSONHandler(&logs, nil))})
			r.post(t, chatPath, tc.body, nil)
			o := r.outcome(t)
			if o.Settled != tc.want || !o.UsageClamped {
				t.Errorf("outcome %+v, want %d settled and the usage marked clamped", o, tc.want)
			}
			level := r.level(t, pol.Buckets[0], bucketKey("p", "model", "m"))
			if want := capacity - float64(tc.want); level < want-1e-3 || level > want+1e-3 {
				t.Errorf("per-model bucket at %v, want %v", level, want)
			}
			var warned bool
			for line := range strings.Lines(logs.String()) {
				if strings.Contains(line, "secret prompt") {
					t.Errorf("log shows the prompt: %s", line)
				}
				var rec map[string]any
				if err := json.Unmarshal([]byte(line), &rec); err != nil {
					t.Fatal(err)
				}
				if rec["level"] == "WARN" && strings.Contains(fmt.Sprint(rec["msg"]), "implausible") {
					warned = true
				}
			}
			if !warned {
				t.Errorf("no warning about the implausible usage:\n%s", logs.String())
			}
		})
	}
}
