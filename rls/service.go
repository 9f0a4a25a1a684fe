package rls

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/internal/billing"
	"github.com/tokengate/tokengate/pricing"
	"github.com/tokengate/tokengate/rls/rlconfig"
	"github.com/tokengate/tokengate/tokenizer"
)

// ServiceName is the gRPC service the Service implements, as the health
// server names it.
const ServiceName = "envoy.service.ratelimit.v3.RateLimitService"

// MaxDescriptors bounds the descriptors of one call: each is a store call.
// Envoy sends one per rate_limits entry of a route, a handful.
const MaxDescriptors = 256

// Config is the service's configuration. Plain data; Store is required.
type Config struct {
	// Store holds the buckets and quotas, the same store as the ext_proc
	// server's, so that both fronts meter one set of levels. It must
	// implement buckets.Charger and buckets.Inspector.
	Store buckets.Store
	// Prices prices the hits of descriptors that meet a quota of money, by
	// the model entry's model. Required when a mapped rule is one.
	Prices *pricing.Table
	// Logger receives the service's logs. Default slog.Default().
	Logger *slog.Logger
	// OnDescriptor, when set, is called once per descriptor answered, for
	// metrics.
	OnDescriptor func(Result)
	// OnError, when set, is called once per call answered with an error,
	// with its reason (Result's error reasons).
	OnError func(reason string)
	// OnStats, when set, is called once per descriptor of hits that meets
	// a limit ratelimit keeps stats for, with what ratelimit would add to
	// them (for a deferred charge, once it is written), and once per
	// descriptor of a call to a domain no mapping names, hits or not
	// (RatelimitStats.DomainNotFound).
	OnStats func(RatelimitStats)
	// OnGlobalShadowMode, when set, is called once per call that was over
	// the limit and answered OK by the service's shadow mode
	// (rls.shadow_mode), as ratelimit counts global_shadow_mode.
	OnGlobalShadowMode func()
}

// Result is what one descriptor of a call met and was answered. A plain
// value; Domain is the request's only when a mapping names it, so that it
// is a bounded label.
type Result struct {
	// Domain is the mapped domain, or "" for a domain no mapping names.
	Domain string
	// Policy is the policy the descriptor met; "" when none.
	Policy string
	// Kind: limit, deny, unlimited, no_limit (a descriptor that lands on
	// no limit), unknown_domain, replaced, unpriced (a quota of money
	// the model entry's model has no price for), override (a descriptor's
	// own limit).
	Kind string
	// Code is the status's code: ok or over_limit; deferred for a hit of
	// a deferred domain (config.RLS.DeferredCharges), answered OK before
	// it is written.
	Code string
	// Hits are the descriptor's hits; Negative for a refund.
	Hits     uint64
	Negative bool
	// Shadow is true when shadow mode (the rule's or the service's) turned
	// an over-limit answer into OK.
	Shadow bool
}

// Kinds of Result.
const (
	KindLimit         = "limit"
	KindDeny          = "deny"
	KindUnlimited     = "unlimited"
	KindNoLimit       = "no_limit"
	KindUnknownDomain = "unknown_domain"
	KindReplaced      = "replaced"
	KindUnpriced      = "unpriced"
	KindOverride      = "override"
)

// Reasons of Config.OnError.
const (
	ErrorInvalid  = "invalid_request"
	ErrorNoConfig = "no_config"
	ErrorStore    = "store_error"
	ErrorCaller   = "caller_gone"
	// ErrorDeferred counts a deferred charge the store failed after the
	// call was answered (the failover store keeps it for replay).
	ErrorDeferred = "deferred_store_error"
)

// Mapping is what Load swaps in: a validated configuration whose rls
// section maps domains onto its policies, and those policies as the
// admission core holds them (the same that the ext_proc server was given).
type Mapping struct {
	Config   *config.Config
	Policies []admission.Policy
}

// mapping is a loaded Mapping. Immutable.
type mapping struct {
	cfg      *config.Config
	policies admission.Policies
	byName   map[string]*config.Policy
	// shadow and quota are the service's shadow and quota mode (rls:).
	shadow, quota bool
	// metadata answers with dynamic metadata
	// (rls.response_dynamic_metadata).
	metadata bool
	// headers are the RateLimit-* header names
	// (rls.limit_response_headers); nil when off.
	headers *limitHeaders
	// json serves POST /json (rls.json_endpoint).
	json bool
	// near is rls.near_limit_ratio, as ratelimit holds it.
	near float32
}

// Service implements envoy.service.ratelimit.v3.RateLimitService on the
// admission core: each descriptor lands on the rules of a policy
// (config.Config.MatchRLS) and its hits are tokens of those rules, charged
// in the store (docs/rls.md, "Hits onto tokens"). Safe for concurrent
// use.
type Service struct {
	rlsv3.UnimplementedRateLimitServiceServer
	cfg       Config
	charger   buckets.Charger
	inspector buckets.Inspector
	// later charges a deferred domain's hits without the call waiting
	// (nil when the store cannot); deferred counts those not yet written.
	later     buckets.AsyncCharger
	deferred  sync.WaitGroup
	live      atomic.Pointer[mapping]
	overrides atomic.Pointer[admission.Overrides]
}

