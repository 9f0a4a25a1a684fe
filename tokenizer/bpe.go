package tokenizer

import (
	"hash/maphash"
	"math"
	"unicode/utf8"
)

// The per-worker cache of piece counts is direct-mapped: a fixed array of
// slots holding the piece's bytes inline, so that a look-up or an insert
// never allocates and memory stays bounded. A collision simply replaces the
// slot; the key is compared in full, so a hit is always exact.
const (
	cacheBits     = 12
	cacheMaxPiece = 30
)

type cacheSlot struct {
	n     uint8 // piece length; 0 marks an empty slot
	count uint8 // tokens of the piece (at most its length)
	key   [cacheMaxPiece]byte
}

type pieceCache [1 << cacheBits]cacheSlot

// cacheSeed and cacheKeys key the cache's hash per process, so that no
// input can be crafted to collide: a piece longer than midMax hashes its
// bytes with maphash, a shorter one its packed key (see countPiece),
// mixed with cacheKeys and multiplied, whose carries make collisions
// depend on the keys.
var (
	cacheSeed = maphash.MakeSeed()
	cacheKeys = [2]uint64{maphash.String(cacheSeed, "short"), maphash.String(cacheSeed, "mid")}
)

const noRank = math.MaxInt32

// worker holds the scratch space of one counting goroutine. Workers are
// pooled by the Counter; a worker is used by one goroutine at a time.
type worker struct {
	// cache holds piece counts per vocabulary (indexed by vocab.id),
	// allocated on first use.
	cache [numVocabs]*pieceCache
	// joins holds recent joins per vocabulary (see join), allocated on
	// first use.
	joins [numVocabs]*joinCache
	// work counts BPE merge steps and rank look-ups, for the linearity test.
	work int
	// scratch for long and non-ASCII pieces: the ranks and offsets of
	// their parts, and for long ones the links and tournament tree of
	// mergeLarge
	toks, starts []int32
	next, prev   []int32
	tree         []uint64
	scan         scanState
}

// A merge joins two adjacent parts, which are tokens; the join is a token
// or not. A join is cached as one word: the key of the two ranks
// (joinKey), shifted left by joinShift, then the rank of the join plus one
// (0: not a token).
const (
	joinShift = 21
	joinMask  = 1<<joinShift - 1
	joinBits  = 14
	joinMul   = 0x9E3779B97F4A7C15 // the cache's hash multiplier
)

// joinKey packs two ranks (below joinMask) into a key of 42 bits; it is
// never 0, so an empty cache entry matches no key.
func joinKey(a, b int32) uint64 { return uint64(a+1)<<joinShift | uint64(b) }

// joinCache is a direct-mapped cache of joins, hits and misses: merges of
// similar pieces repeat the same joins, and this small table stays in the
// CPU cache where the vocabulary's tables do not. Keyed by ranks, a hit
// costs no hashing of bytes, whatever the length of the join.
type joinCache [1 << joinBits]uint64

// joinCache returns the worker's join cache for v.
func (w *worker) joinCache(v *vocab) *joinCache {
	jc := w.joins[v.id]
	if jc == nil {
		jc = new(joinCache)
		w.joins[v.id] = jc
	}
	return jc
}

// join returns the rank of s, the join of adjacent parts of ranks a and
// b, or -1 when s is not a token, through the cache jc.
func (v *vocab) join(jc *joinCache, a, b int32, s string) int32 {
	k := joinKey(a, b)
	e := jc[(k*joinMul)>>(64-joinBits)]
	if e>>joinShift != k {
		e = v.joinMiss(jc, k, s)
	}
	return int32(e&joinMask) - 1
}

// joinMiss looks up the join s of key k in the vocabulary and caches it.
//
//go:noinline
func (v *vocab) joinMiss(jc *joinCache, k uint64, s string) uint64 {
	e := k << joinShift
	if r := v.rank(s); r != noRank {
		e |= uint64(r) + 1
	}
	jc[(k*joinMul)>>(64-joinBits)] = e
	return e
}

func newWorker() *worker {
	return &worker{}
}

