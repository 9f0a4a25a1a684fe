package tokenizer

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"strconv"
	"sync"
	"unicode/utf8"
	"unsafe"

	"github.com/pkoukk/tiktoken-go-loader/assets"
)

// Encoding names this package can count with.
const (
	O200kBase  = "o200k_base"
	Cl100kBase = "cl100k_base"
)

// vocab is one BPE vocabulary: the rank of every mergeable byte string.
// It is immutable once built (but for planes, computed on first use under
// a lock) and safe for concurrent use.
type vocab struct {
	name  string
	id    int // index of the vocabulary in per-worker caches
	ranks map[string]int32
	// pair holds the rank of every two-byte token (index b0<<8|b1), noRank
	// when the pair is not a token; it spares a map lookup in the first BPE
	// pass.
	pair []int32
	// bytes holds the rank of every single byte (all 256 are tokens).
	bytes [256]int32
	// short is an open-addressing table of the tokens of at most 7 bytes,
	// keyed by their bytes packed into a word: one probe, no pointer
	// chasing, for the look-ups that dominate BPE merges.
	shortKeys  []uint64
	shortRanks []int32
	shortMask  uint64
	// filter is a blocked Bloom filter over the keys of short and mid and
	// over the longer tokens: 256 KB, small enough to stay in the CPU
	// cache where the tables and the map do not. Most BPE merge look-ups,
	// and most whole-piece look-ups of random text, ask for a string that
	// is not a token; the filter answers them with one cached word (see
	// mayBeShort, mayBeMid, mayBeLong).
	filter []uint64
	// mid is the same for tokens of 8 to 15 bytes, keyed by two words
	// (CJK merges look up 6 to 12 bytes all the time).
	midKeys  [][2]uint64
	midRanks []int32
	midMask  uint64
	// chars tells, for every rune below 0x10000, whether a piece may start
	// its merges from the character as one part or be cut around it (the
	// rank of its charInfo: 4 bytes a character, so that text of many
	// scripts finds more of them in the CPU cache; the cut lists of a
	// character of two or three bytes follow from its bytes, see
	// bmpChar); charMaps holds what computing the same for a four-byte
	// character takes, and those lists; cuts lists the tokens that forbid
	// either in some contexts (see premerge.go).
	chars    []int32
	planes   [16]suppPlane // the same for planes 1 to 16, on first use
	charMaps *charMaps
	cuts     []cutList
	// spacedIndex holds, for every rune below 0x10000, the index in
	// spaced of how a piece that starts with a space and the character
	// may start (0: from bytes; premerge.go).
	spacedIndex []uint16
	spaced      []spacedStart
	near        []nearFilter // the first filter of each of cuts
	nearRanks   []int32      // the least ranks of near (see nearFilter)
	// split finds the end of the pre-tokenizer piece starting at i.
	split func(s string, i int) (end int, eof bool)
	// tokens maps a rank back to its bytes, for Encode round trips in tests.
	tokens []string
	// valid has bit r set when token r is valid UTF-8 (not a fragment of
	// a character).
	valid []uint64
}

// numVocabs is the number of vocabularies this package can load.
const numVocabs = 2

// vocabCache loads each vocabulary at most once per process. The data are
// read-only after loading, so sharing them between Counters is safe and
// keeps a second New cheap.
var vocabCache struct {
	mu     sync.Mutex
	loaded map[string]*vocab
}

// loadVocab returns the named vocabulary, parsing the embedded offline files
// of tiktoken-go-loader on first use. Nothing is downloaded.
func loadVocab(name string) (*vocab, error) {
	vocabCache.mu.Lock()
	defer vocabCache.mu.Unlock()
	if v, ok := vocabCache.loaded[name]; ok {
		return v, nil
	}
	var split func(string, int) (int, bool)
	var id int
	switch name {
	case O200kBase:
		split, id = splitO200k, 0
	case Cl100kBase:
		split, id = splitCl100k, 1
	default:
		return nil, fmt.Errorf("tokenizer: unknown encoding %q (want %s or %s)", name, O200kBase, Cl100kBase)
	}
	data, err := vocabAsset(name)
	if err != nil {
		return nil, err
	}
	v, err := parseVocab(name, data)
	if err != nil {
		return nil, err
	}
	v.split, v.id = split, id
	if vocabCache.loaded == nil {
		vocabCache.loaded = make(map[string]*vocab)
	}
	vocabCache.loaded[name] = v
	return v, nil
}