// New returns a service without a mapping: every call is an error until
// Load gives it one, as ratelimit answers before its first configuration.
func New(c Config) (*Service, error) {
	ch, ok := c.Store.(buckets.Charger)
	if !ok {
		return nil, fmt.Errorf("rls: the bucket store %T cannot charge hits (buckets.Charger)", c.Store)
	}
	in, ok := c.Store.(buckets.Inspector)
	if !ok {
		return nil, fmt.Errorf("rls: the bucket store %T cannot be inspected (buckets.Inspector)", c.Store)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	s := &Service{cfg: c, charger: ch, inspector: in}
	s.later, _ = c.Store.(buckets.AsyncCharger)
	s.overrides.Store(&admission.Overrides{})
	return s, nil
}

// Load makes m the mapping of every call from now on; calls under way
// finish on the one they started with. A nil Config unloads it.
func (s *Service) Load(m Mapping) error {
	if m.Config == nil {
		s.live.Store(nil)
		return nil
	}
	lm := &mapping{cfg: m.Config, policies: admission.NewPolicies(m.Policies), byName: map[string]*config.Policy{}, near: float32(m.Config.RLS.NearLimit())}
	for i := range m.Config.Policies {
		p := &m.Config.Policies[i]
		lm.byName[p.Name] = p
		ap := lm.policies[p.Name]
		if ap == nil {
			return fmt.Errorf("rls: policy %q of the configuration is not among the admission policies", p.Name)
		}
		if ap.Charges() && s.cfg.Prices == nil {
			return fmt.Errorf("rls: policy %q has a quota of money but the service has no price table", p.Name)
		}
	}
	if r := m.Config.RLS; r != nil {
		lm.shadow, lm.quota, lm.metadata, lm.json = r.ShadowMode, r.QuotaMode, r.ResponseDynamicMetadata, r.JSONEndpoint
		if r.LimitResponseHeaders.Enabled {
			lm.headers = &limitHeaders{}
			lm.headers.limit, lm.headers.remaining, lm.headers.reset = r.LimitResponseHeaders.Names()
		}
	}
	s.live.Store(lm)
	return nil
}

// SetOverrides makes o the per-identity overrides of every call from now
// on, as the ext_proc server's (admission.Overrides).
func (s *Service) SetOverrides(o admission.Overrides) {
	if o == nil {
		o = admission.Overrides{}
	}
	s.overrides.Store(&o)
}

// plan is what one descriptor meets.
type plan struct {
	kind   string
	node   *config.RLSDescriptor
	policy string
	hits   uint64
	// given: the hits were sent (the descriptor's hits_addend, or the
	// call's above 0), not ratelimit's default of 1.
	given    bool
	negative bool
	buckets  []buckets.Bucket
	quotas   []buckets.Quota
	slots    []buckets.Slot
	// perHit is the money one hit costs, in micro-units, for quotas of
	// money.
	perHit float64
	// name is the limit's name (rate_limit.name) for current_limit.
	name string
	// adhoc is a descriptor's own limit: as ratelimit's, it has no name,
	// replaces nothing and has no shadow or quota mode (§3.2).
	adhoc bool
	// zero is the current_limit of a limit of 0 requests per unit (a deny
	// node, or a descriptor's own limit of requests_per_unit 0): every
	// hit is over it, a check passes, nothing is written. nil for any
	// other limit.
	zero *rlsv3.RateLimitResponse_RateLimit
	// met is the verdict of the rule the answer's status came from, when
	// it counts hits (a bucket or a quota) and the descriptor charged them.
	met *verdict
}

// modes is the node whose shadow mode, quota mode, name and replaces apply
// to the plan's limit; nil for none.
func (p *plan) modes() *config.RLSDescriptor {
	if p.adhoc {
		return nil
	}
	return p.node
}

// verdict is what the store said of one rule of a descriptor.
type verdict struct {
	over      bool
	remaining float64 // in hits
	reset     time.Duration
	limit     *rlsv3.RateLimitResponse_RateLimit
	// counted is set for a bucket or a quota after a charge: of its
	// capacity (in hits), used hits are given out (RatelimitStats).
	counted        bool
	capacity, used float64
}

var (
	okCode   = rlsv3.RateLimitResponse_OK
	overCode = rlsv3.RateLimitResponse_OVER_LIMIT
)

// ShouldRateLimit implements rlsv3.RateLimitServiceServer.
func (s *Service) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	if req.GetDomain() == "" {
		return nil, s.fail(ErrorInvalid, codes.Unknown, "rate limit domain must not be empty")
	}
	if len(req.GetDescriptors()) == 0 {
		return nil, s.fail(ErrorInvalid, codes.Unknown, "rate limit descriptor list must not be empty")
	}
	if n := len(req.GetDescriptors()); n > MaxDescriptors {
		return nil, s.fail(ErrorInvalid, codes.InvalidArgument, fmt.Sprintf("%d descriptors in one call, more than the %d the service answers", n, MaxDescriptors))
	}
	m := s.live.Load()
	if m == nil {
		return nil, s.fail(ErrorNoConfig, codes.Unknown, "no rate limit configuration loaded")
	}
	plans := make([]plan, len(req.GetDescriptors()))
	for i, d := range req.GetDescriptors() {
		p, err := s.plan(m, req, d)
		if err != nil {
			return nil, s.fail(ErrorInvalid, codes.InvalidArgument, fmt.Sprintf("descriptor %d: %v", i, err))
		}
		plans[i] = p
	}
	// An unlimited limit is never replaced, as ratelimit sets it aside
	// before it drops the replaced names; what it replaces still goes.
	replaced := rlconfig.Replaced(plans,
		func(p plan) string {
			if n := p.modes(); n != nil && p.kind != KindUnlimited {
				return n.Name
			}
			return ""
		},
		func(p plan) []string {
			if n := p.modes(); n != nil {
				return n.Replaces
			}
			return nil
		})

	resp := &rlsv3.RateLimitResponse{Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(plans))}
	domain := ""
	if m.cfg.RLSTree(req.GetDomain()) != nil {
		domain = req.GetDomain()
	}
	if s.later != nil && m.cfg.RLS.Deferred(domain) && allHits(plans) {
		// A caller gone before anything is queued charges nothing, as a
		// charge it waits for does.
		if err := ctx.Err(); err != nil {
			return nil, s.storeError(err)
		}
		s.deferCharges(m, req, plans, replaced, domain, resp)
		if m.metadata {
			resp.DynamicMetadata = responseMetadata(req, plans, resp.Statuses)
		}
		return resp, nil
	}
	failedLimit, failedQuota, quotaMode := 0, 0, 0
	var retry time.Duration
	pick := headerPick{least: math.MaxUint32}
	for i := range plans {
		p := &plans[i]
		if replaced[i] {
			p.kind = KindReplaced
		}
		st, err := s.answer(ctx, p)
		if err != nil {
			return nil, s.storeError(err)
		}
		res := Result{Domain: domain, Policy: p.policy, Kind: p.kind, Code: "ok", Hits: p.hits, Negative: p.negative}
		if st.Code == overCode {
			res.Code = "over_limit"
			if n := p.modes(); n != nil && n.ShadowMode {
				st.Code, st.LimitRemaining, res.Shadow = okCode, 0, true
			}
		}
		// As ratelimit counts them: the service's quota mode takes in
		// every descriptor but the unlimited, those without a limit too;
		// a replaced limit is none, its quota mode with it.
		quota := m.quota && p.kind != KindUnlimited || p.kind != KindReplaced && p.modes() != nil && p.modes().QuotaMode
		pick.see(st, quota)
		if quota {
			quotaMode++
		}
		if st.Code == overCode {
			if quota {
				failedQuota++
			} else {
				failedLimit++
			}
			retry = max(retry, st.GetDurationUntilReset().AsDuration())
		}
		resp.Statuses[i] = st
		if s.cfg.OnDescriptor != nil {
			if m.shadow && st.Code == overCode {
				res.Shadow = true
			}
			s.cfg.OnDescriptor(res)
		}
		s.stats(m, p, req.GetDomain(), req.GetDescriptors()[i])
	}
	resp.OverallCode = okCode
	if failedLimit > 0 || quotaMode > 0 && quotaMode == failedQuota {
		resp.OverallCode = overCode
	}
	if m.shadow && resp.OverallCode == overCode {
		resp.OverallCode = okCode
		if s.cfg.OnGlobalShadowMode != nil {
			s.cfg.OnGlobalShadowMode()
		}
	}
	if m.headers != nil {
		resp.ResponseHeadersToAdd = m.headers.of(pick.status)
	}
	if resp.OverallCode == overCode {
		secs := int64(math.Ceil(retry.Seconds()))
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, headerValue(config.RetryAfterHeader, strconv.FormatInt(max(secs, 1), 10)))
	}
	if m.metadata {
		resp.DynamicMetadata = responseMetadata(req, plans, resp.Statuses)
	}
	return resp, nil
}

