package tokenizer

import (
	"hash/maphash"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"

	"github.com/tokengate/tokengate/internal/jsonstr"
)

// A request body that arrives in chunks (Envoy's STREAMED and
// FULL_DUPLEX_STREAMED body modes) can be counted while it arrives: a
// Precount reads each chunk as it comes, with a small resumable JSON
// lexer, and counts the long string values in it (a prompt, a document)
// piece by piece. Count, given the Precount, then finds those strings'
// tokens ready and tokenizes only the rest, so the decision that follows
// the last chunk does not wait for the prompt to be tokenized.
//
// Counts are exactly those of Count on the whole body, by construction:
//
//   - A string is decoded with JSON's escapes as unescape does (a lone or
//     mismatched surrogate is U+FFFD, bytes are kept as they are), and cut
//     into pieces with the same pre-tokenizer; a piece is counted only once
//     the pre-tokenizer says no further text can change it (the guarantee
//     Stream relies on), and never before the UTF-8 character that ends it
//     is complete. The open piece is carried to the next chunk.
//   - What a string counted to is kept under the offset of its opening
//     quote, its end and a hash of its raw bytes (keyed per process), in the
//     encoding it was counted with. Count uses it only where it counts one
//     whole string value on its own (never for text it assembles from
//     several values or re-encodes as JSON), and only when the value at
//     that offset ends where the precounted one ended, has the same raw
//     bytes and is counted with the same encoding. Anything else is counted
//     as if there were no Precount: a duplicate key's earlier value, a
//     string counted in an encoding the model turned out not to use, a
//     string whose open piece grew too long.
//
// The encoding is the one Count will choose: fixed by the path for
// Anthropic's and Gemini's APIs, else the top-level "model" string once it
// has been read. Strings that come before "model" (a body with sorted keys
// has "messages" first) are counted in o200k_base, the encoding of current
// models, Anthropic's and Gemini's; a model of another encoding makes them
// count again in Count.
//
// Memory is bounded: the lexer keeps one bit per open container (at most
// maxDepth) and the open string's text not yet counted, at most
// precountMaxOpen bytes past the chunk being read; the memo holds a few
// words per precounted string, which is at least precountMin bytes long.

const (
	// precountMin is the length of a string value, in raw bytes, from
	// which it is precounted; shorter ones cost Count little.
	precountMin = 4 << 10
	// precountMaxOpen bounds the text held back while a piece is open: a
	// string with a longer piece (one run of letters or spaces) is left to
	// Count.
	precountMaxOpen = 256 << 10
	// precountStep is how much text a string gathers before its closed
	// pieces are counted; each count at least doubles the text held, so a
	// long open piece is not split again for every small chunk.
	precountStep = 16 << 10
	// maxModelLen bounds the model name read from the body.
	maxModelLen = 256
)

// precountSeed keys the hash of precounted strings per process, so that no
// body can be crafted to pass another string's count off as its own.
var precountSeed = maphash.MakeSeed()

// Precount counts a request body's long string values as the body arrives.
// Create one per request body with Counter.NewPrecount, Write the body's
// chunks in order, and count the whole body with Counter.CountPrecounted.
// A Precount is owned by one goroutine; it holds no resource beyond its
// memory, so one dropped unfinished needs no closing.
type Precount struct {
	c     *Counter
	fixed bool   // the path fixes the encoding, whatever the model
	path  string // the model the path names, for a body that names none
	enc   string // the encoding strings are counted in; "" counts none
	v     *vocab
	n     int  // bytes written so far: the offset of the next chunk
	stop  bool // the body is not valid JSON: nothing more is read
	// precountMin, precountStep and precountMaxOpen, which tests lower.
	min, step, maxOpen int

	// The lexer outside strings: a bit per open container (1 an object),
	// whether an object's next string is a key, and whether the last key
	// at the top level was "model".
	stack   []uint64
	depth   int
	keyNext bool
	atModel bool

	// The string being read.
	inStr   bool
	isKey   bool
	start   int // offset of its opening quote
	dec     escState
	hex     rune // \uXXXX digits read so far
	nhex    int
	surr    rune         // a surrogate waiting for the escape that may pair with it
	text    []byte       // decoded text not yet counted
	keep    bool         // text is kept (false once the string is left to Count)
	long    bool         // the string is long enough to be counted as it arrives
	counted int          // tokens of its pieces counted so far
	check   int          // len(text) at which to look again (see grown)
	hash    maphash.Hash // of its raw bytes, quotes included

	memo map[int]precounted
	hits int
}

