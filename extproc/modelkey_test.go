package extproc

import (
	"slices"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// S10: a per-model bucket is keyed by the model the provider bills, so
// `gpt-4o`, `GPT-4o`, `openai/gpt-4o` and a dated snapshot share one bucket
// instead of each opening a fresh one.
func TestPerModelBucketKeyedByResolvedModel(t *testing.T) {
	counter, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "model", Per: perModel, Limit: buckets.Limit{Capacity: 1e6, Rate: 1}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(
		`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}}`)}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, tokenizer: counter, msgTimeout: 10 * time.Second})
	for _, m := range []string{"gpt-4o", "GPT-4o", "openai/gpt-4o", "gpt-4o-2024-08-06"} {
		resp, body := r.post(t, chatPath, `{"model":"`+m+`","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, nil)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d: %s", m, resp.StatusCode, body)
		}
		r.outcome(t)
	}
	r.store.mu.Lock()
	keys := slices.Compact(slices.Sorted(slices.Values(r.store.keys)))
	r.store.mu.Unlock()
	if want := []string{bucketKey("p", "model", "gpt-4o")}; !slices.Equal(keys, want) {
		t.Errorf("bucket keys %q, want one: %q", keys, want)
	}
}

// S22: an endpoint that generates nothing (Anthropic count_tokens,
// moderations) passes through unmetered: nothing is reserved or charged.
func TestFreeEndpointPassesUnmetered(t *testing.T) {
	counter, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "all", Limit: buckets.Limit{Capacity: 10, Rate: 1e-9}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(`{"input_tokens":12}`)}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, tokenizer: counter, msgTimeout: 10 * time.Second})
	for _, path := range []string{"/v1/messages/count_tokens", "/v1/moderations"} {
		resp, body := r.post(t, path, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"a long prompt that would not fit ten tokens"}]}`, nil)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d: %s", path, resp.StatusCode, body)
		}
		if o := r.outcome(t); o.Decision != "unmetered" || o.Reserved != 0 || o.Settled != 0 {
			t.Errorf("%s: outcome %+v, want unmetered with nothing reserved or settled", path, o)
		}
	}
	r.store.mu.Lock()
	defer r.store.mu.Unlock()
	if len(r.store.keys) != 0 {
		t.Errorf("reservations made for free endpoints: %q", r.store.keys)
	}
}

// An override of a per-model rule names the model as an operator writes
// it; ModelKey resolves it as a request's model is resolved, so any
// spelling of the model meets it (S10).
func TestPerModelOverrideMeetsEverySpelling(t *testing.T) {
	counter, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "model", Per: perModel, Limit: buckets.Limit{Capacity: 1e6, Rate: 1}}}}
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(
		`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}}`)}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, tokenizer: counter, msgTimeout: 10 * time.Second})
	r.srv.SetOverrides(Overrides{{Policy: "p", Rule: "model", Identity: ModelKey("OpenAI/GPT-4o-2024-08-06")}: {Limit: buckets.Limit{Capacity: 777, Rate: 1}}})
	for _, m := range []string{"gpt-4o", "GPT-4o", "openai/gpt-4o", "gpt-4o-2024-11-20", "ft:gpt-4o:org::x"} {
		resp, body := r.post(t, chatPath, `{"model":"`+m+`","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`, nil)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d: %s", m, resp.StatusCode, body)
		}
		r.outcome(t)
		if got := resp.Header.Get(headerLimit); got != "777" {
			t.Errorf("%s: limit %q, want the override's 777", m, got)
		}
	}
	if ModelKey("") != "" || ModelKey("gpt-4o-mini") == ModelKey("gpt-4o") {
		t.Error("ModelKey folds what it must not")
	}
}
