package tokenizer

import (
	"hash/maphash"
	"math"
	"unicode/utf8"
)

// smallPiece is the longest piece merged with the simple quadratic scan;
// longer pieces use a tournament tree so that a hostile prompt (one 100 KB run of a
// letter, CJK without spaces) costs O(n log n), not O(n²).
const smallPiece = 16

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

// cacheSeed keys the cache's hash per process, so that no input can be
// crafted to collide.
var cacheSeed = maphash.MakeSeed()

func (c *pieceCache) slot(p string) *cacheSlot {
	return &c[maphash.String(cacheSeed, p)>>(64-cacheBits)]
}

const noRank = math.MaxInt32

// worker holds the scratch space of one counting goroutine. Workers are
// pooled by the Counter; a worker is used by one goroutine at a time.
type worker struct {
	// cache holds piece counts per vocabulary (indexed by vocab.id),
	// allocated on first use.
	cache [numVocabs]*pieceCache
	// work counts BPE merge steps and rank look-ups, for the linearity test.
	work int
	// scratch for long and non-ASCII pieces
	next, prev []int32
	tree       []uint64
	starts     []int32
	// recent holds recent short look-ups (hits and misses) per vocabulary:
	// merges of similar pieces repeat the same look-ups, and this small
	// table stays in the CPU cache where the vocabulary's does not.
	recent [numVocabs]*recentRanks
}

const recentBits = 12

type recentRanks struct {
	keys  [1 << recentBits]uint64
	ranks [1 << recentBits]int32
}

// mergeRank is rank for BPE merges of p[a:b], through the worker's recent
// table.
func (v *vocab) mergeRank(w *worker, p string, a, b int32) int32 {
	n := b - a
	if n > shortMax {
		return v.rank(p[a:b])
	}
	k := packShort(p[a:b])
	if !v.mayBeShort(k) {
		return noRank
	}
	rc := w.recent[v.id]
	if rc == nil {
		rc = new(recentRanks)
		w.recent[v.id] = rc
	}
	i := (k * 0x9E3779B97F4A7C15) >> (64 - recentBits)
	if rc.keys[i] == k {
		return rc.ranks[i]
	}
	r := v.getShort(k)
	rc.keys[i], rc.ranks[i] = k, r
	return r
}

func newWorker() *worker {
	return &worker{}
}

// maxKeptPiece is the longest piece whose merge scratch a worker keeps
// for the next call. A longer piece (one run of a letter, a CJK text
// without punctuation) allocates its own, which is garbage once counted,
// so that a pooled worker holds at most ~450 KB of scratch besides its
// ~350 KB of caches whatever it counted (TestWorkerMemoryBounded).
const maxKeptPiece = 16 << 10

