// Package pricing turns the tokens a request used into money: a price table
// per model and service tier (input, cached input, cache writes of each
// retention, audio, output, reasoning, per million tokens, with an optional
// long-context band), kept with what each model can do (its context window
// and maximum output), shipped defaults for current OpenAI and Anthropic
// models with the page and day each price was read, and the configuration
// types that override and extend them.
//
// Money is integer micro-units of the table's currency (Micros; 1 USD is
// 1,000,000) and prices are integer micro-units per million tokens (Rate),
// both read from decimal strings exactly, never through floating point. A
// request's cost is the exact sum of tokens × rate, rounded up to a whole
// micro-unit once, at the end of the request (Price.Cost): never less than
// the provider bills, less than one micro-unit more, and sums never drift.
//
// Models resolve by canonical name (modelname.Canonical: case, router
// prefixes), then aliases and the snapshots an entry names, then by the
// model a snapshot belongs to (modelname.Snapshot) only where that model's
// entry shares its price with every snapshot (Entry.SharesSnapshots):
// providers price some snapshots apart. A fine-tune is a model of its own,
// never priced as its base model, whose rates it does not share. A model
// the table does not price is refused with ErrUnpriced, or priced at a
// configured fallback: the operator chooses (Config.UnknownModels).
//
// Most callers build a Table from Config.Table once, then call
// Table.Resolve per request and Price.AtTier with the tier the request asks
// for (Table.TierFor), Price.MaxCost to reserve before forwarding, and
// Price.Cost at the tier the answer names to settle the provider's reported
// usage.
package pricing
