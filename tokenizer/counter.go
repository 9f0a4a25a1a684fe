// Package tokenizer counts what an LLM request will cost before it is
// forwarded (S7): the prompt tokens the provider will bill, computed offline
// with the model family's BPE vocabulary and OpenAI's chat-format overhead,
// and the output allowance, taken from the request's own caps or learned
// from settled completions of comparable requests.
//
// Counting does work linear in the input on every input (O(n log n) time
// for one giant piece, never tiktoken's O(n²)): the pre-tokenizers are
// hand-written (no backtracking regexp), short pieces are merged with the
// usual quadratic scan, long ones with a tournament tree, characters that
// are one token start as one part where that provably changes nothing, and
// piece counts are cached. Counts are identical to OpenAI's tiktoken
// (encode_ordinary), whose split patterns see Unicode 16.0: the character
// classes are generated from that version's data, not taken from Go's
// older unicode package. Special-token strings in user text are counted as
// text.
//
// For Anthropic and Gemini, whose tokenizers are not public, InputTokens is
// a conservative estimate (Count.Exact is false); docs/tokenizer.md says how far
// it is from recorded usage.
package tokenizer

import (
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"

	"github.com/tokengate/tokengate/internal/modelname"
)

// Options configures a Counter. The zero value counts known OpenAI models
// exactly, refuses unknown models with ErrUnknownModel, and uses the
// package defaults for the output allowance.
type Options struct {
	// FallbackEncoding is used for models this package does not know
	// (o200k_base or cl100k_base). Empty means unknown models are refused
	// with ErrUnknownModel. A fallback shows in Count.Fallback.
	FallbackEncoding string
	// DefaultOutputTokens is the output allowance of a request without a
	// cap when nothing has been learned yet. Zero means 4096.
	DefaultOutputTokens int
	// MaxOutputTokens bounds a request's own cap: a larger cap is absurd
	// and refused with ErrInvalidCap. Zero means 1<<20.
	MaxOutputTokens int
	// Estimator configures the learned output estimate.
	Estimator EstimatorOptions
}

// Counter counts request bodies and learns output allowances. Create it with
// New; the zero value is not usable. It is safe for concurrent use: scratch
// space and piece caches are pooled per goroutine at work. Vocabularies are
// loaded on first use of each encoding and shared by all Counters of the
// process.
type Counter struct {
	opts Options
	// workers is a free list of scratch spaces. A channel rather than a
	// sync.Pool: the pool is emptied at every GC, and with it the piece
	// caches that make repeated words cheap.
	workers chan *worker
	est     *estimator
	// vocabs caches the loaded vocabularies, so that counting takes no lock.
	vocabs [numVocabs]atomic.Pointer[vocab]
}

// New validates opts and returns a Counter.
func New(opts Options) (*Counter, error) {
	switch opts.FallbackEncoding {
	case "", O200kBase, Cl100kBase:
	default:
		return nil, fmt.Errorf("tokenizer: fallback encoding %q: want %q, %q or empty", opts.FallbackEncoding, O200kBase, Cl100kBase)
	}
	if opts.DefaultOutputTokens < 0 {
		return nil, fmt.Errorf("tokenizer: default output tokens %d: must not be negative", opts.DefaultOutputTokens)
	}
	if opts.DefaultOutputTokens == 0 {
		opts.DefaultOutputTokens = 4096
	}
	if opts.MaxOutputTokens < 0 {
		return nil, fmt.Errorf("tokenizer: max output tokens %d: must not be negative", opts.MaxOutputTokens)
	}
	if opts.MaxOutputTokens == 0 {
		opts.MaxOutputTokens = 1 << 20
	}
	est, err := newEstimator(opts.Estimator)
	if err != nil {
		return nil, err
	}
	initClasses()
	return &Counter{opts: opts, est: est, workers: make(chan *worker, 2*runtime.GOMAXPROCS(0))}, nil
}

func (c *Counter) vocab(encoding string) (*vocab, error) {
	i := 0
	switch encoding {
	case O200kBase:
	case Cl100kBase:
		i = 1
	default:
		return loadVocab(encoding) // reports the unknown encoding
	}
	if v := c.vocabs[i].Load(); v != nil {
		return v, nil
	}
	v, err := loadVocab(encoding)
	if err != nil {
		return nil, err
	}
	c.vocabs[i].Store(v)
	return v, nil
}

func (c *Counter) getWorker() *worker {
	select {
	case w := <-c.workers:
		return w
	default:
		return newWorker()
	}
}

