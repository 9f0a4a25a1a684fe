package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
)

// caseVariantMembers are members whose keys differ from fields Count reads
// only by case: the provider ignores them, and so must Count.
var caseVariantMembers = []string{
	`"Max_Tokens":7`, `"N":3`, `"Stream":true`, `"Model":"gpt-3.5-turbo"`, `"MAX_COMPLETION_TOKENS":1`,
	`"GenerationConfig":{"MaxOutputTokens":9,"CandidateCount":5}`, `"Stream_Options":{"Include_Usage":true}`,
	`"generationConfig":{"MAXOUTPUTTOKENS":2,"candidatecount":6}`,
}

// withCaseVariants inserts the members selected by sel into the object
// body, first when sel is even, last when it is odd; other bodies are
// returned as they are.
func withCaseVariants(body string, sel uint16) string {
	t := strings.TrimSpace(body)
	if !json.Valid([]byte(t)) || !strings.HasPrefix(t, "{") {
		return body
	}
	var add []string
	for i, m := range caseVariantMembers {
		if sel&(2<<i) != 0 {
			add = append(add, m)
		}
	}
	if len(add) == 0 {
		return body
	}
	members := strings.Join(add, ",")
	inner := strings.TrimSpace(t[1 : len(t)-1])
	switch {
	case inner == "":
		return "{" + members + "}"
	case sel&1 == 0:
		return "{" + members + "," + t[1:]
	default:
		return t[:len(t)-1] + "," + members + "}"
	}
}

// reference reads what Count must report from a body decoded by
// encoding/json into maps: exact keys, and the last duplicate wins, as
// the providers read bodies.
type reference struct {
	model                string
	stream, includeUsage bool
	caps                 map[string]int // metered caps by dotted path
	badCap               bool
	choices, floor       int
	embedding            bool
}

func referenceRead(t *testing.T, api API, body []byte, maxCap int) (reference, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil || m == nil {
		return reference{}, false
	}
	r := reference{caps: map[string]int{}, choices: 1, floor: 1}
	r.model, _ = m["model"].(string)
	r.stream, _ = m["stream"].(bool)
	if so, ok := m["stream_options"].(map[string]any); ok {
		r.includeUsage, _ = so["include_usage"].(bool)
	}
	whole := func(v any, lo, hi int64) (int, bool) {
		n, ok := v.(json.Number)
		if !ok {
			return 0, false
		}
		i, err := strconv.ParseInt(string(n), 10, 64)
		return int(i), err == nil && i >= lo && i <= hi
	}
	readCap := func(obj map[string]any, path, key string) {
		v, ok := obj[key]
		if !ok || v == nil {
			return
		}
		// Any number up to maxCap is metered, rounded up, never below 0.
		n, ok := v.(json.Number)
		f, err := strconv.ParseFloat(string(n), 64)
		if ok && (err == nil || math.IsInf(f, -1)) && f <= float64(maxCap) {
			r.caps[path+key] = int(math.Ceil(max(f, 0)))
		} else {
			r.badCap = true
		}
	}
	count := func(v any) int {
		if v == nil {
			return 1
		}
		n, ok := whole(v, 1, 128)
		if !ok {
			return -1
		}
		return n
	}
	switch api {
	case ChatCompletions, Completions, Responses:
		for _, k := range []string{"max_tokens", "max_completion_tokens", "max_output_tokens"} {
			readCap(m, "", k)
		}
		if api == ChatCompletions {
			r.choices = count(m["n"])
		}
		if api == Completions {
			prompts := 0
			switch p := m["prompt"].(type) {
			case string:
				prompts = 1
			case []any:
				prompts = len(p)
				if !slices.ContainsFunc(p, func(x any) bool { _, isNum := x.(json.Number); return !isNum }) {
					prompts = 1
				}
			}
			r.choices = max(count(m["n"]), count(m["best_of"])) * max(prompts, 1)
		}
		if api == Responses {
			r.floor = 16
		}
	case Messages:
		readCap(m, "", "max_tokens")
		if th, ok := m["thinking"].(map[string]any); ok && th["type"] == "enabled" {
			if b, ok := whole(th["budget_tokens"], 1, math.MaxInt32); ok {
				r.floor = b + 1
			}
		}
	case Gemini:
		if m["contents"] == nil && (m["requests"] != nil || m["content"] != nil) {
			r.embedding = true
			break
		}
		for _, name := range []string{"generationConfig", "generation_config"} {
			cfg, ok := m[name].(map[string]any)
			if !ok {
				continue
			}
			readCap(cfg, name+".", "maxOutputTokens")
			readCap(cfg, name+".", "max_output_tokens")
			for _, k := range []string{"candidateCount", "candidate_count"} {
				if v, ok := cfg[k]; ok {
					r.choices = max(r.choices, count(v))
				}
			}
		}
	}
	return r, true
}

