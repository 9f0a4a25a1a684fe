package extproc

import (
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/buckets"
)

// finishedLines returns the "request finished" log lines, decoded.
func finishedLines(t *testing.T, logs string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.Lines(logs) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec["msg"] == "request finished" {
			out = append(out, rec)
		}
	}
	return out
}

// A refused request logs the status the client got (429, 413, …), not 0.
func TestRefusedRequestLogsItsStatus(t *testing.T) {
	var logs syncBuffer
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "user", Limit: buckets.Limit{Capacity: 100, Rate: 1e-9}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte("{}")}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	for _, body := range []string{
		`{"model":"m","max_tokens":500,"messages":[]}`, // 413: never fits
		`{"model":"m","max_tokens":80,"messages":[]}`,  // 200
		`{"model":"m","max_tokens":80,"messages":[]}`,  // 429
		`{"model":`, // 400
	} {
		r.post(t, chatPath, body, nil)
		r.outcome(t)
	}
	var got []float64
	for _, rec := range finishedLines(t, logs.String()) {
		got = append(got, rec["status"].(float64))
	}
	if want := []float64{413, 429, 400}; !slices.Equal(got, want) {
		t.Errorf("logged statuses %v, want %v (the admitted request logs at debug)", got, want)
	}
}

// A non-streamed answer logs its output tokens, from the provider's usage.
func TestNonStreamedAnswerLogsOutputTokens(t *testing.T) {
	var logs syncBuffer
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(
		`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":7,"total_tokens":17}}`)}}
	r := newRig(t, u, rigOptions{logger: slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	r.post(t, chatPath, `{"model":"m","max_tokens":50,"messages":[]}`, nil)
	r.outcome(t)
	lines := finishedLines(t, logs.String())
	if len(lines) != 1 || lines[0]["output_tokens"] != 7.0 || lines[0]["status"] != 200.0 {
		t.Errorf("request finished lines %v, want one with output_tokens 7 and status 200", lines)
	}
}
