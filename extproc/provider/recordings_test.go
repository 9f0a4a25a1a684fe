package provider

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/tokengate/tokengate/tokenizer"
)

// recordingsDir holds real provider traffic, shared by the whole product and
// never edited: testdata/providers at the repository root.
const recordingsDir = "../../testdata/providers"

// recording is one recorded exchange and the facts its meta.json states.
type recording struct {
	name     string // provider/case
	api      tokenizer.API
	body     []byte // response.sse or response.json
	sse      bool
	meta     recordingMeta
	askUsage bool // the request set stream_options.include_usage
}

type recordingMeta struct {
	API             string          `json:"api"`
	Status          int             `json:"status"`
	UsageNormalized *normalizedMeta `json:"usage_normalized"`
	SSE             *struct {
		LineEnding      string `json:"line_ending"`
		Events          int    `json:"events"`
		CommentLines    int    `json:"comment_lines"`
		HasDoneSentinel bool   `json:"has_done_sentinel"`
		Bytes           int    `json:"bytes"`
	} `json:"sse"`
	Files struct {
		Response *string `json:"response"`
	} `json:"files"`
}

type normalizedMeta struct {
	InputTokens              int  `json:"input_tokens"`
	OutputTokens             int  `json:"output_tokens"`
	TotalTokens              int  `json:"total_tokens"`
	CachedInputTokens        *int `json:"cached_input_tokens"`
	CacheCreationInputTokens *int `json:"cache_creation_input_tokens"`
	ReasoningTokens          *int `json:"reasoning_tokens"`
}

// notNormalized leaves out of a comparison with usage_normalized the fields
// meta.json does not normalise; TestBillingFieldsOfRecordings checks them.
var notNormalized = cmpopts.IgnoreFields(Usage{}, "CacheCreationExtendedInputTokens", "AudioInputTokens", "AudioOutputTokens", "ServiceTier")

// usage is the normalized usage as this package reports it: quantities the
// provider does not report are 0.
func (n *normalizedMeta) usage() Usage {
	deref := func(p *int) int {
		if p == nil {
			return 0
		}
		return *p
	}
	return Usage{
		InputTokens:              n.InputTokens,
		OutputTokens:             n.OutputTokens,
		CachedInputTokens:        deref(n.CachedInputTokens),
		CacheCreationInputTokens: deref(n.CacheCreationInputTokens),
		ReasoningTokens:          deref(n.ReasoningTokens),
	}
}

// apiOf maps meta.json's api to the body shape.
var apiOf = map[string]tokenizer.API{
	"chat.completions":      tokenizer.ChatCompletions,
	"completions":           tokenizer.Completions,
	"embeddings":            tokenizer.Embeddings,
	"responses":             tokenizer.Responses,
	"messages":              tokenizer.Messages,
	"messages.count_tokens": tokenizer.Messages,
	"generateContent":       tokenizer.Gemini,
	"streamGenerateContent": tokenizer.Gemini,
	"batchEmbedContents":    tokenizer.Gemini,
}

// loadRecordings returns every recording that has a response body.
func loadRecordings(t testing.TB) []recording {
	t.Helper()
	metas, err := filepath.Glob(filepath.Join(recordingsDir, "*", "*", "meta.json"))
	if err != nil || len(metas) == 0 {
		t.Fatalf("no recordings under %s (err %v)", recordingsDir, err)
	}
	var recs []recording
	for _, path := range metas {
		dir := filepath.Dir(path)
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var m recordingMeta
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if m.Files.Response == nil || m.API == "" {
			continue
		}
		api, ok := apiOf[m.API]
		if !ok {
			t.Fatalf("%s: unknown api %q", path, m.API)
		}
		body, err := os.ReadFile(filepath.Join(dir, *m.Files.Response))
		if err != nil {
			t.Fatal(err)
		}
		rec := recording{
			name: filepath.Base(filepath.Dir(dir)) + "/" + filepath.Base(dir),
			api:  api,
			body: body,
			sse:  strings.HasSuffix(*m.Files.Response, ".sse"),
			meta: m,
		}
		if req, err := os.ReadFile(filepath.Join(dir, "request.json")); err == nil {
			var r struct {
				StreamOptions struct {
					IncludeUsage bool `json:"include_usage"`
				} `json:"stream_options"`
			}
			// Some request bodies are not JSON objects; they simply do not ask.
			_ = json.Unmarshal(req, &r)
			rec.askUsage = r.StreamOptions.IncludeUsage
		}
		recs = append(recs, rec)
	}
	return recs
}