// headerPick chooses the status whose RateLimit-* headers an answer
// carries, as ratelimit chooses it (§3.5): the one with the least
// limit_remaining among those with a current_limit, the first on a tie;
// a status over the limit outside quota mode takes over, the last such
// one. Statuses are seen in order, after the rule's shadow mode.
type headerPick struct {
	status *rlsv3.RateLimitResponse_DescriptorStatus
	least  uint32
}

func (h *headerPick) see(st *rlsv3.RateLimitResponse_DescriptorStatus, quota bool) {
	if st.GetCurrentLimit() != nil && st.GetLimitRemaining() < h.least {
		h.status, h.least = st, st.GetLimitRemaining()
	}
	if st.GetCode() == overCode && !quota {
		h.status, h.least = st, 0
	}
}

// limitHeaders are the names of ratelimit's RateLimit-* headers.
type limitHeaders struct{ limit, remaining, reset string }

// of is the headers of st: its requests_per_unit, its limit_remaining and
// its duration_until_reset in whole seconds, rounded up. ratelimit
// computes the reset from the unit's fixed window; a bucket's status says
// when the bucket is full again (OK) or holds the hits again (over), and
// a quota's when its window ends. None when st is nil or has no limit (a
// descriptor refused unpriced, over the limit without one).
func (h *limitHeaders) of(st *rlsv3.RateLimitResponse_DescriptorStatus) []*corev3.HeaderValue {
	if st.GetCurrentLimit() == nil {
		return nil
	}
	reset := int64(math.Ceil(st.GetDurationUntilReset().AsDuration().Seconds()))
	return []*corev3.HeaderValue{
		headerValue(h.limit, strconv.FormatUint(uint64(st.GetCurrentLimit().GetRequestsPerUnit()), 10)),
		headerValue(h.remaining, strconv.FormatUint(uint64(st.GetLimitRemaining()), 10)),
		headerValue(h.reset, strconv.FormatInt(reset, 10)),
	}
}