// maxKeptPiece is the longest piece whose merge scratch a worker keeps for
// the next call. A longer piece (one run of a letter, a CJK text without
// punctuation) allocates its own, which is garbage once counted, so that a
// pooled worker holds at most ~260 KB of scratch besides its 512 KB of
// caches whatever it counted (TestWorkerMemoryBounded).
const maxKeptPiece = 8 << 10

// trim drops scratch grown past what maxKeptPiece needs.
func (w *worker) trim() {
	if cap(w.next) > maxKeptPiece+1 {
		w.next, w.prev = nil, nil
	}
	if cap(w.tree) > 2*maxKeptPiece {
		w.tree = nil
	}
	if cap(w.toks) > maxKeptPiece+1 {
		w.toks, w.starts = nil, nil
	}
}

// rank returns the rank of s, or noRank.
func (v *vocab) rank(s string) int32 {
	if len(s) <= shortMax {
		if k := packShort(s); v.mayBeShort(k) {
			return v.getShort(k)
		}
		return noRank
	}
	if len(s) <= midMax {
		if k := packMid(s); v.mayBeMid(k) {
			return v.getMid(k)
		}
		return noRank
	}
	if !v.mayBeLong(s) {
		return noRank
	}
	if r, ok := v.ranks[s]; ok {
		return r
	}
	return noRank
}

// countText returns the number of tokens of text, encoded as ordinary text
// (special-token strings are plain text). Invalid UTF-8 counts as if each
// invalid byte were U+FFFD (see sanitize); the pre-tokenizers split raw
// text into the same pieces, so only a piece that holds such bytes is
// rewritten, by countPiece.
func (v *vocab) countText(w *worker, text string) int {
	n := 0
	for i := 0; i < len(text); {
		e, _ := v.split(text, i)
		n += v.countPiece(w, text[i:e])
		i = e
	}
	return n
}

// sanitize maps invalid UTF-8 bytes to U+FFFD one by one, as Go's
// conversion to runes does (and tiktoken-go with it). Text that reaches
// OpenAI's tiktoken is always valid Unicode, so this only has to be a
// consistent choice, and counts stay defined on any input.
func sanitize(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			if utf8.ValidString(s[i:]) {
				return s
			}
			return string([]rune(s))
		}
	}
	return s
}

// countPiece counts the tokens of piece p, which may hold invalid UTF-8.
func (v *vocab) countPiece(w *worker, p string) int {
	switch len(p) {
	case 1:
		if p[0] < 0x80 {
			return 1
		}
		return v.countPiece(w, sanitize(p))
	case 2:
		if p[0]|p[1] >= 0x80 && charLen(p, 0) != 2 {
			return v.countPiece(w, sanitize(p))
		}
		if v.pair[int(p[0])<<8|int(p[1])] != noRank {
			return 1
		}
		return 2
	}
	w.work++
	// A piece that is a token is one token, unless the token is a
	// fragment of a character: then the piece holds invalid UTF-8. This
	// is rank, inline: a piece of up to midMax bytes hashes its packed
	// key for the cache too.
	r, h := int32(noRank), uint64(0)
	switch {
	case len(p) <= shortMax:
		k := packShort(p)
		if v.mayBeShort(k) {
			r = v.getShort(k)
		}
		h = (k ^ cacheKeys[0]) * 0x9E3779B97F4A7C15
	case len(p) <= midMax:
		k := packMid(p)
		if v.mayBeMid(k) {
			r = v.getMid(k)
		}
		h = (k[0]^cacheKeys[0])*0x9E3779B97F4A7C15 + (k[1]^cacheKeys[1])*0xC2B2AE3D27D4EB4F
	default:
		r = v.rank(p)
		h = maphash.String(cacheSeed, p)
	}
	if r != noRank && v.valid[r>>6]&(1<<(r&63)) != 0 {
		return 1
	}
	// The cache is keyed by the raw piece: invalid bytes map to U+FFFD
	// the same way every time.
	var slot *cacheSlot
	if len(p) <= cacheMaxPiece {
		c := w.cache[v.id]
		if c == nil {
			c = new(pieceCache)
			w.cache[v.id] = c
		}
		slot = &c[h>>(64-cacheBits)]
		if int(slot.n) == len(p) && string(slot.key[:len(p)]) == p {
			return int(slot.count)
		}
	}
	n := v.merge(w, p, nil)
	if slot != nil {
		slot.n, slot.count = uint8(len(p)), uint8(n)
		copy(slot.key[:], p)
	}
	return n
}