// precounted is what one string value counted to.
type precounted struct {
	end    int    // offset just past its closing quote
	hash   uint64 // of its raw bytes, quotes included
	enc    string // the encoding it was counted in
	tokens int
}

// escState is where the string decoder is within an escape sequence.
type escState uint8

const (
	escNone    escState = iota // plain text
	escStart                   // after '\'
	escHex                     // in the four digits of \uXXXX
	escSurr                    // after a \u surrogate, which the next \u may pair with
	escSurrEsc                 // after a surrogate and '\'
	escSurrHex                 // in the digits of the \u that may pair with the surrogate
)

// NewPrecount returns a Precount for a request body sent to path (the HTTP
// :path, as Request.Path), to be counted without Request.API or
// Request.Model: with those, Count chooses the encoding from them, and a
// Precount that guessed otherwise only saves less.
func (c *Counter) NewPrecount(path string) *Precount {
	p := &Precount{c: c, text: make([]byte, 0, 1024), min: precountMin, step: precountStep, maxOpen: precountMaxOpen}
	p.hash.SetSeed(precountSeed)
	switch e := Classify("POST", path); {
	case e.Class == Metered && (e.API == Messages || e.API == Gemini):
		p.fixed = true
		p.setEncoding(O200kBase)
	case e.Class == Free || e.Class != Metered && e.Name != "other":
		// Count refuses it before reading a string.
	default:
		p.path = modelFromPath(path)
		p.setModel("")
	}
	return p
}

// setModel sets the encoding as Count will choose it for model, the
// top-level "model" string (or the path's when the body names none):
// o200k_base when it is unknown, as a guess.
func (p *Precount) setModel(model string) {
	if p.fixed {
		return
	}
	enc := O200kBase
	if model == "" {
		model = p.path
	}
	if model != "" {
		if e, _, err := p.c.EncodingFor(model); err == nil {
			enc = e
		}
	}
	p.setEncoding(enc)
}

// setEncoding switches to enc; what was counted in another one is of no
// use to Count, and dropped.
func (p *Precount) setEncoding(enc string) {
	if enc == p.enc {
		return
	}
	p.memo = nil
	p.enc, p.v = "", nil
	if v, err := p.c.vocab(enc); err == nil {
		p.enc, p.v = enc, v
	}
}

// Write reads the next chunk of the body. It does not keep chunk.
func (p *Precount) Write(chunk []byte) {
	defer func() { p.n += len(chunk) }()
	if p.stop {
		return
	}
	seg := 0 // where the open string's raw bytes in chunk begin
	for i := 0; i < len(chunk); {
		if p.inStr {
			end, ok := p.readString(chunk, i)
			if !ok {
				p.abort()
				return
			}
			if end < 0 {
				break // the string goes on in the next chunk
			}
			p.hash.Write(chunk[seg : end+1])
			p.endString(p.n + end + 1)
			i = end + 1
			continue
		}
		switch c := chunk[i]; c {
		case '"':
			p.startString(p.n + i)
			seg = i
		case '{', '[':
			if p.depth >= maxDepth {
				p.abort()
				return
			}
			if p.depth/64 >= len(p.stack) {
				p.stack = append(p.stack, 0)
			}
			bit := uint64(1) << (p.depth % 64)
			if c == '{' {
				p.stack[p.depth/64] |= bit
			} else {
				p.stack[p.depth/64] &^= bit
			}
			p.depth++
			p.keyNext = c == '{'
		case '}', ']':
			if p.depth == 0 {
				p.abort()
				return
			}
			p.depth--
			p.keyNext = false
		case ',':
			p.keyNext = p.inObject()
		case ':':
			p.keyNext = false
		}
		i++
	}
	if p.inStr {
		p.hash.Write(chunk[seg:])
		p.grown()
	}
}

