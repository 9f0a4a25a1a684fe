package extproc

import "github.com/tokengate/tokengate/admission"

// The key forms of the admission core, as the tests here build them.
var (
	bucketKey    = admission.BucketKey
	identityPart = admission.IdentityPart
)

const globalPart = admission.GlobalPart
