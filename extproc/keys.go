package extproc

import (
	"crypto/sha256"
	"encoding/hex"
	"net/url"
	"strings"

	"google.golang.org/protobuf/types/known/structpb"
)

// Bucket and slot keys follow one scheme:
//
//	tg:<policy>:<rule>:<identity>
//
// where <policy> and <rule> are configuration names (<policy> is "*" for a
// provider rule: the provider account is shared by every policy) and <identity> is the
// identity value (the model name for Per "model", "*" for a global rule,
// "anonymous" for a missing identity under Anonymous "shared"). Every part is
// query-escaped, so a ':' inside a value cannot forge another key; an
// identity with Hash set is replaced by "h." and the hex SHA-256 of its value
// (S9a), so raw API keys never reach the store.
const keyPrefix = "tg:"

const (
	sharedScope       = "*"
	globalIdentity    = "*"
	anonymousIdentity = "anonymous"
)

func bucketKey(policy, rule, identity string) string {
	var b strings.Builder
	b.Grow(len(keyPrefix) + len(policy) + len(rule) + len(identity) + 2)
	b.WriteString(keyPrefix)
	b.WriteString(url.QueryEscape(policy))
	b.WriteByte(':')
	b.WriteString(url.QueryEscape(rule))
	b.WriteByte(':')
	b.WriteString(url.QueryEscape(identity))
	return b.String()
}

func hashIdentity(v string) string {
	sum := sha256.Sum256([]byte(v))
	return "h." + hex.EncodeToString(sum[:16])
}

// lookupIdentity finds one identity value; ok is false when it is missing.
func lookupIdentity(id Identity, headers map[string]string, md map[string]*structpb.Struct) (string, bool) {
	var v string
	if id.Header != "" {
		v = headers[id.Header]
	} else {
		v = metadataString(md[id.Metadata], id.Path)
	}
	v = strings.TrimSpace(v)
	if v == "" {
		return "", false
	}
	if strings.HasPrefix(strings.ToLower(v), "bearer ") {
		v = strings.TrimSpace(v[len("bearer "):])
	}
	if id.Hash {
		v = hashIdentity(v)
	}
	return v, true
}

// metadataString reads a dotted path ("claims.sub") from a Struct. Numbers
// and booleans are printed; anything else is missing.
func metadataString(s *structpb.Struct, path string) string {
	if s == nil {
		return ""
	}
	parts := strings.Split(path, ".")
	for i, p := range parts {
		v, ok := s.GetFields()[p]
		if !ok {
			return ""
		}
		if i == len(parts)-1 {
			switch k := v.GetKind().(type) {
			case *structpb.Value_StringValue:
				return k.StringValue
			case *structpb.Value_NumberValue, *structpb.Value_BoolValue:
				b, err := v.MarshalJSON()
				if err != nil {
					return ""
				}
				return string(b)
			}
			return ""
		}
		s = v.GetStructValue()
		if s == nil {
			return ""
		}
	}
	return ""
}
