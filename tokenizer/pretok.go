package tokenizer

import (
	"sync"
	"unicode"
	"unicode/utf8"
)

//go:generate sh internal/gen/gen.sh classes

// The pre-tokenizers below are hand-written equivalents of the cl100k_base
// and o200k_base split patterns, as OpenAI's tiktoken evaluates them: with
// the Unicode 16.0 tables of Rust's regex crate (unicode_tables.go, made
// from the Unicode data by internal/gen; Go's unicode package is older),
// and White_Space for \s. They never backtrack more than a bounded look
// at the current run, so splitting is linear in the input.
//
// Each returns the end of the piece that starts at i and whether the
// decision looked at the end of the text: a piece with eof == false is final
// whatever text is appended later, which is what Stream relies on.

// Character classes, as bit flags.
const (
	clsL     uint8 = 1 << iota // \p{L}
	clsN                       // \p{N}
	clsS                       // \s (White_Space)
	clsUpper                   // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] (o200k)
	clsLower                   // [\p{Ll}\p{Lm}\p{Lo}\p{M}] (o200k)
	clsNL                      // \r or \n
)

// The class of every code point, in two tables built once from the
// generated ones: a flat one for the BMP, and for the planes above it one
// block of 256 classes per 256 code points, identical blocks shared (most
// of those planes are unassigned).
var (
	classOnce  sync.Once
	bmpClass   [0x10000]uint8 // class of every rune of the BMP
	suppIndex  []uint16       // (r-0x10000)>>8: index of r's block in suppBlocks
	suppBlocks []uint8        // blocks of 256 classes
)

func initClasses() {
	classOnce.Do(func() {
		all := make([]uint8, unicode.MaxRune+1)
		set := func(tab *unicode.RangeTable, c uint8) {
			for _, r := range tab.R16 {
				for x := int(r.Lo); x <= int(r.Hi); x += int(r.Stride) {
					all[x] |= c
				}
			}
			for _, r := range tab.R32 {
				for x := int(r.Lo); x <= int(r.Hi); x += int(r.Stride) {
					all[x] |= c
				}
			}
		}
		set(letter16, clsL)
		set(number16, clsN)
		set(whiteSpace16, clsS)
		for _, tab := range []*unicode.RangeTable{upper16, title16, modifier16, otherLetter16, mark16} {
			set(tab, clsUpper)
		}
		for _, tab := range []*unicode.RangeTable{lower16, modifier16, otherLetter16, mark16} {
			set(tab, clsLower)
		}
		all['\r'] |= clsNL
		all['\n'] |= clsNL
		copy(bmpClass[:], all[:0x10000])
		supp := all[0x10000:]
		index := make([]uint16, len(supp)>>8)
		var blocks []uint8
		seen := make(map[string]uint16)
		for b := range index {
			blk := supp[b<<8 : (b+1)<<8]
			i, ok := seen[string(blk)]
			if !ok {
				i = uint16(len(blocks) >> 8)
				seen[string(blk)] = i
				blocks = append(blocks, blk...)
			}
			index[b] = i
		}
		suppIndex, suppBlocks = index, blocks
	})
}

// classOf returns the class of a valid rune.
func classOf(r rune) uint8 {
	if r < 0x10000 {
		return bmpClass[r]
	}
	return suppBlocks[int(suppIndex[(r-0x10000)>>8])<<8|int(r&0xFF)]
}

// class returns the class and byte length of the rune at s[i]. An
// invalid UTF-8 byte counts as U+FFFD (a symbol), see sanitize.
func class(s string, i int) (uint8, int) {
	if b := s[i]; b < utf8.RuneSelf {
		return bmpClass[b], 1
	}
	return classMulti(s, i)
}

