// Package identity holds the forms an identity's value takes: as tokengate
// reads a credential a request carries, and in store and override keys.
// The gateway's fronts (package admission) and the configuration's
// validation (package config) read identities by these rules alike.
package identity

import (
	"crypto/sha256"
	"encoding/hex"
	"net/url"
	"strings"

	"github.com/tokengate/tokengate/internal/modelname"
)

// MaxPartBytes bounds a key part: a longer escaped value is hashed.
const MaxPartBytes = 128

// Credential is a header value as tokengate reads a credential: without
// surrounding space and without a bearer scheme, whose name is
// case-insensitive (RFC 7235), which bearer reports. Identities are metered
// in this form; the admin API reads its token so.
func Credential(v string) (value string, bearer bool) {
	v = strings.TrimSpace(v)
	if strings.HasPrefix(strings.ToLower(v), "bearer ") {
		return strings.TrimSpace(v[len("bearer "):]), true
	}
	return v, false
}

// Hash is the form a hashed identity's value takes (S9a): "h." and the
// hex of the first 16 bytes of its SHA-256.
func Hash(v string) string {
	sum := sha256.Sum256([]byte(v))
	return "h." + hex.EncodeToString(sum[:16])
}

// Part is the key part of an identity value: escaped, or "!" and its Hash
// when the escaped form is longer than MaxPartBytes.
func Part(v string) string {
	if e := url.QueryEscape(v); len(e) <= MaxPartBytes {
		return e
	}
	return "!" + Hash(v)
}

// Key is the form an identity's value takes in store keys and in override
// keys: read as a request's value is read (Credential), hashed when hash
// is set (S9a) so that raw API keys never reach the store, and escaped
// (or hashed when long). It is "" for a blank value.
func Key(value string, hash bool) string {
	v, _ := Credential(value)
	if v == "" {
		return ""
	}
	if hash {
		v = Hash(v)
	}
	return Part(v)
}

// ModelKey is the form a model name takes in the keys of per-model rules
// and in override keys, as a request naming that model gets it: resolved
// by modelname.Key (case, router prefix, fine-tune and snapshot do not
// matter), then escaped. It is "" for an empty name.
func ModelKey(model string) string {
	m := modelname.Key(model)
	if m == "" {
		return ""
	}
	return Part(m)
}
