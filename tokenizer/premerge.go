package tokenizer

import (
	"math"
	"math/bits"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"unicode/utf8"
)

// Most non-ASCII characters are one token each, or a few tokens that BPE
// rebuilds from the character's bytes alone, and BPE spends most of its
// work on such rebuilding. Where it provably makes no difference, a piece
// skips it: a character starts its merges as one part, or the piece is cut
// around it.
//
// Let X be a character of two to four bytes. Say a token cuts X in a piece
// when it occurs there covering part of X together with bytes outside X:
// it starts with a proper tail of X (its last one to three continuation
// bytes) and goes on past X, or it ends with a proper head of X (its lead
// byte, possibly with one or two continuation bytes) and starts before X.
// Such tokens are few (a few hundred byte-level fragments such as
// "\xbd物"); vocab.cuts lists them by the tails and heads they hold. When
// no token cuts X, the first merge that joins bytes of X with bytes outside
// it must make a token holding all of X; until then X's bytes are merged
// exactly as BPE merges them on X alone, since those merges involve X's
// bytes only and BPE orders them by rank (leftmost on ties) in both runs.
//
// Separate. If X alone is several tokens T1..Tk, X never becomes one
// part, so no merge ever joins its bytes with others. If X alone is one
// token and no longer token starts or ends with the whole X, X becomes
// one part and stays one: the first merge of the part X with a neighbour
// would make such a token. Either way the piece's tokens are those of the
// text before X, then X's own, then those of the text after X, each merged
// on its own: the piece is cut around X.
//
// Whole (X alone is one token). Starting X as one part gives the same
// tokens in a piece when no token cuts X there (and here only tokens that
// rank below X count, see uncut) and:
//
//  1. (reachable) every merge of BPE on X alone before the last has a rank
//     below rank(X);
//  2. (later) no token that extends X (starts or ends with the whole X and
//     is longer) and ranks below X occurs around X in the piece.
//
// Why: until X is whole, the only merges that touch its bytes are those of
// X alone, and X always becomes whole. Every other merge happens in the
// same order in both runs: when BPE on bytes picks a merge M while X is
// incomplete, M's rank m is at most the rank of X's pending inner merge
// (BPE picks the least), which by (1) is at most rank(X); a merge that
// needs the whole X makes a token extending X, which by (2) ranks above
// rank(X), hence above m, so starting from X never brings it ahead of M.
// The inequality is strict, so ties (equal ranks, broken leftmost) keep
// their order too. The argument holds for all the characters of a piece at
// once.
//
// (2) needs no check of its own. A lower-ranked extension T = P·X is the
// join of two tokens of lower ranks: BPE built it so, and derivable checks
// it for every such token when the vocabulary loads (a character with one
// that is not starts as bytes). If the join splits T inside X, its left
// part ends with a head of X: a cutting token that ranks below X and occurs
// wherever T does. If it splits T inside P, its right part is a shorter
// lower-ranked extension ending with X, which occurs there too: by
// induction, again a cutting token below X occurs. Likewise for X·S. So
// where no token below rank(X) cuts X, no lower-ranked extension occurs.
// This matters: tokens such as " X" often rank below X.
//
// Spaced. A piece that starts with a space and a character X of two or
// three bytes may start from the tokens of P = " X" alone, T1..Tk, as
// parts, when the merges of BPE on P alone all rank at most R and every
// token that would cross P's end ranks above R. Until P reaches T1..Tk,
// one of its own merges (rank <= R) is pending, so BPE on bytes picks no
// merge above R: none crosses P's end (nothing precedes P in the piece),
// P's bytes are merged as alone, and every merge it picks elsewhere ranks
// at most R. A merge that needs T1..Tk (of the last part with the next)
// ranks above R, so starting from them never brings it ahead of those.
// The merges outside P thus happen in the same order in both runs. A
// token that crosses P's end starts with a proper tail of P and goes on
// past it: with a tail of X (the cut list of X), with the whole X (the
// extensions of X below R, listed when the vocabulary loads), or, when k
// is 1, with the whole P (the vocabulary rules out those below R). Both
// lists are checked in context. In most scripts " X" is a token of lower
// rank than the tokens of a space and X's lead byte, which cut X itself:
// without this, the first character of every word of such a script would
// start as bytes.
//
// TestPremergeCutTokens puts every cutting token in its context;
// TestPremergeMatchesOracle, the fixture of OpenAI's tiktoken and the
// differential tests compare the result token for token.