// charLen returns the length of the valid UTF-8 sequence of two to four
// bytes at p[i], or 0.
func charLen(p string, i int) int {
	b := p[i]
	switch {
	case b-0xC2 < 0x1E:
		if i+1 < len(p) && isCont(p[i+1]) {
			return 2
		}
	case b-0xE0 < 0x10:
		if i+2 < len(p) && isCont(p[i+1]) && isCont(p[i+2]) &&
			(b != 0xE0 || p[i+1] >= 0xA0) && (b != 0xED || p[i+1] < 0xA0) {
			return 3
		}
	case b-0xF0 < 5:
		if i+3 < len(p) && isCont(p[i+1]) && isCont(p[i+2]) && isCont(p[i+3]) &&
			(b != 0xF0 || p[i+1] >= 0x90) && (b != 0xF4 || p[i+1] < 0x90) {
			return 4
		}
	}
	return 0
}

// encodePiece appends the ranks of p's tokens to dst.
func (v *vocab) encodePiece(w *worker, p string, dst []int) []int {
	if r, ok := v.ranks[p]; ok {
		return append(dst, int(r))
	}
	v.merge(w, p, &dst)
	return dst
}

// merge is tiktoken's byte-pair merge of p: repeatedly merge the adjacent
// pair of parts of lowest rank (leftmost on ties). It returns the number of
// tokens and, when out is not nil, appends them. Parts are tokens, so
// the joins a merge looks up are cached by rank (see join). Short pieces
// are merged with a scan, long ones with a tournament tree; a piece with
// non-ASCII characters is cut around those that BPE never joins with
// their neighbours, and characters that are one token start as one part,
// when that provably changes nothing (premerge.go).
func (v *vocab) merge(w *worker, p string, out *[]int) int {
	for i := 0; i < len(p); i++ {
		if p[i] >= 0x80 {
			return v.mergeChars(w, p, out)
		}
	}
	return v.mergeBytes(w, p, out)
}

// mergeBytes merges p from one part per byte.
func (v *vocab) mergeBytes(w *worker, p string, out *[]int) int {
	var tokBuf [scanParts]int32
	var startBuf [scanParts + 1]int32
	toks, starts := tokBuf[:0], startBuf[:0]
	if len(p) > scanParts {
		w.grow(len(p))
		toks, starts = w.toks[:0], w.starts[:0]
	}
	for i := 0; i < len(p); i++ {
		toks = append(toks, v.bytes[p[i]])
		starts = append(starts, int32(i))
	}
	return v.mergeSegment(w, p, toks, starts, true, out)
}

// grow makes the part scratch hold a piece of n bytes.
func (w *worker) grow(n int) {
	if cap(w.toks) < n {
		w.toks = make([]int32, 0, n)
		w.starts = make([]int32, 0, n+1)
	}
}

