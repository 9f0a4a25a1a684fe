package tokenizer

import (
	"math"
	"strings"
	"unicode/utf8"
)

// Most non-ASCII characters are one token each, and BPE spends most of its
// work on them rebuilding that token from the character's two or three
// bytes. For the characters where it provably makes no difference, a piece
// starts its merges from one part per character instead of one per byte.
//
// Let X be a character of two or three bytes, merged by BPE on its own
// bytes into the single token X. Starting X as one part gives the same
// tokens in every context when:
//
//  1. (reachable) BPE on X's bytes alone ends in the one token X, and every
//     merge on the way has a rank below rank(X);
//  2. (not cut) in the piece, no token could cover part of X together
//     with bytes outside X: the piece has no occurrence of a token that
//     starts with a proper tail of X (its last one or two continuation
//     bytes) and goes on past X, nor of one that ends with a proper head
//     of X (its lead byte, possibly with the next byte) and starts before
//     X. Such tokens are few (a few hundred byte-level fragments such as
//     "\xbd物"); vocab.cuts lists them per character;
//  3. (later) every token that starts or ends with the whole X (and is
//     longer) has a rank above rank(X).
//
// Why: by (2), until X is whole the only merges that touch its bytes are
// those inside X, the ones BPE does on X alone, and nothing outside can
// take its bytes, so X always becomes whole. Every other merge happens in
// the same order in both runs: when BPE on bytes picks a merge M while X is
// incomplete, M's rank m is at most the rank of X's pending inner merge
// (BPE picks the least), which by (1) is at most rank(X); a merge that
// needs the whole X has by (3) a rank above rank(X), hence above m, so
// starting from X never brings it ahead of M. The inequality is strict, so
// ties (equal ranks, broken leftmost) keep their order too. The argument
// holds for all the characters of a piece at once.
//
// TestPremergeCutTokens puts every token of (2) in its context, and
// TestPremergeMatchesOracle and the differential tests compare the result
// with tiktoken-go token for token.

// charInfo says whether a character may start as one part (rank >= 0) and
// where to look for the tokens of condition 2 around it.
type charInfo struct {
	rank   int32  // the character's rank, -1 if it never starts whole
	after  uint16 // index in vocab.cuts of the tokens that start with a tail of it (0: none)
	before uint16 // index in vocab.cuts of the tokens that end with a head of it (0: none)
}

// buildChars computes v.chars: for every rune of two or three UTF-8 bytes
// that satisfies conditions 1 and 3, its rank, and the tokens of condition
// 2, which partStarts checks on every piece.
func (v *vocab) buildChars() {
	const none = math.MaxInt32
	cut := cutIndex{lists: make([]cutList, 1)} // index 0: no tokens
	minStart := make([]int32, 0x10000)         // least rank of a longer token starting with the rune
	minEnd := make([]int32, 0x10000)           // least rank of a longer token ending with the rune
	for i := range minStart {
		minStart[i], minEnd[i] = none, none
	}
	for rank, tok := range v.tokens {
		if len(tok) < 2 {
			continue
		}
		cut.add(tok)
		if r, n := utf8.DecodeRuneInString(tok); n < len(tok) && n > 1 && r < 0x10000 {
			minStart[r] = min(minStart[r], int32(rank))
		}
		if r, n := utf8.DecodeLastRuneInString(tok); n < len(tok) && n > 1 && r < 0x10000 {
			minEnd[r] = min(minEnd[r], int32(rank))
		}
	}
	// A character's tails and heads are fixed; merge their lists once per
	// combination so that a piece checks one list on each side.
	merged := make(map[[2]uint16]uint16)
	join := func(a, b uint16) uint16 {
		if a == 0 || b == 0 {
			return a | b
		}
		if i, ok := merged[[2]uint16{a, b}]; ok {
			return i
		}
		la, lb := &cut.lists[a], &cut.lists[b]
		l := cutList{two: la.two | lb.two}
		for i := range l.one {
			l.one[i] = la.one[i] | lb.one[i]
		}
		l.next = append(append([]string(nil), la.next...), lb.next...)
		l.prev = append(append([]string(nil), la.prev...), lb.prev...)
		cut.lists = append(cut.lists, l)
		i := uint16(len(cut.lists) - 1)
		merged[[2]uint16{a, b}] = i
		return i
	}
	v.chars = make([]charInfo, 0x10000)
	var buf [4]byte
	for r := range v.chars {
		v.chars[r] = charInfo{rank: -1}
		if r < 0x80 || (0xD800 <= r && r < 0xE000) {
			continue
		}
		n := utf8.EncodeRune(buf[:], rune(r))
		x := string(buf[:n])
		rx := v.rank(x)
		if rx == noRank || rx >= minStart[r] || rx >= minEnd[r] {
			continue
		}
		after, before := cut.tail1[x[n-1]&0x3F], cut.head1[x[0]-0xC0]
		if n == 3 {
			// BPE on three bytes merges one pair first, then the token.
			r01 := v.pair[int(x[0])<<8|int(x[1])]
			r12 := v.pair[int(x[1])<<8|int(x[2])]
			if first := min(r01, r12); first >= rx {
				continue
			}
			after = join(after, cut.tail2[int(x[1]&0x3F)<<6|int(x[2]&0x3F)])
			before = join(before, cut.head2[int(x[0]&0x0F)<<6|int(x[1]&0x3F)])
		}
		v.chars[r] = charInfo{rank: rx, after: after, before: before}
	}
	v.cuts = cut.lists
}

