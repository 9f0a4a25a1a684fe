package metrics

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/tokengate/tokengate/extproc"
)

func TestFinish(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	m.Finish(extproc.Outcome{Policy: "default", Decision: "admitted", Model: "gpt-4o-mini-2024-07-18", Reserved: 200, Settled: 50, SettleOutcome: "complete"})
	m.Finish(extproc.Outcome{Policy: "default", Decision: "admitted", Model: "claude-3-5-haiku", Reserved: 100, Settled: 100, SettleOutcome: "cut_off", CutOff: true,
		AllowanceSource: "history", FallbackEncoding: true, Waited: 300 * time.Millisecond, InDebt: []string{"user"}})
	m.Finish(extproc.Outcome{Policy: "default", Decision: "refused_tokens", Model: "gpt-4o"})

	want := `
# HELP tokengate_requests_total Requests by policy and decision (admitted, refused_tokens, refused_requests, never_admissible, bad_request, unauthorized, store_error, unmetered).
# TYPE tokengate_requests_total counter
tokengate_requests_total{decision="admitted",policy="default"} 2
tokengate_requests_total{decision="refused_tokens",policy="default"} 1
# HELP tokengate_tokens_settled_total Tokens charged at settlement (the real usage).
# TYPE tokengate_tokens_settled_total counter
tokengate_tokens_settled_total{model_family="claude",policy="default"} 100
tokengate_tokens_settled_total{model_family="gpt-4o",policy="default"} 50
# HELP tokengate_cutoffs_total Streams cut off at a hard budget (S14).
# TYPE tokengate_cutoffs_total counter
tokengate_cutoffs_total{policy="default"} 1
# HELP tokengate_output_allowance_source_total Where admitted requests' output allowance came from: request (its own cap), history (learned estimate) or default (S7).
# TYPE tokengate_output_allowance_source_total counter
tokengate_output_allowance_source_total{policy="default",source="history"} 1
# HELP tokengate_unknown_model_total Requests for a model no rule knows, counted with the configured fallback encoding.
# TYPE tokengate_unknown_model_total counter
tokengate_unknown_model_total{policy="default"} 1
# HELP tokengate_debt_settlements_total Settlements that left a bucket below zero (an under-estimate, S9), by bucket.
# TYPE tokengate_debt_settlements_total counter
tokengate_debt_settlements_total{bucket="user",policy="default"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_requests_total", "tokengate_tokens_settled_total", "tokengate_cutoffs_total",
		"tokengate_output_allowance_source_total", "tokengate_unknown_model_total", "tokengate_debt_settlements_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(m.waits); n != 1 {
		t.Errorf("wait series = %d, want 1", n)
	}
	if n := testutil.CollectAndCount(m.estimateError); n != 1 {
		t.Errorf("estimate error series = %d, want 1", n)
	}
}

// Labels never carry what a client sent: unknown models map to "other".
func TestFamilyBounded(t *testing.T) {
	for model, want := range map[string]string{
		"gpt-4o-2024-08-06":        "gpt-4o",
		"gpt-4-0613":               "gpt-4",
		"openai/gpt-5-nano":        "gpt-5",
		"my-secret-deployment-123": "other",
		"":                         "none",
		"gemini-2.5-flash":         "gemini",
	} {
		if got := Family(model); got != want {
			t.Errorf("Family(%q) = %q, want %q", model, got, want)
		}
	}
}

// Settlements at the plausibility bound and streams forwarded unread are
// counted by policy.
func TestClampedAndUnreadCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg)
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", Reserved: 10, Settled: 4106, SettleOutcome: "complete", UsageClamped: true})
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", Reserved: 60, Settled: 60, SettleOutcome: "aborted", StreamUnread: true})
	m.Finish(extproc.Outcome{Policy: "p", Decision: "admitted", Reserved: 60, Settled: 20, SettleOutcome: "complete"})
	want := `
# HELP tokengate_usage_clamped_total Settlements whose provider-reported usage was beyond what the request makes plausible; the bound was charged instead.
# TYPE tokengate_usage_clamped_total counter
tokengate_usage_clamped_total{policy="p"} 1
# HELP tokengate_streams_unread_total Streams forwarded unread after one server-sent event passed the size bound; settled at the reservation.
# TYPE tokengate_streams_unread_total counter
tokengate_streams_unread_total{policy="p"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "tokengate_usage_clamped_total", "tokengate_streams_unread_total"); err != nil {
		t.Error(err)
	}
}