// charInfo says how a character of two to four bytes starts its merges.
type charInfo struct {
	// rank is the character's rank when it may start whole (rank >= 0);
	// -1 when it must start as bytes; -(k+1) when it is separate, k
	// being the number of its own tokens: a piece is cut around it unless
	// a token cuts it.
	rank   int32
	after  uint16 // index in vocab.cuts of the tokens that start with a tail of it (0: none)
	before uint16 // index in vocab.cuts of the tokens that end with a head of it (0: none)
}

// suppPlane holds the charInfo of the characters of one plane above the
// BMP, computed on first use: 256 blocks of 256 characters, identical
// blocks shared (a plane needs 30 to 70 distinct ones), so that a plane
// costs about 100 KB and a few milliseconds once, and only planes that
// text uses are computed.
type suppPlane struct {
	ready  atomic.Bool
	mu     sync.Mutex
	index  [256]uint16 // by (r>>8)&0xFF: the block in blocks
	blocks []charInfo  // blocks of 256
}

// charMaps holds what computing a four-byte character's charInfo needs,
// beyond vocab.chars: the least rank of a longer token starting (ending)
// with the character, and the cut lists of its three-byte tail and head.
type charMaps struct {
	minStart, minEnd map[rune]int32
	afterBy1         [64]uint16        // by the last continuation byte
	beforeBy1        [64]uint16        // by the lead byte (C0..FF)
	afterBy2         [4096]uint16      // by the last 2 continuation bytes: tails of 1 and 2
	beforeBy2        [0x15 << 6]uint16 // by lead byte (E0..F4) and a continuation byte: heads of 1 and 2
	afterBy3         map[uint32]uint16 // by 3 continuation bytes: tails of 1 to 3
	beforeBy3        map[uint32]uint16 // by lead byte and 2 continuation bytes: heads of 1 to 3
	// unsure holds the characters with a lower-ranked extension that is
	// not the join of two lower-ranked tokens (see charInfo).
	unsure map[rune]bool
}

