package provider

// This file holds the one-pass reader of the common OpenAI chunk. The
// general reader in observeOpenAI walks the members of the chunk, which
// skips each value once, and then walks the choices, each choice and its
// delta again. A stream is made of hundreds of such chunks, so the common
// shape is read here in a single pass over the bytes instead.
//
// The one-pass reader accepts only well-formed chunks whose meaning it can
// take completely; for anything else (a syntax error, a choice that is not
// an object, a usage member that is not null, more choices than it stages)
// it reports false without having changed the Stream, and the general
// reader runs, with its errors. It therefore never changes what Observe
// returns; it only returns it sooner.

import "github.com/tokengate/tokengate/internal/jsonstr"

// maxFastChoices is the number of choices a chunk may carry for the
// one-pass reader; more go to the general reader.
const maxFastChoices = 8

// fastChunk is what the one-pass reader stages before it commits a chunk
// to the Stream.
type fastChunk struct {
	id, object, created, model []byte // last value keep would store, or nil
	choices                    [maxFastChoices]choice
	nChoices                   int // choices staged
	usage                      member
	usagePrevEnd               int
	hasUsage                   bool
}

// fastOpenAI reads a chat.completion.chunk or text_completion chunk in one
// pass. It reports false, with the Stream unchanged apart from s.text
// (which Observe resets per event), when the chunk needs the general reader.
func (s *Stream) fastOpenAI(ev *Event, event, data []byte, off, n int) bool {
	var c fastChunk
	if !s.fastChunkObject(&c, data) {
		s.text = s.text[:0]
		return false
	}
	for _, k := range [...]struct {
		dst *[]byte
		v   []byte
	}{{&s.id, c.id}, {&s.object, c.object}, {&s.created, c.created}, {&s.model, c.model}} {
		if k.v != nil {
			keep(k.dst, k.v)
		}
	}
	for _, ch := range c.choices[:c.nChoices] {
		s.markChoice(ch.index, ch.finished)
	}
	// A usage member is null here (others go to the general reader): the
	// chunk carries no usage, and the member is dropped when tokengate
	// asked for it, as observeOpenAI does.
	if c.hasUsage && s.hideUsage {
		ev.Forward = cutMember(event, data, off, n, c.usage, c.usagePrevEnd)
	}
	return true
}

// fastChunkObject reads the chunk object that is the whole of data.
func (s *Stream) fastChunkObject(c *fastChunk, data []byte) bool {
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return false
	}
	i = skipSpace(data, i+1)
	prevEnd := -1
	if i < len(data) && data[i] == '}' {
		i++
	} else {
		for {
			start := i
			key, vs, ok := plainKey(data, i)
			if !ok {
				return false
			}
			var ve int
			var err error
			switch string(key) {
			case "choices":
				if ve, ok = s.fastChoices(c, data, vs); !ok {
					return false
				}
			default:
				if ve, err = skipValue(data, vs); err != nil {
					return false
				}
				v := data[vs:ve]
				switch string(key) {
				case "id":
					stage(&c.id, v)
				case "object":
					stage(&c.object, v)
				case "created":
					stage(&c.created, v)
				case "model":
					stage(&c.model, v)
				case "usage":
					if !isNull(v) {
						return false
					}
					c.usage = member{key: key, start: start, valueStart: vs, valueEnd: ve}
					c.usagePrevEnd, c.hasUsage = prevEnd, true
				}
			}
			prevEnd = ve
			i = skipSpace(data, ve)
			if i >= len(data) {
				return false
			}
			if data[i] == '}' {
				i++
				break
			}
			if data[i] != ',' {
				return false
			}
			i = skipSpace(data, i+1)
		}
	}
	return skipSpace(data, i) == len(data)
}

// stage records v as the value keep would store last.
func stage(dst *[]byte, v []byte) {
	if keepable(v) {
		*dst = v
	}
}