func (p *Precount) inObject() bool {
	return p.depth > 0 && p.stack[(p.depth-1)/64]&(1<<((p.depth-1)%64)) != 0
}

// abort stops reading a body that is not valid JSON: Count refuses it.
func (p *Precount) abort() {
	p.stop, p.inStr, p.memo, p.text, p.stack = true, false, nil, nil, nil
}

func (p *Precount) startString(off int) {
	p.inStr, p.isKey, p.start = true, p.keyNext && p.inObject(), off
	p.dec, p.keep, p.long, p.counted = escNone, true, false, 0
	p.text, p.check = p.text[:0], p.min
	p.hash.Reset()
}

// readString decodes the open string's bytes from chunk[i:]: it returns
// the offset of the closing quote in chunk, or -1 when the chunk ends
// first; ok is false for a fault of JSON syntax.
func (p *Precount) readString(chunk []byte, i int) (end int, ok bool) {
	for i < len(chunk) {
		if p.dec != escNone {
			var again bool
			if again, ok = p.escape(chunk[i]); !ok {
				return 0, false
			}
			if !again {
				i++
			}
			continue
		}
		j := jsonstr.Plain(chunk, i)
		p.emit(chunk[i:j])
		if j == len(chunk) {
			return -1, true
		}
		switch chunk[j] {
		case '"':
			return j, true
		case '\\':
			p.dec = escStart
		default:
			return 0, false // a control character
		}
		i = j + 1
	}
	return -1, true
}

// escape reads one byte c of an escape sequence as unescape decodes it.
// again is true when c ends a surrogate's wait unpaired: the surrogate is
// written as U+FFFD and c must be read again in the state that follows.
func (p *Precount) escape(c byte) (again, ok bool) {
	switch p.dec {
	case escStart:
		var b byte
		switch c {
		case '"', '\\', '/':
			b = c
		case 'b':
			b = '\b'
		case 'f':
			b = '\f'
		case 'n':
			b = '\n'
		case 'r':
			b = '\r'
		case 't':
			b = '\t'
		case 'u':
			p.dec, p.hex, p.nhex = escHex, 0, 0
			return false, true
		default:
			return false, false
		}
		p.emit([]byte{b})
		p.dec = escNone
	case escHex, escSurrHex:
		if !isHex(c) {
			return false, false
		}
		p.hex = p.hex<<4 | hexDigit(c)
		if p.nhex++; p.nhex < 4 {
			return false, true
		}
		r := p.hex
		if p.dec == escSurrHex {
			if d := utf16.DecodeRune(p.surr, r); d != utf8.RuneError {
				p.emitRune(d)
				p.dec = escNone
				return false, true
			}
			p.emitRune(utf8.RuneError) // r is read on its own, as unescape does
		}
		if utf16.IsSurrogate(r) {
			p.surr, p.dec = r, escSurr
		} else {
			p.emitRune(r)
			p.dec = escNone
		}
	case escSurr:
		if c == '\\' {
			p.dec = escSurrEsc
			return false, true
		}
		p.emitRune(utf8.RuneError)
		p.dec = escNone
		return true, true
	case escSurrEsc:
		if c == 'u' {
			p.dec, p.hex, p.nhex = escSurrHex, 0, 0
			return false, true
		}
		p.emitRune(utf8.RuneError)
		p.dec = escStart
		return true, true
	}
	return false, true
}

// hexDigit is the value of the hex digit c.
func hexDigit(c byte) rune {
	switch {
	case c <= '9':
		return rune(c - '0')
	case c <= 'F':
		return rune(c - 'A' + 10)
	}
	return rune(c - 'a' + 10)
}

func (p *Precount) emit(b []byte) {
	if p.keep && len(b) > 0 {
		p.text = append(p.text, b...)
		if len(p.text) >= p.check {
			p.grown()
		}
	}
}

func (p *Precount) emitRune(r rune) {
	var b [utf8.UTFMax]byte
	p.emit(utf8.AppendRune(b[:0], r))
}

