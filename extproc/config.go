package extproc

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// Config is the server's configuration. It is plain data: the wiring code
// maps a configuration file onto it and NewServer validates it. The zero
// value is not valid: Policies, Store and Counter are required.
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
	// Namespace is the Envoy dynamic metadata namespace the token counts
	// are written under (S24). Default "tokengate".
	Namespace string
	// SettleTimeout bounds each settlement's store call. Default 2s.
	SettleTimeout time.Duration
	// MaxBodyBytes bounds a request body gathered from several messages and
	// a non-streamed response body kept to read its usage. Default 8 MiB.
	MaxBodyBytes int
	// Logger receives request-scoped logs. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock for waits and response headers. Default time.Now.
	Now func() time.Time
	// counter is what counting goes through: Counter, or a fake in tests.
	counter tokenCounter

	// OnFinish, when set, is called once per request when its stream ends,
	// on the stream's goroutine, with what happened to it (for metrics).
	OnFinish func(Outcome)
}

// Outcome is what happened to one request, reported once when its stream
// ends. It is a plain value.
type Outcome struct {
	// Policy is the configured policy's name, or "unknown" when the route
	// named none of them.
	Policy string
	// Decision: admitted, unmetered, refused_tokens, refused_requests,
	// never_admissible, bad_request, unauthorized, store_error, or empty
	// when the stream ended before a decision.
	Decision    string
	Model       string
	InputTokens int
	Reserved    int // tokens reserved, extensions included
	Output      int // output tokens counted live
	Settled     int // tokens charged at settlement
	// SettleOutcome: complete, aborted, cut_off, upstream_error,
	// no_response, shutdown; empty when nothing was reserved.
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
}

// Policy is one named set of limits: how identities are found, the chain of
// buckets every request passes, concurrency limits, waiting and output caps.
// It is plain data, copied by NewServer; a zero Policy is invalid (it needs a
// Name and at least one bucket).
type Policy struct {
	Name string
	// Identities says how a request's identities are found (S9a).
	Identities []Identity
	// Anonymous is what happens when an identity is missing: "shared" (one
	// anonymous bucket per rule, the default) or "reject" (401).
	Anonymous string
	// Buckets is the chain (S10), in order.
	Buckets []BucketRule
	// Concurrency caps requests in flight (S11).
	Concurrency []ConcurrencyRule
	// MaxWait lets a request short of tokens wait up to this long (S12);
	// zero refuses at once.
	MaxWait time.Duration
	// MaxQueue bounds how many requests of this policy wait at once (S12).
	// Zero with a positive MaxWait means no bound beyond MaxWait.
	MaxQueue int
	// MaxOutputTokens is a hard per-request output cap (S14); 0 = none.
	MaxOutputTokens int
	// ClampOutput writes the reserved output allowance into the request
	// body's output cap, so the model itself stops there on every Envoy
	// version (the fallback for Envoy without FULL_DUPLEX_STREAMED).
	ClampOutput bool
	// InjectUsage asks OpenAI-style streams for
	// stream_options.include_usage (S15) and hides it from the client.
	InjectUsage bool
	// PriorityHeader names a request header that marks priority traffic
	// (S19) with the value "true" or "1".
	PriorityHeader string
}

// Identity says where one identity of a request is found (S9a): a request
// header set by an auth filter, or a dotted key in a namespace of Envoy's
// forwarded dynamic metadata (JWT claims). Exactly one of Header and
// Metadata is set; the zero value is invalid. Plain data.
type Identity struct {
	Name     string
	Header   string
	Metadata string // dynamic metadata namespace
	Path     string // dotted key in that namespace
	// Hash stores only a hash of the value (API keys never become store keys).
	Hash bool
}

// BucketRule is one bucket of a policy's chain; its store key is described
// in keys.go and the repository README. Plain data; the zero value is invalid (Name and
// Limit are required).
type BucketRule struct {
	Name string
	// Per is an identity name, "model", or "" for one global bucket.
	Per      string
	Limit    buckets.Limit
	Hard     bool    // may never go below zero; a stream is cut when it runs out (S14)
	MaxDebt  float64 // see buckets.Bucket.MaxDebt
	Headroom float64 // see buckets.Bucket.Headroom (S19)
	// Provider marks the bucket that stands for the provider account: it
	// receives the provider's Retry-After pauses (S18).
	Provider bool
}

// ConcurrencyRule caps requests in flight (S11). Plain data; the zero value
// is invalid (Name and Max are required).
type ConcurrencyRule struct {
	Name  string
	Per   string // as BucketRule.Per
	Max   int
	Lease time.Duration // how long a slot lives if never released; default 10m
}

// unknownPolicy stands in Outcome.Policy for a policy name that the route
// sent but the configuration does not define.
const unknownPolicy = "unknown"

const (
	anonymousShared = "shared"
	anonymousReject = "reject"
	perModel        = "model"
)

