package tokenizer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
)

// Paths that fix how a body is read: by its API, by its model, or not at
// all (the body's own fields decide).
const (
	chatPath     = "/v1/chat/completions"
	messagesPath = "/v1/messages"
	geminiPath   = "/v1beta/models/gemini-2.0-flash:generateContent"
	azurePath    = "/openai/deployments/gpt-4/chat/completions?api-version=2024-10-21"
)

// precountEvery makes a Precount count every string value, from its first
// byte, and its closed pieces after every byte: small bodies then exercise
// everything a long prompt does.
func precountEvery(p *Precount) { p.min, p.step, p.check = 1, 1, 1 }

// precountChunks writes body to a new Precount in the chunks that cuts
// (increasing offsets inside body) delimit. Each chunk is a copy, which is
// scribbled over once written: a Precount that kept it would count garbage.
func precountChunks(c *Counter, path string, body []byte, cuts []int, tune func(*Precount)) *Precount {
	pre := c.NewPrecount(path)
	if tune != nil {
		tune(pre)
	}
	from := 0
	for _, to := range append(cuts, len(body)) {
		chunk := bytes.Clone(body[from:to])
		pre.Write(chunk)
		for i := range chunk {
			chunk[i] = '"'
		}
		from = to
	}
	return pre
}

// precountSame counts body with Count and with CountPrecounted after
// writing it in the chunks cuts delimit, and fails unless the two agree
// field by field, errors included. It returns the strings precounted and
// those Count used.
func precountSame(t testing.TB, c *Counter, path string, body []byte, cuts []int, tune func(*Precount)) (strs, used int) {
	t.Helper()
	want, wantErr := c.Count(Request{Path: path, Body: body})
	pre := precountChunks(c, path, body, cuts, tune)
	got, err := c.CountPrecounted(Request{Path: path, Body: body}, pre)
	if fmt.Sprint(err) != fmt.Sprint(wantErr) {
		t.Fatalf("%s %.300q cut at %v: error %v, Count says %v", path, body, cuts, err, wantErr)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("%s %.300q cut at %v: CountPrecounted differs from Count (-Count +CountPrecounted):\n%s", path, body, cuts, diff)
	}
	return pre.Precounted()
}

// everyCut checks body cut once at every offset, then written a byte at a
// time, and returns how many strings Count took from the Precount in all.
func everyCut(t *testing.T, c *Counter, path string, body []byte, tune func(*Precount)) (used int) {
	t.Helper()
	for i := 0; i <= len(body); i++ {
		_, u := precountSame(t, c, path, body, []int{i}, tune)
		used += u
	}
	bytewise := make([]int, 0, len(body))
	for i := 1; i < len(body); i++ {
		bytewise = append(bytewise, i)
	}
	_, u := precountSame(t, c, path, body, bytewise, tune)
	return used + u
}

// randomCuts returns up to n increasing offsets inside a body of size bytes.
func randomCuts(rng *rand.Rand, size, n int) []int {
	if size == 0 {
		return nil
	}
	cuts := make([]int, rng.IntN(n+1))
	for i := range cuts {
		cuts[i] = rng.IntN(size + 1)
	}
	slices.Sort(cuts)
	return cuts
}