// canonical re-encodes a valid body through encoding/json's tokenizer with
// duplicate keys removed (the first position, the last value) and
// whitespace dropped: the same request as the provider sees it.
func canonical(t *testing.T, body []byte) []byte {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var value func() (any, error)
	type object struct {
		keys []string
		vals map[string]any
	}
	value = func() (any, error) {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		switch d := tok.(type) {
		case json.Delim:
			if d == '[' {
				var arr []any
				for dec.More() {
					v, err := value()
					if err != nil {
						return nil, err
					}
					arr = append(arr, v)
				}
				_, err := dec.Token()
				return arr, err
			}
			o := object{vals: map[string]any{}}
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return nil, err
				}
				v, err := value()
				if err != nil {
					return nil, err
				}
				key := k.(string)
				if _, dup := o.vals[key]; !dup {
					o.keys = append(o.keys, key)
				}
				o.vals[key] = v
			}
			_, err := dec.Token()
			return o, err
		}
		return tok, nil
	}
	v, err := value()
	if err != nil {
		t.Fatalf("canonical of a valid body: %v", err)
	}
	var out bytes.Buffer
	var write func(v any)
	write = func(v any) {
		switch x := v.(type) {
		case object:
			out.WriteByte('{')
			for i, k := range x.keys {
				if i > 0 {
					out.WriteByte(',')
				}
				b, _ := json.Marshal(k)
				out.Write(b)
				out.WriteByte(':')
				write(x.vals[k])
			}
			out.WriteByte('}')
		case []any:
			out.WriteByte('[')
			for i, e := range x {
				if i > 0 {
					out.WriteByte(',')
				}
				write(e)
			}
			out.WriteByte(']')
		case json.Number:
			out.WriteString(string(x))
		default:
			b, err := json.Marshal(x)
			if err != nil {
				t.Fatalf("canonical: %v", err)
			}
			out.Write(b)
		}
	}
	write(v)
	return out.Bytes()
}