func isCont(b byte) bool { return b&0xC0 == 0x80 }

// leadLen returns the length of the UTF-8 sequence a lead byte starts.
func leadLen(b byte) int {
	switch {
	case b < 0x80:
		return 1
	case b >= 0xF0:
		return 4
	case b >= 0xE0:
		return 3
	default:
		return 2
	}
}

// cutIndex indexes, while a vocabulary loads, the tokens that hold part of
// a character together with bytes outside it, as they could occur in valid
// UTF-8: by the tail (continuation bytes) they start with, the rest of the
// token; by the head (lead byte and at most one continuation byte) they end
// with, the rest before it. Only tails and heads of two- and three-byte
// characters matter. Each index maps to a cutList in lists (0: none).
type cutIndex struct {
	tail1 [64]uint16   // one continuation byte (index: its low 6 bits)
	tail2 [4096]uint16 // two continuation bytes
	head1 [64]uint16   // the lead byte of a 2- or 3-byte character (index: b-0xC0)
	head2 [1024]uint16 // the lead and first continuation byte of a 3-byte character
	lists []cutList
}

// cutList holds the neighbours (the rest of a cutting token, next to the
// character) of a character's tails or heads, behind a filter on the
// neighbour's first two bytes (for a head: its last two, nearest first),
// so that most characters are cleared without comparing strings.
type cutList struct {
	one  [4]uint64 // bit b: a neighbour of one byte b
	two  uint64    // bit pairBit(b0, b1): a longer neighbour starting b0 b1
	next []string  // after a tail: the bytes that follow
	prev []string  // before a head: the bytes that precede
}

func pairBit(b0, b1 byte) uint64 { return 1 << ((uint(b0)*11 + uint(b1)) & 63) }

func (c *cutIndex) list(idx *uint16) *cutList {
	if *idx == 0 {
		if len(c.lists) >= math.MaxUint16 {
			panic("tokenizer: too many cut lists") // a vocabulary has a few hundred
		}
		*idx = uint16(len(c.lists))
		c.lists = append(c.lists, cutList{})
	}
	return &c.lists[*idx]
}

// addNext records rest as following a tail.
func (l *cutList) addNext(rest string) {
	if len(rest) == 1 {
		l.one[rest[0]>>6] |= 1 << (rest[0] & 63)
	} else {
		l.two |= pairBit(rest[0], rest[1])
	}
	l.next = append(l.next, rest)
}