// normalize fills defaults and returns every problem found, each naming its
// field.
func (c *Config) normalize() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
	}
	if c.PolicyMetadataKey == "" {
		c.PolicyMetadataKey = "x-tokengate-policy"
	}
	c.PolicyMetadataKey = strings.ToLower(c.PolicyMetadataKey)
	if c.Namespace == "" {
		c.Namespace = "tokengate"
	}
	if c.SettleTimeout == 0 {
		c.SettleTimeout = 2 * time.Second
	}
	if c.SettleTimeout < 0 {
		bad("SettleTimeout", "must not be negative, got %v", c.SettleTimeout)
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 8 << 20
	}
	if c.MaxBodyBytes < 0 {
		bad("MaxBodyBytes", "must not be negative, got %d", c.MaxBodyBytes)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Store == nil {
		bad("Store", "is required")
	}
	if c.counter == nil {
		if c.Counter == nil {
			bad("Counter", "is required")
		} else {
			c.counter = tokenizerCounter{c.Counter}
		}
	}
	if len(c.Policies) == 0 {
		bad("Policies", "at least one policy is required")
	}
	names := map[string]bool{}
	for i := range c.Policies {
		p := &c.Policies[i]
		f := fmt.Sprintf("Policies[%d]", i)
		if p.Name == "" {
			bad(f+".Name", "is required")
		} else if names[p.Name] {
			bad(f+".Name", "duplicate policy %q", p.Name)
		}
		names[p.Name] = true
		errs = append(errs, p.normalize(f)...)
	}
	if c.DefaultPolicy != "" && !names[c.DefaultPolicy] {
		bad("DefaultPolicy", "names no policy: %q", c.DefaultPolicy)
	}
	return errors.Join(errs...)
}

func (p *Policy) normalize(f string) []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s.%s: %s", f, field, fmt.Sprintf(format, args...)))
	}
	switch p.Anonymous {
	case "":
		p.Anonymous = anonymousShared
	case anonymousShared, anonymousReject:
	default:
		bad("Anonymous", "must be %q or %q, got %q", anonymousShared, anonymousReject, p.Anonymous)
	}
	ids := map[string]bool{}
	for i, id := range p.Identities {
		g := fmt.Sprintf("Identities[%d]", i)
		switch {
		case id.Name == "":
			bad(g+".Name", "is required")
		case id.Name == perModel:
			bad(g+".Name", "%q is reserved for per-model buckets", perModel)
		case ids[id.Name]:
			bad(g+".Name", "duplicate identity %q", id.Name)
		}
		ids[id.Name] = true
		switch {
		case id.Header != "" && id.Metadata != "":
			bad(g, "set either Header or Metadata, not both")
		case id.Header == "" && id.Metadata == "":
			bad(g, "one of Header or Metadata is required")
		case id.Metadata != "" && id.Path == "":
			bad(g+".Path", "is required with Metadata")
		}
		p.Identities[i].Header = strings.ToLower(id.Header)
	}
	per := func(g, v string) {
		if v != "" && v != perModel && !ids[v] {
			bad(g+".Per", "names no identity of the policy: %q", v)
		}
	}
	if len(p.Buckets) == 0 {
		bad("Buckets", "at least one bucket is required")
	}
	bnames := map[string]bool{}
	for i, b := range p.Buckets {
		g := fmt.Sprintf("Buckets[%d]", i)
		if b.Name == "" {
			bad(g+".Name", "is required")
		} else if bnames[b.Name] {
			bad(g+".Name", "duplicate bucket %q", b.Name)
		}
		bnames[b.Name] = true
		per(g, b.Per)
		if b.Limit.Capacity <= 0 {
			bad(g+".Limit.Capacity", "must be positive, got %v", b.Limit.Capacity)
		}
		if b.Limit.Rate <= 0 {
			bad(g+".Limit.Rate", "must be positive, got %v", b.Limit.Rate)
		}
		if b.MaxDebt < 0 {
			bad(g+".MaxDebt", "must not be negative, got %v", b.MaxDebt)
		}
		if b.Headroom < 0 || (b.Limit.Capacity > 0 && b.Headroom >= b.Limit.Capacity) {
			bad(g+".Headroom", "must be in [0, capacity), got %v", b.Headroom)
		}
	}
	for i, c := range p.Concurrency {
		g := fmt.Sprintf("Concurrency[%d]", i)
		if c.Name == "" {
			bad(g+".Name", "is required")
		} else if bnames[c.Name] {
			bad(g+".Name", "duplicate name %q", c.Name)
		}
		bnames[c.Name] = true
		per(g, c.Per)
		if c.Max <= 0 {
			bad(g+".Max", "must be positive, got %d", c.Max)
		}
		if c.Lease < 0 {
			bad(g+".Lease", "must not be negative, got %v", c.Lease)
		}
		if c.Lease == 0 {
			p.Concurrency[i].Lease = 10 * time.Minute
		}
	}
	if p.MaxWait < 0 {
		bad("MaxWait", "must not be negative, got %v", p.MaxWait)
	}
	if p.MaxQueue < 0 {
		bad("MaxQueue", "must not be negative, got %d", p.MaxQueue)
	}
	if p.MaxOutputTokens < 0 {
		bad("MaxOutputTokens", "must not be negative, got %d", p.MaxOutputTokens)
	}
	p.PriorityHeader = strings.ToLower(p.PriorityHeader)
	return errs
}

// tokenCounter counts a request before it is forwarded and learns output
// sizes from settled requests: *tokenizer.Counter through tokenizerCounter.
type tokenCounter interface {
	Count(req tokenizer.Request) (tokenizer.Count, error)
	// NewLive returns a live output counter for a response in encoding.
	NewLive(encoding string) liveCounter
	Observe(policy string, c tokenizer.Count, outputTokens int)
}

// liveCounter counts streamed output text incrementally (S13).
type liveCounter interface {
	Write(delta string)
	Tokens() int
}