// responseMetadata is the dynamic metadata of an answer, as ratelimit's
// RESPONSE_DYNAMIC_METADATA builds it (§3.5): the domain; each
// descriptor's entries as "key=value", its own limit as ratelimit prints
// it and its hits_addend when set (0 included); the call's hits_addend
// when not 0; and, under "metadata", the metadata of the limits met whose
// status is not OVER_LIMIT (after the rule's shadow mode, before the
// service's), merged in descriptor order. A replaced limit, a
// descriptor's own limit, an unlimited descriptor and one without a
// limit give none.
func responseMetadata(req *rlsv3.RateLimitRequest, plans []plan, statuses []*rlsv3.RateLimitResponse_DescriptorStatus) *structpb.Struct {
	ds := make([]*structpb.Value, 0, len(req.GetDescriptors()))
	for _, d := range req.GetDescriptors() {
		entries := make([]*structpb.Value, len(d.GetEntries()))
		for i, e := range d.GetEntries() {
			entries[i] = structpb.NewStringValue(e.GetKey() + "=" + e.GetValue())
		}
		f := map[string]*structpb.Value{"entries": structpb.NewListValue(&structpb.ListValue{Values: entries})}
		if l := d.GetLimit(); l != nil {
			f["limit"] = structpb.NewStringValue(limitText(l))
		}
		if h := d.GetHitsAddend(); h != nil {
			f["hitsAddend"] = structpb.NewNumberValue(float64(h.GetValue()))
		}
		ds = append(ds, structpb.NewStructValue(&structpb.Struct{Fields: f}))
	}
	fields := map[string]*structpb.Value{
		"domain":      structpb.NewStringValue(req.GetDomain()),
		"descriptors": structpb.NewListValue(&structpb.ListValue{Values: ds}),
	}
	if h := req.GetHitsAddend(); h != 0 {
		fields["hitsAddend"] = structpb.NewNumberValue(float64(h))
	}
	passed := &structpb.Struct{Fields: map[string]*structpb.Value{}}
	for i := range plans {
		if statuses[i].GetCode() != overCode {
			mergeMetadata(passed, plans[i].metadata())
		}
	}
	if len(passed.Fields) > 0 {
		fields["metadata"] = structpb.NewStructValue(passed)
	}
	return &structpb.Struct{Fields: fields}
}

// metadata is the metadata of the limit p met; nil when it met none of
// its node's (no limit, unlimited, replaced, its own limit, unpriced).
func (p *plan) metadata() *structpb.Struct {
	if p.kind != KindLimit && p.kind != KindDeny {
		return nil
	}
	return p.node.Metadata.Struct()
}

// mergeMetadata merges src into dst as ratelimit merges the metadata of
// passed limits: a key dst lacks is added, one both hold as mappings is
// merged the same way, any other stays as dst has it. What it adds is a
// copy: src is the configuration's, shared by every call.
func mergeMetadata(dst, src *structpb.Struct) {
	for k, v := range src.GetFields() {
		have, ok := dst.Fields[k]
		switch {
		case !ok:
			dst.Fields[k] = proto.CloneOf(v)
		case have.GetStructValue() != nil && v.GetStructValue() != nil:
			d := have.GetStructValue()
			if d.Fields == nil {
				d.Fields = map[string]*structpb.Value{}
			}
			mergeMetadata(d, v.GetStructValue())
		}
	}
}

// limitText is a descriptor's own limit as ratelimit prints it in the
// metadata (the message's compact text form, ratelimit's API knowing
// requests_per_unit and unit), with one space between fields where
// protobuf-go's text form puts one or two, varying by build.
func limitText(l *commonv3.RateLimitDescriptor_RateLimitOverride) string {
	var parts []string
	if n := l.GetRequestsPerUnit(); n != 0 {
		parts = append(parts, "requests_per_unit:"+strconv.FormatUint(uint64(n), 10))
	}
	if u := l.GetUnit(); u != 0 {
		parts = append(parts, "unit:"+u.String())
	}
	return strings.Join(parts, " ")
}

// allHits reports whether every descriptor of a call carries hits it was
// sent: a stream-done call, never a check, nor a request-path call whose
// entries carry no hits_addend and count ratelimit's 1 each (AI Gateway's
// QuotaPolicy, envoy-ratelimit.md §5.2), whose answer Envoy acts on.
func allHits(plans []plan) bool {
	for i := range plans {
		if plans[i].hits == 0 || !plans[i].given {
			return false
		}
	}
	return true
}

// deferCharges answers a deferred domain's stream-done call OK at once,
// each status naming the limit its descriptor met, and queues the charge
// of every descriptor that meets a bucket or quota
// (config.RLS.DeferredCharges): Envoy ignores the answer, and charges
// that nobody waits for share the store's calls. Concurrency limits are
// only checked by a charge, so a deferred one leaves them alone.
func (s *Service) deferCharges(m *mapping, req *rlsv3.RateLimitRequest, plans []plan, replaced []bool, domain string, resp *rlsv3.RateLimitResponse) {
	resp.OverallCode = okCode
	for i := range plans {
		p := &plans[i]
		if replaced[i] {
			p.kind = KindReplaced
		}
		st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode}
		resp.Statuses[i] = st
		code := "ok"
		if (p.kind == KindLimit || p.kind == KindOverride) && (len(p.buckets) > 0 || len(p.quotas) > 0) {
			st.CurrentLimit = p.limitMet()
			r, actual := p.reservation()
			s.deferred.Add(1)
			s.later.ChargeAsync(r, actual, func(states []buckets.BucketState, err error) {
				defer s.deferred.Done()
				if err != nil {
					s.cfg.Logger.Warn("rls: a deferred charge was not written", "domain", domain, "policy", p.policy, "hits", p.hits, "err", err)
					if s.cfg.OnError != nil {
						s.cfg.OnError(ErrorDeferred)
					}
					return
				}
				// The quotas' spend is not read back: a descriptor of
				// quotas alone adds its hits to total_hits only.
				if len(states) == len(p.buckets) && len(p.buckets) > 0 {
					vs := p.chargedVerdicts(states)
					_, pick := p.status(vs)
					p.met = &vs[pick]
				}
				s.stats(m, p, req.GetDomain(), req.GetDescriptors()[i])
			})
			code = "deferred"
		}
		if s.cfg.OnDescriptor != nil {
			s.cfg.OnDescriptor(Result{Domain: domain, Policy: p.policy, Kind: p.kind, Code: code, Hits: p.hits, Negative: p.negative})
		}
	}
}

