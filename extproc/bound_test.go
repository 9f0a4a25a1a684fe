package extproc

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/pricing"
)

// The usage a provider reports is bounded by what the model can do, its
// context window and its maximum output (the model table kept with the
// price table), never by what this request's body holds or what other
// tenants' answers were: input the provider really billed lives outside
// the body (Responses previous_response_id or conversation, Gemini
// cachedContent, file_id inputs, server-side tools), and an uncapped
// answer may be as long as the model allows.
func TestUsageBoundKeepsInputBilledOutsideTheBody(t *testing.T) {
	tc := realCounter(t)
	// A follow-up turn: the body holds a few tokens, the provider bills
	// the whole conversation before it. Synthetic answer.
	answer := `{"id":"resp_2","object":"response","status":"completed","model":"gpt-6.2-sol","output":[],` +
		`"usage":{"input_tokens":75000,"input_tokens_details":{"cached_tokens":0},"output_tokens":20,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":75020}}`
	r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(answer)}}, rigOptions{tokenizer: tc})
	body := `{"model":"gpt-6.2-sol","previous_response_id":"resp_1","input":"and then?","max_output_tokens":100}`
	if resp, text := r.post(t, "/v1/responses", body, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, text)
	}
	o := r.outcome(t)
	// 75,000 × $2 + 20 × $10 per million.
	if got := charged(t, o); o.UsageClamped || o.Settled != 75_020 || got != 150_200 {
		t.Errorf("clamped %v, settled %d tokens, charged %v; want the billed 75020 tokens, 150200 micro-dollars", o.UsageClamped, o.Settled, got)
	}
}

// An uncapped request's output is bounded by the model's maximum output,
// not by an estimate learned from earlier answers, which any tenant can
// push down with short ones: here the allowance is 100 tokens, and the
// provider bills an answer of 30,000.
func TestUsageBoundIsNotLearnedFromOtherAnswers(t *testing.T) {
	answer := `{"id":"c1","object":"chat.completion","model":"gpt-6.2-sol","choices":[{"index":0,"message":{"role":"assistant","content":"…"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":10,"completion_tokens":30000,"total_tokens":30010}}`
	r := moneyRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(answer)}}, rigOptions{})
	if resp, text := r.post(t, chatPath, `{"model":"gpt-6.2-sol","messages":[]}`, nil); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, text)
	}
	o := r.outcome(t)
	if got := charged(t, o); o.UsageClamped || o.Settled != 30_010 || got != 10*2+30_000*10 {
		t.Errorf("clamped %v, settled %d tokens, charged %v; want the billed 30010 tokens, 300020 micro-dollars", o.UsageClamped, o.Settled, got)
	}
}

// The bound stays a defence against absurd numbers: 9e15 tokens are
// charged at the bound, margin × the model's limits + slack (gpt-6.2-sol:
// a 1,050,000-token window and 128,000 output tokens), counted in the
// outcome (tokengate_usage_clamped_total) and logged. A model the table
// does not know is bounded by the configured defaults.
func TestUsageBoundClampsAbsurdUsage(t *testing.T) {
	for _, tt := range []struct {
		model   string
		in, out int
	}{
		{"gpt-6.2-sol", 4*1_050_000 + 4096, 4*128_000 + 4096},
		{"gpt-4o-mini", 4*2_000_000 + 4096, 4*(1<<20) + 4096},
	} {
		answer := `{"id":"c1","object":"chat.completion","model":"` + tt.model + `","choices":[],` +
			`"usage":{"prompt_tokens":9000000000000000,"completion_tokens":9000000000000000}}`
		var logs bytes.Buffer
		r := newRig(t, &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(answer)}},
			rigOptions{logger: slog.New(slog.NewJSONHandler(&logs, nil)), prices: pricing.Defaults()})
		if resp, text := r.post(t, chatPath, `{"model":"`+tt.model+`","messages":[]}`, nil); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, text)
		}
		o := r.outcome(t)
		if !o.UsageClamped || o.Settled != tt.in+tt.out {
			t.Errorf("%s: clamped %v, settled %d; want the bound %d + %d", tt.model, o.UsageClamped, o.Settled, tt.in, tt.out)
		}
		if !strings.Contains(logs.String(), "implausible usage reported") {
			t.Errorf("%s: nothing logged:\n%s", tt.model, logs.String())
		}
	}
}
