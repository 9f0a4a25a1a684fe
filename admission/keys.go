package admission

import (
	"crypto/rand"
	"encoding/base64"
	"net/url"
	"strings"

	"github.com/tokengate/tokengate/internal/identity"
)

// Bucket and slot keys follow one scheme:
//
//	tg:<policy>:<rule>:<identity>
//
// where <policy> and <rule> are configuration names (<policy> is "*" for a
// provider rule: the provider account is shared by every policy), each
// query-escaped, so a ':' inside a name cannot forge another key.
// <identity> is one of:
//   - the query-escaped identity value (the model name for Per "model");
//     an identity with Hash set is replaced by "h." and the hex SHA-256 of
//     its value (S9a), so raw API keys never reach the store;
//   - "!h." and the hex SHA-256 of the value, for a value whose escaped
//     form is longer than maxIdentityBytes: keys stay small whatever a
//     client sends;
//   - "%2A" (an escaped "*") for a global rule;
//   - "!anonymous" for a missing identity under Anonymous "shared", and
//     "!none" for a request that names no model.
//
// Query escaping turns every '!' into "%21", so the reserved forms cannot
// be reached by any identity value.
//
// Quota keys follow it too, whatever the quota's unit: a quota switched
// between tokens: and cost: keeps its key, as it did in every release. The
// store records the unit with the spend instead (buckets.Quota.Tag: tokens,
// or money and its currency) and reads a spend recorded in another unit as
// nothing spent: the window starts afresh in the new unit, and the first
// admission in it replaces the old unit's spend. A spend recorded without
// a unit, by a release before the tag, is read as the quota's configured
// unit, which is what that release meant by it: an upgrade keeps every
// window's spend.
const keyPrefix = "tg:"

const (
	sharedScope      = "*"
	globalPart       = "%2A"
	anonymousPart    = "!anonymous"
	noModelPart      = "!none"
	maxIdentityBytes = identity.MaxPartBytes
)

func bucketKey(policy, rule, part string) string {
	var b strings.Builder
	b.Grow(len(keyPrefix) + len(policy) + len(rule) + len(part) + 2)
	b.WriteString(keyPrefix)
	b.WriteString(url.QueryEscape(policy))
	b.WriteByte(':')
	b.WriteString(url.QueryEscape(rule))
	b.WriteByte(':')
	b.WriteString(part)
	return b.String()
}

// identityPart is the key part of an identity value (identity.Part).
func identityPart(v string) string { return identity.Part(v) }

func hashIdentity(v string) string { return identity.Hash(v) }

// Credential is a header value as tokengate reads a credential
// (identity.Credential).
func Credential(v string) (value string, bearer bool) { return identity.Credential(v) }

// IdentityKey is the form an identity's value takes in store keys and in
// override keys (OverrideKey.Identity; identity.Key): read as a request's
// value is read, hashed when hash is set (S9a), escaped (or hashed when
// long). It is "" for a blank value.
func IdentityKey(value string, hash bool) string { return identity.Key(value, hash) }

// ModelKey is the form a model name takes in the keys of per-model rules
// and in override keys (identity.ModelKey). It is "" for an empty name.
func ModelKey(model string) string { return identity.ModelKey(model) }

// NewID is 128 random bits in unpadded URL-safe base64 (22 characters):
// reservation IDs are the server's, never the client's. Each lives in
// Redis in a record or a once-only marker, so its length is Redis memory
// per request: 10 bytes fewer than hex.
func NewID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// DescriptorKey is the store key of the bucket of a rate-limit descriptor
// that carries its own limit where the mapping has none: one per domain
// and list of entries (key=value each), as envoyproxy/ratelimit keeps one
// counter for them. Its policy part "!rls" is reserved: an escaped policy
// name never starts with '!'. The entries are each escaped and joined by
// '&', or hashed ("!h.") when that is longer than maxIdentityBytes.
func DescriptorKey(domain string, entries []string) string {
	escaped := make([]string, len(entries))
	for i, e := range entries {
		escaped[i] = url.QueryEscape(e)
	}
	part := strings.Join(escaped, "&")
	if len(part) > maxIdentityBytes {
		part = "!" + hashIdentity(part)
	}
	return keyPrefix + "!rls:" + url.QueryEscape(domain) + ":" + part
}