// stats hands what ratelimit would add to the stats of the limit that
// descriptor d of a call to domain met, planned as p and answered, to
// Config.OnStats: domain_not_found for a domain no mapping names; nothing
// for a check, a refund, or a descriptor that meets no limit ratelimit
// keeps stats for.
func (s *Service) stats(m *mapping, p *plan, domain string, d *commonv3.RateLimitDescriptor) {
	if s.cfg.OnStats == nil {
		return
	}
	if p.kind == KindUnknownDomain {
		s.cfg.OnStats(RatelimitStats{Key: domain, DomainNotFound: 1})
		return
	}
	if p.hits == 0 || p.negative {
		return
	}
	key := m.statsKey(p, domain, d)
	if key == "" {
		return
	}
	st := RatelimitStats{Key: key, TotalHits: p.hits}
	if v := p.met; v != nil {
		shadow := false
		if n := p.modes(); n != nil {
			shadow = n.ShadowMode
		}
		ratelimitCount(&st, v.capacity, v.used, p.hits, m.near, shadow)
	}
	s.cfg.OnStats(st)
}

// limitMet is the limit of p's first bucket, or else of its first quota:
// which limit a descriptor met, for an answer given before the store was
// asked (remaining and reset are not known then).
func (p *plan) limitMet() *rlsv3.RateLimitResponse_RateLimit {
	if len(p.buckets) > 0 {
		return bucketLimit(p.buckets[0].Limit, p.name)
	}
	q := p.quotas[0]
	limit := q.Limit
	if q.Unit == buckets.Money {
		limit /= p.perHit
	}
	return &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: clampUint32(limit), Unit: windowUnit(q.Window), Name: p.name}
}

// Drain waits until every deferred charge is written (or failed), or ctx
// ends. Call it once the gRPC server has stopped taking calls, before the
// store's Flush.
func (s *Service) Drain(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		s.deferred.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("rls: deferred charges still unwritten: %w", ctx.Err())
	}
}

// fail counts and answers an error.
func (s *Service) fail(reason string, code codes.Code, msg string) error {
	if s.cfg.OnError != nil {
		s.cfg.OnError(reason)
	}
	return status.Error(code, msg)
}

// storeError answers a store call that failed: the caller's own end as
// its code, anything else as the store being unavailable.
func (s *Service) storeError(err error) error {
	switch {
	case errors.Is(err, context.Canceled):
		return s.fail(ErrorCaller, codes.Canceled, "the call was cancelled")
	case errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, buckets.ErrStore):
		return s.fail(ErrorCaller, codes.DeadlineExceeded, "the call's deadline passed")
	}
	s.cfg.Logger.Warn("rate-limit call failed: the bucket store did not answer", "err", err)
	return s.fail(ErrorStore, codes.Unavailable, "the bucket store is unavailable")
}

// hitsOf is a descriptor's hits (§3.3): its own hits_addend when set, 0
// included, else the request's, at least 1.
func hitsOf(req *rlsv3.RateLimitRequest, d *commonv3.RateLimitDescriptor) uint64 {
	if h := d.GetHitsAddend(); h != nil {
		return h.GetValue()
	}
	return uint64(max(1, req.GetHitsAddend()))
}

