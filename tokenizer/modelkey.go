package tokenizer

import "github.com/tokengate/tokengate/internal/modelname"

// modelKey returns the canonical key of a model name (see Count.ModelKey):
// modelname.Key, the rule pricing reads names by too.
func modelKey(model string) string { return modelname.Key(model) }

// ModelKey returns the key a model name is metered by, as Count.ModelKey
// reports it for a request naming that model: lower case, without a router
// prefix, fine-tune wrapper or snapshot suffix. For callers that have a
// model name but no request body (the usage API, overrides of per-model
// rules).
func ModelKey(model string) string { return modelname.Key(model) }
