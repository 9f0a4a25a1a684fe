// Package rls serves Envoy's external rate-limit API,
// envoy.service.ratelimit.v3.RateLimitService, on tokengate's admission
// core (package admission) and bucket store: a drop-in for
// envoyproxy/ratelimit, mapped onto tokengate's policies by the
// configuration's rls section (docs/rls.md).
package rls