// plan finds what descriptor d of req meets, and its buckets, quotas and
// slots with the limits in force.
func (s *Service) plan(m *mapping, req *rlsv3.RateLimitRequest, d *commonv3.RateLimitDescriptor) (plan, error) {
	p := plan{hits: hitsOf(req, d), given: d.GetHitsAddend() != nil || req.GetHitsAddend() > 0, negative: d.GetIsNegativeHits()}
	match, known, ok := m.cfg.MatchRLS(req.GetDomain(), d)
	override := d.GetLimit()
	// An unknown domain has no limit before a descriptor's own is looked
	// at, as ratelimit's GetLimit answers it.
	switch {
	case !known:
		p.kind = KindUnknownDomain
		return p, nil
	case !ok && override == nil:
		p.kind = KindNoLimit
		return p, nil
	}
	var limit buckets.Limit
	if override != nil {
		l, unit, err := overrideLimit(override)
		if err != nil {
			return p, err
		}
		if l.Capacity == 0 {
			// ratelimit's own limit of 0 skips the tree as any own limit
			// does: every hit over it.
			p.kind, p.adhoc = KindOverride, true
			p.zero = &rlsv3.RateLimitResponse_RateLimit{Unit: unit}
			return p, nil
		}
		limit = l
	}
	switch {
	case !ok || override != nil && match.Descriptor().Policy == "":
		// A descriptor's own limit where the tree has no policy (no
		// limit, unlimited or deny: ratelimit's own limit skips the
		// tree): a bucket of the domain's own, one per list of entries,
		// as ratelimit keeps one counter per domain and entries.
		p.kind, p.adhoc = KindOverride, true
		p.buckets = []buckets.Bucket{{Name: "limit", Key: admission.DescriptorKey(req.GetDomain(), entryStrings(d)), Limit: limit, MaxDebt: limit.Capacity}}
		return p, nil
	}
	node := match.Descriptor()
	p.node, p.name = node, node.Name
	switch {
	case node.Unlimited:
		p.kind = KindUnlimited
		return p, nil
	case node.Deny:
		p.kind, p.zero = KindDeny, &rlsv3.RateLimitResponse_RateLimit{Name: p.name}
		return p, nil
	}
	p.kind, p.policy = KindLimit, node.Policy
	if override != nil {
		p.kind, p.adhoc, p.name = KindOverride, true, ""
	}
	pol, cpol := m.policies[node.Policy], m.byName[node.Policy]
	if pol == nil || cpol == nil {
		return p, fmt.Errorf("the mapping names policy %q, which is not loaded", node.Policy)
	}
	ids := make(map[string]string, len(pol.Identities))
	for _, id := range pol.Identities {
		if v, ok := match.Identity(id.Name); ok {
			if k := admission.IdentityKey(v, id.Hash); k != "" {
				ids[id.Name] = k
			}
		}
	}
	model, _ := match.Model()
	c := admission.Chain{
		Policy: pol, PolicyName: pol.Name, IDs: ids, ModelKey: tokenizer.ModelKey(model),
		Overrides: *s.overrides.Load(),
	}
	if s.cfg.Prices != nil {
		c.Currency = s.cfg.Prices.Currency()
	}
	bs, qs, cs := node.Meets(*cpol)
	for _, b := range bs {
		if r := bucketRule(pol, b.Name); r != nil {
			bk := c.Bucket(*r)
			if override != nil {
				bk.Limit = limit
			}
			p.buckets = append(p.buckets, bk)
		}
	}
	money := false
	for _, q := range qs {
		if r := quotaRule(pol, q.Name); r != nil {
			p.quotas = append(p.quotas, c.Quota(*r))
			money = money || r.Unit == buckets.Money
		}
	}
	for _, cr := range cs {
		if r := concurrencyRule(pol, cr.Name); r != nil {
			p.slots = append(p.slots, c.Slot(*r))
		}
	}
	if money {
		price, err := admission.PriceOf(s.cfg.Prices, model, billing.Auto)
		if err != nil {
			p.kind = KindUnpriced
			return p, nil
		}
		p.perHit = perHit(price)
	}
	return p, nil
}

// answer runs one descriptor's plan against the store and says its
// status; shadow and quota mode are the caller's.
func (s *Service) answer(ctx context.Context, p *plan) (*rlsv3.RateLimitResponse_DescriptorStatus, error) {
	switch p.kind {
	case KindUnknownDomain, KindNoLimit, KindReplaced:
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode}, nil
	case KindUnlimited:
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode, LimitRemaining: math.MaxUint32}, nil
	case KindUnpriced:
		// A quota of money that cannot price the hits cannot count them:
		// refused, nothing written, as ext_proc refuses an unpriced model.
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: overCode}, nil
	}
	if p.zero != nil {
		// Nothing is counted: a check passes also after hits, where
		// ratelimit's window counter would hold them (docs/rls.md).
		st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode, CurrentLimit: p.zero}
		if p.hits > 0 && !p.negative {
			st.Code = overCode
			p.met = &verdict{counted: true, used: float64(p.hits)}
		}
		return st, nil
	}
	if len(p.buckets) == 0 && len(p.quotas) == 0 && len(p.slots) == 0 {
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode}, nil
	}
	var vs []verdict
	var err error
	switch {
	case p.hits == 0:
		vs, err = s.check(ctx, p)
	default:
		vs, err = s.charge(ctx, p)
	}
	if err != nil {
		return nil, err
	}
	st, pick := p.status(vs)
	if pick >= 0 && vs[pick].counted {
		p.met = &vs[pick]
	}
	return st, nil
}

// check answers a descriptor of 0 hits: over while some rule is in debt
// (a level of exactly 0 passes, with remaining 0), or while some
// concurrency limit is full. Nothing is written.
func (s *Service) check(ctx context.Context, p *plan) ([]verdict, error) {
	var vs []verdict
	if len(p.buckets) > 0 || len(p.quotas) > 0 {
		bs, qs, err := s.inspector.Inspect(ctx, p.buckets, p.quotas)
		if err != nil {
			return nil, err
		}
		if len(bs) != len(p.buckets) || len(qs) != len(p.quotas) {
			return nil, fmt.Errorf("rls: the store answered %d and %d states for %d buckets and %d quotas: %w", len(bs), len(qs), len(p.buckets), len(p.quotas), buckets.ErrStore)
		}
		for i, b := range p.buckets {
			vs = append(vs, bucketVerdict(b, bs[i].Remaining, bs[i].Reset, 0, p.name))
		}
		vs = append(vs, p.quotaVerdicts(qs)...)
	}
	if len(p.slots) > 0 {
		held, err := s.inspector.InUse(ctx, p.slots)
		if err != nil {
			return nil, err
		}
		if len(held) != len(p.slots) {
			return nil, fmt.Errorf("rls: the store answered %d counts for %d slots: %w", len(held), len(p.slots), buckets.ErrStore)
		}
		for i, sl := range p.slots {
			vs = append(vs, verdict{
				over: held[i] >= sl.Max, remaining: float64(max(0, sl.Max-held[i])),
				limit: &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: uint32(sl.Max), Name: p.name},
			})
		}
	}
	return vs, nil
}