// TestPrecountDecodes feeds JSON string contents through the Precount's
// decoder cut at every offset and requires exactly what unescape, which
// Count reads strings with, makes of them: every escape, surrogate pairs
// and their failures, and invalid UTF-8, split mid-sequence.
func TestPrecountDecodes(t *testing.T) {
	for _, raw := range []string{
		`plain text`, `a\nb\"c\\d\/e\bf\fg\rh\ti`, `caf\u00e9 \u00E9\u4e2D`,
		`\ud83d\ude00`, `x\ud83d\ude00y\uD83D\uDE00`, `\ud83d\ud83d\ude00`, `\ud800x`, `\udc00\ud800`,
		`\ud83d\n`, `\ud83d\u0041`, `\ud83d`, `\ud83d\\`, `\udc00`, `\ud83d\"`, `\ud800\ud800\ud800`,
		`\u0000\u001f`, "\xe6\x97\xa5\xe6\x9c", "\xff\xfe\xc3", "\xf0\x9f\x98\x80\xf0\x9f\x98", `\u00e9` + "\xe9",
	} {
		want := string(unescape([]byte(raw)))
		for cut := 0; cut <= len(raw); cut++ {
			if got := precountDecode(raw, []int{cut}); got != want {
				t.Errorf("%q cut at %d decodes to %q, want %q", raw, cut, got, want)
			}
		}
		every := make([]int, 0, len(raw))
		for i := 1; i < len(raw); i++ {
			every = append(every, i)
		}
		if got := precountDecode(raw, every); got != want {
			t.Errorf("%q a byte at a time decodes to %q, want %q", raw, got, want)
		}
	}
}

// precountDecode decodes raw, the inside of a JSON string, with the
// Precount's decoder, in the chunks cuts delimit.
func precountDecode(raw string, cuts []int) string {
	p := &Precount{inStr: true, keep: true, check: 1 << 30}
	from := 0
	for _, to := range append(cuts, len(raw)) {
		if end, ok := p.readString([]byte(raw[from:to]), 0); !ok || end >= 0 {
			return fmt.Sprintf("<fault: ok %v, end %d>", ok, end)
		}
		from = to
	}
	if end, ok := p.readString([]byte{'"'}, 0); !ok || end != 0 {
		return fmt.Sprintf("<fault at the closing quote: ok %v, end %d>", ok, end)
	}
	return string(p.text)
}

// FuzzPrecountDecode is TestPrecountDecodes on any valid string contents.
func FuzzPrecountDecode(f *testing.F) {
	for _, s := range []string{`a\nb\"c\\d\/e\u00e9\ud83d\ude00\ud800x\udc00\u0041`, `\ud83d\ud83d\ude00\ud83d\n`, "\xf0\x9f\x98 \xff"} {
		f.Add(s, uint64(1))
	}
	f.Fuzz(func(t *testing.T, raw string, seed uint64) {
		if _, err := parseDoc([]byte(`"` + raw + `"`)); err != nil {
			return
		}
		cuts := randomCuts(rand.New(rand.NewPCG(seed, 0)), len(raw), 8)
		if got, want := precountDecode(raw, cuts), string(unescape([]byte(raw))); got != want {
			t.Fatalf("%q cut at %v decodes to %q, want %q", raw, cuts, got, want)
		}
	})
}