// FuzzCountExactKeys checks Count against encoding/json on bodies with
// keys that differ only by case and repeated keys (S7, S23):
//   - Count accepts exactly the bodies encoding/json finds valid, and a
//     refused one gets a syntax error that names a byte offset;
//   - the caps, choices, stream flags, model and cap floor Count reports
//     are those read from encoding/json's maps (exact keys, the last
//     duplicate wins);
//   - the body re-encoded without duplicates and whitespace counts the same.
func FuzzCountExactKeys(f *testing.F) {
	for _, s := range []string{
		`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":90000,"Max_Tokens":10}`,
		`{"model":"gpt-4o","messages":[{"role":"user","content":"hi","Content":"long hidden text"}],"N":1,"n":5,"max_completion_tokens":3}`,
		`{"model":"gpt-4o","messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"b"}],"stream":true,"stream_options":{"include_usage":false},"stream_options":{"include_usage":true}}`,
		`{"model":"babbage-002","prompt":["a","b"],"n":2,"best_of":3,"max_tokens":9,"max_tokens":12}`,
		`{"model":"gpt-5","input":[{"role":"user","content":"x"}],"max_output_tokens":40,"tools":[{"type":"function","name":"f","parameters":{"properties":{"a":{"type":"string"},"a":{"type":"integer","enum":["x","y"]}}}}]}`,
		`{"model":"claude-sonnet-4-5","max_tokens":9000,"thinking":{"type":"enabled","budget_tokens":4000},"Thinking":{"type":"enabled","budget_tokens":8999},"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
		`{"contents":[{"parts":[{"text":"x"}]}],"generationConfig":{"maxOutputTokens":5},"generationConfig":{"candidateCount":2},"generation_config":{"max_output_tokens":7}}`,
		`{"requests":[{"content":{"parts":[{"text":"x"}]}}]}`,
		`{"model":"gpt-4o","messages":[{"role":"user","content":"caf\u00e9 \ud83d\ude00 \ud800 x"}],"max\u005ftokens":3}`,
		`{"model":"gpt-4o","messages":[],"max_tokens":1e3}`,
		`{"model":"gpt-4o","messages":[],"max_tokens":"10"}`,
		`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}`,
		`[{"model":"gpt-4o"}]`,
	} {
		f.Add(s, uint16(0), uint8(0))
		f.Add(s, uint16(0xffff), uint8(1))
	}
	apis := []API{ChatCompletions, Completions, Responses, Messages, Gemini}
	const maxCap = 100000
	c, err := New(Options{FallbackEncoding: O200kBase, MaxOutputTokens: maxCap, DefaultOutputTokens: 1000})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body string, sel uint16, apiSel uint8) {
		in := []byte(withCaseVariants(body, sel))
		api := apis[int(apiSel)%len(apis)]
		got, err := c.Count(Request{API: api, Body: in})
		var syn *syntaxError
		if valid := json.Valid(in); !valid {
			if !errors.As(err, &syn) || !errors.Is(err, ErrMalformed) {
				t.Fatalf("invalid JSON %q: Count error %v, want a syntax error", in, err)
			}
			return
		}
		if errors.As(err, &syn) {
			t.Fatalf("valid JSON %q: Count reports a syntax error: %v", in, err)
		}
		canon := canonical(t, in)
		got2, err2 := c.Count(Request{API: api, Body: canon})
		if (err == nil) != (err2 == nil) {
			t.Fatalf("Count(%q) error %v, but of its canonical form %q: %v", in, err, canon, err2)
		}
		if err != nil {
			for _, s := range []error{ErrMalformed, ErrUnknownAPI, ErrUnknownModel, ErrInvalidCap} {
				if errors.Is(err, s) != errors.Is(err2, s) {
					t.Fatalf("Count(%q) error %v, of its canonical form %q: %v", in, err, canon, err2)
				}
			}
			return
		}
		if utf8.Valid(in) {
			// encoding/json turns invalid UTF-8 into U+FFFD, which may count
			// differently from the bytes themselves.
			if diff := cmp.Diff(got, got2); diff != "" {
				t.Fatalf("Count(%q) and of its canonical form %q differ (-orig +canonical):\n%s", in, canon, diff)
			}
		}
		ref, ok := referenceRead(t, api, in, maxCap)
		if !ok {
			t.Fatalf("encoding/json cannot read %q as an object, Count could", in)
		}
		if ref.badCap {
			t.Fatalf("Count(%q) accepted a cap encoding/json reads as invalid", in)
		}
		wantCap := 0
		var wantFields []string
		for k, n := range ref.caps {
			wantCap = max(wantCap, n)
			wantFields = append(wantFields, k)
		}
		gotFields := slices.Clone(got.CapFields)
		slices.Sort(gotFields)
		slices.Sort(wantFields)
		if utf8.Valid(in) && got.Model != ref.model {
			t.Errorf("model %q, encoding/json reads %q", got.Model, ref.model)
		}
		if ref.embedding {
			if !got.Embedding {
				t.Errorf("%q is not read as an embedding", in)
			}
			return
		}
		if got.OutputCap != wantCap || !slices.Equal(gotFields, wantFields) || got.Choices != ref.choices ||
			got.Stream != ref.stream || got.IncludeUsage != ref.includeUsage || got.CapFloor != ref.floor {
			t.Errorf("Count(%q) as %s: cap %d %q, choices %d, stream %v, include_usage %v, floor %d; encoding/json reads %d %q, %d, %v, %v, %d",
				in, api, got.OutputCap, gotFields, got.Choices, got.Stream, got.IncludeUsage, got.CapFloor,
				wantCap, wantFields, ref.choices, ref.stream, ref.includeUsage, ref.floor)
		}
	})
}

// validate reports the first fault in src as a *syntaxError, or nil when
// src is one JSON value surrounded by optional whitespace.
func validate(src []byte) error {
	d, err := parseDoc(src)
	if err != nil {
		return err
	}
	d.release()
	return nil
}

// FuzzValidate checks the JSON validator against encoding/json on any
// input, including the offset of the first fault where encoding/json
// reports one.
func FuzzValidate(f *testing.F) {
	for _, s := range []string{`{}`, `{"a":[1,2.5e-3,true,null,"\u00e9"]}`, `{"a":`, `[1,]`, `"\x"`, "\"\x01\"", `01`, `-`, `1.`, `1e`, `tru`, `{"a" 1}`, `{} {}`, ` `} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		err := validate(in)
		var want *json.SyntaxError
		jerr := json.Unmarshal(in, new(json.RawMessage))
		if (err == nil) != (jerr == nil) {
			t.Fatalf("validate(%q) = %v, encoding/json says %v", in, err, jerr)
		}
		if err == nil {
			return
		}
		var syn *syntaxError
		if !errors.As(err, &syn) || syn.off < 0 || syn.off > len(in) {
			t.Fatalf("validate(%q) = %v: want a syntax error with an offset within the input", in, err)
		}
		if errors.As(jerr, &want) && !errors.Is(jerr, io.ErrUnexpectedEOF) && syn.what != "unexpected end of input" {
			// encoding/json's offset is one past the faulty byte.
			if int(want.Offset)-1 != syn.off && !strings.Contains(syn.what, "nesting") {
				t.Fatalf("validate(%q) = %v, encoding/json: %v at offset %d", in, err, jerr, want.Offset)
			}
		}
	})
}

// FuzzUnescape checks string decoding against encoding/json on any valid
// JSON string, and the keys members yields against encoding/json's.
func FuzzUnescape(f *testing.F) {
	for _, s := range []string{`"plain"`, `"a\nb\"c\\d\/e\u00e9\ud83d\ude00\ud800x\udc00\u0041"`, `"12345678\\9"`, `"\u12"`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var want string
		if json.Unmarshal([]byte(s), &want) != nil || !utf8.ValidString(s) {
			return
		}
		d, err := parseDoc([]byte(s))
		if err != nil {
			t.Fatalf("parseDoc(%q): %v", s, err)
		}
		defer d.release()
		if got := d.root().str(); got != want {
			t.Fatalf("str(%s) = %q, encoding/json %q", s, got, want)
		}
		obj := []byte(`{` + s + `:1}`)
		od, err := parseDoc(obj)
		if err != nil {
			t.Fatalf("parseDoc(%s): %v", obj, err)
		}
		defer od.release()
		for k := range od.root().members() {
			if string(k) != want {
				t.Fatalf("key of %s = %q, encoding/json %q", obj, k, want)
			}
		}
	})
}
