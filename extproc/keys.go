package extproc

import (
	"errors"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/admission"
)

// errDuplicateIdentity is a request that carries an identity header more
// than once.
var errDuplicateIdentity = errors.New("identity header repeated")

// headerCount is how many entries of hm carry key (lower case).
func headerCount(hm *corev3.HeaderMap, key string) int {
	n := 0
	for _, h := range hm.GetHeaders() {
		if strings.EqualFold(h.GetKey(), key) {
			n++
		}
	}
	return n
}

// lookupIdentity finds one identity value; ok is false when it is missing.
// A header that appears more than once, or a bearer credential that holds
// a comma (Envoy joins repeated inline headers such as authorization with
// one), is errDuplicateIdentity: the upstream may read another value than
// the one metered.
func lookupIdentity(id Identity, hm *corev3.HeaderMap, headers map[string]string, md map[string]*structpb.Struct) (string, bool, error) {
	var v string
	if id.Header != "" {
		if headerCount(hm, id.Header) > 1 {
			return "", false, errDuplicateIdentity
		}
		v = headers[id.Header]
	} else {
		v = metadataString(md[id.Metadata], id.Path)
	}
	v, bearer := admission.Credential(v)
	if v == "" {
		return "", false, nil
	}
	if bearer && id.Header != "" && strings.ContainsRune(v, ',') {
		return "", false, errDuplicateIdentity
	}
	if id.Hash {
		v = admission.HashIdentity(v)
	}
	return v, true, nil
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

// maxRequestIDBytes bounds the client's x-request-id as a log field.
const maxRequestIDBytes = 128

// logID is the request's id in logs: its x-request-id, cut to
// maxRequestIDBytes, or a random one.
func logID(requestID string) string {
	if requestID == "" {
		return randomID()
	}
	if len(requestID) > maxRequestIDBytes {
		requestID = strings.ToValidUTF8(requestID[:maxRequestIDBytes], "")
	}
	return requestID
}

// randomID is a new reservation ID (admission.NewID).
func randomID() string { return admission.NewID() }

// Credential is a header value as tokengate reads a credential
// (admission.Credential).
func Credential(v string) (value string, bearer bool) { return admission.Credential(v) }

// IdentityKey is the form an identity's value takes in store keys and in
// override keys (admission.IdentityKey).
func IdentityKey(value string, hash bool) string { return admission.IdentityKey(value, hash) }

// ModelKey is the form a model name takes in the keys of per-model rules
// and in override keys (admission.ModelKey).
func ModelKey(model string) string { return admission.ModelKey(model) }