func streamRecordings(t testing.TB) []recording {
	var out []recording
	for _, r := range loadRecordings(t) {
		if r.sse {
			out = append(out, r)
		}
	}
	if len(out) < 30 {
		t.Fatalf("found %d SSE recordings, want at least 30", len(out))
	}
	return out
}

// TestParseUsageRecordings checks S22 on every non-streamed body: the usage
// read equals meta.json's usage_normalized, and bodies without usage (errors)
// report none.
func TestParseUsageRecordings(t *testing.T) {
	n := 0
	for _, r := range loadRecordings(t) {
		if r.sse {
			continue
		}
		n++
		t.Run(r.name, func(t *testing.T) {
			got, ok, err := ParseUsage(r.api, r.body)
			if err != nil {
				t.Fatalf("ParseUsage: %v", err)
			}
			want := r.meta.UsageNormalized
			if ok != (want != nil) {
				t.Fatalf("ParseUsage ok = %v, want %v", ok, want != nil)
			}
			if want == nil {
				return
			}
			if diff := cmp.Diff(want.usage(), got, notNormalized); diff != "" {
				t.Errorf("usage mismatch (-want +got):\n%s", diff)
			}
			if got.Total() != want.TotalTokens {
				t.Errorf("Total() = %d, want total_tokens %d", got.Total(), want.TotalTokens)
			}
		})
	}
	if n < 50 {
		t.Errorf("checked %d JSON bodies, want at least 50", n)
	}
}

// replay is what one pass over a recording produced.
type replay struct {
	Events    []string // raw events from the Framer
	Forwarded []byte   // all Forward bytes, joined
	Text      string   // all Text, joined
	Usage     Usage
	HasUsage  bool
	Done      int // events with Done
	UsageEvts int // events with Usage
	Dropped   int // events with Forward == nil
	Errors    []string
}

// play feeds body to a Framer in the given chunks and observes every event.
func play(api tokenizer.API, askUsage, injected bool, body []byte, cuts []int) replay {
	var (
		f   Framer
		s   = NewStream(api, askUsage, injected)
		out replay
		txt strings.Builder
	)
	observe := func(ev []byte) {
		out.Events = append(out.Events, string(ev))
		e, err := s.Observe(ev)
		if err != nil {
			out.Errors = append(out.Errors, err.Error())
		}
		out.Forwarded = append(out.Forwarded, e.Forward...)
		txt.WriteString(e.Text)
		if e.Done {
			out.Done++
		}
		if e.Usage {
			out.UsageEvts++
		}
		if e.Forward == nil {
			out.Dropped++
		}
	}
	prev := 0
	for _, c := range append(cuts, len(body)) {
		f.Feed(body[prev:c])
		prev = c
		for ev, ok := f.Next(); ok; ev, ok = f.Next() {
			observe(ev)
		}
	}
	if tail := f.Flush(); tail != nil {
		observe(tail)
	}
	out.Text = txt.String()
	out.Usage, out.HasUsage = s.Usage()
	return out
}

// fixedCuts splits n bytes into chunks of size.
func fixedCuts(n, size int) []int {
	var cuts []int
	for c := size; c < n; c += size {
		cuts = append(cuts, c)
	}
	return cuts
}

// dataEvents counts the events that carry a data field: the events the
// WHATWG algorithm dispatches, which meta.sse.events counts.
func dataEvents(events []string) int {
	n := 0
	for _, ev := range events {
		for line := range strings.Lines(ev) {
			if isDataLine([]byte(strings.TrimRight(line, "\r\n"))) {
				n++
				break
			}
		}
	}
	return n
}