// charge charges (or, for negative hits, refunds) a descriptor's hits
// from every bucket and quota it meets in one store call, applied once by
// an ID of the service's own however often the store sends it, written
// also when some rule has fewer tokens than the hits (down to its floor).
// Concurrency limits are checked, not held: over RLS a call is not a
// request in flight.
func (s *Service) charge(ctx context.Context, p *plan) ([]verdict, error) {
	r, actual := p.reservation()
	var vs []verdict
	if len(p.buckets) > 0 || len(p.quotas) > 0 {
		states, err := s.charger.Charge(ctx, r, actual)
		if err != nil {
			return nil, err
		}
		if len(states) != len(p.buckets) {
			return nil, fmt.Errorf("rls: the store answered %d states for %d buckets: %w", len(states), len(p.buckets), buckets.ErrStore)
		}
		vs = p.chargedVerdicts(states)
		if len(p.quotas) > 0 {
			// The quotas' spend is read after the charge: under
			// concurrent hits it may hold others' too, so a quota's
			// verdict can only be the stricter one.
			_, qs, err := s.inspector.Inspect(context.WithoutCancel(ctx), nil, p.quotas)
			if err != nil {
				return nil, err
			}
			if len(qs) != len(p.quotas) {
				return nil, fmt.Errorf("rls: the store answered %d states for %d quotas: %w", len(qs), len(p.quotas), buckets.ErrStore)
			}
			for _, v := range p.quotaVerdicts(qs) {
				if p.negative {
					v.over = false
				}
				v.counted = !p.negative
				vs = append(vs, v)
			}
		}
	}
	if len(p.slots) > 0 && !p.negative {
		held, err := s.inspector.InUse(context.WithoutCancel(ctx), p.slots)
		if err != nil {
			return nil, err
		}
		for i, sl := range p.slots {
			if i < len(held) {
				vs = append(vs, verdict{
					over: held[i] >= sl.Max, remaining: float64(max(0, sl.Max-held[i])),
					limit: &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: uint32(sl.Max), Name: p.name},
				})
			}
		}
	}
	return vs, nil
}

// chargedVerdicts are the verdicts of p's buckets after a charge left
// them at states.
func (p *plan) chargedVerdicts(states []buckets.BucketState) []verdict {
	need := float64(p.hits)
	if p.negative {
		need = 0
	}
	vs := make([]verdict, 0, len(p.buckets))
	for i, b := range p.buckets {
		// The level the charge left before the floor is below zero
		// when the bucket held fewer tokens than the hits.
		before := states[i].Remaining - states[i].Forgiven
		v := bucketVerdict(b, states[i].Remaining, states[i].Reset, need, p.name)
		v.over = before < 0 && !p.negative
		v.counted, v.capacity, v.used = !p.negative, b.Limit.Capacity, b.Limit.Capacity-before
		vs = append(vs, v)
	}
	return vs
}

// reservation is the charge of p's hits, with an ID of its own: a
// settlement of a reservation never taken, of the hits (or, for a refund,
// of a reservation of the hits settled at 0).
func (p *plan) reservation() (*buckets.Reservation, float64) {
	n := float64(p.hits)
	r := &buckets.Reservation{ID: admission.NewID(), Buckets: p.buckets, Quotas: p.quotas}
	if p.negative {
		r.Cost, r.Money = n, n*p.perHit
		return r, 0
	}
	r.Spent = n * p.perHit
	return r, n
}

// bucketVerdict is a bucket's verdict at level (after the call), for a
// call of need hits: over when in debt; the reset is the time until it is
// full (OK) or holds need hits again (over).
func bucketVerdict(b buckets.Bucket, level float64, full time.Duration, need float64, name string) verdict {
	v := verdict{over: level < 0, remaining: max(0, level), reset: full, limit: bucketLimit(b.Limit, name)}
	if v.over || level < need {
		v.reset = refill(b.Limit, need-level)
	}
	return v
}

// quotaVerdicts are the quotas' verdicts after a charge (or, checking,
// as they stand): over when the window is overspent; the reset is the
// window's end. A quota of money counts in hits at the descriptor's price.
func (p *plan) quotaVerdicts(qs []buckets.QuotaState) []verdict {
	out := make([]verdict, 0, len(qs))
	for j, q := range qs {
		remaining, limit := q.Remaining, q.Limit
		if p.quotas[j].Unit == buckets.Money {
			remaining, limit = remaining/p.perHit, limit/p.perHit
		}
		out = append(out, verdict{
			over: q.Remaining < 0, remaining: max(0, remaining), reset: q.Reset,
			limit:    &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: clampUint32(limit), Unit: windowUnit(p.quotas[j].Window), Name: p.name},
			capacity: limit, used: limit - remaining,
		})
	}
	return out
}