// mergeChars merges p, which has non-ASCII characters, segment by
// segment (invalid UTF-8 first becomes U+FFFD, see sanitize): a separate
// character that no token cuts ends a segment and adds its own tokens;
// inside a segment, a character that may start whole and that no token
// cuts is one part, others one part per byte (premerge.go).
func (v *vocab) mergeChars(w *worker, p string, out *[]int) int {
	w.grow(len(p))
	// The parts of the segment from seg: their ranks and offsets.
	toks, starts := w.toks[:len(p)], w.starts[:len(p)]
	bytes := &v.bytes
	m := v.charMaps
	np, n, seg, whole := 0, 0, 0, false
	outLen := 0
	if out != nil {
		outLen = len(*out)
	}
	for i := 0; i < len(p); {
		b := p[i]
		if b < 0x80 {
			toks[np], starts[np] = bytes[b], int32(i-seg)
			np++
			i++
			continue
		}
		// Decode the character (as charLen and class do) and look it up
		// (as bmpChar or suppChar).
		var ci charInfo
		size := 0
		r := rune(0)
		switch {
		case b < 0xE0:
			if b >= 0xC2 && i+1 < len(p) && isCont(p[i+1]) {
				r = rune(b&0x1F)<<6 | rune(p[i+1]&0x3F)
				ci = charInfo{rank: v.chars[r], after: m.afterBy1[r&0x3F], before: m.beforeBy1[r>>6]}
				size = 2
			}
		case b < 0xF0:
			if i+2 < len(p) && load16(p, i+1)&0xC0C0 == 0x8080 {
				r = rune(b&0x0F)<<12 | rune(p[i+1]&0x3F)<<6 | rune(p[i+2]&0x3F)
				if r >= 0x800 && uint32(r-0xD800) >= 0x800 {
					ci = charInfo{rank: v.chars[r], after: m.afterBy2[r&0xFFF], before: m.beforeBy2[r>>6]}
					size = 3
				}
			}
		case b < 0xF5:
			if i+3 < len(p) {
				if w := load32(p, i); w&0xC0C0C000 == 0x80808000 {
					r := rune(w&0x07)<<18 | rune(w>>8&0x3F)<<12 | rune(w>>16&0x3F)<<6 | rune(w>>24&0x3F)
					if uint32(r-0x10000) < 0x100000 {
						ci, size = v.suppChar(r), 4
					}
				}
			}
		}
		if size == 0 { // invalid UTF-8: start again with U+FFFD for it
			return v.mergeInvalid(w, p, out, outLen)
		}
		// A piece that starts with a space and this character may start
		// from their tokens alone (premerge.go): the space is part 0.
		if i == 1 && p[0] == ' ' && size < 4 {
			if k := v.spacedIndex[r]; k != 0 && v.spacedUncut(&v.spaced[k], ci, p[1+size:]) {
				sp := &v.spaced[k]
				at := int32(0)
				for j := range int(sp.n) {
					toks[j], starts[j] = sp.toks[j], at
					at += int32(sp.lens[j])
				}
				np, whole = int(sp.n), true
				i += size
				continue
			}
		}
		// Whether a token cuts the character: the filters of vocab.near,
		// with the least ranks of the neighbours they pass,
		// clear most characters here, the rest in uncut.
		uncut := ci.rank != -1
		bound := ci.rank // as in uncut
		if bound < 0 {
			bound = math.MaxInt32
		}
		if uncut && (i+size < len(p) && v.nearBelow(ci.after, p[i+size], bound) ||
			i > 0 && v.nearBelow(ci.before, p[i-1], bound)) {
			uncut = v.uncut(p, i, size, ci)
		}
		switch {
		case uncut && ci.rank >= 0:
			toks[np], starts[np] = ci.rank, int32(i-seg)
			np++
			whole = true
		case uncut:
			if np > 0 {
				n += v.mergeSegment(w, p[seg:i], toks[:np], starts[:np], !whole, out)
			}
			n += ci.sepTokens()
			if out != nil {
				v.mergeBytes(w, p[i:i+size], out)
			}
			seg, np, whole = i+size, 0, false
		default:
			for k := range size {
				toks[np], starts[np] = bytes[p[i+k]], int32(i+k-seg)
				np++
			}
		}
		i += size
	}
	return n + v.mergeSegment(w, p[seg:], toks[:np], starts[:np], !whole, out)
}

// spacedUncut reports whether no token below sp.bound that starts with a
// tail of the character (list c.after) or with the whole character
// (sp.ext) begins the rest of the piece after it.
func (v *vocab) spacedUncut(sp *spacedStart, c charInfo, rest string) bool {
	if rest == "" {
		return true
	}
	if v.nearBelow(c.after, rest[0], sp.bound) && v.cuts[c.after].followedBy(rest, sp.bound) {
		return false
	}
	return !v.nearBelow(sp.ext, rest[0], sp.bound) || !v.cuts[sp.ext].followedBy(rest, sp.bound)
}