// TestStreamRecordings replays every recorded stream whole (S13, S22): the
// events counted, the bytes forwarded and the usage merged match the
// recording and its meta.json.
func TestStreamRecordings(t *testing.T) {
	for _, r := range streamRecordings(t) {
		t.Run(r.name, func(t *testing.T) {
			got := play(r.api, r.askUsage, false, r.body, nil)
			if len(got.Errors) > 0 {
				t.Fatalf("Observe errors: %q", got.Errors)
			}
			if n := dataEvents(got.Events); n != r.meta.SSE.Events {
				t.Errorf("dispatched events = %d, want meta.sse.events %d", n, r.meta.SSE.Events)
			}
			if !bytes.Equal(got.Forwarded, r.body) {
				t.Errorf("forwarded bytes differ from the recording (%d vs %d bytes)", len(got.Forwarded), len(r.body))
			}
			if got.Dropped != 0 {
				t.Errorf("%d events dropped without injected usage", got.Dropped)
			}
			want := r.meta.UsageNormalized
			if got.HasUsage != (want != nil) {
				t.Fatalf("Stream.Usage ok = %v, want %v", got.HasUsage, want != nil)
			}
			if want != nil {
				if diff := cmp.Diff(want.usage(), got.Usage, notNormalized); diff != "" {
					t.Errorf("usage mismatch (-want +got):\n%s", diff)
				}
				if got.Usage.Total() != want.TotalTokens {
					t.Errorf("Total() = %d, want total_tokens %d", got.Usage.Total(), want.TotalTokens)
				}
			}
			if r.meta.SSE.HasDoneSentinel || r.api == tokenizer.Messages || r.api == tokenizer.Responses {
				if got.Done != 1 {
					t.Errorf("Done events = %d, want 1", got.Done)
				}
			}
			if got.Text == "" && r.name != "openai/chat-stream-include-usage-length" {
				// That one spent every output token on hidden reasoning.
				t.Errorf("no output text counted")
			}
		})
	}
}

// TestStreamChunking feeds every recording in every chunk size from 1 to 64
// bytes and in random splits (S13; events split mid-data, mid-CRLF and
// mid-UTF-8): the events, the text and the usage never depend on chunking.
func TestStreamChunking(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	for _, r := range streamRecordings(t) {
		t.Run(r.name, func(t *testing.T) {
			whole := play(r.api, r.askUsage, false, r.body, nil)
			check := func(label string, cuts []int) {
				got := play(r.api, r.askUsage, false, r.body, cuts)
				// cmp.Diff is slow on long streams; only diff a mismatch.
				if reflect.DeepEqual(whole, got) {
					return
				}
				if diff := cmp.Diff(whole, got); diff != "" {
					t.Fatalf("%s: replay differs from whole body (-want +got):\n%s", label, diff)
				}
			}
			for size := 1; size <= 64; size++ {
				check("chunk size "+strconv.Itoa(size), fixedCuts(len(r.body), size))
			}
			for k := range 8 {
				var cuts []int
				for c := rng.IntN(40); c < len(r.body); c += 1 + rng.IntN(200) {
					cuts = append(cuts, c)
				}
				check("random split "+strconv.Itoa(k), cuts)
			}
		})
	}
}

// TestStreamCutsInsideLineEnds places a chunk boundary inside every CRLF and
// inside every multi-byte UTF-8 character of the recordings.
func TestStreamCutsInsideLineEnds(t *testing.T) {
	for _, r := range streamRecordings(t) {
		var crlf, utf []int
		for i := 1; i < len(r.body); i++ {
			if r.body[i-1] == '\r' && r.body[i] == '\n' {
				crlf = append(crlf, i)
			}
			if r.body[i]&0xC0 == 0x80 {
				utf = append(utf, i)
			}
		}
		if len(crlf)+len(utf) == 0 {
			continue
		}
		t.Run(r.name, func(t *testing.T) {
			whole := play(r.api, r.askUsage, false, r.body, nil)
			for label, cuts := range map[string][]int{"CRLF": crlf, "UTF-8": utf} {
				if diff := cmp.Diff(whole, play(r.api, r.askUsage, false, r.body, cuts)); diff != "" {
					t.Errorf("cut inside every %s: replay differs (-want +got):\n%s", label, diff)
				}
			}
		})
	}
}