// precountEdges are bodies where what a Precount sees cut at any byte could
// differ from the whole: escapes and surrogate pairs split mid-sequence,
// invalid UTF-8, pieces that only the next chunk closes, strings before
// "model", a model of another encoding, duplicate keys, nested values,
// strings Count counts only as part of other text.
var precountEdges = []struct{ path, body string }{
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"caf\u00e9 \ud83d\ude00 x\ud800y \udc00\ud83d\n\ud83d\u0041 \"q\" \\ \/ \b\f\r\t end"}]}`},
	{chatPath, "{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"\xe6\x97\xa5\xe6\x9c\xac \xff\xfe \xf0\x9f\x98 x \xc3\"}]}"},
	{chatPath, `{"messages":[{"role":"user","content":"It's   a  test\n\n  of  spaces   \n x"}],"model":"gpt-4o"}`},
	{chatPath, `{"messages":[{"role":"user","content":"It's   a  test\n\n  of  spaces   \n x"}],"model":"gpt-4"}`},
	{chatPath, `{"model":"gpt-4","model":"gpt-4o","messages":[{"role":"user","content":"first model loses"}]}`},
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"earlier, longer value that is dropped","content":"later"}]}`},
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"dropped"}],"messages":[{"role":"user","content":"kept"}]}`},
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"user","name":"bob","content":[{"type":"text","text":"part one"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"two"}]}],"tools":[{"type":"function","function":{"name":"f","description":"desc of f.","parameters":{"type":"object","properties":{"a":{"type":"string","description":"an a","enum":["x","y z"]}}}}}],"response_format":{"type":"json_schema","json_schema":{"name":"s","schema":{"type":"string"}}}}`},
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"a\":\"b\"}"}}]},{"role":"tool","content":"result text"}]}`},
	{chatPath, `{"model":{"nested":"gpt-4"},"messages":[{"role":"user","content":"x"}]}`},
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"unterminated`},
	{chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"bad \x escape"}]}`},
	{"/v1/completions", `{"model":"babbage-002","prompt":["one two","three"],"suffix":"tail"}`},
	{"/v1/embeddings", `{"input":"embed this text","model":"text-embedding-3-small"}`},
	{"/v1/responses", `{"model":"gpt-4o","instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"hello there"}]},{"type":"function_call_output","call_id":"c","output":"tool said this"}]}`},
	{"/v1/responses", `{"input":"plain string input","model":"gpt-5"}`},
	{messagesPath, `{"model":"claude-sonnet-4-5","max_tokens":100,"system":"sys prompt","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"nested result"}]}]}]}`},
	{geminiPath, `{"contents":[{"role":"user","parts":[{"text":"gemini text"},{"text":"more"}]}],"systemInstruction":{"parts":[{"text":"sys"}]}}`},
	{azurePath, `{"messages":[{"role":"user","content":"azure deployment names the model"}]}`},
	{"", `{"model":"gpt-4o","messages":[{"role":"user","content":"no path"}]}`},
	{"", `"a bare string"`},
}

// TestPrecountEdges checks every edge body cut at every byte, with every
// string value precounted, against Count (S7: the count is exact).
func TestPrecountEdges(t *testing.T) {
	c := newTestCounter(t)
	used := 0
	for _, e := range precountEdges {
		used += everyCut(t, c, e.path, []byte(e.body), precountEvery)
	}
	if used == 0 {
		t.Fatal("Count took no string from a Precount: nothing was compared")
	}
}

// TestPrecountUsed checks which strings Count takes from the Precount:
// long values counted in the encoding Count uses, never one counted in
// another, nor a duplicate key's earlier value, nor one whose open piece
// outgrew the bound.
func TestPrecountUsed(t *testing.T) {
	c := newTestCounter(t)
	long := strings.Repeat("Lorem ipsum dolor sit amet, 漢字 \\u00e9\\ud83d\\ude00 42. ", 200) // ~10 KB raw
	msgs := `"messages":[{"role":"user","content":"` + long + `"},{"role":"user","content":[{"type":"text","text":"` + long + `"}]}]`
	for _, tc := range []struct {
		name, path, body string
		strs, used       int
		chunks           bool // cut only in chunks of equal size (else the last may bring most of the string)
	}{
		{"model first", chatPath, `{"model":"gpt-4o",` + msgs + `}`, 2, 2, false},
		{"model last", chatPath, `{` + msgs + `,"model":"gpt-4o"}`, 2, 2, false},
		{"model last, of another encoding", chatPath, `{` + msgs + `,"model":"gpt-4"}`, 0, 0, false},
		{"model first, of another encoding", chatPath, `{"model":"gpt-4",` + msgs + `}`, 2, 2, false},
		{"a later model of another encoding", chatPath, `{"model":"gpt-4o",` + msgs + `,"model":"gpt-4"}`, 0, 0, false},
		{"model by the path", geminiPath, `{"contents":[{"parts":[{"text":"` + long + `"}]}],"model":"gpt-4"}`, 1, 1, false},
		{"duplicate key, the earlier long", chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"` + long + `","content":"short"}]}`, 1, 0, false},
		{"duplicate messages", chatPath, `{"model":"gpt-4o",` + msgs + `,"messages":[]}`, 2, 0, false},
		{"counted only within other text", chatPath, `{"model":"gpt-4o","messages":[],"tools":[{"type":"function","function":{"name":"f","description":"` + long + `"}}]}`, 1, 0, false},
		{"a long key", chatPath, `{"model":"gpt-4o","` + long + `":"x","messages":[{"role":"user","content":"x"}]}`, 0, 0, false},
		{"a piece of 100 KiB", chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("a", 100<<10) + `"}]}`, 1, 1, false},
		{"a piece past the bound", chatPath, `{"model":"gpt-4o","messages":[{"role":"user","content":" x` + strings.Repeat("a", precountMaxOpen+1) + `"}]}`, 0, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			rng := rand.New(rand.NewPCG(7, uint64(len(body))))
			cutss := [][]int{chunked(len(body), 1000), chunked(len(body), 32<<10)}
			if !tc.chunks {
				cutss = append(cutss, nil, randomCuts(rng, len(body), 40))
			}
			for _, cuts := range cutss {
				strs, used := precountSame(t, c, tc.path, body, cuts, nil)
				if strs != tc.strs || used != tc.used {
					t.Fatalf("cut at %d offsets: %d strings precounted, %d used; want %d, %d", len(cuts), strs, used, tc.strs, tc.used)
				}
			}
		})
	}
}