// vocabAsset returns the embedded .tiktoken file of an encoding.
func vocabAsset(name string) ([]byte, error) {
	data, err := assets.Assets.ReadFile(name + ".tiktoken")
	if err != nil {
		return nil, fmt.Errorf("tokenizer: read embedded vocabulary %s: %w", name, err)
	}
	return data, nil
}

// parseVocab parses a .tiktoken file ("base64 rank" per line). All token
// bytes live in one arena so that loading costs two large allocations and a
// map, not one string per token.
func parseVocab(name string, data []byte) (*vocab, error) {
	lines := bytes.Count(data, []byte{'\n'}) + 1
	arena := make([]byte, 0, len(data)*3/4)
	type entry struct{ off, n, rank int32 }
	entries := make([]entry, 0, lines)
	maxRank := int32(-1)
	for lineNo := 1; len(data) > 0; lineNo++ {
		line := data
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			line, data = data[:i], data[i+1:]
		} else {
			data = nil
		}
		if len(line) == 0 {
			continue
		}
		sp := bytes.IndexByte(line, ' ')
		if sp < 0 {
			return nil, fmt.Errorf("tokenizer: %s line %d: missing rank", name, lineNo)
		}
		off := len(arena)
		arena = arena[:off+base64.StdEncoding.DecodedLen(sp)]
		n, err := base64.StdEncoding.Decode(arena[off:], line[:sp])
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %s line %d: %w", name, lineNo, err)
		}
		arena = arena[:off+n]
		rank, err := strconv.Atoi(string(line[sp+1:]))
		if err != nil || rank < 0 || rank > 1<<30 {
			return nil, fmt.Errorf("tokenizer: %s line %d: bad rank %q", name, lineNo, line[sp+1:])
		}
		entries = append(entries, entry{int32(off), int32(n), int32(rank)})
		maxRank = max(maxRank, int32(rank))
	}
	v := &vocab{
		name:   name,
		ranks:  make(map[string]int32, len(entries)),
		pair:   make([]int32, 1<<16),
		tokens: make([]string, maxRank+1),
	}
	for i := range v.pair {
		v.pair[i] = noRank
	}
	for i := range v.bytes {
		v.bytes[i] = -1
	}
	for _, e := range entries {
		// The arena is never written again, so strings may alias it.
		tok := unsafe.String(&arena[e.off], int(e.n))
		v.ranks[tok] = e.rank
		v.tokens[e.rank] = tok
		switch len(tok) {
		case 1:
			v.bytes[tok[0]] = e.rank
		case 2:
			v.pair[int(tok[0])<<8|int(tok[1])] = e.rank
		}
	}
	v.shortKeys = make([]uint64, 1<<18)
	v.shortRanks = make([]int32, 1<<18)
	v.shortMask = uint64(len(v.shortKeys) - 1)
	v.midKeys = make([][2]uint64, 1<<17)
	v.midRanks = make([]int32, 1<<17)
	v.midMask = uint64(len(v.midKeys) - 1)
	v.filter = make([]uint64, 1<<filterBits)
	for _, e := range entries {
		tok := unsafe.String(&arena[e.off], int(e.n))
		switch {
		case e.n <= shortMax:
			k := packShort(tok)
			v.putShort(k, e.rank)
			i, m := filterSlot(k)
			v.filter[i] |= m
		case e.n <= midMax:
			k := packMid(tok)
			v.putMid(k, e.rank)
			i, m := filterSlot(k[0]*0xD6E8FEB86659FD93 ^ k[1])
			v.filter[i] |= m
		default:
			i, m := filterSlot(longKey(tok))
			v.filter[i] |= m
		}
	}
	if len(v.tokens) >= joinMask {
		return nil, fmt.Errorf("tokenizer: %s: %d tokens, at most %d supported", name, len(v.tokens), joinMask-1)
	}
	v.valid = make([]uint64, (len(v.tokens)+63)/64)
	for r, tok := range v.tokens {
		if utf8.ValidString(tok) {
			v.valid[r>>6] |= 1 << (r & 63)
		}
	}
	for b, r := range v.bytes {
		if r < 0 {
			return nil, fmt.Errorf("tokenizer: %s: byte %#x is not a token", name, b)
		}
	}
	v.buildChars()
	return v, nil
}

// shortMax is the longest token kept in the short table.
const shortMax = 7

// packShort packs s (at most 7 bytes) and its length into a word; a
// packed key is never 0, which marks an empty slot. Two overlapping loads
// (they agree on the bytes they share) replace a loop over the bytes.
func packShort(s string) uint64 {
	n := len(s)
	var k uint64
	switch {
	case n >= 4:
		k = uint64(load32(s, 0)) | uint64(load32(s, n-4))<<(8*(n-4))
	case n >= 2:
		k = uint64(s[0]) | uint64(s[1])<<8 | (uint64(s[n-2])|uint64(s[n-1])<<8)<<(8*(n-2))
	case n == 1:
		k = uint64(s[0])
	}
	return k | uint64(n)<<56
}