// buildChars computes v.chars for the BMP, the maps from which four-byte
// characters are computed, and v.cuts.
func (v *vocab) buildChars() {
	const none = math.MaxInt32
	cut := cutIndex{lists: make([]cutList, 1), tail3: map[uint32]uint16{}, head3: map[uint32]uint16{}}
	minStart := make([]int32, 0x10000) // least rank of a longer token starting with the rune
	minEnd := make([]int32, 0x10000)   // least rank of a longer token ending with the rune
	// least rank of a token longer than " "+rune starting with it
	minSpaced := make([]int32, 0x10000)
	for i := range minStart {
		minStart[i], minEnd[i], minSpaced[i] = none, none, none
	}
	m := &charMaps{minStart: map[rune]int32{}, minEnd: map[rune]int32{}}
	// m.unsure lists the characters with a lower-ranked extension that is
	// not the join of two lower-ranked tokens (see charInfo).
	m.unsure = map[rune]bool{}
	extends := func(r rune, x, tok string, rank int) {
		if rx := v.rank(x); int32(rank) < rx && rx != noRank && !v.derivable(tok, int32(rank)) {
			m.unsure[r] = true
		}
	}
	for rank, tok := range v.tokens {
		if len(tok) < 2 {
			continue
		}
		cut.add(tok, int32(rank))
		if r, n := utf8.DecodeRuneInString(tok); n < len(tok) && n > 1 {
			if r < 0x10000 {
				minStart[r] = min(minStart[r], int32(rank))
			} else if old, ok := m.minStart[r]; !ok || int32(rank) < old {
				m.minStart[r] = int32(rank)
			}
			extends(r, tok[:n], tok, rank)
		}
		if tok[0] == ' ' {
			if r, n := utf8.DecodeRuneInString(tok[1:]); n > 1 && 1+n < len(tok) && r < 0x10000 {
				minSpaced[r] = min(minSpaced[r], int32(rank))
			}
		}
		if r, n := utf8.DecodeLastRuneInString(tok); n < len(tok) && n > 1 {
			if r < 0x10000 {
				minEnd[r] = min(minEnd[r], int32(rank))
			} else if old, ok := m.minEnd[r]; !ok || int32(rank) < old {
				m.minEnd[r] = int32(rank)
			}
			extends(r, tok[len(tok)-n:], tok, rank)
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
		var l cutList
		l.next = append(append([]string(nil), la.next...), lb.next...)
		l.prev = append(append([]string(nil), la.prev...), lb.prev...)
		l.ranks = append(append([]int32(nil), la.ranks...), lb.ranks...)
		cut.lists = append(cut.lists, l)
		i := uint16(len(cut.lists) - 1)
		merged[[2]uint16{a, b}] = i
		return i
	}
	m.afterBy1, m.beforeBy1 = cut.tail1, cut.head1
	for k := range m.afterBy2 {
		m.afterBy2[k] = join(cut.tail1[k&0x3F], cut.tail2[k])
	}
	for k := range m.beforeBy2 {
		m.beforeBy2[k] = join(cut.head1[0x20+(k>>6)], cut.head2[k])
	}
	m.afterBy3, m.beforeBy3 = map[uint32]uint16{}, map[uint32]uint16{}
	for k, l := range cut.tail3 {
		m.afterBy3[k] = join(m.afterBy2[k&0xFFF], l)
	}
	for k, l := range cut.head3 {
		m.beforeBy3[k] = join(m.beforeBy2[int((k>>12)-0xE0)<<6|int((k>>6)&0x3F)], l)
	}
	v.charMaps = m
	v.chars = make([]int32, 0x10000)
	var buf [4]byte
	for r := range v.chars {
		if r < 0x80 || (0xD800 <= r && r < 0xE000) {
			v.chars[r] = -1
			continue
		}
		n := utf8.EncodeRune(buf[:], rune(r))
		v.chars[r] = v.charInfo(string(buf[:n]), minStart[r], minEnd[r]).rank
	}
	v.spacedStarts(&cut, minSpaced)
	v.cuts = cut.lists
	v.near = make([]nearFilter, len(v.cuts))
	for i := range v.cuts {
		l := &v.cuts[i]
		l.index()
		var least [256]int32 // least rank of a neighbour by nearest byte
		for b := range least {
			least[b] = math.MaxInt32
		}
		for j, rest := range l.next {
			least[rest[0]] = min(least[rest[0]], l.ranks[j])
		}
		for j, pre := range l.prev {
			b := pre[len(pre)-1]
			least[b] = min(least[b], l.ranks[j])
		}
		f := &v.near[i]
		for b, r := range least {
			if b&63 == 0 {
				f.base[b>>6] = uint32(len(v.nearRanks))
			}
			if r != math.MaxInt32 {
				f.bits[b>>6] |= 1 << (b & 63)
				v.nearRanks = append(v.nearRanks, r)
			}
		}
	}
}

// charInfo computes the charInfo of character x (two to four bytes),
// given the least ranks of the longer tokens that start and end with it.
func (v *vocab) charInfo(x string, minStart, minEnd int32) charInfo {
	m := v.charMaps
	var ci charInfo
	ci.after, ci.before = m.lists(x)
	toks, inner := v.alone(x)
	rx := v.rank(x)
	switch {
	case toks > 1:
		ci.rank = -int32(toks) - 1
	case minStart == math.MaxInt32 && minEnd == math.MaxInt32:
		ci.rank = -2 // one token that never joins another
	case inner < rx && rx < minStart && rx < minEnd:
		ci.rank = rx
	case inner < rx:
		// Lower-ranked extensions, each the join of two lower-ranked
		// tokens: the cut check finds them in context (see above).
		if r, _ := utf8.DecodeRuneInString(x); m.unsure[r] {
			ci.rank = -1
		} else {
			ci.rank = rx
		}
	default:
		ci.rank = -1
	}
	return ci
}

// spacedStart is how a piece that starts with a space and a character X
// starts (see Spaced above): with parts toks[:n] of lengths lens[:n], the
// tokens of " X" alone, when no token of rank below bound crosses the end
// of " X": none of the cut list of X, and none of ext, the tokens that
// start with X and go on (0: none below bound).
type spacedStart struct {
	bound int32
	toks  [3]int32
	lens  [3]uint8
	n     uint8
	ext   uint16
}

// spacedStarts computes v.spaced and v.spacedIndex for the characters of
// two and three bytes, adding the lists of extensions to cut. minSpaced
// holds the least rank of a token longer than " X" that starts with " X".
func (v *vocab) spacedStarts(cut *cutIndex, minSpaced []int32) {
	v.spacedIndex = make([]uint16, len(v.chars))
	// 0: none; most characters qualify, so one allocation holds them all
	v.spaced = make([]spacedStart, 1, len(v.chars))
	for r := range v.spacedIndex {
		if r < 0x80 || (0xD800 <= r && r < 0xE000) || len(v.spaced) == math.MaxUint16 {
			continue
		}
		x := " " + string(rune(r))
		var sp spacedStart
		var lens [5]int
		n, bound := v.aloneParts(x, &lens)
		if bound < 0 || n > len(sp.toks) || n == 1 && minSpaced[r] < bound {
			continue
		}
		sp.bound, sp.n = bound, uint8(n)
		at := 0
		for j := range n {
			sp.toks[j], sp.lens[j] = v.rank(x[at:at+lens[j]]), uint8(lens[j])
			at += lens[j]
		}
		v.spacedIndex[r] = uint16(len(v.spaced))
		v.spaced = append(v.spaced, sp)
	}
	// The extensions of each such character that rank below its bound.
	for rank, tok := range v.tokens {
		r, n := utf8.DecodeRuneInString(tok)
		if n < 2 || n == len(tok) || r >= 0x10000 {
			continue
		}
		if i := v.spacedIndex[r]; i != 0 && int32(rank) < v.spaced[i].bound {
			cut.list(&v.spaced[i].ext).addNext(tok[n:], int32(rank))
		}
	}
}

// aloneParts runs BPE on the bytes of x (at most 4) alone, stores the
// lengths of the resulting tokens in lens and returns their number and the
// highest rank of its merges (-1: none).
func (v *vocab) aloneParts(x string, lens *[5]int) (int, int32) {
	parts := len(x)
	for i := range parts {
		lens[i] = 1
	}
	high := int32(-1)
	for parts > 1 {
		minR, mi, at := int32(noRank), -1, 0
		for i := 0; i < parts-1; i++ {
			if r := v.rank(x[at : at+lens[i]+lens[i+1]]); r < minR {
				minR, mi = r, i
			}
			at += lens[i]
		}
		if mi < 0 {
			break
		}
		high = max(high, minR)
		lens[mi] += lens[mi+1]
		copy(lens[mi+1:parts], lens[mi+2:parts+1])
		parts--
	}
	return parts, high
}

// lists returns the cut lists of character x (two to four bytes): of the
// tokens that start with one of its tails and of those that end with one
// of its heads.
func (m *charMaps) lists(x string) (after, before uint16) {
	switch len(x) {
	case 2:
		after, before = m.afterBy1[x[1]&0x3F], m.beforeBy1[x[0]-0xC0]
	case 3:
		after = m.afterBy2[int(x[1]&0x3F)<<6|int(x[2]&0x3F)]
		before = m.beforeBy2[int(x[0]-0xE0)<<6|int(x[1]&0x3F)]
	case 4:
		after = m.afterBy2[int(x[2]&0x3F)<<6|int(x[3]&0x3F)]
		if l, ok := m.afterBy3[uint32(x[1]&0x3F)<<12|uint32(x[2]&0x3F)<<6|uint32(x[3]&0x3F)]; ok {
			after = l
		}
		before = m.beforeBy2[int(x[0]-0xE0)<<6|int(x[1]&0x3F)]
		if l, ok := m.beforeBy3[uint32(x[0])<<12|uint32(x[1]&0x3F)<<6|uint32(x[2]&0x3F)]; ok {
			before = l
		}
	}
	return after, before
}

// bmpChar returns the charInfo of a character of two or three bytes,
// rune r: its rank from vocab.chars, its cut lists from its bytes.
func (v *vocab) bmpChar(r rune) charInfo {
	m := v.charMaps
	ci := charInfo{rank: v.chars[r]}
	switch {
	case r < 0x80 || (0xD800 <= r && r < 0xE000):
	case r < 0x800:
		ci.after, ci.before = m.afterBy1[r&0x3F], m.beforeBy1[r>>6]
	default:
		ci.after, ci.before = m.afterBy2[r&0xFFF], m.beforeBy2[r>>6]
	}
	return ci
}

// sepTokens returns the number of tokens of a separate character (rank <
// -1).
func (c charInfo) sepTokens() int { return int(-c.rank) - 1 }

// alone runs BPE on the bytes of x (at most 4) alone. It returns the
// number of tokens and the highest rank of its merges but the last (-1
// when there is at most one merge).
func (v *vocab) alone(x string) (toks int, inner int32) {
	var startBuf [5]int32
	parts := len(x)
	starts := startBuf[:parts+1]
	for i := range starts {
		starts[i] = int32(i)
	}
	inner, last := -1, int32(-1)
	for parts > 1 {
		minR, mi := int32(noRank), -1
		for i := 0; i < parts-1; i++ {
			if r := v.rank(x[starts[i]:starts[i+2]]); r < minR {
				minR, mi = r, i
			}
		}
		if mi < 0 {
			break
		}
		inner = max(inner, last)
		last = minR
		copy(starts[mi+1:parts], starts[mi+2:parts+1])
		parts--
	}
	return parts, inner
}

// derivable reports whether tok, of the given rank, is the join of two
// tokens of lower ranks, as every token of a vocabulary trained by BPE is.
func (v *vocab) derivable(tok string, rank int32) bool {
	for k := 1; k < len(tok); k++ {
		if v.rank(tok[:k]) < rank && v.rank(tok[k:]) < rank {
			return true
		}
	}
	return false
}

// suppInfo returns the charInfo of a four-byte character.
func (v *vocab) suppInfo(x string) charInfo {
	return v.suppChar(rune(x[0]&0x07)<<18 | rune(x[1]&0x3F)<<12 | rune(x[2]&0x3F)<<6 | rune(x[3]&0x3F))
}

// suppChar returns the charInfo of a character above the BMP.
func (v *vocab) suppChar(r rune) charInfo {
	pl := &v.planes[r>>16-1]
	if !pl.ready.Load() {
		v.buildPlane(pl, r>>16)
	}
	return pl.blocks[int(pl.index[r>>8&0xFF])<<8|int(r&0xFF)]
}

// buildPlane computes the charInfo of every character of plane (1 to 16)
// into pl, once.
func (v *vocab) buildPlane(pl *suppPlane, plane rune) {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	if pl.ready.Load() {
		return
	}
	seen := make(map[[256]charInfo]uint16)
	var blk [256]charInfo
	var buf [4]byte
	for b := range rune(256) {
		for k := range rune(256) {
			r := plane<<16 | b<<8 | k
			utf8.EncodeRune(buf[:], r)
			ms, ok := v.charMaps.minStart[r]
			if !ok {
				ms = math.MaxInt32
			}
			me, ok := v.charMaps.minEnd[r]
			if !ok {
				me = math.MaxInt32
			}
			blk[k] = v.charInfo(string(buf[:]), ms, me)
		}
		i, ok := seen[blk]
		if !ok {
			i = uint16(len(pl.blocks) >> 8)
			seen[blk] = i
			pl.blocks = append(pl.blocks, blk[:]...)
		}
		pl.index[b] = i
	}
	pl.ready.Store(true)
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
// token; by the head (lead byte and at most two continuation bytes) they
// end with, the rest before it. Each index maps to a cutList in lists (0:
// none).
type cutIndex struct {
	tail1 [64]uint16        // one continuation byte (index: its low 6 bits)
	tail2 [4096]uint16      // two continuation bytes
	tail3 map[uint32]uint16 // three continuation bytes
	head1 [64]uint16        // a lead byte (index: b-0xC0)
	head2 [0x15 << 6]uint16 // a lead byte of 3 or 4 bytes (index: b-0xE0) and a continuation byte
	head3 map[uint32]uint16 // a lead byte of 4 bytes and two continuation bytes (index: b<<12|...)
	lists []cutList
}

// cutList holds the neighbours (the rest of a cutting token, next to the
// character) of a character's tails or heads, sorted by their nearest two
// bytes (see nearKey), so that a look-up compares only the strings that
// begin (for a head: end) with the bytes next to the character.
type cutList struct {
	one   cutNear  // bit b: a neighbour of one byte b
	two   uint64   // bit pairBit(b0, b1): a longer neighbour with nearest bytes b0, b1
	keys  []uint32 // the key of each neighbour, ascending
	next  []string // after a tail: the bytes that follow
	prev  []string // before a head: the bytes that precede
	ranks []int32  // the rank of each cutting token, in the order of next or prev
}

// nearKey is the key of a neighbour whose nearest byte is b0 and, when it
// has more than one, next nearest b1 (-1 when it has one).
func nearKey(b0 byte, b1 int) uint32 { return uint32(b0)<<9 | uint32(b1+1) }

// index sorts the neighbours of l by key.
func (l *cutList) index() {
	n := len(l.ranks)
	keys := make([]uint32, n)
	order := make([]int, n)
	for j := range n {
		order[j] = j
		switch {
		case len(l.next) > 0 && len(l.next[j]) == 1:
			keys[j] = nearKey(l.next[j][0], -1)
		case len(l.next) > 0:
			keys[j] = nearKey(l.next[j][0], int(l.next[j][1]))
		case len(l.prev[j]) == 1:
			keys[j] = nearKey(l.prev[j][0], -1)
		default:
			pre := l.prev[j]
			keys[j] = nearKey(pre[len(pre)-1], int(pre[len(pre)-2]))
		}
	}
	sort.SliceStable(order, func(a, b int) bool { return keys[order[a]] < keys[order[b]] })
	sorted := cutList{keys: make([]uint32, n), ranks: make([]int32, n)}
	for j, o := range order {
		k := keys[o]
		sorted.keys[j], sorted.ranks[j] = k, l.ranks[o]
		if b0, b1 := byte(k>>9), int(k&0x1FF)-1; b1 < 0 {
			sorted.one[b0>>6] |= 1 << (b0 & 63)
		} else {
			sorted.two |= pairBit(b0, byte(b1))
		}
		if len(l.next) > 0 {
			sorted.next = append(sorted.next, l.next[o])
		} else {
			sorted.prev = append(sorted.prev, l.prev[o])
		}
	}
	*l = sorted
}

func pairBit(b0, b1 byte) uint64 { return 1 << ((uint(b0)*11 + uint(b1)) & 63) }

// find returns the range of the neighbours of l with key k.
func (l *cutList) find(k uint32) (int, int) {
	lo, _ := slices.BinarySearch(l.keys, k)
	hi := lo
	for hi < len(l.keys) && l.keys[hi] == k {
		hi++
	}
	return lo, hi
}

// cutNear is the first filter of a cutList, kept apart in vocab.near so
// that the check every character makes touches 32 bytes: bit b is set
// when a neighbour starts (after a tail) or ends (before a head) with
// byte b.
type cutNear [4]uint64

func (f *cutNear) has(b byte) bool { return f[b>>6]&(1<<(b&63)) != 0 }

// nearFilter is the first filter of a cutList, kept apart in vocab.near so
// that the check every character makes touches a few bytes: bit b of bits
// is set when a neighbour starts (after a tail) or ends (before a head)
// with byte b, and vocab.nearRanks holds the least rank of the tokens of
// those neighbours, for the set bits in order from base.
type nearFilter struct {
	bits [4]uint64
	base [4]uint32 // index in vocab.nearRanks of the first set bit of each word of bits
}

// nearBelow reports whether cut list l may hold a neighbour whose nearest
// byte is b and whose token ranks below bound: when it does not, the list
// cuts nothing there (followedBy and precededBy count only such tokens).
func (v *vocab) nearBelow(l uint16, b byte, bound int32) bool {
	f := &v.near[l]
	w, bit := f.bits[b>>6], uint64(1)<<(b&63)
	return w&bit != 0 && v.nearRanks[f.base[b>>6]+uint32(bits.OnesCount64(w&(bit-1)))] < bound
}

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

// mapList is list for an index kept in a map.
func (c *cutIndex) mapList(m map[uint32]uint16, k uint32) *cutList {
	idx := m[k]
	l := c.list(&idx)
	m[k] = idx
	return l
}

// addNext records rest as following a tail.
func (l *cutList) addNext(rest string, rank int32) {
	l.ranks = append(l.ranks, rank)
	l.next = append(l.next, rest)
}

// addPrev records pre as preceding a head.
func (l *cutList) addPrev(pre string, rank int32) {
	l.ranks = append(l.ranks, rank)
	l.prev = append(l.prev, pre)
}

func (c *cutIndex) add(tok string, rank int32) {
	k := 0
	for k < len(tok) && isCont(tok[k]) {
		k++
	}
	if k < len(tok) {
		switch k {
		case 1:
			c.list(&c.tail1[tok[0]&0x3F]).addNext(tok[1:], rank)
		case 2:
			c.list(&c.tail2[int(tok[0]&0x3F)<<6|int(tok[1]&0x3F)]).addNext(tok[2:], rank)
		case 3:
			c.mapList(c.tail3, uint32(tok[0]&0x3F)<<12|uint32(tok[1]&0x3F)<<6|uint32(tok[2]&0x3F)).addNext(tok[3:], rank)
		}
	}
	for j := len(tok) - 1; j >= 1 && j >= len(tok)-3; j-- {
		if isCont(tok[j]) {
			continue
		}
		// tok[j] starts the last character of tok
		if tok[j] < 0xC2 || tok[j] > 0xF4 || leadLen(tok[j]) <= len(tok)-j {
			break
		}
		switch len(tok) - j {
		case 1:
			c.list(&c.head1[tok[j]-0xC0]).addPrev(tok[:j], rank)
		case 2:
			c.list(&c.head2[int(tok[j]-0xE0)<<6|int(tok[j+1]&0x3F)]).addPrev(tok[:j], rank)
		case 3:
			c.mapList(c.head3, uint32(tok[j])<<12|uint32(tok[j+1]&0x3F)<<6|uint32(tok[j+2]&0x3F)).addPrev(tok[:j], rank)
		}
		break
	}
}

// followedBy reports whether a neighbour of l whose token ranks below
// bound follows, at the start of after.
func (l *cutList) followedBy(after string, bound int32) bool {
	if len(after) == 0 {
		return false
	}
	if l.one.has(after[0]) {
		lo, hi := l.find(nearKey(after[0], -1))
		for j := lo; j < hi; j++ {
			if l.ranks[j] < bound {
				return true
			}
		}
	}
	if len(after) < 2 || l.two&pairBit(after[0], after[1]) == 0 {
		return false
	}
	lo, hi := l.find(nearKey(after[0], int(after[1])))
	for j := lo; j < hi; j++ {
		if l.ranks[j] < bound && strings.HasPrefix(after, l.next[j]) {
			return true
		}
	}
	return false
}

// precededBy reports whether a neighbour of l whose token ranks below
// bound precedes, at the end of before.
func (l *cutList) precededBy(before string, bound int32) bool {
	n := len(before)
	if n == 0 {
		return false
	}
	if l.one.has(before[n-1]) {
		lo, hi := l.find(nearKey(before[n-1], -1))
		for j := lo; j < hi; j++ {
			if l.ranks[j] < bound {
				return true
			}
		}
	}
	if n < 2 || l.two&pairBit(before[n-1], before[n-2]) == 0 {
		return false
	}
	lo, hi := l.find(nearKey(before[n-1], int(before[n-2])))
	for j := lo; j < hi; j++ {
		if l.ranks[j] < bound && strings.HasSuffix(before, l.prev[j]) {
			return true
		}
	}
	return false
}

// uncut reports whether no token cuts the n-byte character at p[i:i+n].
// For a character that may start whole, only cutting tokens that rank
// below it count: until the character is whole one of its own merges,
// all ranked at most its rank, is pending, so a merge that would cut it
// and ranks above it never comes first.
func (v *vocab) uncut(p string, i, n int, c charInfo) bool {
	bound := int32(math.MaxInt32)
	if c.rank >= 0 {
		bound = c.rank
	}
	if i+n < len(p) && v.nearBelow(c.after, p[i+n], bound) && v.cuts[c.after].followedBy(p[i+n:], bound) {
		return false
	}
	return i == 0 || !v.nearBelow(c.before, p[i-1], bound) || !v.cuts[c.before].precededBy(p[:i], bound)
}