// chunked returns the cuts of a body of size bytes into chunks of n.
func chunked(size, n int) []int {
	var cuts []int
	for i := n; i < size; i += n {
		cuts = append(cuts, i)
	}
	return cuts
}

// TestPrecountRecorded counts every recorded request (chat, responses,
// completions, embeddings, Anthropic messages, Gemini), with every string
// value precounted, cut at every byte (at 100 places in longer bodies)
// and at random, against Count; and with the thresholds as they are.
func TestPrecountRecorded(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(3, 4))
	used, bodies := 0, 0
	for _, m := range loadCases(t) {
		if _, err := os.Stat(filepath.Join(m.dir, "request.json")); err != nil {
			continue // a recording of tokenizer vectors, not of a request
		}
		body := m.request(t)
		bodies++
		step := max(1, len(body)/100)
		if len(body) <= 400 {
			step = 1
		}
		for i := 0; i <= len(body); i += step {
			_, u := precountSame(t, c, m.Path, body, []int{i}, precountEvery)
			used += u
		}
		for range 4 {
			precountSame(t, c, m.Path, body, randomCuts(rng, len(body), 30), precountEvery)
			precountSame(t, c, m.Path, body, randomCuts(rng, len(body), 30), nil)
		}
	}
	if bodies < 50 || used == 0 {
		t.Fatalf("%d recorded bodies, %d strings used from a Precount: the recordings are missing", bodies, used)
	}
}

// randomBody returns a request body of a random shape and model whose
// strings hold the differential texts with random escapes, lone
// surrogates, invalid UTF-8 and, now and then, several KB of text, with
// keys in random order and now and then twice.
func randomBody(rng *rand.Rand) (path string, body []byte) {
	str := func() string {
		var b strings.Builder
		for range 1 + rng.IntN(4) {
			b.WriteString(differentialSeeds[rng.IntN(len(differentialSeeds))])
		}
		if rng.IntN(8) == 0 {
			for b.Len() < precountMin+rng.IntN(3*precountMin) {
				b.WriteString(differentialSeeds[rng.IntN(len(differentialSeeds))])
				b.WriteByte(" \n."[rng.IntN(3)])
			}
		}
		return jsonString(rng, b.String())
	}
	members := func(ms ...string) string {
		if rng.IntN(6) == 0 && len(ms) > 0 {
			ms = append(ms, ms[rng.IntN(len(ms))]) // a duplicate key
		}
		rng.Shuffle(len(ms), func(i, j int) { ms[i], ms[j] = ms[j], ms[i] })
		return "{" + strings.Join(ms, ",") + "}"
	}
	list := func(n int, elem func() string) string {
		var es []string
		for range n {
			es = append(es, elem())
		}
		return "[" + strings.Join(es, ",") + "]"
	}
	model := []string{`"gpt-4o"`, `"gpt-4"`, `"gpt-4o-mini"`, `"claude-sonnet-4-5"`, `"unknown-model"`, `"gpt-5"`}[rng.IntN(6)]
	switch rng.IntN(6) {
	case 0:
		return chatPath, []byte(members(`"model":`+model, `"messages":`+list(1+rng.IntN(3), func() string {
			if rng.IntN(2) == 0 {
				return members(`"role":"user"`, `"content":`+str())
			}
			return members(`"role":"user"`, `"content":`+list(1+rng.IntN(2), func() string {
				return members(`"type":"text"`, `"text":`+str())
			}))
		}), `"max_tokens":50`))
	case 1:
		return messagesPath, []byte(members(`"model":`+model, `"max_tokens":100`, `"system":`+str(), `"messages":`+list(1+rng.IntN(2), func() string {
			return members(`"role":"user"`, `"content":`+list(1, func() string { return members(`"type":"text"`, `"text":`+str()) }))
		})))
	case 2:
		return geminiPath, []byte(members(`"contents":` + list(1+rng.IntN(2), func() string {
			return members(`"role":"user"`, `"parts":`+list(1+rng.IntN(2), func() string { return members(`"text":` + str()) }))
		})))
	case 3:
		return "/v1/responses", []byte(members(`"model":`+model, `"instructions":`+str(), `"input":`+str()))
	case 4:
		return "/v1/completions", []byte(members(`"model":`+model, `"prompt":`+list(1+rng.IntN(3), str)))
	}
	return "", []byte(members(`"model":`+model, `"messages":`+list(1, func() string { return members(`"role":"user"`, `"content":`+str()) })))
}