// mergeInvalid is merge for p with invalid UTF-8: it merges p with each
// invalid byte replaced by U+FFFD (see sanitize), dropping the tokens
// mergeChars appended to out past outLen before it met the invalid byte.
//
//go:noinline
func (v *vocab) mergeInvalid(w *worker, p string, out *[]int, outLen int) int {
	if out != nil {
		*out = (*out)[:outLen]
	}
	return v.mergeChars(w, sanitize(p), out)
}

// scanParts is the most parts merged with the quadratic scan; pieces
// with more parts use a tournament tree. A CJK piece of up to 64
// characters that start whole stays in the scan, whose keys sit in one
// cache line per 16 parts.
const scanParts = 64

// In scan, a part's key is the rank of its join with the next part
// shifted left by keyBits, with the part's index in the low bits. noKey
// marks no join: a rank of -1 or noRank shifted so.
const (
	keyBits = 6 // scanParts <= 1<<keyBits
	noKey   = math.MaxUint32 &^ (1<<keyBits - 1)
)

// mergeSegment merges s from its parts: toks holds their ranks, starts
// their offsets (both overwritten; starts has room for one more). The
// parts are s's bytes when bytes is true.
func (v *vocab) mergeSegment(w *worker, s string, toks, starts []int32, bytes bool, out *[]int) int {
	n := len(toks)
	switch {
	case n == 0:
		return 0
	case n == 1:
		if out != nil {
			*out = append(*out, int(toks[0]))
		}
		return 1
	}
	starts = append(starts, int32(len(s)))
	if n > scanParts {
		return v.mergeLarge(w, s, toks, starts, bytes, out)
	}
	jc := w.joinCache(v)
	sc := &w.scan
	// Keys past the last part are noKey up to the width minKeys reads.
	width := 8
	if n > 8 {
		width = (n + 15) &^ 15 // 16, 32, 48 or 64
	}
	keys := sc.keys[:width]
	if bytes {
		for i := range n - 1 {
			keys[i] = uint32(v.pair[int(s[i])<<8|int(s[i+1])])<<keyBits | uint32(i)
		}
	} else {
		for i := range n - 1 {
			a, b := starts[i], starts[i+2]
			if b-a == 2 { // two bytes
				keys[i] = uint32(v.pair[int(s[a])<<8|int(s[a+1])])<<keyBits | uint32(i)
				continue
			}
			// A join of up to 7 bytes (two characters, mostly) is looked up
			// directly: most are not tokens, and the filter answers those
			// with one load, where the join cache, which often misses on
			// the many pairs of characters, costs one more.
			if b-a <= shortMax {
				r := int32(noRank)
				if k := packShort(s[a:b]); v.mayBeShort(k) {
					r = v.getShort(k)
				}
				keys[i] = uint32(r)<<keyBits | uint32(i)
				continue
			}
			// join, inlined: most keys of a CJK piece are joins
			k := joinKey(toks[i], toks[i+1])
			e := jc[(k*joinMul)>>(64-joinBits)]
			if e>>joinShift != k {
				e = v.joinMiss(jc, k, s[a:b])
			}
			keys[i] = uint32(int32(e&joinMask)-1)<<keyBits | uint32(i)
		}
	}
	if n <= 3 {
		return v.mergeFew(w, jc, s, toks, starts, out)
	}
	for i := n - 1; i < width; i++ {
		keys[i] = noKey
	}
	return v.scan(w, jc, s, toks, starts, width, bytes, out)
}

