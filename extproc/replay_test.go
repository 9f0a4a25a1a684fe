package extproc

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// providersDir holds the recorded provider traffic, beside the repository.
const providersDir = "../testdata/providers"

type recording struct {
	dir   string
	Case  string `json:"case"`
	Path  string `json:"path"`
	URL   string `json:"url"`
	Usage *struct {
		Input  int `json:"input_tokens"`
		Output int `json:"output_tokens"`
	} `json:"usage_normalized"`
	ContentType string `json:"response_content_type"`
}

func streamedRecordings(t *testing.T) []recording {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(providersDir, "*", "*", "response.sse"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no recordings under %s (%v)", providersDir, err)
	}
	var out []recording
	for _, f := range files {
		dir := filepath.Dir(f)
		b, err := os.ReadFile(filepath.Join(dir, "meta.json"))
		if err != nil {
			t.Fatal(err)
		}
		rec := recording{dir: dir}
		if err := json.Unmarshal(b, &rec); err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		out = append(out, rec)
	}
	return out
}

// replayUpstream answers every request with the recording named by the
// x-replay header, byte for byte.
type replayUpstream struct{ recs map[string]recording }

func (u replayUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rec := u.recs[r.Header.Get("x-replay")]
	body, err := os.ReadFile(filepath.Join(rec.dir, "response.sse"))
	if err != nil {
		http.Error(w, err.Error(), 500)
		return
	}
	w.Header().Set("content-type", rec.ContentType)
	w.WriteHeader(200)
	w.Write(body)
}

// Every streamed recording passes through the stand-in byte for byte when
// no limit bites, in FULL_DUPLEX_STREAMED (split into small chunks) and in
// STREAMED mode, and the tokens settled equal the recorded usage (S8, S22);
// without recorded usage, the prompt count plus the live count (S13), or,
// for a model that bills reasoning the stream does not show, at least the
// reservation.
func TestReplayRecordings(t *testing.T) {
	recs := streamedRecordings(t)
	byCase := map[string]recording{}
	for _, r := range recs {
		byCase[r.Case] = r
	}
	tc, err := tokenizer.New(tokenizer.Options{FallbackEncoding: tokenizer.O200kBase})
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Name: "replay", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e7, Rate: 1e3}}}}
	for _, mode := range []struct {
		name  string
		o     rigOptions
		chunk int
	}{
		{"duplex", rigOptions{mode: duplexMode(), chunkSize: 13}, 13},
		{"streamed", rigOptions{mode: streamedMode()}, 0},
	} {
		t.Run(mode.name, func(t *testing.T) {
			o := mode.o
			o.policies, o.tokenizer, o.upstream = []Policy{pol}, tc, replayUpstream{byCase}
			// Loading a vocabulary the first time takes longer than Envoy's
			// default 200 ms message timeout under the race detector.
			o.msgTimeout = 10 * time.Second
			r := newRig(t, nil, o)
			for _, rec := range recs {
				req, err := os.ReadFile(filepath.Join(rec.dir, "request.json"))
				if err != nil {
					t.Fatal(err)
				}
				want, err := os.ReadFile(filepath.Join(rec.dir, "response.sse"))
				if err != nil {
					t.Fatal(err)
				}
				path := rec.Path
				if u := rec.URL; len(u) > 0 {
					if i := indexQuery(u); i >= 0 {
						path += u[i:]
					}
				}
				resp, got := r.post(t, path, string(req), map[string]string{"x-replay": rec.Case})
				if resp.StatusCode != 200 {
					t.Errorf("%s: status %d: %s", rec.Case, resp.StatusCode, got)
					r.outcome(t)
					continue
				}
				if got != string(want) {
					t.Errorf("%s: client body differs from the recording (%d vs %d bytes)", rec.Case, len(got), len(want))
				}
				o := r.outcome(t)
				c, err := tc.Count(tokenizer.Request{Path: rec.Path, Body: req})
				if err != nil {
					t.Fatalf("%s: %v", rec.Case, err)
				}
				switch counted := o.InputTokens + o.Output; {
				case rec.Usage != nil:
					if w := rec.Usage.Input + rec.Usage.Output; o.Settled != w || !o.Usage {
						t.Errorf("%s: settled %d (usage seen %v), want recorded %d", rec.Case, o.Settled, o.Usage, w)
					}
				case o.Output == 0:
					t.Errorf("%s: nothing counted live", rec.Case)
				case c.HiddenReasoning:
					if o.Settled != max(o.Reserved, counted) {
						t.Errorf("%s: settled %d, want the larger of the reservation %d and input %d + live output %d", rec.Case, o.Settled, o.Reserved, o.InputTokens, o.Output)
					}
				case o.Settled != counted:
					t.Errorf("%s: settled %d, want input %d + live output %d", rec.Case, o.Settled, o.InputTokens, o.Output)
				}
			}
			r.store.settlements(t)
		})
	}
}

func indexQuery(u string) int {
	for i := range len(u) {
		if u[i] == '?' {
			return i
		}
	}
	return -1
}

// Every streamed recording cut at a two-token budget (S14) ends with its
// format's own closing events, in FULL_DUPLEX_STREAMED.
func TestReplayCutOff(t *testing.T) {
	recs := streamedRecordings(t)
	byCase := map[string]recording{}
	for _, r := range recs {
		byCase[r.Case] = r
	}
	tc, err := tokenizer.New(tokenizer.Options{FallbackEncoding: tokenizer.O200kBase})
	if err != nil {
		t.Fatal(err)
	}
	pol := Policy{Name: "cut", MaxOutputTokens: 2, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e7, Rate: 1e3}}}}
	r := newRig(t, nil, rigOptions{policies: []Policy{pol}, tokenizer: tc, upstream: replayUpstream{byCase},
		mode: duplexMode(), chunkSize: 29, msgTimeout: 10 * time.Second})
	closing := map[string][]string{
		"/v1/chat/completions":  {`"finish_reason":"length"`, "data: [DONE]"},
		"/v1/completions":       {`"finish_reason":"length"`, "data: [DONE]"},
		"/v1/messages":          {`"stop_reason":"max_tokens"`, "event: message_stop"},
		"/v1/responses":         {"response.incomplete", `"max_output_tokens"`},
		"streamGenerateContent": {`"MAX_TOKENS"`},
	}
	for _, rec := range recs {
		req, err := os.ReadFile(filepath.Join(rec.dir, "request.json"))
		if err != nil {
			t.Fatal(err)
		}
		path := rec.Path
		if i := indexQuery(rec.URL); i >= 0 {
			path += rec.URL[i:]
		}
		resp, got := r.post(t, path, string(req), map[string]string{"x-replay": rec.Case})
		o := r.outcome(t)
		if resp.StatusCode != 200 {
			t.Errorf("%s: status %d", rec.Case, resp.StatusCode)
			continue
		}
		if !o.CutOff {
			if o.Output > 2 {
				t.Errorf("%s: %d output tokens and no cut-off", rec.Case, o.Output)
			}
			continue
		}
		var want []string
		for suffix, w := range closing {
			if strings.HasSuffix(strings.SplitN(path, "?", 2)[0], suffix) || strings.Contains(path, suffix) {
				want = w
			}
		}
		for _, w := range want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: cut stream lacks %s:\n%s", rec.Case, w, tail(got, 400))
			}
		}
	}
	r.store.settlements(t)
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}
