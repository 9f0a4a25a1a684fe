package extproc

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/tokengate/tokengate/internal/jsonscan"
	"github.com/tokengate/tokengate/internal/jsonstr"
	"github.com/tokengate/tokengate/tokenizer"
)

// rewriteBody returns body with stream_options.include_usage set when
// injectUsage (S15) and, when clampTotal > 0 (clamp_output), its output
// capped so that the whole request generates at most clampTotal tokens:
// each cap field the tokenizer found (c.CapFields) is lowered to
// c.ChoiceCap(clampTotal), a per-choice value, and never raised; a body
// without a cap gets c.AddCapField. ChoiceCap keeps the cap at or above the
// least the provider accepts (16 for Responses, thinking.budget_tokens + 1
// for Anthropic extended thinking).
//
// Keys are matched exactly, as the provider matches them, and every
// occurrence of a repeated key is rewritten, so the provider sees the new
// value whichever duplicate it reads; an added member goes last, where it
// wins. Everything else is kept byte for byte. The body was already
// parsed by the tokenizer, so an error here means a shape the rewrite
// cannot handle.
func rewriteBody(c tokenizer.Count, body []byte, injectUsage bool, clampTotal int) ([]byte, error) {
	top, err := readObject(body, 0)
	if err != nil {
		return nil, fmt.Errorf("rewrite request body: %w", err)
	}
	var edits []edit
	if injectUsage {
		e, err := includeUsage(body, &top)
		if err != nil {
			return nil, fmt.Errorf("rewrite request body: %w", err)
		}
		edits = append(edits, e...)
	}
	if clampTotal > 0 {
		if perChoice, ok := c.ChoiceCap(clampTotal); ok {
			e, err := clampCaps(body, &top, c, perChoice)
			if err != nil {
				return nil, fmt.Errorf("rewrite request body: %w", err)
			}
			edits = append(edits, e...)
		}
	}
	return applyEdits(body, edits), nil
}

// includeUsage sets stream_options.include_usage to true in every
// stream_options, adding one when there is none.
func includeUsage(body []byte, top *object) ([]edit, error) {
	const opts = `{"include_usage":true}`
	occ := top.all("stream_options")
	if len(occ) == 0 {
		return []edit{top.add(`"stream_options":` + opts)}, nil
	}
	var edits []edit
	for _, m := range occ {
		switch v := body[m.start:m.end]; v[0] {
		case 'n':
			edits = append(edits, edit{m.start, m.end, opts})
		case '{':
			so, err := readObject(body, m.start)
			if err != nil {
				return nil, fmt.Errorf("stream_options: %w", err)
			}
			iu := so.all("include_usage")
			if len(iu) == 0 {
				edits = append(edits, so.add(`"include_usage":true`))
			}
			for _, u := range iu {
				edits = append(edits, edit{u.start, u.end, "true"})
			}
		default:
			return nil, errors.New("stream_options is not an object")
		}
	}
	return edits, nil
}

// clampCaps lowers every occurrence of each cap field of c above perChoice
// to perChoice, or adds c.AddCapField when the body sets no cap.
func clampCaps(body []byte, top *object, c tokenizer.Count, perChoice int) ([]edit, error) {
	value := strconv.Itoa(perChoice)
	var edits []edit
	lower := func(ms []member) {
		for _, m := range ms {
			if n, err := strconv.ParseFloat(string(body[m.start:m.end]), 64); err == nil && n > float64(perChoice) {
				edits = append(edits, edit{m.start, m.end, value})
			}
		}
	}
	for _, field := range c.CapFields {
		outer, inner, nested := strings.Cut(field, ".")
		if !nested {
			lower(top.all(outer))
			continue
		}
		for _, m := range top.all(outer) {
			if body[m.start] != '{' {
				continue
			}
			obj, err := readObject(body, m.start)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", outer, err)
			}
			lower(obj.all(inner))
		}
	}
	if len(c.CapFields) > 0 || c.AddCapField == "" {
		return edits, nil
	}
	outer, inner, nested := strings.Cut(c.AddCapField, ".")
	if !nested {
		return []edit{top.add(strconv.Quote(outer) + ":" + value)}, nil
	}
	occ := top.all(outer)
	if len(occ) == 0 {
		return []edit{top.add(strconv.Quote(outer) + ":{" + strconv.Quote(inner) + ":" + value + "}")}, nil
	}
	for _, m := range occ {
		switch body[m.start] {
		case '{':
			obj, err := readObject(body, m.start)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", outer, err)
			}
			edits = append(edits, obj.add(strconv.Quote(inner)+":"+value))
		case 'n':
			edits = append(edits, edit{m.start, m.end, "{" + strconv.Quote(inner) + ":" + value + "}"})
		default:
			return nil, fmt.Errorf("%s is not an object", outer)
		}
	}
	return edits, nil
}