// jsonString encodes s as a JSON string, escaping at random what need not
// be, writing astral characters as surrogate pairs now and then, and
// slipping in lone surrogates.
func jsonString(rng *rand.Rand, s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		raw := s[i : i+n]
		i += n
		switch {
		case r == utf8.RuneError && n == 1:
			b.WriteString(raw) // invalid UTF-8 stays as it is
		case r == '"' || r == '\\' || r < 0x20 || rng.IntN(12) == 0:
			if r > 0xFFFF {
				fmt.Fprintf(&b, `\u%04x\u%04X`, 0xD800+(r-0x10000)>>10, 0xDC00+(r-0x10000)&0x3FF)
			} else if short := map[rune]string{'"': `\"`, '\\': `\\`, '\n': `\n`, '\t': `\t`, '/': `\/`}[r]; short != "" && rng.IntN(2) == 0 {
				b.WriteString(short)
			} else {
				fmt.Fprintf(&b, `\u%04x`, r)
			}
		default:
			b.WriteString(raw)
		}
		if rng.IntN(40) == 0 {
			b.WriteString([]string{`\ud800`, `\udfff`, `\ud83d\u0041`, `\ud83d\n`}[rng.IntN(4)])
		}
	}
	b.WriteByte('"')
	return b.String()
}

// TestPrecountRandom counts random bodies cut at random, with every string
// precounted and with the thresholds as they are, against Count.
func TestPrecountRandom(t *testing.T) {
	c := newTestCounter(t)
	rng := rand.New(rand.NewPCG(5, 6))
	n := 200
	if testing.Short() {
		n = 60
	}
	used := 0
	for range n {
		path, body := randomBody(rng)
		for range 3 {
			_, u := precountSame(t, c, path, body, randomCuts(rng, len(body), 20), precountEvery)
			used += u
			_, u = precountSame(t, c, path, body, chunked(len(body), 1+rng.IntN(2000)), nil)
			used += u
		}
	}
	if used == 0 {
		t.Fatal("Count took no string from a Precount: nothing was compared")
	}
}

