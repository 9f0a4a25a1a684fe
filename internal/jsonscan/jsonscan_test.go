package jsonscan

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/internal/jsonstr"
)

// valid reports whether Value accepts in as one JSON value with only white
// space around it, and checks that a refusal is a *jsonstr.Error at an
// offset inside the input.
func valid(t *testing.T, in []byte) bool {
	t.Helper()
	end, err := Value(in, 0)
	if err != nil {
		var e *jsonstr.Error
		if !errors.As(err, &e) || e.Off < 0 || e.Off > len(in) {
			t.Fatalf("Value(%q) error %v (%T), want a *jsonstr.Error at an offset within the input", in, err, err)
		}
		return false
	}
	if end <= 0 || end > len(in) {
		t.Fatalf("Value(%q) ends at %d, outside the input", in, end)
	}
	return Space(in, end) == len(in)
}

// TestValueAgreesWithEncodingJSON: the scanner accepts what encoding/json
// accepts, on a table of tricky values.
func TestValueAgreesWithEncodingJSON(t *testing.T) {
	for _, in := range []string{
		`0`, `-0.5e+10`, `1E3`, `true`, `null`, `"a\"b"`, `[]`, `{}`, `[1,[2,{"a":[]}]]`, ` { "a" : 1 , "b" : [ ] } `,
		`01`, `-`, `1.`, `.5`, `1e`, `tru`, `nul`, `[1,]`, `"\x"`, `"\u12"`, `"\u12G4"`, `"\`, `{"a"}`, `{"a":1,}`, `{,}`, `[`, `"abc`, "\"a\x01\"", `{"a":1 "b":2}`,
		`{"a":1}}`, `[1] 2`, ``, ` `,
	} {
		if got, want := valid(t, []byte(in)), json.Valid([]byte(in)); got != want {
			t.Errorf("Value(%q) valid = %v, encoding/json says %v", in, got, want)
		}
	}
}

// TestValueDepthBound: nesting past MaxDepth is refused, not recursed into.
func TestValueDepthBound(t *testing.T) {
	ok := strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth)
	if !valid(t, []byte(ok)) {
		t.Errorf("%d levels refused", MaxDepth)
	}
	deep := "[" + ok + "]"
	if _, err := Value([]byte(deep), 0); err == nil || !strings.Contains(err.Error(), "nesting deeper than") {
		t.Errorf("%d levels: error %v, want the nesting bound", MaxDepth+1, err)
	}
}

// FuzzValue: on any input Value never panics, and agrees with encoding/json
// on what is one valid value (inputs under the depth bound).
func FuzzValue(f *testing.F) {
	for _, s := range []string{`{"a":[1,2,{"b":null}],"c":"\u00e9"}`, `[1e5,-0.0,true,false]`, `"\ud800"`, `{"a":1,}`, "\"\xff\""} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if strings.Count(string(in), "[")+strings.Count(string(in), "{") >= MaxDepth {
			return
		}
		if got, want := valid(t, in), json.Valid(in); got != want {
			t.Fatalf("Value(%q) valid = %v, encoding/json says %v", in, got, want)
		}
	})
}
