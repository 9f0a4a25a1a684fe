package extproc

import (
	"errors"
	"log/slog"
	"time"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc/provider"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/tokenizer"
)

// Config is the server's configuration. It is plain data: the wiring code
// maps a validated configuration file (package config, which holds every
// rule about policies, buckets and names) onto it, and NewServer fills the
// defaults without checking the policies again. The zero value is not
// valid: Policies, Store and Counter are required.
type Config struct {
	// Policies are the rate-limit policies, looked up by Name.
	Policies []Policy
	// DefaultPolicy names the policy used when the route names none.
	DefaultPolicy string
	// PolicyMetadataKey is the gRPC initial metadata key naming the policy,
	// set per route through ExtProcPerRoute.overrides.grpc_initial_metadata.
	// Default "x-tokengate-policy".
	PolicyMetadataKey string
	// Store holds the buckets (memory for one instance, Redis for a fleet).
	Store buckets.Store
	// Counter counts prompt tokens, estimates output allowances and counts
	// streamed output.
	Counter *tokenizer.Counter
	// Prices prices requests for quotas of money: the most a request can
	// cost is reserved, what it cost is settled. Required when a policy has
	// a quota of money; a request for a model it cannot price is then
	// refused (400 unpriced_model), unless the table has a fallback.
	Prices *pricing.Table
	// Namespace is the Envoy dynamic metadata namespace the token counts
	// are written under (S24). Default "tokengate".
	Namespace string
	// SettleTimeout bounds each settlement's store call, and each renewal
	// and pause. Default 2s.
	SettleTimeout time.Duration
	// StoreTimeout bounds each Reserve and Extend. They run on a context of
	// their own, not the client's: a reservation the store may have written
	// must be known to be settled, and a client's cancellation is never a
	// store failure. Set it above the store's own timeouts (Redis's dial
	// and read timeouts), which decide when the store counts as down.
	// Default 30s.
	StoreTimeout time.Duration
	// MaxBodyBytes bounds a request body in every body mode, and a
	// non-streamed response body kept to read its usage (a larger one is
	// forwarded, its usage unread). A request body over it, or a
	// content-length announcing one, is refused with 413: before the
	// upstream is contacted in BUFFERED and FULL_DUPLEX_STREAMED mode, with
	// the upstream request reset in STREAMED mode. A request body is held
	// whole to be counted, in one buffer of at most MaxBodyBytes.
	// ServerOptions sets the gRPC receive limit above it, so that tokengate,
	// not gRPC, answers an oversized BUFFERED body (one message); in the
	// streamed modes Envoy's chunks are small and only this bound applies.
	// Default 8 MiB.
	MaxBodyBytes int
	// MaxEventBytes bounds one unfinished server-sent event held back while
	// its end is awaited; a stream past it is forwarded unread and settled
	// at its reservation (Outcome.StreamUnread). Default 4 MiB.
	MaxEventBytes int
	// StreamIdleTimeout ends a stream on which Envoy sends nothing for this
	// long; an open reservation is settled as aborted. Longer than the
	// longest silence of an upstream (a slow non-streamed answer sends
	// nothing until it is done). It is also each reservation's lifetime in
	// the store (see reservationLifetime). Default 10m.
	StreamIdleTimeout time.Duration
	// MaxStreams bounds the streams open at once; one more is refused with
	// RESOURCE_EXHAUSTED (Envoy answers its status_on_error, or, failing
	// open, passes the request unmetered). Default 10000.
	MaxStreams int
	// UsageMargin, UsageSlack, UsageContextWindow and UsageMaxOutputTokens
	// bound the usage a provider may report for a request by what its
	// model can do: a prompt of at most UsageMargin × the model's context
	// window + UsageSlack, an output of at most UsageMargin × its maximum
	// output × the request's choices + UsageSlack, each never below what
	// the request was counted and reserved at here. The model's limits come
	// from Prices (pricing.Price.ContextWindow and MaxOutputTokens); a model
	// the table does not know, or does not give limits for, has
	// UsageContextWindow and UsageMaxOutputTokens. The margin covers
	// server-side tool loops, in which one request calls the model several
	// times. Beyond the bound it is settled (Outcome.UsageClamped), so that
	// a hostile or broken upstream cannot drive shared buckets to their
	// floor. Defaults 4, 4096, 2,000,000 and 2^20.
	UsageMargin          float64
	UsageSlack           int
	UsageContextWindow   int
	UsageMaxOutputTokens int
	// Logger receives request-scoped logs. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock for waits and response headers. Default time.Now.
	Now func() time.Time
	// counter is what counting goes through: Counter, or a fake in tests.
	counter tokenCounter
	// afterFunc starts the timers that renew concurrency slots:
	// time.AfterFunc, or a fake clock's in tests.
	afterFunc func(time.Duration, func()) stopper

	// OnFinish, when set, is called once per request when its stream ends,
	// on the stream's goroutine, with what happened to it (for metrics):
	// after the store has answered the settlement, or SettleTimeout has
	// passed waiting for it.
	OnFinish func(Outcome)
}