// object is a JSON object of the body: its members and where its closing
// brace is.
type object struct {
	members []member
	close   int // offset of the closing '}'
	added   int // members added by edits
}

// member is one member of an object: its exact key and the offsets of its
// value in the body.
type member struct {
	key        string
	start, end int
}

// all returns every member named key, in order.
func (o object) all(key string) []member {
	var ms []member
	for _, m := range o.members {
		if m.key == key {
			ms = append(ms, m)
		}
	}
	return ms
}

// add returns the edit that appends a member (its text) to the object.
// Edits at one place apply in the order they were made.
func (o *object) add(memberText string) edit {
	if len(o.members)+o.added > 0 {
		memberText = "," + memberText
	}
	o.added++
	return edit{o.close, o.close, memberText}
}

// readObject reads the object that starts at offset at of body (after
// optional whitespace) in place, as encoding/json would: keys are matched
// exactly, their escapes decoded (package jsonstr); values are stepped
// over (package jsonscan). Its errors name an offset, never text of the
// body.
func readObject(body []byte, at int) (object, error) {
	i := jsonscan.Space(body, at)
	if i >= len(body) || body[i] != '{' {
		return object{}, fmt.Errorf("not a JSON object at byte %d", at)
	}
	var o object
	if i = jsonscan.Space(body, i+1); i < len(body) && body[i] == '}' {
		o.close = i
	} else {
		if err := o.read(body, i); err != nil {
			return object{}, err
		}
	}
	if at == 0 && jsonscan.Space(body, o.close+1) != len(body) {
		// The body itself: nothing may follow it.
		return object{}, invalid(o.close + 1)
	}
	return o, nil
}

// read reads the members from the first key's quote at body[i] to the
// closing brace.
func (o *object) read(body []byte, i int) error {
	for {
		if i >= len(body) || body[i] != '"' {
			return invalid(i)
		}
		end, err := jsonstr.Scan(body, i)
		if err != nil {
			return invalid(i)
		}
		key := body[i+1 : end-1]
		i = jsonscan.Space(body, end)
		if i >= len(body) || body[i] != ':' {
			return invalid(i)
		}
		start := jsonscan.Space(body, i+1)
		if end, err = jsonscan.Value(body, start); err != nil {
			return invalid(start)
		}
		o.members = append(o.members, member{key: decodedKey(key), start: start, end: end})
		switch i = jsonscan.Space(body, end); {
		case i < len(body) && body[i] == ',':
			i = jsonscan.Space(body, i+1)
		case i < len(body) && body[i] == '}':
			o.close = i
			return nil
		default:
			return invalid(i)
		}
	}
}

// invalid is the error of a body that is not valid JSON at byte off.
func invalid(off int) error { return fmt.Errorf("not a valid JSON object at byte %d", off) }

// decodedKey is the key whose inside (between its quotes) is raw. Invalid
// UTF-8 is kept as it is, where encoding/json would put U+FFFD: either
// way such a key is none of the fields a rewrite looks for.
func decodedKey(raw []byte) string {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw)
	}
	return string(jsonstr.Append(nil, raw))
}

// edit replaces body[start:end] with text.
type edit struct {
	start, end int
	text       string
}

// applyEdits returns a copy of body with non-overlapping edits applied.
func applyEdits(body []byte, edits []edit) []byte {
	slices.SortStableFunc(edits, func(a, b edit) int { return a.start - b.start })
	n := len(body)
	for _, e := range edits {
		n += len(e.text) - (e.end - e.start)
	}
	out := make([]byte, 0, n)
	last := 0
	for _, e := range edits {
		out = append(out, body[last:e.start]...)
		out = append(out, e.text...)
		last = e.end
	}
	return append(out, body[last:]...)
}
