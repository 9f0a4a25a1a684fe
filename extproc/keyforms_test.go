package extproc

import "github.com/tokengate/tokengate/admission"

// The key forms of the admission core, as the tests here build them.
var (
	bucketKey    = admission.BucketKey
	quotaKey     = admission.QuotaKey
	identityPart = admission.IdentityPart
)

const globalPart = admission.GlobalPart
