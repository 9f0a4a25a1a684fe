package tokenizer

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// maxModelKey bounds the length of a ModelKey: model names come from the
// client, and keys end up in bucket keys and logs.
const maxModelKey = 64

// modelKey returns the canonical key of a model name (see Count.ModelKey):
// normalized like the encoding lookup, then without a dated snapshot
// suffix, because providers rate-limit a model and its snapshots together;
// distinct keys would let a client multiply a per-model bucket by naming
// snapshots.
func modelKey(model string) string {
	m := normalizeModel(model)
	if m == "" {
		return ""
	}
	m = stripSnapshot(m)
	if len(m) > maxModelKey || strings.TrimLeft(m, "abcdefghijklmnopqrstuvwxyz0123456789._:-") != "" {
		sum := sha256.Sum256([]byte(m))
		return "sha256:" + hex.EncodeToString(sum[:12])
	}
	return m
}

// stripSnapshot removes a snapshot suffix: -YYYY-MM-DD (OpenAI),
// -YYYYMMDD and @YYYYMMDD (Anthropic, Vertex AI), -MMDD on gpt-* models
// (gpt-4-0613), -NNN and -preview-MM-DD on gemini-* models
// (gemini-1.5-pro-002, gemini-2.5-pro-preview-05-06).
func stripSnapshot(m string) string {
	digitsAt := func(s string, i, n int) bool {
		if i < 0 || i+n > len(s) {
			return false
		}
		for _, c := range []byte(s[i : i+n]) {
			if !isDigit(c) {
				return false
			}
		}
		return true
	}
	n := len(m)
	switch {
	case n > 11 && m[n-11] == '-' && digitsAt(m, n-10, 4) && m[n-6] == '-' && digitsAt(m, n-5, 2) && m[n-3] == '-' && digitsAt(m, n-2, 2):
		return m[:n-11]
	case n > 9 && (m[n-9] == '-' || m[n-9] == '@') && digitsAt(m, n-8, 8):
		return m[:n-9]
	case strings.HasPrefix(m, "gpt-") && n > 5 && m[n-5] == '-' && digitsAt(m, n-4, 4):
		return m[:n-5]
	case strings.HasPrefix(m, "gemini-") && n > 4 && m[n-4] == '-' && digitsAt(m, n-3, 3):
		return m[:n-4]
	case strings.HasPrefix(m, "gemini-") && strings.HasSuffix(m[:max(n-6, 0)], "-preview") && m[n-6] == '-' && digitsAt(m, n-5, 2) && m[n-3] == '-' && digitsAt(m, n-2, 2):
		return m[:n-6]
	}
	return m
}

// ModelKey returns the key a model name is metered by, as Count.ModelKey
// reports it for a request naming that model: lower case, without a router
// prefix or a dated snapshot. For callers that have a model name but no
// request body (the usage API).
func ModelKey(model string) string { return modelKey(model) }
