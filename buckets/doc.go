// Package buckets models token buckets for rate-limiting LLM traffic by
// tokens (SPEC S1–S12, S14, S18–S20): limits, chains of buckets, admission
// decisions, reservations and their settlement, concurrency slots, quotas
// over calendar windows (budgets of tokens or money per day, week or
// month), and the Store contract with its in-memory implementation,
// Memory.
//
// A bucket holds at most Capacity tokens and refills lazily at Rate tokens
// per second: nothing runs in the background, every operation first brings
// the level up to date from one clock, then acts, in one atomic step. A
// request reserves its estimated cost from every bucket of its chain at once
// (all or none), and settles the actual usage when its response ends:
// over-estimates are refunded, under-estimates are debited even into debt.
//
// Being over the limit is a Decision, never an error. Errors are reserved for
// invalid input (ErrInvalidLimit, ErrInvalidRequest) and for a store that
// cannot be reached (ErrStore).
//
// Most callers want Store.Reserve, then Store.Settle exactly once.
package buckets