// mergeFew is scan for two or three parts, whose keys are in w.scan.keys:
// at most two merges, the second, if any, of the merged part with the
// part left over.
func (v *vocab) mergeFew(w *worker, jc *joinCache, s string, toks, starts []int32, out *[]int) int {
	keys := &w.scan.keys
	n := len(toks)
	m := keys[0]
	if n == 3 {
		m = min(m, keys[1])
	}
	w.work += n
	if m >= noKey {
		if out != nil {
			for _, t := range toks {
				*out = append(*out, int(t))
			}
		}
		return n
	}
	w.work++
	r := int32(m >> keyBits)
	if n == 2 {
		if out != nil {
			*out = append(*out, int(r))
		}
		return 1
	}
	// The merged part and the one left over, in order.
	a, b := r, toks[2]
	if m&(1<<keyBits-1) == 1 {
		a, b = toks[0], r
	}
	var j int32
	if len(s) <= shortMax { // as in mergeSegment
		j = noRank
		if k := packShort(s); v.mayBeShort(k) {
			j = v.getShort(k)
		}
	} else {
		j = v.join(jc, a, b, s)
	}
	if uint32(j) < noRank { // a token: the third merge
		w.work++
		if out != nil {
			*out = append(*out, int(j))
		}
		return 1
	}
	if out != nil {
		*out = append(*out, int(a), int(b))
	}
	return 2
}

// scanState is the scratch of scan, kept in the worker so that it need
// not be cleared for every segment.
type scanState struct {
	// keys holds, for each part, the key of its join with the next part
	// (see keyBits).
	keys       [scanParts]uint32
	next, prev [scanParts]uint8 // the list of parts
}

// minKeys returns the least of the first width (8 or a multiple of 16)
// keys: a branch-free tree of comparisons, eight keys at a time.
func (sc *scanState) minKeys(width int) uint32 {
	k := &sc.keys
	m := min(min(min(k[0], k[1]), min(k[2], k[3])), min(min(k[4], k[5]), min(k[6], k[7])))
	if width > 8 {
		m = min(m, min(min(min(k[8], k[9]), min(k[10], k[11])), min(min(k[12], k[13]), min(k[14], k[15]))))
		if width > 16 {
			for i := 16; i < width; i += 8 {
				k := (*[8]uint32)(k[i : i+8])
				m = min(m, min(min(min(k[0], k[1]), min(k[2], k[3])), min(min(k[4], k[5]), min(k[6], k[7]))))
			}
		}
	}
	return m
}

// scan is tiktoken's merge loop on at most scanParts parts of s: toks
// holds the rank of each part, starts its offset (and len(s) last),
// w.scan.keys the key of its join with the next part, so that the least
// key is the merge to make: lowest rank, leftmost on ties. Parts keep
// their index; a merged part leaves the list and its key becomes noKey.
// bytes tells that the parts started as s's bytes.
func (v *vocab) scan(w *worker, jc *joinCache, s string, toks, starts []int32, width int, bytes bool, out *[]int) int {
	n := len(toks)
	sc := &w.scan
	for i := range n {
		sc.next[i], sc.prev[i] = uint8(i+1), uint8(i-1)
	}
	parts := n
	w.work += n
	for {
		m := sc.minKeys(width)
		if m >= noKey {
			break
		}
		w.work++
		parts--
		i := int(m & (1<<keyBits - 1))
		j := int(sc.next[i])
		toks[i] = int32(m >> keyBits)
		sc.keys[j] = noKey
		nj := int(sc.next[j])
		sc.next[i] = uint8(nj)
		// The joins with both neighbours: join, inlined. In a piece
		// merged from bytes, a short join between ASCII bytes is looked
		// up directly, as in mergeSegment: in random text (base64, say)
		// most such joins are new, and the join cache misses them.
		if nj < n {
			sc.prev[nj] = uint8(i)
			if a, b := starts[i], starts[sc.next[nj]]; bytes && b-a <= shortMax && s[a]|s[b-1] < 0x80 {
				r := int32(noRank)
				if k := packShort(s[a:b]); v.mayBeShort(k) {
					r = v.getShort(k)
				}
				sc.keys[i] = uint32(r)<<keyBits | uint32(i)
			} else {
				k := joinKey(toks[i], toks[nj])
				e := jc[(k*joinMul)>>(64-joinBits)]
				if e>>joinShift != k {
					e = v.joinMiss(jc, k, s[a:b])
				}
				sc.keys[i] = uint32(int32(e&joinMask)-1)<<keyBits | uint32(i)
			}
		} else {
			sc.keys[i] = noKey
		}
		if i > 0 {
			pi := int(sc.prev[i])
			if a, b := starts[pi], starts[nj]; bytes && b-a <= shortMax && s[a]|s[b-1] < 0x80 {
				r := int32(noRank)
				if k := packShort(s[a:b]); v.mayBeShort(k) {
					r = v.getShort(k)
				}
				sc.keys[pi] = uint32(r)<<keyBits | uint32(pi)
			} else {
				k := joinKey(toks[pi], toks[i])
				e := jc[(k*joinMul)>>(64-joinBits)]
				if e>>joinShift != k {
					e = v.joinMiss(jc, k, s[a:b])
				}
				sc.keys[pi] = uint32(int32(e&joinMask)-1)<<keyBits | uint32(pi)
			}
		}
	}
	if out != nil {
		for i := 0; i < n; i = int(sc.next[i]) {
			*out = append(*out, int(toks[i]))
		}
	}
	return parts
}