// addPrev records pre as preceding a head.
func (l *cutList) addPrev(pre string) {
	n := len(pre)
	if n == 1 {
		l.one[pre[0]>>6] |= 1 << (pre[0] & 63)
	} else {
		l.two |= pairBit(pre[n-1], pre[n-2])
	}
	l.prev = append(l.prev, pre)
}

func (c *cutIndex) add(tok string) {
	k := 0
	for k < len(tok) && isCont(tok[k]) {
		k++
	}
	if k < len(tok) {
		switch k {
		case 1:
			c.list(&c.tail1[tok[0]&0x3F]).addNext(tok[1:])
		case 2:
			c.list(&c.tail2[int(tok[0]&0x3F)<<6|int(tok[1]&0x3F)]).addNext(tok[2:])
		}
	}
	for j := len(tok) - 1; j >= 1 && j >= len(tok)-3; j-- {
		if isCont(tok[j]) {
			continue
		}
		// tok[j] starts the last character of tok
		if leadLen(tok[j]) <= len(tok)-j || tok[j] >= 0xF0 {
			break
		}
		switch len(tok) - j {
		case 1:
			c.list(&c.head1[tok[j]-0xC0]).addPrev(tok[:j])
		case 2:
			c.list(&c.head2[int(tok[j]&0x0F)<<6|int(tok[j+1]&0x3F)]).addPrev(tok[:j])
		}
		break
	}
}

// followedBy reports whether a neighbour of l follows, at the start of after.
func (l *cutList) followedBy(after string) bool {
	if len(after) == 0 {
		return false
	}
	if l.one[after[0]>>6]&(1<<(after[0]&63)) == 0 && (len(after) < 2 || l.two&pairBit(after[0], after[1]) == 0) {
		return false
	}
	for _, rest := range l.next {
		if strings.HasPrefix(after, rest) {
			return true
		}
	}
	return false
}

// precededBy reports whether a neighbour of l precedes, at the end of before.
func (l *cutList) precededBy(before string) bool {
	n := len(before)
	if n == 0 {
		return false
	}
	if l.one[before[n-1]>>6]&(1<<(before[n-1]&63)) == 0 && (n < 2 || l.two&pairBit(before[n-1], before[n-2]) == 0) {
		return false
	}
	for _, pre := range l.prev {
		if strings.HasSuffix(before, pre) {
			return true
		}
	}
	return false
}

// whole reports whether the n-byte character c at p[i:i+n] starts as one
// part: it satisfies conditions 1 and 3, and no token of condition 2
// occurs in p across its boundaries.
func (v *vocab) whole(p string, i, n int, c charInfo) bool {
	if c.rank < 0 {
		return false
	}
	if c.after != 0 && v.cuts[c.after].followedBy(p[i+n:]) {
		return false
	}
	return c.before == 0 || !v.cuts[c.before].precededBy(p[:i])
}

// partStarts fills starts with the boundaries of the parts that BPE on p
// starts from: one per byte, except a character that starts whole (see
// vocab.whole), which is one part. p must be valid UTF-8. It returns the
// boundaries (parts+1 of them, the last len(p)) and whether any character
// was taken whole.
func (v *vocab) partStarts(p string, starts []int32) ([]int32, bool) {
	starts = starts[:0]
	whole := false
	for i := 0; i < len(p); {
		starts = append(starts, int32(i))
		b := p[i]
		if b < 0xC2 || b >= 0xF0 || i+1 >= len(p) {
			i++
			continue
		}
		var r rune
		n := 2
		if b < 0xE0 {
			r = rune(b&0x1F)<<6 | rune(p[i+1]&0x3F)
		} else {
			if i+2 >= len(p) {
				i++
				continue
			}
			n = 3
			r = rune(b&0x0F)<<12 | rune(p[i+1]&0x3F)<<6 | rune(p[i+2]&0x3F)
		}
		if v.whole(p, i, n, v.chars[r]) {
			whole = true
			i += n
		} else {
			i++
		}
	}
	return append(starts, int32(len(p))), whole
}