// Outcome is what happened to one request, reported once when its stream
// ends. It is a plain value.
type Outcome struct {
	// Policy is the configured policy's name, or "unknown" when the route
	// named none of them.
	Policy string
	// Decision: admitted, unmetered, refused_tokens, refused_requests,
	// refused_budget, never_admissible, bad_request, unauthorized,
	// store_error, or empty when the stream ended before a decision.
	Decision    string
	Model       string
	InputTokens int
	Reserved    int // tokens reserved, extensions included
	Output      int // output tokens counted live
	Settled     int // tokens charged at settlement
	// SettleOutcome: complete, aborted, cut_off, upstream_error,
	// no_response (forwarded, never answered), not_forwarded, shutdown;
	// empty when nothing was reserved.
	SettleOutcome string
	CutOff        bool
	Status        int  // upstream HTTP status, 0 when none was seen
	Usage         bool // the provider reported usage
	// AllowanceSource says where the output allowance came from: request,
	// history or default (S7); empty when the body was not counted.
	AllowanceSource string
	// FallbackEncoding is true when the model was unknown and counted with
	// the configured fallback encoding.
	FallbackEncoding bool
	// Waited is how long the request was held for its tokens (S12).
	Waited time.Duration
	// InDebt names the buckets that settlement left below zero (S9).
	InDebt []string
	// Forgiven names the buckets whose floor (max_debt, or zero for a hard
	// bucket) kept settlement from charging all of the usage (S9, S14).
	Forgiven []string
	// StreamUnread is true when a stream passed Config.MaxEventBytes within
	// one event: it was forwarded unread and settled at its reservation.
	StreamUnread bool
	// UsageClamped is true when the provider reported more usage than the
	// request makes plausible and the bound was settled instead (see
	// Config.UsageMargin).
	UsageClamped bool
	// Quotas is what settlement charged each quota of the policy, in
	// order; empty when nothing was reserved.
	Quotas []QuotaCharge
	// Budget names the quota that refused the request (decision
	// refused_budget, or never_admissible by a quota's whole budget).
	Budget string

	// API is the API the request was read as (tokenizer.API: chat,
	// completions, embeddings, responses, messages, gemini); empty when
	// the body was not counted. Embedding is true for a request that
	// generates no output.
	API       string
	Embedding bool
	// ResponseModel is the model the upstream's answer names, as it
	// wrote it; empty when none was read.
	ResponseModel string
	// ProviderUsage is the usage the provider reported, by token type;
	// the zero value when Usage is false.
	ProviderUsage provider.Usage
	// Streamed is true when the answer was a stream, counted live.
	Streamed bool
	// Duration runs from the request's headers to the end of its stream,
	// on Config.Now. FirstOutput runs from the request's headers to the
	// first output text of a streamed answer; zero when none arrived.
	Duration, FirstOutput time.Duration
}

// QuotaCharge is what settling one request charged one quota: tokens, or
// micro-units of Config.Prices' currency when Money is true.
type QuotaCharge struct {
	Name   string
	Money  bool
	Amount float64
}

// Defaults of the usage bound (Config.UsageMargin and the others). The
// context window is the largest of any model served today (Gemini 1.5
// Pro's 2M); the output is the tokenizer's largest output cap.
const (
	defaultUsageMargin          = 4
	defaultUsageSlack           = 4096
	defaultUsageContextWindow   = 2_000_000
	defaultUsageMaxOutputTokens = 1 << 20
)