// load32 returns the 4 bytes of s at i as a little-endian word.
func load32(s string, i int) uint32 {
	s = s[i : i+4]
	return uint32(s[0]) | uint32(s[1])<<8 | uint32(s[2])<<16 | uint32(s[3])<<24
}

func shortHash(k uint64) uint64 { return (k * 0x9E3779B97F4A7C15) >> 40 }

func (v *vocab) putShort(k uint64, rank int32) {
	for i := shortHash(k) & v.shortMask; ; i = (i + 1) & v.shortMask {
		if v.shortKeys[i] == 0 {
			v.shortKeys[i], v.shortRanks[i] = k, rank
			return
		}
	}
}

// filterBits is log2 of the number of words of the short-token filter.
const filterBits = 15

// filterSlot returns the word and the three bits of key k in the filter.
func filterSlot(k uint64) (uint64, uint64) {
	h := k * 0x9E3779B97F4A7C15
	h ^= h >> 29
	h *= 0xBF58476D1CE4E5B9
	return h >> (64 - filterBits), 1<<(h&63) | 1<<(h>>6&63) | 1<<(h>>12&63)
}

// mayBeShort reports whether packed key k may be a token; false is
// certain (no false negatives), true is wrong for about 1 % of non-tokens.
func (v *vocab) mayBeShort(k uint64) bool {
	i, m := filterSlot(k)
	return v.filter[i&(1<<filterBits-1)]&m == m
}

// longKey is the filter key of a string longer than midMax: its length,
// first and last 8 bytes.
func longKey(s string) uint64 {
	n := len(s)
	return load64(s, 0)*0xC2B2AE3D27D4EB4F ^ load64(s, n-8)*0x165667B19E3779F9 ^ uint64(n)
}

// load16 returns the 2 bytes of s at i as a little-endian word.
func load16(s string, i int) uint16 {
	s = s[i : i+2]
	return uint16(s[0]) | uint16(s[1])<<8
}

// load64 returns the 8 bytes of s at i as a little-endian word (one load).
func load64(s string, i int) uint64 {
	s = s[i : i+8]
	return uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
		uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56
}

// mayBeLong is mayBeShort for a string longer than midMax.
func (v *vocab) mayBeLong(s string) bool {
	i, m := filterSlot(longKey(s))
	return v.filter[i&(1<<filterBits-1)]&m == m
}

// mayBeMid is mayBeShort for a packed mid key.
func (v *vocab) mayBeMid(k [2]uint64) bool {
	i, m := filterSlot(k[0]*0xD6E8FEB86659FD93 ^ k[1])
	return v.filter[i&(1<<filterBits-1)]&m == m
}

// getShort returns the rank of a packed key, or noRank. Keys sit apart
// from ranks so that a miss, the common case in BPE merges, touches only
// the dense key array.
func (v *vocab) getShort(k uint64) int32 {
	keys := v.shortKeys
	for i := shortHash(k) & v.shortMask; ; i = (i + 1) & v.shortMask {
		switch keys[i] {
		case k:
			return v.shortRanks[i]
		case 0:
			return noRank
		}
	}
}

// midMax is the longest token kept in the mid table.
const midMax = 15

// packMid packs s (8 to 15 bytes): its first 8 bytes, then the rest and
// its length.
func packMid(s string) [2]uint64 {
	return [2]uint64{load64(s, 0), packShort(s[8:]) | uint64(len(s))<<60}
}

func midHash(k [2]uint64) uint64 {
	return ((k[0]*0x9E3779B97F4A7C15)^(k[1]*0xC2B2AE3D27D4EB4F))>>40 | 0
}

func (v *vocab) putMid(k [2]uint64, rank int32) {
	for i := midHash(k) & v.midMask; ; i = (i + 1) & v.midMask {
		if v.midKeys[i][1] == 0 {
			v.midKeys[i], v.midRanks[i] = k, rank
			return
		}
	}
}

func (v *vocab) getMid(k [2]uint64) int32 {
	keys := v.midKeys
	for i := midHash(k) & v.midMask; ; i = (i + 1) & v.midMask {
		switch keys[i][1] {
		case 0:
			return noRank
		case k[1]:
			if keys[i][0] == k[0] {
				return v.midRanks[i]
			}
		}
	}
}