// trim drops scratch grown past what maxKeptPiece needs.
func (w *worker) trim() {
	if cap(w.next) > maxKeptPiece+1 {
		w.next, w.prev = nil, nil
	}
	if cap(w.tree) > 2*maxKeptPiece {
		w.tree = nil
	}
	if cap(w.starts) > maxKeptPiece+1 {
		w.starts = nil
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
	// fragment of a character: then the piece holds invalid UTF-8.
	if r := v.rank(p); r != noRank && v.valid[r>>6]&(1<<(r&63)) != 0 {
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
		slot = c.slot(p)
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

// scanParts is the most parts merged with the quadratic scan when a piece
// starts from whole characters (see premerge.go).
const scanParts = 64

// merge is tiktoken's byte-pair merge of p: repeatedly merge the adjacent
// pair of parts of lowest rank (leftmost on ties). It returns the number of
// tokens and, when out is not nil, appends them. Short pieces are merged
// with a scan, long ones with a tournament tree; a piece with non-ASCII
// characters is cut around those that BPE never joins with their
// neighbours, and characters that are one token start as one part, when
// that provably changes nothing (premerge.go).
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
	if len(p) <= smallPiece {
		var startBuf [smallPiece + 1]int32
		var rankBuf [smallPiece]int32
		n := len(p)
		starts, ranks := startBuf[:n+1], rankBuf[:n]
		for i := range n - 1 {
			starts[i] = int32(i)
			ranks[i] = v.pair[int(p[i])<<8|int(p[i+1])]
		}
		starts[n-1], starts[n] = int32(n-1), int32(n)
		ranks[n-1] = noRank
		return v.scan(w, p, starts, ranks, out)
	}
	return v.mergeLarge(w, p, nil, out)
}

// mergeChars merges p, which has non-ASCII characters, segment by
// segment (invalid UTF-8 first becomes U+FFFD, see sanitize): a separate
// character that no token cuts ends a segment and adds its own tokens;
// inside a segment, a character that may start whole and that no token
// cuts is one part, others one part per byte (premerge.go).
func (v *vocab) mergeChars(w *worker, p string, out *[]int) int {
	if cap(w.starts) < len(p)+1 {
		w.starts = make([]int32, 0, len(p)+1)
	}
	starts := w.starts[:0]
	n, seg, whole := 0, 0, false
	outLen := 0
	if out != nil {
		outLen = len(*out)
	}
	for i := 0; i < len(p); {
		b := p[i]
		if b < 0x80 {
			starts = append(starts, int32(i-seg))
			i++
			continue
		}
		var ci charInfo
		size := charLen(p, i)
		switch size {
		case 2:
			ci = v.chars[rune(b&0x1F)<<6|rune(p[i+1]&0x3F)]
		case 3:
			ci = v.chars[rune(b&0x0F)<<12|rune(p[i+1]&0x3F)<<6|rune(p[i+2]&0x3F)]
		case 4:
			ci = v.suppInfo(p[i : i+4])
		default: // invalid UTF-8: start again with U+FFFD for it
			if out != nil {
				*out = (*out)[:outLen]
			}
			return v.mergeChars(w, sanitize(p), out)
		}
		// Whether a token cuts the character: the filters of vocab.near
		// clear most characters here, the rest in uncut.
		uncut := ci.rank != -1
		if uncut && (ci.after != 0 && i+size < len(p) && v.near[ci.after].has(p[i+size]) ||
			ci.before != 0 && i > 0 && v.near[ci.before].has(p[i-1])) {
			uncut = v.uncut(p, i, size, ci)
		}
		switch {
		case uncut && ci.rank >= 0:
			starts = append(starts, int32(i-seg))
			whole = true
		case uncut:
			if seg < i {
				n += v.mergeSegment(w, p[seg:i], starts, whole, out)
			}
			n += ci.sepTokens()
			if out != nil {
				v.mergeBytes(w, p[i:i+size], out)
			}
			seg, starts, whole = i+size, starts[:0], false
		default:
			for k := range size {
				starts = append(starts, int32(i+k-seg))
			}
		}
		i += size
	}
	return n + v.mergeSegment(w, p[seg:], starts, whole, out)
}

// mergeSegment merges s from the parts that start at starts, which are
// bytes unless whole.
func (v *vocab) mergeSegment(w *worker, s string, starts []int32, whole bool, out *[]int) int {
	switch len(s) {
	case 0:
		return 0
	case 1:
		if out != nil {
			*out = append(*out, int(v.bytes[s[0]]))
		}
		return 1
	case 2:
		if r := v.pair[int(s[0])<<8|int(s[1])]; r != noRank {
			if out != nil {
				*out = append(*out, int(r))
			}
			return 1
		}
		if out != nil {
			*out = append(*out, int(v.bytes[s[0]]), int(v.bytes[s[1]]))
		}
		return 2
	}
	switch {
	case !whole:
		return v.mergeBytes(w, s, out)
	case len(starts) == 1:
		if out != nil {
			*out = append(*out, int(v.rank(s)))
		}
		return 1
	}
	starts = append(starts, int32(len(s)))
	if len(starts)-1 <= scanParts {
		return v.mergeScan(w, s, starts, out)
	}
	return v.mergeLarge(w, s, starts, out)
}

// joinRank returns the rank of p[a:b], the join of two adjacent parts.
func (v *vocab) joinRank(w *worker, p string, a, b int32) int32 {
	if b-a == 2 {
		return v.pair[int(p[a])<<8|int(p[a+1])]
	}
	return v.mergeRank(w, p, a, b)
}

// mergeScan merges the parts of p that start at starts (parts+1
// boundaries, at most scanParts parts; overwritten) by finding the lowest
// rank with a scan at every step.
func (v *vocab) mergeScan(w *worker, p string, starts []int32, out *[]int) int {
	var rankBuf [scanParts]int32
	parts := len(starts) - 1
	ranks := rankBuf[:parts]
	for i := 0; i < parts-1; i++ {
		ranks[i] = v.joinRank(w, p, starts[i], starts[i+2])
	}
	ranks[parts-1] = noRank
	return v.scan(w, p, starts, ranks, out)
}

// scan is the merge loop of mergeScan: ranks[i] is the rank of parts i and
// i+1 merged (noRank for the last part).
func (v *vocab) scan(w *worker, p string, starts, ranks []int32, out *[]int) int {
	parts := len(ranks)
	w.work += parts
	for parts > 1 {
		minR, mi := int32(noRank), -1
		for i := 0; i < parts-1; i++ {
			if ranks[i] < minR {
				minR, mi = ranks[i], i
			}
		}
		if mi < 0 {
			break
		}
		w.work++
		// merge parts mi and mi+1
		for j := mi + 1; j < parts; j++ {
			starts[j] = starts[j+1]
		}
		for j := mi + 1; j < parts-1; j++ {
			ranks[j] = ranks[j+1]
		}
		parts--
		ranks[parts-1] = noRank
		if mi+1 < parts {
			ranks[mi] = v.mergeRank(w, p, starts[mi], starts[mi+2])
		} else {
			ranks[mi] = noRank
		}
		if mi > 0 {
			ranks[mi-1] = v.mergeRank(w, p, starts[mi-1], starts[mi+1])
		}
	}
	if out != nil {
		for i := range parts {
			*out = append(*out, int(v.rank(p[starts[i]:starts[i+1]])))
		}
	}
	return parts
}

// mergeLarge gives the same result as mergeScan in O(n log n): parts form a
// linked list over byte offsets, and a tournament tree over the positions
// holds, for each part, the candidate merge with its right neighbour keyed
// by (rank, position), so the root is the merge tiktoken would pick: lowest
// rank, leftmost on ties. A merge updates three leaves; there are fewer
// than n merges. starts lists the initial part boundaries; nil means one
// part per byte.
func (v *vocab) mergeLarge(w *worker, p string, starts []int32, out *[]int) int {
	const none = math.MaxUint64
	n := len(p)
	size := 1
	for size < n {
		size <<= 1
	}
	if cap(w.next) < n+1 {
		w.next = make([]int32, n+1)
		w.prev = make([]int32, n+1)
	}
	if cap(w.tree) < 2*size {
		w.tree = make([]uint64, 2*size)
	}
	next, prev, tree := w.next[:n+1], w.prev[:n+1], w.tree[:2*size]
	key := func(r int32, pos int32) uint64 {
		if r == noRank {
			return none
		}
		return uint64(r)<<32 | uint64(pos)
	}
	leaves := tree[size:]
	for i := range leaves {
		leaves[i] = none
	}
	parts := n
	if starts == nil {
		for i := range n {
			next[i] = int32(i + 1)
			prev[i] = int32(i - 1)
		}
		for i := 0; i < n-1; i++ {
			if r := v.pair[int(p[i])<<8|int(p[i+1])]; r != noRank {
				leaves[i] = uint64(r)<<32 | uint64(i)
			}
		}
	} else {
		parts = len(starts) - 1
		prevStart := int32(-1)
		for j := range parts {
			s := starts[j]
			next[s], prev[s] = starts[j+1], prevStart
			prevStart = s
			if j+1 < parts {
				leaves[s] = key(v.joinRank(w, p, s, starts[j+2]), s)
			}
		}
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
	w.work += parts
	for tree[1] != none {
		w.work++
		pos := int32(uint32(tree[1]))
		mid := next[pos]
		end := next[mid]
		// merge [pos,mid) and [mid,end)
		next[pos] = end
		next[mid] = -1
		parts--
		update(mid, none)
		if end < int32(n) {
			prev[end] = pos
			update(pos, key(v.mergeRank(w, p, pos, next[end]), pos))
		} else {
			update(pos, none)
		}
		if pos > 0 {
			pp := prev[pos]
			update(pp, key(v.mergeRank(w, p, pp, end), pp))
		}
	}
	if out != nil {
		for i := int32(0); i < int32(n); i = next[i] {
			*out = append(*out, int(v.rank(p[i:next[i]])))
		}
	}
	return parts
}