func (c *Counter) putWorker(w *worker) {
	w.trim()
	select {
	case c.workers <- w:
	default:
	}
}

// CountText returns the number of tokens of text in the named encoding,
// with special-token strings counted as ordinary text.
func (c *Counter) CountText(encoding, text string) (int, error) {
	v, err := c.vocab(encoding)
	if err != nil {
		return 0, err
	}
	w := c.getWorker()
	defer c.putWorker(w)
	return v.countText(w, text), nil
}

// Encode returns the token ids of text in the named encoding, as
// tiktoken's encode_ordinary would. Counting does not need it; it exists
// so the counter can be checked token for token.
func (c *Counter) Encode(encoding, text string) ([]int, error) {
	v, err := c.vocab(encoding)
	if err != nil {
		return nil, err
	}
	w := c.getWorker()
	defer c.putWorker(w)
	text = sanitize(text)
	out := []int{}
	for i := 0; i < len(text); {
		e, _ := v.split(text, i)
		out = v.encodePiece(w, text[i:e], out)
		i = e
	}
	return out, nil
}

// family is the tokenizer family of a model.
type family int

const (
	familyOpenAI family = iota
	familyAnthropic
	familyGemini
)

// modelPrefixes maps model name prefixes to encodings, longest first where
// prefixes overlap (gpt-4o before gpt-4).
var modelPrefixes = []struct{ prefix, encoding string }{
	{"gpt-4o", O200kBase},
	{"chatgpt-4o", O200kBase},
	{"gpt-4.1", O200kBase},
	{"gpt-4.5", O200kBase},
	{"gpt-5", O200kBase},
	// OpenAI publishes no vocabulary for gpt-6; it is counted as gpt-5 is,
	// so that every model the shipped price table prices can be counted.
	{"gpt-6", O200kBase},
	{"gpt-oss", O200kBase},
	{"gpt-realtime", O200kBase},
	{"gpt-audio", O200kBase},
	{"o1", O200kBase},
	{"o3", O200kBase},
	{"o4", O200kBase},
	{"codex-", O200kBase},
	{"computer-use", O200kBase},
	{"gpt-4", Cl100kBase},
	{"gpt-3.5", Cl100kBase},
	{"gpt-35", Cl100kBase}, // Azure spelling: gpt-35-turbo
	{"text-embedding-3", Cl100kBase},
	{"text-embedding-ada-002", Cl100kBase},
	{"babbage-002", Cl100kBase},
	{"davinci-002", Cl100kBase},
}

// normalizeModel lower-cases a model name and strips what does not change
// its tokenizer: a router prefix ("openai/gpt-4o"), a Gemini resource path
// ("models/..."), a fine-tune wrapper ("ft:gpt-4o-mini:org::id"). The rule
// is modelname's, which pricing shares.
func normalizeModel(model string) string {
	return modelname.Base(modelname.Canonical(model))
}

// familyOf reports the tokenizer family of a normalized model name.
func familyOf(m string) family {
	switch {
	case strings.HasPrefix(m, "claude"):
		return familyAnthropic
	case strings.HasPrefix(m, "gemini"), strings.HasPrefix(m, "gemma"):
		return familyGemini
	}
	return familyOpenAI
}

// knownEncoding returns the encoding of an OpenAI model, or "".
func knownEncoding(m string) string {
	for _, p := range modelPrefixes {
		if !strings.HasPrefix(m, p.prefix) {
			continue
		}
		// "o1" must not claim "o10-something": the prefix ends the name or
		// is followed by a separator.
		if rest := m[len(p.prefix):]; len(p.prefix) <= 2 && rest != "" && rest[0] != '-' {
			continue
		}
		return p.encoding
	}
	return ""
}

// EncodingFor returns the encoding used to count model. Anthropic and Gemini
// models are counted with o200k_base and scaled (Count.Exact is false).
// fallback is true when the model is unknown and the configured fallback
// encoding is used; without one, the error wraps ErrUnknownModel.
func (c *Counter) EncodingFor(model string) (encoding string, fallback bool, err error) {
	m := normalizeModel(model)
	if familyOf(m) != familyOpenAI {
		return O200kBase, false, nil
	}
	if e := knownEncoding(m); e != "" {
		return e, false, nil
	}
	if c.opts.FallbackEncoding != "" {
		return c.opts.FallbackEncoding, true, nil
	}
	if model == "" {
		return "", false, fmt.Errorf("%w: the request names no model", ErrUnknownModel)
	}
	return "", false, fmt.Errorf("%w: %q", ErrUnknownModel, model)
}