// unknownPolicy stands in Outcome.Policy for a policy name that the route
// sent but the configuration does not define.
const unknownPolicy = "unknown"

// What UnknownEndpoints may say.
const (
	unknownRefuse = "refuse"
	unknownPass   = "pass"
	unknownCharge = "charge"
)

// normalize fills defaults. The policies are not checked again: they come
// from a validated configuration (package config). Only what no
// configuration file can get wrong is refused here.
func (c *Config) normalize() error {
	var errs []error
	if c.PolicyMetadataKey == "" {
		c.PolicyMetadataKey = "x-tokengate-policy"
	}
	if c.Namespace == "" {
		c.Namespace = "tokengate"
	}
	if c.SettleTimeout <= 0 {
		c.SettleTimeout = 2 * time.Second
	}
	if c.MaxEventBytes <= 0 {
		c.MaxEventBytes = 4 << 20
	}
	if c.StreamIdleTimeout <= 0 {
		c.StreamIdleTimeout = 10 * time.Minute
	}
	if c.MaxStreams <= 0 {
		c.MaxStreams = 10000
	}
	if c.StoreTimeout <= 0 {
		c.StoreTimeout = 30 * time.Second
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = 8 << 20
	}
	if c.UsageMargin <= 0 {
		c.UsageMargin = defaultUsageMargin
	}
	if c.UsageSlack <= 0 {
		c.UsageSlack = defaultUsageSlack
	}
	if c.UsageContextWindow <= 0 {
		c.UsageContextWindow = defaultUsageContextWindow
	}
	if c.UsageMaxOutputTokens <= 0 {
		c.UsageMaxOutputTokens = defaultUsageMaxOutputTokens
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.afterFunc == nil {
		c.afterFunc = func(d time.Duration, f func()) stopper { return time.AfterFunc(d, f) }
	}
	if c.Store == nil {
		errs = append(errs, errors.New("Store is required"))
	}
	if c.counter == nil {
		if c.Counter == nil {
			errs = append(errs, errors.New("Counter is required"))
		} else {
			c.counter = tokenizerCounter{c.Counter}
		}
	}
	for i := range c.Policies {
		if p := &c.Policies[i]; p.Charges() && c.Prices == nil {
			errs = append(errs, errors.New("Prices is required: policy "+p.Name+" has a quota of money"))
		}
	}
	return errors.Join(errs...)
}

// reservationLifetime is how long a reservation stays settleable in the
// store past its last renewal (buckets.Request.Lifetime): StreamIdleTimeout,
// and at least each slot's lease (the store sees to that). An open request
// renews its reservation every third of it (startRenewal), so a request of
// any length stays settleable while its gateway runs; the lifetime bounds
// how long the record of a gateway that died is kept (its tokens stay
// charged), and how long a settlement may still be replayed after a store
// outage. It follows the idle limit rather than a knob of its own: both say
// how long tokengate keeps a request it hears nothing about.
func (c *Config) reservationLifetime() time.Duration { return c.StreamIdleTimeout }

// tokenCounter counts a request before it is forwarded and learns output
// sizes from settled requests: *tokenizer.Counter through tokenizerCounter.
type tokenCounter interface {
	Count(req tokenizer.Request) (tokenizer.Count, error)
	// NewLive returns a live output counter for a response in encoding.
	NewLive(encoding string) liveCounter
	Observe(policy string, c tokenizer.Count, outputTokens int)
}

// stopper stops a timer; *time.Timer is one.
type stopper interface{ Stop() bool }

// liveCounter counts streamed output text incrementally (S13).
type liveCounter interface {
	Write(delta string)
	Tokens() int
	// Hold and Release bracket the writes of one response chunk, which
	// then share the counter's scratch space; Release reports whether it
	// gave any back.
	Hold()
	Release() bool
}

// The policy types are the admission core's, shared with the rate-limit
// service (package admission).
type (
	Policy          = admission.Policy
	QuotaRule       = admission.QuotaRule
	Identity        = admission.Identity
	BucketRule      = admission.BucketRule
	ConcurrencyRule = admission.ConcurrencyRule
	Override        = admission.Override
	OverrideKey     = admission.OverrideKey
	Overrides       = admission.Overrides
)

const (
	anonymousShared = admission.AnonymousShared
	anonymousReject = admission.AnonymousReject
	perModel        = admission.PerModel
)