// TestInjectedUsage replays every include_usage recording as if tokengate had
// asked for the usage on the client's behalf (S15): the client gets no
// "usage" member and no usage-only chunk, while tokengate still reads the
// usage.
func TestInjectedUsage(t *testing.T) {
	n := 0
	for _, r := range streamRecordings(t) {
		if !r.askUsage {
			continue
		}
		n++
		t.Run(r.name, func(t *testing.T) {
			plain := play(r.api, true, false, r.body, nil)
			got := play(r.api, false, true, r.body, fixedCuts(len(r.body), 7))
			if len(got.Errors) > 0 {
				t.Fatalf("Observe errors: %q", got.Errors)
			}
			if diff := cmp.Diff(plain.Usage, got.Usage); diff != "" || !got.HasUsage {
				t.Errorf("usage read with injection differs (-plain +injected):\n%s", diff)
			}
			if plain.Text != got.Text {
				t.Errorf("text differs with injection")
			}
			if got.Dropped != 1 && !strings.Contains(r.name, "error-midstream") {
				t.Errorf("dropped %d events, want the one usage-only chunk", got.Dropped)
			}
			var f Framer
			f.Feed(got.Forwarded)
			for ev, ok := f.Next(); ok; ev, ok = f.Next() {
				data, _, n := (&Stream{}).eventData(ev)
				if n == 0 || string(data) == "[DONE]" {
					continue
				}
				var chunk map[string]json.RawMessage
				if err := json.Unmarshal(data, &chunk); err != nil {
					t.Fatalf("forwarded event is not JSON: %v\n%s", err, ev)
				}
				if _, ok := chunk["usage"]; ok {
					t.Errorf("forwarded chunk still has usage: %s", data)
				}
			}
			if len(f.Pending()) != 0 {
				t.Errorf("forwarded stream ends with an incomplete event %q", f.Pending())
			}
		})
	}
	if n < 10 {
		t.Errorf("found %d include_usage recordings, want 10", n)
	}
}

// TestInjectedUsageMatchesPlainStream compares, key by key, the chunks a
// client receives when tokengate injected include_usage with the chunks the
// same provider sends when nobody asked for usage.
func TestInjectedUsageMatchesPlainStream(t *testing.T) {
	recs := map[string]recording{}
	for _, r := range streamRecordings(t) {
		recs[r.name] = r
	}
	for _, tc := range []struct{ withUsage, without string }{
		{"openai/chat-stream-include-usage-length", "openai/chat-stream-no-usage"},
		{"openai/completions-stream-include-usage", "openai/completions-stream-no-usage"},
	} {
		t.Run(tc.withUsage, func(t *testing.T) {
			w, wo := recs[tc.withUsage], recs[tc.without]
			injected := play(w.api, false, true, w.body, nil)
			plain := play(wo.api, false, false, wo.body, nil)
			if diff := cmp.Diff(keyShapes(t, plain.Forwarded), keyShapes(t, injected.Forwarded)); diff != "" {
				t.Errorf("chunk shapes differ (-without usage +injected):\n%s", diff)
			}
		})
	}
}

// keyShapes returns the distinct ordered top-level key lists of the chunks of
// a stream, and whether it ends with [DONE].
func keyShapes(t *testing.T, stream []byte) []string {
	t.Helper()
	seen := map[string]bool{}
	var shapes []string
	var f Framer
	f.Feed(stream)
	for ev, ok := f.Next(); ok; ev, ok = f.Next() {
		data, _, _ := (&Stream{}).eventData(ev)
		if string(data) == "[DONE]" {
			shapes = append(shapes, "[DONE]")
			continue
		}
		obj, err := openObject(data, 0)
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for m, ok := obj.next(); ok; m, ok = obj.next() {
			keys = append(keys, string(m.key))
		}
		if shape := strings.Join(keys, ","); !seen[shape] {
			seen[shape] = true
			shapes = append(shapes, shape)
		}
	}
	return shapes
}