// FuzzPrecount counts any body cut at random against Count, with every
// string precounted or the thresholds as they are.
func FuzzPrecount(f *testing.F) {
	for _, e := range precountEdges {
		f.Add([]byte(e.body), uint64(1), uint8(0))
	}
	rng := rand.New(rand.NewPCG(8, 9))
	for i := range 4 {
		_, body := randomBody(rng)
		f.Add(body, uint64(i), uint8(i))
	}
	paths := []string{chatPath, messagesPath, geminiPath, "/v1/responses", "/v1/completions", azurePath, "", "/v1/embeddings"}
	f.Fuzz(func(t *testing.T, body []byte, seed uint64, mode uint8) {
		rng := rand.New(rand.NewPCG(seed, uint64(mode)))
		var tune func(*Precount)
		if mode&1 == 0 {
			tune = precountEvery
		}
		precountSame(t, newFuzzCounter(t), paths[int(mode>>1)%len(paths)], body, randomCuts(rng, len(body), 16), tune)
	})
}

// fuzzCounter is shared by the iterations of a fuzz target.
var fuzzCounter = sync.OnceValues(func() (*Counter, error) { return New(Options{}) })

func newFuzzCounter(t *testing.T) *Counter {
	c, err := fuzzCounter()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestPrecountMisuse: a Precount given another body, or another
// Counter's, or nothing, changes nothing.
func TestPrecountMisuse(t *testing.T) {
	c := newTestCounter(t)
	body := []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"the prompt as written"}]}`)
	other := bytes.Replace(body, []byte("written"), []byte("changed"), 1)
	pre := precountChunks(c, chatPath, body, []int{30}, precountEvery)
	for _, tc := range []struct {
		name string
		c    *Counter
		body []byte
		pre  *Precount
		used int // the strings of body that other has too: "user"
	}{
		{"another body of the same length", c, other, pre, 1},
		{"a longer body", c, append(slices.Clone(body), ' '), pre, 0},
		{"another Counter", newTestCounter(t), body, pre, 0},
		{"no Precount", c, body, nil, 0},
	} {
		want, err := tc.c.Count(Request{Path: chatPath, Body: tc.body})
		if err != nil {
			t.Fatal(err)
		}
		_, before := pre.Precounted()
		got, err := tc.c.CountPrecounted(Request{Path: chatPath, Body: tc.body}, tc.pre)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%s: (-Count +CountPrecounted):\n%s", tc.name, diff)
		}
		if _, after := pre.Precounted(); after-before != tc.used {
			t.Errorf("%s: Count took %d strings from the Precount, want %d", tc.name, after-before, tc.used)
		}
	}
}

// BenchmarkPrecount counts a 4 MB chat prompt whole ("count") and written
// in 32 KiB chunks to a Precount first ("precount": the chunks, then the
// count, with "final-ms" the count after the last chunk), in the same
// iterations; cost is precount's time over count's.
//
//	go test ./tokenizer -run '^$' -bench Precount -benchtime 5x
func BenchmarkPrecount(b *testing.B) {
	c, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	var sb strings.Builder
	sb.WriteString(`{"messages":[{"role":"user","content":"`)
	for sb.Len() < 4<<20 {
		sb.WriteString(differentialSeeds[sb.Len()%len(differentialSeeds)])
		sb.WriteString(` \"quoted\" \u00e9\ud83d\ude00. `)
	}
	sb.WriteString(`"}],"model":"gpt-4o"}`)
	body := []byte(sb.String())
	req := Request{Path: chatPath, Body: body}
	var whole, pre, final time.Duration
	for b.Loop() {
		start := time.Now()
		want, err := c.Count(req)
		if err != nil {
			b.Fatal(err)
		}
		whole += time.Since(start)
		start = time.Now()
		p := precountChunks(c, chatPath, body, chunked(len(body), 32<<10), nil)
		last := time.Now()
		got, err := c.CountPrecounted(req, p)
		final += time.Since(last)
		pre += time.Since(start)
		if err != nil || got.InputTokens != want.InputTokens {
			b.Fatalf("precounted %d, %v; Count %d", got.InputTokens, err, want.InputTokens)
		}
	}
	b.ReportMetric(float64(pre)/float64(whole), "cost")
	b.ReportMetric(float64(final.Microseconds())/1e3/float64(b.N), "final-ms")
	b.ReportMetric(float64(whole.Microseconds())/1e3/float64(b.N), "count-ms")
}