// status is a descriptor's status from its rules' verdicts: the most
// restrictive rule's — among rules over the limit, the one that takes
// longest to hold the hits again; else the one with the least remaining.
// pick is that rule's verdict, -1 for none.
func (p *plan) status(vs []verdict) (st *rlsv3.RateLimitResponse_DescriptorStatus, pick int) {
	if len(vs) == 0 {
		return &rlsv3.RateLimitResponse_DescriptorStatus{Code: okCode}, -1
	}
	for i, v := range vs[1:] {
		w := vs[pick]
		switch {
		case v.over && !w.over, v.over && w.over && v.reset > w.reset, !v.over && !w.over && v.remaining < w.remaining:
			pick = i + 1
		}
	}
	v := vs[pick]
	st = &rlsv3.RateLimitResponse_DescriptorStatus{
		Code: okCode, CurrentLimit: v.limit, LimitRemaining: clampUint32(math.Floor(v.remaining)),
		DurationUntilReset: durationpb.New(v.reset.Round(time.Millisecond)),
	}
	if v.over {
		st.Code, st.LimitRemaining = overCode, 0
	}
	return st, pick
}

// overrideLimit is a descriptor's own limit as a bucket's, and its unit:
// requests_per_unit of capacity, refilling requests_per_unit per unit. A
// limit of 0 is the zero Limit, which no bucket can hold: the caller
// answers it as a deny.
func overrideLimit(o *commonv3.RateLimitDescriptor_RateLimitOverride) (buckets.Limit, rlconfig.Unit, error) {
	unit := rlconfig.Unit(o.GetUnit())
	secs := rlconfig.UnitSeconds(unit)
	if secs == 0 {
		return buckets.Limit{}, unit, errors.New("its limit has no unit")
	}
	n := float64(o.GetRequestsPerUnit())
	if n == 0 {
		return buckets.Limit{}, unit, nil
	}
	return buckets.Limit{Capacity: n, Rate: n / float64(secs)}, unit, nil
}

// units are the units a bucket's limit is reported in.
var units = []rlconfig.Unit{
	rlsv3.RateLimitResponse_RateLimit_SECOND, rlsv3.RateLimitResponse_RateLimit_MINUTE,
	rlsv3.RateLimitResponse_RateLimit_HOUR, rlsv3.RateLimitResponse_RateLimit_DAY,
	rlsv3.RateLimitResponse_RateLimit_WEEK, rlsv3.RateLimitResponse_RateLimit_MONTH,
	rlsv3.RateLimitResponse_RateLimit_YEAR,
}

// bucketLimit is a bucket's limit as ratelimit would report the rule it was
// imported from: a bucket of capacity N refilling N per unit is N per that
// unit; any other bucket is its refill per the unit nearest the time it
// takes to refill whole.
func bucketLimit(l buckets.Limit, name string) *rlsv3.RateLimitResponse_RateLimit {
	full := l.Capacity / l.Rate
	best, dist := units[0], math.Inf(1)
	for _, u := range units {
		if d := math.Abs(math.Log(float64(rlconfig.UnitSeconds(u)) / full)); d < dist {
			best, dist = u, d
		}
	}
	n := l.Rate * float64(rlconfig.UnitSeconds(best))
	if math.Abs(n-l.Capacity) <= 1e-6*l.Capacity {
		n = l.Capacity
	}
	return &rlsv3.RateLimitResponse_RateLimit{RequestsPerUnit: clampUint32(math.Round(n)), Unit: best, Name: name}
}

// windowUnit is a quota window's unit.
func windowUnit(w buckets.Window) rlconfig.Unit {
	switch w.Period {
	case buckets.Day:
		return rlsv3.RateLimitResponse_RateLimit_DAY
	case buckets.Week:
		return rlsv3.RateLimitResponse_RateLimit_WEEK
	case buckets.Month:
		return rlsv3.RateLimitResponse_RateLimit_MONTH
	}
	return rlsv3.RateLimitResponse_RateLimit_UNKNOWN
}

// perHit is what one hit costs at price, in micro-units: a token at the
// dearest of the model's rates, so that hits of any kind are never charged
// less than they cost.
func perHit(price pricing.Price) float64 {
	const n = 1_000_000
	return float64(max(price.MaxCost(n, 0), price.MaxCost(0, n))) / n
}

func clampUint32(v float64) uint32 {
	switch {
	case v <= 0 || math.IsNaN(v):
		return 0
	case v >= math.MaxUint32:
		return math.MaxUint32
	}
	return uint32(v)
}

// entryStrings are a descriptor's entries as key=value strings, in order.
func entryStrings(d *commonv3.RateLimitDescriptor) []string {
	out := make([]string, len(d.GetEntries()))
	for i, e := range d.GetEntries() {
		out[i] = e.GetKey() + "=" + e.GetValue()
	}
	return out
}

func bucketRule(p *admission.Policy, name string) *admission.BucketRule {
	for i := range p.Buckets {
		if p.Buckets[i].Name == name {
			return &p.Buckets[i]
		}
	}
	return nil
}

func quotaRule(p *admission.Policy, name string) *admission.QuotaRule {
	for i := range p.Quotas {
		if p.Quotas[i].Name == name {
			return &p.Quotas[i]
		}
	}
	return nil
}

func concurrencyRule(p *admission.Policy, name string) *admission.ConcurrencyRule {
	for i := range p.Concurrency {
		if p.Concurrency[i].Name == name {
			return &p.Concurrency[i]
		}
	}
	return nil
}

func headerValue(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, Value: v} }

// refill is the time bucket limit l takes to refill n tokens, at most a
// year (a duration Envoy can print). The cap is applied to the float: a
// refill of centuries does not fit a time.Duration.
func refill(l buckets.Limit, n float64) time.Duration {
	const most = 365 * 24 * time.Hour
	if l.Rate <= 0 {
		return most
	}
	ns := math.Ceil(n / l.Rate * float64(time.Second))
	if !(ns < float64(most)) {
		return most
	}
	return time.Duration(ns)
}