// grown decides what becomes of an open string whose text has grown. A
// key, the model, or any value while no encoding is known is only read,
// and left to Count once it is precountMin long; another value is long
// from p.min on, and has its closed pieces counted.
func (p *Precount) grown() {
	if !p.keep || len(p.text) < p.check {
		return
	}
	if !p.long {
		if p.isKey || p.enc == "" || p.isModel() {
			if len(p.text) >= precountMin {
				p.drop()
			} else {
				p.check = precountMin
			}
			return
		}
		p.long = true
	}
	p.countClosed()
}

// isModel reports whether the open string is the top-level model.
func (p *Precount) isModel() bool { return p.atModel && p.depth == 1 && !p.isKey }

// drop leaves the open string to Count.
func (p *Precount) drop() {
	p.keep, p.long = false, false
	p.text = p.text[:0]
	if cap(p.text) > p.maxOpen {
		p.text = make([]byte, 0, 1024)
	}
}

// countClosed counts the pieces of the open string's text that no further
// text can change, and keeps the rest.
func (p *Precount) countClosed() {
	n := completeLen(p.text)
	// The string aliases text only during this call; the piece cache
	// clones what it keeps.
	s := unsafe.String(unsafe.SliceData(p.text), n)
	w := p.c.getWorker()
	i := 0
	for i < len(s) {
		e, eof := p.v.split(s, i)
		if eof {
			break
		}
		p.counted += p.v.countPiece(w, s[i:e])
		i = e
	}
	p.c.putWorker(w)
	p.text = p.text[:copy(p.text, p.text[i:])]
	if len(p.text) > p.maxOpen {
		p.drop()
		return
	}
	p.check = min(max(2*len(p.text), len(p.text)+p.step), p.maxOpen+1)
}

// endString ends the open string, whose closing quote ends before end.
func (p *Precount) endString(end int) {
	p.inStr = false
	topValue, model := p.depth == 1 && !p.isKey, p.isModel()
	switch {
	case p.isKey:
		p.atModel = p.depth == 1 && p.keep && string(p.text) == "model"
	case model:
		name := ""
		if p.keep && len(p.text) <= maxModelLen {
			name = string(p.text)
		}
		p.setModel(name)
	}
	if !p.isKey && !model && p.keep && p.enc != "" && (p.long || end-p.start >= p.min) {
		w := p.c.getWorker()
		p.counted += p.v.countText(w, unsafe.String(unsafe.SliceData(p.text), len(p.text)))
		p.c.putWorker(w)
		if p.memo == nil {
			p.memo = make(map[int]precounted)
		}
		p.memo[p.start] = precounted{end: end, hash: p.hash.Sum64(), enc: p.enc, tokens: p.counted}
	}
	p.text = p.text[:0]
	if cap(p.text) > p.maxOpen {
		p.text = make([]byte, 0, 1024)
	}
	if topValue {
		p.atModel = false
	}
}

// Precounted returns how many string values have been counted so far, and
// how many of them Count has used.
func (p *Precount) Precounted() (strings, used int) { return len(p.memo), p.hits }

// tokens returns the tokens of the string value v when v was precounted in
// encoding enc, exactly as written: same offset, end and raw bytes.
func (p *Precount) tokens(v jval, enc string) (int, bool) {
	if p == nil || v.kind() != '"' {
		return 0, false
	}
	m, ok := p.memo[v.off]
	if !ok || m.end != v.end || m.enc != enc || maphash.Bytes(precountSeed, v.d.src[v.off:v.end]) != m.hash {
		return 0, false
	}
	p.hits++
	return m.tokens, true
}

// CountPrecounted is Count for a body that was written to pre, whole and
// in order: its long string values are taken as pre counted them, which
// is exactly what Count would find. A nil pre, or a body of another length
// than what pre read, is counted as Count does.
func (c *Counter) CountPrecounted(req Request, pre *Precount) (Count, error) {
	if pre != nil && (pre.c != c || pre.n != len(req.Body)) {
		pre = nil
	}
	return c.count(req, pre)
}
