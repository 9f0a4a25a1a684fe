package provider

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/tokenizer"
)

// The model an answer names, read from every recording, streamed or not,
// is the response_model its meta.json states.
func TestResponseModelRecordings(t *testing.T) {
	n := 0
	for _, r := range loadRecordings(t) {
		data, err := os.ReadFile(filepath.Join(recordingsDir, r.name, "meta.json"))
		if err != nil {
			t.Fatal(err)
		}
		var meta struct {
			ResponseModel *string `json:"response_model"`
		}
		if err := json.Unmarshal(data, &meta); err != nil {
			t.Fatalf("%s: %v", r.name, err)
		}
		want := ""
		if meta.ResponseModel != nil {
			want = *meta.ResponseModel
			n++
		}
		t.Run(r.name, func(t *testing.T) {
			var got string
			if r.sse {
				var f Framer
				s := NewStream(r.api, r.askUsage, false)
				f.Feed(r.body)
				for ev, ok := f.Next(); ok; ev, ok = f.Next() {
					if _, err := s.Observe(ev); err != nil {
						t.Fatal(err)
					}
				}
				if tail := f.Flush(); tail != nil {
					if _, err := s.Observe(tail); err != nil {
						t.Fatal(err)
					}
				}
				got = s.Model()
			} else {
				got = ResponseModel(r.api, r.body)
			}
			if got != want {
				t.Errorf("model %q, want %q", got, want)
			}
		})
	}
	if n < 40 {
		t.Errorf("%d recordings name a model, want at least 40", n)
	}
}

// A model name is read only where the API puts it, and only when it is a
// string of bounded length.
func TestResponseModelBounded(t *testing.T) {
	long := strings.Repeat("m", maxModelBytes+1)
	for _, c := range []struct {
		api  tokenizer.API
		body string
		want string
	}{
		{tokenizer.ChatCompletions, `{"id":"x","model":"gpt-4o"}`, "gpt-4o"},
		{tokenizer.ChatCompletions, `{"choices":[{"model":"inner"}]}`, ""},
		{tokenizer.ChatCompletions, `{"model":42}`, ""},
		{tokenizer.ChatCompletions, `{"model":"` + long + `"}`, ""},
		{tokenizer.ChatCompletions, `not json`, ""},
		{tokenizer.Messages, `{"model":"claude-\u0078"}`, "claude-x"},
		{tokenizer.Gemini, `{"model":"no","modelVersion":"gemini-2.5-flash"}`, "gemini-2.5-flash"},
		{tokenizer.Gemini, `[{"modelVersion":"a"},{"candidates":[]},{"modelVersion":"b"}]`, "b"},
	} {
		if got := ResponseModel(c.api, []byte(c.body)); got != c.want {
			t.Errorf("ResponseModel(%s, %.60s) = %q, want %q", c.api, c.body, got, c.want)
		}
	}
}
