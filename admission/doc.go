// Package admission is the admission core that tokengate's two fronts
// share, the ext_proc server (package extproc) and Envoy's rate-limit
// service (package rls): policies and their rules, the store keys of a
// request's identities and model, the limits in force for them (overrides
// and tiers), and the pricing of a request for quotas of money. It speaks
// neither front's protocol and imports neither.
package admission