// plainKey reads an object key without escapes at b[i] and the colon after
// it, and returns the key and the offset of the value (white space
// skipped).
func plainKey(b []byte, i int) (key []byte, valueStart int, ok bool) {
	if i >= len(b) || b[i] != '"' {
		return nil, 0, false
	}
	j := jsonstr.Plain(b, i+1)
	if j >= len(b) || b[j] != '"' {
		return nil, 0, false // an escape or a control character: the general reader decides
	}
	k := skipSpace(b, j+1)
	if k >= len(b) || b[k] != ':' {
		return nil, 0, false
	}
	return b[i+1 : j], skipSpace(b, k+1), true
}

// fastChoices reads the choices value at b[i] and returns its end. The
// nesting depths passed on are those the general reader checks when it
// skips the whole choices value.
func (s *Stream) fastChoices(c *fastChunk, b []byte, i int) (int, bool) {
	if i >= len(b) {
		return 0, false
	}
	if b[i] == 'n' {
		end, err := skipLiteral(b, i, "null")
		if err != nil {
			return 0, false
		}
		return end, true
	}
	if b[i] != '[' {
		return 0, false
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1, true
	}
	for {
		if c.nChoices == maxFastChoices {
			return 0, false
		}
		end, ch, ok := s.fastChoice(b, i)
		if !ok {
			return 0, false
		}
		c.choices[c.nChoices] = ch
		c.nChoices++
		i = skipSpace(b, end)
		if i >= len(b) {
			return 0, false
		}
		if b[i] == ']' {
			return i + 1, true
		}
		if b[i] != ',' {
			return 0, false
		}
		i = skipSpace(b, i+1)
	}
}

// fastChoice reads one choice object at b[i] (depth 1 in the choices
// value).
func (s *Stream) fastChoice(b []byte, i int) (end int, ch choice, ok bool) {
	if i >= len(b) || b[i] != '{' {
		return 0, ch, false
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1, ch, true
	}
	for {
		key, vs, ok := plainKey(b, i)
		if !ok {
			return 0, ch, false
		}
		var ve int
		var err error
		switch string(key) {
		case "delta":
			if ve, ok = s.fastDelta(b, vs); !ok {
				return 0, ch, false
			}
		default:
			if ve, err = skipValueDepth(b, vs, 2); err != nil {
				return 0, ch, false
			}
			v := b[vs:ve]
			switch string(key) {
			case "index":
				if ch.index, err = parseCount(v); err != nil {
					return 0, ch, false
				}
			case "finish_reason":
				ch.finished = !isNull(v)
			case "text":
				if s.appendString(v) != nil {
					return 0, ch, false
				}
			}
		}
		i = skipSpace(b, ve)
		if i >= len(b) {
			return 0, ch, false
		}
		if b[i] == '}' {
			return i + 1, ch, true
		}
		if b[i] != ',' {
			return 0, ch, false
		}
		i = skipSpace(b, i+1)
	}
}

// fastDelta reads a choice's delta at b[i] (depth 2 in the choices value)
// and appends its output text as chatDelta does.
func (s *Stream) fastDelta(b []byte, i int) (int, bool) {
	if i >= len(b) {
		return 0, false
	}
	if b[i] == 'n' {
		end, err := skipLiteral(b, i, "null")
		return end, err == nil
	}
	if b[i] != '{' {
		return 0, false
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1, true
	}
	for {
		key, vs, ok := plainKey(b, i)
		if !ok {
			return 0, false
		}
		ve, err := skipValueDepth(b, vs, 3)
		if err != nil {
			return 0, false
		}
		v := b[vs:ve]
		switch string(key) {
		case "content", "refusal", "reasoning", "reasoning_content":
			err = s.appendString(v)
		case "function_call":
			err = s.appendStrings(v, "name", "arguments")
		case "audio":
			err = s.appendStrings(v, "transcript")
		case "tool_calls":
			err = s.toolCalls(v)
		}
		if err != nil {
			return 0, false
		}
		i = skipSpace(b, ve)
		if i >= len(b) {
			return 0, false
		}
		if b[i] == '}' {
			return i + 1, true
		}
		if b[i] != ',' {
			return 0, false
		}
		i = skipSpace(b, i+1)
	}
}
