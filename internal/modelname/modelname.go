// Package modelname is the one rule for reading a model name as a client
// writes it: what the tokenizer counts with, what a per-model bucket is
// keyed by, and what the price table looks up. Each use takes a different
// step of the same reading:
//
//   - Canonical: lower case, without surrounding space and without a
//     router or resource prefix ("openai/gpt-4o", "models/gemini-2.5-pro").
//     A fine-tune keeps its "ft:" wrapper. The price table looks models up
//     by this name.
//   - Snapshot: the model a snapshot name belongs to ("gpt-4o-2024-08-06"
//     is "gpt-4o"). The price table falls back to it only when the
//     family's entry says its snapshots share its price; providers price
//     some snapshots apart.
//   - FineTune: the base model of a fine-tune ("ft:gpt-4o-mini:org::id" is
//     "gpt-4o-mini"). The tokenizer counts a fine-tune with its base
//     model's vocabulary, and per-model limits treat it as its base model,
//     as the provider does.
//   - Key: all three, bounded, for keys.
//
// Pricing never takes the FineTune step. A fine-tune shares its base
// model's vocabulary and rate limits but not its price: OpenAI bills
// inference on a fine-tuned model at its own rates (gpt-4o-mini fine-tunes
// at twice the base model's), so pricing one as its base model would let
// spend run past a money budget. A fine-tune is priced by its own entry or
// by the configured fallback, or refused.
//
// The package imports nothing of tokengate, so both package tokenizer and
// package pricing can use it.
package modelname

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// Canonical returns model lower case, without surrounding space and
// without a router or resource prefix: everything up to the last '/'
// ("openai/gpt-4o", "models/gemini-2.5-pro", "vertex_ai/claude-x").
func Canonical(model string) string {
	m := strings.ToLower(strings.TrimSpace(model))
	if i := strings.LastIndexByte(m, '/'); i >= 0 {
		m = m[i+1:]
	}
	return m
}

// FineTune returns the base model of a canonical fine-tune name, OpenAI's
// "ft:BASE:ORG:SUFFIX:ID", and whether m is one.
func FineTune(m string) (base string, ok bool) {
	rest, ok := strings.CutPrefix(m, "ft:")
	if !ok {
		return "", false
	}
	base, _, _ = strings.Cut(rest, ":")
	return base, base != ""
}

// Base returns the model whose vocabulary and limits a canonical name
// shares: the base model of a fine-tune, else m.
func Base(m string) string {
	if b, ok := FineTune(m); ok {
		return b
	}
	return m
}

// Snapshot returns the model a canonical snapshot name belongs to, and
// whether m is one. A snapshot ends in -YYYY-MM-DD (OpenAI), -YYYYMMDD or
// @YYYYMMDD (Anthropic, Vertex AI; the year starting with 2), -MMDD on
// gpt-* models (gpt-4-0613), -NNN on gemini-* models (gemini-1.5-pro-002)
// or -MM-DD after -preview on gemini-* models
// (gemini-2.5-pro-preview-05-06). Nothing else is removed:
// "gpt-6.2-sol-fast" is not a snapshot of "gpt-6.2-sol" (it costs twice
// as much).
func Snapshot(m string) (family string, ok bool) {
	digitsAt := func(i, n int) bool {
		if i < 0 || i+n > len(m) {
			return false
		}
		for _, c := range []byte(m[i : i+n]) {
			if c < '0' || c > '9' {
				return false
			}
		}
		return true
	}
	n := len(m)
	switch {
	case n > 11 && m[n-11] == '-' && digitsAt(n-10, 4) && m[n-6] == '-' && digitsAt(n-5, 2) && m[n-3] == '-' && digitsAt(n-2, 2):
		return m[:n-11], true
	case n > 9 && (m[n-9] == '-' || m[n-9] == '@') && m[n-8] == '2' && digitsAt(n-8, 8):
		return m[:n-9], true
	case strings.HasPrefix(m, "gpt-") && n > 5 && m[n-5] == '-' && digitsAt(n-4, 4):
		return m[:n-5], true
	case strings.HasPrefix(m, "gemini-") && n > 4 && m[n-4] == '-' && digitsAt(n-3, 3):
		return m[:n-4], true
	case strings.HasPrefix(m, "gemini-") && n > 6 && strings.HasSuffix(m[:n-6], "-preview") && m[n-6] == '-' && digitsAt(n-5, 2) && m[n-3] == '-' && digitsAt(n-2, 2):
		return m[:n-6], true
	}
	return "", false
}

// MaxKey bounds the length of a Key: model names come from clients, and
// keys end up in store keys and logs.
const MaxKey = 64

// Key returns the key a model is metered by: Canonical, then Base, then
// without a snapshot suffix, because providers rate-limit a model, its
// snapshots and its fine-tunes together; distinct keys would let a client
// multiply a per-model limit by naming snapshots. A name longer than
// MaxKey or with bytes outside [a-z0-9._:-] becomes "sha256:" and 24 hex
// digits of its hash. Key is "" for an empty name.
func Key(model string) string {
	m := Base(Canonical(model))
	if m == "" {
		return ""
	}
	if f, ok := Snapshot(m); ok {
		m = f
	}
	if len(m) > MaxKey || strings.TrimLeft(m, "abcdefghijklmnopqrstuvwxyz0123456789._:-") != "" {
		sum := sha256.Sum256([]byte(m))
		return "sha256:" + hex.EncodeToString(sum[:12])
	}
	return m
}