// mergeLarge gives the same result as scan in O(n log n) for any number of
// parts: parts form a linked list, and a tournament tree over them holds,
// for each part, the candidate merge with its right neighbour keyed by
// (rank, index), so the root is the merge tiktoken would pick: lowest
// rank, leftmost on ties. A merge updates three leaves; there are fewer
// than n merges. toks and starts are as for scan; the parts are s's bytes
// when bytes is true.
func (v *vocab) mergeLarge(w *worker, s string, toks, starts []int32, bytes bool, out *[]int) int {
	const none = math.MaxUint64
	n := len(toks)
	size := 1
	for size < n {
		size <<= 1
	}
	if cap(w.next) < n {
		w.next = make([]int32, n)
		w.prev = make([]int32, n)
	}
	if cap(w.tree) < 2*size {
		w.tree = make([]uint64, 2*size)
	}
	next, prev, tree := w.next[:n], w.prev[:n], w.tree[:2*size]
	jc := w.joinCache(v)
	// key orders candidate merges; a rank of -1 or noRank is no merge.
	key := func(r int32, i int32) uint64 {
		if uint32(r) >= noRank {
			return none
		}
		return uint64(r)<<32 | uint64(i)
	}
	// end returns the end of part i.
	end := func(i int32) int32 {
		if i == int32(n) {
			return int32(len(s))
		}
		return starts[i]
	}
	leaves := tree[size:]
	for i := range n {
		next[i], prev[i] = int32(i+1), int32(i-1)
	}
	for i := 0; i < n-1; i++ {
		if bytes {
			leaves[i] = key(v.pair[int(s[i])<<8|int(s[i+1])], int32(i))
		} else {
			leaves[i] = key(v.join(jc, toks[i], toks[i+1], s[starts[i]:starts[i+2]]), int32(i))
		}
	}
	for i := n - 1; i < size; i++ {
		leaves[i] = none
	}
	for i := size - 1; i >= 1; i-- {
		tree[i] = min(tree[2*i], tree[2*i+1])
	}
	// update sets leaf i to k and restores the minima above it, stopping
	// as soon as one is unchanged.
	update := func(i int32, k uint64) {
		j := size + int(i)
		tree[j] = k
		for j > 1 {
			k = min(k, tree[j^1])
			j >>= 1
			if tree[j] == k {
				return
			}
			tree[j] = k
		}
	}
	parts := n
	w.work += n
	for tree[1] != none {
		w.work++
		parts--
		i := int32(uint32(tree[1]))
		toks[i] = int32(tree[1] >> 32)
		j := next[i]
		nj := next[j]
		next[i] = nj
		update(j, none)
		if nj < int32(n) {
			prev[nj] = i
			update(i, key(v.join(jc, toks[i], toks[nj], s[starts[i]:end(next[nj])]), i))
		} else {
			update(i, none)
		}
		if i > 0 {
			pi := prev[i]
			update(pi, key(v.join(jc, toks[pi], toks[i], s[starts[pi]:end(nj)]), pi))
		}
	}
	if out != nil {
		for i := int32(0); i < int32(n); i = next[i] {
			*out = append(*out, int(toks[i]))
		}
	}
	return parts
}