// classMulti is class for a byte that is not ASCII.
func classMulti(s string, i int) (uint8, int) {
	b := s[i]
	// Decode valid sequences inline; the checks on the code point reject
	// overlong forms and surrogates, which the slow path below turns into
	// U+FFFD one byte at a time.
	switch {
	case b < 0xE0:
		if b >= 0xC2 && i+1 < len(s) && s[i+1]&0xC0 == 0x80 {
			return bmpClass[rune(b&0x1F)<<6|rune(s[i+1]&0x3F)], 2
		}
	case b < 0xF0:
		if i+2 < len(s) && s[i+1]&0xC0 == 0x80 && s[i+2]&0xC0 == 0x80 {
			r := rune(b&0x0F)<<12 | rune(s[i+1]&0x3F)<<6 | rune(s[i+2]&0x3F)
			if r >= 0x800 && uint32(r-0xD800) >= 0x800 {
				return bmpClass[r], 3
			}
		}
	case b < 0xF5:
		if i+3 < len(s) && s[i+1]&0xC0 == 0x80 && s[i+2]&0xC0 == 0x80 && s[i+3]&0xC0 == 0x80 {
			r := rune(b&0x07)<<18 | rune(s[i+1]&0x3F)<<12 | rune(s[i+2]&0x3F)<<6 | rune(s[i+3]&0x3F)
			if uint32(r-0x10000) < 0x100000 {
				return suppBlocks[int(suppIndex[(r-0x10000)>>8])<<8|int(r&0xFF)], 4
			}
		}
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	return classOf(r), n
}

// runEnd returns the end of the run of runes from i whose class c has
// c&mask == want (a class bit: mask == want; none of some bits: want 0),
// and whether it reached the end of s.
func runEnd(s string, i int, mask, want uint8) (int, bool) {
	for i < len(s) {
		// class, inline for the common lengths
		b := s[i]
		c, n := bmpClass[b], 1
		switch {
		case b < utf8.RuneSelf:
		case b-0xC2 < 0x1E && i+1 < len(s) && s[i+1]&0xC0 == 0x80:
			c, n = bmpClass[rune(b&0x1F)<<6|rune(s[i+1]&0x3F)], 2
		case b-0xE0 < 0x10 && i+2 < len(s) && load16(s, i+1)&0xC0C0 == 0x8080:
			// E0..EF: an overlong form or a surrogate is invalid
			r := rune(b&0x0F)<<12 | rune(s[i+1]&0x3F)<<6 | rune(s[i+2]&0x3F)
			if r < 0x800 || uint32(r-0xD800) < 0x800 {
				c, n = classMulti(s, i)
				break
			}
			c, n = bmpClass[r], 3
		case b-0xF0 < 4 && i+3 < len(s) && load32(s, i)&0xC0C0C000 == 0x80808000 && (b != 0xF0 || s[i+1] >= 0x90):
			// F0 (not overlong) to F3: planes 1 to 15
			w := load32(s, i)
			r := rune(w&0x07)<<18 | rune(w>>8&0x3F)<<12 | rune(w>>16&0x3F)<<6 | rune(w>>24&0x3F)
			c, n = suppBlocks[int(suppIndex[(r-0x10000)>>8])<<8|int(r&0xFF)], 4
		default:
			c, n = classMulti(s, i)
		}
		if c&mask != want {
			return i, false
		}
		i += n
	}
	return i, true
}

func lowerASCII(b byte) byte {
	if 'A' <= b && b <= 'Z' {
		return b + 'a' - 'A'
	}
	return b
}

// contraction matches (?i:'s|'t|'re|'ve|'m|'ll|'d) at i and returns its
// length (0 when none) and whether the answer depended on the end of s.
func contraction(s string, i int) (int, bool) {
	if i >= len(s) {
		return 0, true
	}
	if s[i] != '\'' {
		return 0, false
	}
	if i+1 >= len(s) {
		return 0, true
	}
	var want byte
	switch lowerASCII(s[i+1]) {
	case 's', 't', 'm', 'd':
		return 2, false
	case 'r', 'v':
		want = 'e'
	case 'l':
		want = 'l'
	default:
		return 0, false
	}
	if i+2 >= len(s) {
		return 0, true
	}
	if lowerASCII(s[i+2]) == want {
		return 3, false
	}
	return 0, false
}

// splitSpace handles the three whitespace alternatives shared by both
// patterns: \s*[\r\n]+ | \s+(?!\S) | \s+, for s[i] a space.
func splitSpace(s string, i int) (int, bool) {
	lastNL, last := -1, i
	k := i
	for k < len(s) {
		c, n := class(s, k)
		if c&clsS == 0 {
			break
		}
		if c&clsNL != 0 {
			lastNL = k
		}
		last = k
		k += n
	}
	eof := k == len(s)
	switch {
	case lastNL >= 0:
		return lastNL + 1, eof
	case eof:
		return k, true
	case last > i:
		return last, false
	default:
		return k, false
	}
}

// splitPunct matches ` ?[^\s\p{L}\p{N}]+` followed by any of tail
// ([\r\n]* for cl100k, [\r\n/]* for o200k). ok is false when it does not
// match at i.
func splitPunct(s string, i int, slash bool) (end int, eof, ok bool) {
	j := i
	if s[i] == ' ' {
		if i+1 >= len(s) {
			return 0, true, false
		}
		if c, _ := class(s, i+1); c&(clsS|clsL|clsN) == 0 {
			j = i + 1
		}
	}
	c, n := class(s, j)
	if c&(clsS|clsL|clsN) != 0 {
		return 0, false, false
	}
	k, _ := runEnd(s, j+n, clsS|clsL|clsN, 0)
	for k < len(s) && (s[k] == '\r' || s[k] == '\n' || (slash && s[k] == '/')) {
		k++
	}
	return k, k == len(s), true
}

// splitDigits matches \p{N}{1,3} at i (s[i] is a number).
func splitDigits(s string, i int) (int, bool) {
	k := i
	for range 3 {
		if k >= len(s) {
			return k, true
		}
		c, n := class(s, k)
		if c&clsN == 0 {
			return k, false
		}
		k += n
	}
	return k, false
}

// splitCl100k is the cl100k_base pattern:
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//	 ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
func splitCl100k(s string, i int) (int, bool) {
	n, eof := contraction(s, i)
	if n > 0 {
		return i + n, false
	}
	c0, n0 := bmpClass[s[i]], 1 // class, inline for ASCII
	if s[i] >= utf8.RuneSelf {
		c0, n0 = classMulti(s, i)
	}
	if c0&clsL != 0 {
		e, eof2 := runEnd(s, i+n0, clsL, clsL)
		return e, eof || eof2
	}
	if c0&(clsL|clsN|clsNL) == 0 {
		// [^\r\n\p{L}\p{N}]?\p{L}+ with the optional character
		e, eof2 := runEnd(s, i+n0, clsL, clsL)
		if e > i+n0 {
			return e, eof || eof2
		}
		eof = eof || i+n0 >= len(s)
	}
	if c0&clsN != 0 {
		e, eof2 := splitDigits(s, i)
		return e, eof || eof2
	}
	if e, eof2, ok := splitPunct(s, i, false); ok {
		return e, eof || eof2
	} else {
		eof = eof || eof2
	}
	e, eof2 := splitSpace(s, i)
	return e, eof || eof2
}

// o200kLowerTail matches [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+
// followed by an optional contraction, at j, with the backtracking of a
// greedy U* against W+ resolved by remembering the last W inside the U run.
func o200kLowerTail(s string, j int) (end int, eof, ok bool) {
	lastW := -1 // the end of the last W in the U run
	k := j
	var lastC uint8 // the class of s[k] when k < len(s)
	lastN := 0
	for k < len(s) {
		// class, inline for the common lengths
		b := s[k]
		c, n := bmpClass[b], 1
		switch {
		case b < utf8.RuneSelf:
		case b-0xC2 < 0x1E && k+1 < len(s) && s[k+1]&0xC0 == 0x80:
			c, n = bmpClass[rune(b&0x1F)<<6|rune(s[k+1]&0x3F)], 2
		case b-0xE0 < 0x10 && k+2 < len(s) && load16(s, k+1)&0xC0C0 == 0x8080:
			// E0..EF: an overlong form or a surrogate is invalid
			r := rune(b&0x0F)<<12 | rune(s[k+1]&0x3F)<<6 | rune(s[k+2]&0x3F)
			if r < 0x800 || uint32(r-0xD800) < 0x800 {
				c, n = classMulti(s, k)
				break
			}
			c, n = bmpClass[r], 3
		case b-0xF0 < 4 && k+3 < len(s) && load32(s, k)&0xC0C0C000 == 0x80808000 && (b != 0xF0 || s[k+1] >= 0x90):
			// F0 (not overlong) to F3: planes 1 to 15
			w := load32(s, k)
			r := rune(w&0x07)<<18 | rune(w>>8&0x3F)<<12 | rune(w>>16&0x3F)<<6 | rune(w>>24&0x3F)
			c, n = suppBlocks[int(suppIndex[(r-0x10000)>>8])<<8|int(r&0xFF)], 4
		default:
			c, n = classMulti(s, k)
		}
		lastC, lastN = c, n
		if c&clsUpper == 0 {
			break
		}
		k += n
		if c&clsLower != 0 {
			lastW = k
		}
	}
	c, n := lastC, lastN
	var e int
	switch {
	case k < len(s) && c&clsLower != 0:
		// s[k] is W but not U: W+ runs from there.
		e, eof = runEnd(s, k+n, clsLower, clsLower)
	case lastW >= 0:
		// W+ is the last W of the U run: the U that follow it, and s[k],
		// are not W.
		e, eof = lastW, k == len(s)
	default:
		return 0, k == len(s), false
	}
	c2, eof2 := contraction(s, e)
	return e + c2, eof || eof2, true
}

// o200kUpperHead matches [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*
// followed by an optional contraction, at j.
func o200kUpperHead(s string, j int) (end int, eof, ok bool) {
	if j >= len(s) {
		return 0, true, false
	}
	if c, _ := class(s, j); c&clsUpper == 0 {
		return 0, false, false
	}
	k, eof := runEnd(s, j, clsUpper, clsUpper)
	e, eof2 := runEnd(s, k, clsLower, clsLower)
	c, eof3 := contraction(s, e)
	return e + c, eof || eof2 || eof3, true
}

// splitO200k is the o200k_base pattern:
//
//	[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
//	[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
//	\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
func splitO200k(s string, i int) (int, bool) {
	c0, n0 := bmpClass[s[i]], 1 // class, inline for ASCII
	if s[i] >= utf8.RuneSelf {
		c0, n0 = classMulti(s, i)
	}
	opt := c0&(clsL|clsN|clsNL) == 0 // may be taken by [^\r\n\p{L}\p{N}]?
	eof := false
	if opt {
		e, eof2, ok := o200kLowerTail(s, i+n0)
		eof = eof || eof2
		if ok {
			return e, eof
		}
	}
	if e, eof2, ok := o200kLowerTail(s, i); ok {
		return e, eof || eof2
	} else {
		eof = eof || eof2
	}
	if opt {
		e, eof2, ok := o200kUpperHead(s, i+n0)
		eof = eof || eof2
		if ok {
			return e, eof
		}
	}
	if e, eof2, ok := o200kUpperHead(s, i); ok {
		return e, eof || eof2
	} else {
		eof = eof || eof2
	}
	if c0&clsN != 0 {
		e, eof2 := splitDigits(s, i)
		return e, eof || eof2
	}
	if e, eof2, ok := splitPunct(s, i, true); ok {
		return e, eof || eof2
	} else {
		eof = eof || eof2
	}
	e, eof2 := splitSpace(s, i)
	return e, eof || eof2
}
