package provider

import "bytes"

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
	// texts counts the strings the chunk's text came from (2 for any
	// text read from tool calls, function calls or audio), text is the
	// span of the last; pads counts its obfuscation members, pad is the
	// span of the last one's value. See chunkShape.
	texts, pads int
	text, pad   span
}

// span is the span of a JSON value in a chunk's data.
type span struct{ start, end int }

// chunkShape is the last chunk that the one-pass reader read whole and
// that took its text from one string — in a stream, the next chunk is
// mostly the same bytes with another text in that string, and another
// random padding in the string of its "obfuscation" member, which OpenAI
// adds to every chunk. Such a chunk is read by comparing its bytes with
// the shape's and reading its strings alone: the same bytes read the same
// way, and reading them again would change nothing the Stream keeps
// (keep and markChoice store what they hold already), but its text. Any
// other reading of the Stream forgets the shape (forget).
type chunkShape struct {
	data  []byte  // the chunk's data, copied; nil when there is no shape
	holes [2]span // the text's and the padding's strings, in data order
	nHole int     // 1 without padding
	text  int     // the index of the text's hole
	// The usage member (null) and the end of the value before it, for
	// the cut when tokengate asked for usage.
	usage        member
	usagePrevEnd int
	hasUsage     bool
}

func (sh *chunkShape) forget() { sh.data = sh.data[:0] }

// record makes the chunk just read whole, c from data, the shape, when it
// is one (one text string, at most one padding).
func (sh *chunkShape) record(c *fastChunk, data []byte, n int) {
	sh.forget()
	if n != 1 || c.texts != 1 || c.pads > 1 {
		return
	}
	sh.holes[0], sh.nHole, sh.text = c.text, 1, 0
	if c.pads == 1 {
		sh.holes[1], sh.nHole = c.pad, 2
		if c.pad.start < c.text.start {
			sh.holes[0], sh.holes[1], sh.text = c.pad, c.text, 1
		}
	}
	sh.data = append(sh.data[:0], data...)
	sh.usage, sh.usagePrevEnd, sh.hasUsage = c.usage, c.usagePrevEnd, c.hasUsage
}

// match reports whether data is the shape with other strings in its
// holes, and where they are in data.
func (sh *chunkShape) match(data []byte) (holes [2]span, ok bool) {
	if len(sh.data) == 0 {
		return holes, false
	}
	at, from := 0, 0 // the next byte of data, and of the shape's
	for k := range sh.nHole {
		h := sh.holes[k]
		lit := sh.data[from:h.start]
		if !bytes.HasPrefix(data[at:], lit) {
			return holes, false
		}
		start := at + len(lit)
		end, err := skipString(data, start)
		if err != nil {
			return holes, false
		}
		holes[k], at, from = span{start, end}, end, h.end
	}
	return holes, bytes.Equal(data[at:], sh.data[from:])
}

// moved is offset i of the shape's data in data, whose holes are holes.
func (sh *chunkShape) moved(i int, holes [2]span) int {
	shift := 0
	for k := range sh.nHole {
		if sh.holes[k].end <= i {
			shift += (holes[k].end - holes[k].start) - (sh.holes[k].end - sh.holes[k].start)
		}
	}
	return i + shift
}

// fastOpenAI reads a chat.completion.chunk or text_completion chunk in one
// pass, or by its shape (see chunkShape). It reports false, with the
// Stream unchanged apart from s.text (which Observe resets per event),
// when the chunk needs the general reader.
func (s *Stream) fastOpenAI(ev *Event, event, data []byte, off, n int) bool {
	if n == 1 && s.fastShaped(ev, event, data, off) {
		return true
	}
	s.shape.forget()
	var c fastChunk
	if !s.fastChunkObject(&c, data) {
		s.text = s.text[:0]
		return false
	}
	s.shape.record(&c, data, n)
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
		ev.Forward = s.cutMember(event, data, off, n, c.usage, c.usagePrevEnd)
	}
	return true
}

// fastShaped reads a chunk of one data field that matches the shape: its
// text string alone, and the cut of its usage member.
func (s *Stream) fastShaped(ev *Event, event, data []byte, off int) bool {
	sh := &s.shape
	holes, ok := sh.match(data)
	if !ok {
		return false
	}
	t := holes[sh.text]
	if s.appendString(data[t.start:t.end]) != nil {
		s.text = s.text[:0]
		return false
	}
	if sh.hasUsage && s.hideUsage {
		u := sh.usage
		u.start, u.valueStart, u.valueEnd = sh.moved(u.start, holes), sh.moved(u.valueStart, holes), sh.moved(u.valueEnd, holes)
		prevEnd := sh.usagePrevEnd
		if prevEnd >= 0 {
			prevEnd = sh.moved(prevEnd, holes)
		}
		ev.Forward = s.cutMember(event, data, off, 1, u, prevEnd)
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
				case "obfuscation":
					if len(v) > 0 && v[0] == '"' {
						c.pads++
						c.pad = span{vs, ve}
					}
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
		end, ch, ok := s.fastChoice(c, b, i)
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
func (s *Stream) fastChoice(c *fastChunk, b []byte, i int) (end int, ch choice, ok bool) {
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
			if ve, ok = s.fastDelta(c, b, vs); !ok {
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
				c.texts, c.text = c.texts+1, span{vs, ve}
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
func (s *Stream) fastDelta(c *fastChunk, b []byte, i int) (int, bool) {
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
			c.texts, c.text = c.texts+1, span{vs, ve}
		case "function_call":
			err = s.appendStrings(v, "name", "arguments")
			c.texts += 2
		case "audio":
			err = s.appendStrings(v, "transcript")
			c.texts += 2
		case "tool_calls":
			err = s.toolCalls(v)
			c.texts += 2
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
