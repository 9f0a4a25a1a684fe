// Package metrics exports what tokengate does as Prometheus metrics (S24):
// decisions by reason, tokens reserved and settled, the estimate error, cut-
// offs, stream outcomes, spend and exhaustion of quotas, the bucket store's
// latency, errors and fallback answers, configuration reloads and limit
// overrides.
//
// Labels come from configuration names only (policy, model family, store
// operation), never from users or API keys, so their number stays bounded.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/lease"
	"github.com/tokengate/tokengate/extproc"
)

// Metrics holds tokengate's collectors. Create it with New; it is safe for
// concurrent use.
type Metrics struct {
	requests      *prometheus.CounterVec
	reserved      *prometheus.CounterVec
	settled       *prometheus.CounterVec
	estimateError *prometheus.HistogramVec
	cutoffs       *prometheus.CounterVec
	streams       *prometheus.CounterVec
	storeLatency  *prometheus.HistogramVec
	storeErrors   *prometheus.CounterVec
	fallback      *prometheus.CounterVec
	storeUp       prometheus.Gauge
	replayPending prometheus.Gauge
	allowance     *prometheus.CounterVec
	fallbackEnc   *prometheus.CounterVec
	waits         *prometheus.HistogramVec
	debt          *prometheus.CounterVec
	forgiven      *prometheus.CounterVec
	gateways      prometheus.Gauge
	fallbackRate  prometheus.Gauge
	clamped       *prometheus.CounterVec
	unread        *prometheus.CounterVec
	quotaTokens   *prometheus.CounterVec
	quotaMoney    *prometheus.CounterVec
	exhausted     *prometheus.CounterVec
	limits        limitMetrics
	rls           rlsMetrics
	genAI         genAI
}

// New registers tokengate's collectors on reg, the GenAI ones labelled
// as o says.
func New(reg prometheus.Registerer, o Options) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_requests_total",
			Help: "Requests by policy and decision (admitted, refused_tokens, refused_requests, refused_budget, never_admissible, bad_request, unauthorized, store_error, unmetered).",
		}, []string{"policy", "decision"}),
		reserved: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_tokens_reserved_total",
			Help: "Tokens reserved at admission (input plus output allowance, extensions included).",
		}, []string{"policy", "model_family"}),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_tokens_settled_total",
			Help: "Tokens charged at settlement (the real usage).",
		}, []string{"policy", "model_family"}),
		estimateError: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tokengate_estimate_error_ratio",
			Help:    "Settled divided by reserved tokens per admitted request: below 1 the reservation was too high, above 1 too low (debt).",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.1, 1.25, 1.5, 2, 4},
		}, []string{"policy"}),
		cutoffs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_cutoffs_total",
			Help: "Streams cut off at a hard budget (S14).",
		}, []string{"policy"}),
		streams: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_stream_outcomes_total",
			Help: "How admitted requests ended: complete, cut_off, aborted, upstream_error, no_response, not_forwarded, shutdown.",
		}, []string{"policy", "outcome"}),
		storeLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tokengate_store_seconds",
			Help:    "Bucket store call latency by operation.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1},
		}, []string{"op"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_store_errors_total",
			Help: "Bucket store calls that failed, by operation.",
		}, []string{"op"}),
		fallback: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_store_fallback_total",
			Help: "Operations answered without the shared store while it was unreachable (S21).",
		}, []string{"op"}),
		storeUp: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tokengate_store_up",
			Help: "1 while the bucket store answers, 0 during an outage.",
		}),
		replayPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tokengate_store_replay_pending",
			Help: "Writes the bucket store missed during an outage (settlements, cancellations, outage spend), waiting to be replayed.",
		}),
		allowance: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_output_allowance_source_total",
			Help: "Where admitted requests' output allowance came from: request (its own cap), history (learned estimate) or default (S7).",
		}, []string{"policy", "source"}),
		fallbackEnc: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_unknown_model_total",
			Help: "Requests for a model no rule knows, counted with the configured fallback encoding.",
		}, []string{"policy"}),
		waits: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "tokengate_wait_seconds",
			Help:    "How long admitted requests were held for their tokens (S12); only requests that waited.",
			Buckets: []float64{.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"policy"}),
		debt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_debt_settlements_total",
			Help: "Settlements that left a bucket below zero (an under-estimate, S9), by bucket.",
		}, []string{"policy", "bucket"}),
		forgiven: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_debt_forgiven_tokens_total",
			Help: "Tokens used but not charged because settlement reached a bucket's floor (max_debt, or zero for a hard bucket; S9, S14), by bucket.",
		}, []string{"bucket"}),
		clamped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_usage_clamped_total",
			Help: "Settlements whose provider-reported usage was beyond what the request makes plausible; the bound was charged instead.",
		}, []string{"policy"}),
		unread: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_streams_unread_total",
			Help: "Streams forwarded unread after one server-sent event passed the size bound; settled at the reservation.",
		}, []string{"policy"}),
		quotaTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_quota_spent_tokens_total",
			Help: "Tokens charged to quotas of tokens at settlement, by policy and quota.",
		}, []string{"policy", "quota"}),
		quotaMoney: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_quota_spent_micros_total",
			Help: "Money charged to quotas of money at settlement, in micro-units of the pricing currency (1,000,000 to the unit), by policy and quota.",
		}, []string{"policy", "quota"}),
		exhausted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokengate_quota_exhausted_total",
			Help: "Requests refused by a quota: its window had too little left (429, refused_budget) or the request could cost more than the whole budget (413, never_admissible), by policy and quota.",
		}, []string{"policy", "quota"}),
	}
	m.gateways = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "tokengate_fleet_gateways",
		Help: "Gateways sharing the bucket store, this one included, at the last heartbeat that reached it.",
	})
	m.fallbackRate = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "tokengate_fallback_tokens_per_minute",
		Help: "This gateway's fallback limit per bucket while failing open: its share of the fleet's (S21).",
	})
	reg.MustRegister(m.requests, m.reserved, m.settled, m.estimateError, m.cutoffs, m.streams,
		m.storeLatency, m.storeErrors, m.fallback, m.storeUp, m.replayPending, m.allowance, m.fallbackEnc, m.waits, m.debt, m.forgiven,
		m.gateways, m.fallbackRate, m.clamped, m.unread, m.quotaTokens, m.quotaMoney, m.exhausted)
	m.limits = newLimitMetrics()
	reg.MustRegister(m.limits.collectors()...)
	m.rls = newRLSMetrics()
	reg.MustRegister(m.rls.collectors()...)
	// A store without a failover (the memory store) has no outage.
	m.storeUp.Set(1)
	m.genAI = newGenAI(o)
	reg.MustRegister(m.genAI.collectors()...)
	return m
}

// Finish records one request's outcome; pass it as extproc.Config.OnFinish.
func (m *Metrics) Finish(o extproc.Outcome) {
	if o.Decision == "" {
		return
	}
	m.requests.WithLabelValues(o.Policy, o.Decision).Inc()
	m.genAI.finish(o)
	if o.FallbackEncoding {
		m.fallbackEnc.WithLabelValues(o.Policy).Inc()
	}
	if o.Budget != "" {
		m.exhausted.WithLabelValues(o.Policy, o.Budget).Inc()
	}
	for _, q := range o.Quotas {
		if q.Money {
			m.quotaMoney.WithLabelValues(o.Policy, q.Name).Add(q.Amount)
		} else {
			m.quotaTokens.WithLabelValues(o.Policy, q.Name).Add(q.Amount)
		}
	}
	if o.Reserved == 0 && o.Settled == 0 {
		return
	}
	if o.AllowanceSource != "" {
		m.allowance.WithLabelValues(o.Policy, o.AllowanceSource).Inc()
	}
	if o.Waited > 0 {
		m.waits.WithLabelValues(o.Policy).Observe(o.Waited.Seconds())
	}
	for _, b := range o.InDebt {
		m.debt.WithLabelValues(o.Policy, b).Inc()
	}
	fam := Family(o.Model)
	m.reserved.WithLabelValues(o.Policy, fam).Add(float64(o.Reserved))
	m.settled.WithLabelValues(o.Policy, fam).Add(float64(o.Settled))
	if o.Reserved > 0 {
		m.estimateError.WithLabelValues(o.Policy).Observe(float64(o.Settled) / float64(o.Reserved))
	}
	if o.CutOff {
		m.cutoffs.WithLabelValues(o.Policy).Inc()
	}
	if o.UsageClamped {
		m.clamped.WithLabelValues(o.Policy).Inc()
	}
	if o.StreamUnread {
		m.unread.WithLabelValues(o.Policy).Inc()
	}
	if o.SettleOutcome != "" {
		m.streams.WithLabelValues(o.Policy, o.SettleOutcome).Inc()
	}
}

// Fallback counts an operation answered during a store outage; pass it as
// failover.Options.OnFallback.
func (m *Metrics) Fallback(op string) { m.fallback.WithLabelValues(op).Inc() }

// Share records the gateways alive and this gateway's fallback limit; pass
// it as failover.Options.OnShare.
func (m *Metrics) Share(gateways int, fallback buckets.Limit) {
	m.gateways.Set(float64(gateways))
	m.fallbackRate.Set(fallback.Rate * 60)
}

// StoreState sets the store health gauge and the writes waiting for
// replay; pass it as failover.Options.OnState.
func (m *Metrics) StoreState(up bool, pending int) {
	if up {
		m.storeUp.Set(1)
	} else {
		m.storeUp.Set(0)
	}
	m.replayPending.Set(float64(pending))
}

// Family maps a model name to a bounded label: the model family, never the
// raw string a client sent.
func Family(model string) string {
	m := strings.ToLower(model)
	if i := strings.LastIndexByte(m, '/'); i >= 0 {
		m = m[i+1:]
	}
	for _, f := range families {
		if strings.HasPrefix(m, f) {
			return f
		}
	}
	if m == "" {
		return "none"
	}
	return "other"
}

// families are matched in order, longest prefix first where they overlap.
var families = []string{
	"gpt-5", "gpt-4.1", "gpt-4o", "gpt-4", "gpt-3.5", "o1", "o3", "o4",
	"text-embedding", "claude", "gemini",
}

// Store wraps a buckets.Store to time its calls, count its errors and the
// debt its settlements forgave. Errors that only say the caller's context
// ended are not counted as store errors.
type Store struct {
	buckets.Store
	m *Metrics
}

// Instrument returns s wrapped with latency and error metrics.
func (m *Metrics) Instrument(s buckets.Store) *Store { return &Store{Store: s, m: m} }

func (s *Store) observe(op string, start time.Time, err error) {
	s.m.storeLatency.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err != nil && !callerGone(err) {
		s.m.storeErrors.WithLabelValues(op).Inc()
	}
}

// callerGone reports whether err only says that the caller's context ended
// (see buckets.Store), which says nothing about the store.
func callerGone(err error) bool {
	return !errors.Is(err, buckets.ErrStore) && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded))
}

// Reserve implements buckets.Store.
func (s *Store) Reserve(ctx context.Context, r buckets.Request) (buckets.Decision, error) {
	start := time.Now()
	d, err := s.Store.Reserve(ctx, r)
	s.observe("reserve", start, err)
	return d, err
}

// Extend implements buckets.Store.
func (s *Store) Extend(ctx context.Context, r *buckets.Reservation, n float64) (bool, error) {
	start := time.Now()
	ok, err := s.Store.Extend(ctx, r, n)
	s.observe("extend", start, err)
	return ok, err
}

// Settle implements buckets.Store.
func (s *Store) Settle(ctx context.Context, r *buckets.Reservation, n float64) ([]buckets.BucketState, error) {
	start := time.Now()
	st, err := s.Store.Settle(ctx, r, n)
	s.settled(start, st, err)
	return st, err
}

func (s *Store) settled(start time.Time, st []buckets.BucketState, err error) {
	s.observe("settle", start, err)
	for _, b := range st {
		if b.Forgiven > 0 {
			s.m.forgiven.WithLabelValues(b.Name).Add(b.Forgiven)
		}
	}
}

var _ buckets.AsyncSettler = (*Store)(nil)

// SettleAsync implements buckets.AsyncSettler, settling at once when the
// wrapped store cannot queue; the latency observed runs until done.
func (s *Store) SettleAsync(r *buckets.Reservation, n float64, done func([]buckets.BucketState, error)) {
	start := time.Now()
	as, ok := s.Store.(buckets.AsyncSettler)
	if !ok {
		st, err := s.Store.Settle(context.Background(), r, n)
		s.settled(start, st, err)
		if done != nil {
			done(st, err)
		}
		return
	}
	as.SettleAsync(r, n, func(st []buckets.BucketState, err error) {
		s.settled(start, st, err)
		if done != nil {
			done(st, err)
		}
	})
}

// Flush implements buckets.AsyncSettler.
func (s *Store) Flush(ctx context.Context) error {
	if as, ok := s.Store.(buckets.AsyncSettler); ok {
		return as.Flush(ctx)
	}
	return nil
}

// Pause implements buckets.Store.
func (s *Store) Pause(ctx context.Context, b buckets.Bucket, until time.Time) error {
	start := time.Now()
	err := s.Store.Pause(ctx, b, until)
	s.observe("pause", start, err)
	return err
}

// Renew implements buckets.Renewer when the wrapped store does.
func (s *Store) Renew(ctx context.Context, r *buckets.Reservation) error {
	rn, ok := s.Store.(buckets.Renewer)
	if !ok {
		return nil
	}
	start := time.Now()
	err := rn.Renew(ctx, r)
	s.observe("renew", start, err)
	return err
}

var _ buckets.Inspector = (*Store)(nil)

// Inspect implements buckets.Inspector; a wrapped store that cannot inspect
// answers an error wrapping errors.ErrUnsupported.
func (s *Store) Inspect(ctx context.Context, bs []buckets.Bucket, qs []buckets.Quota) ([]buckets.BucketState, []buckets.QuotaState, error) {
	in, ok := s.Store.(buckets.Inspector)
	if !ok {
		return nil, nil, fmt.Errorf("metrics: inspect: %T: %w", s.Store, errors.ErrUnsupported)
	}
	start := time.Now()
	st, q, err := in.Inspect(ctx, bs, qs)
	s.observe("inspect", start, err)
	return st, q, err
}

// InUse implements buckets.Inspector; a wrapped store that cannot inspect
// answers an error wrapping errors.ErrUnsupported.
func (s *Store) InUse(ctx context.Context, ss []buckets.Slot) ([]int, error) {
	in, ok := s.Store.(buckets.Inspector)
	if !ok {
		return nil, fmt.Errorf("metrics: in use: %T: %w", s.Store, errors.ErrUnsupported)
	}
	start := time.Now()
	n, err := in.InUse(ctx, ss)
	s.observe("inspect", start, err)
	return n, err
}

var _ buckets.SpendLister = (*Store)(nil)

// ListSpend implements buckets.SpendLister (op "list_spend"); a wrapped
// store that cannot list answers an error wrapping errors.ErrUnsupported.
func (s *Store) ListSpend(ctx context.Context, q buckets.SpendQuery) (buckets.SpendList, error) {
	l, ok := s.Store.(buckets.SpendLister)
	if !ok {
		return buckets.SpendList{}, fmt.Errorf("metrics: list spend: %T: %w", s.Store, errors.ErrUnsupported)
	}
	start := time.Now()
	list, err := l.ListSpend(ctx, q)
	s.observe("list_spend", start, err)
	return list, err
}

var _ buckets.SpendAdder = (*Store)(nil)

// AddSpend implements buckets.SpendAdder (op "add_spend"); a wrapped store
// that cannot add spend answers an error wrapping errors.ErrUnsupported.
func (s *Store) AddSpend(ctx context.Context, id string, ss []buckets.Spend) error {
	a, ok := s.Store.(buckets.SpendAdder)
	if !ok {
		return fmt.Errorf("metrics: add spend: %T: %w", s.Store, errors.ErrUnsupported)
	}
	start := time.Now()
	err := a.AddSpend(ctx, id, ss)
	s.observe("add_spend", start, err)
	return err
}

var _ buckets.Replayer = (*Store)(nil)

// Replay implements buckets.Replayer (op "replay"): the settlements the
// failover store replays after an outage. A wrapped store that cannot
// replay settles once through its records.
func (s *Store) Replay(ctx context.Context, r *buckets.Reservation, actual float64, sent bool) ([]buckets.BucketState, error) {
	start := time.Now()
	var st []buckets.BucketState
	var err error
	if rp, ok := s.Store.(buckets.Replayer); ok {
		st, err = rp.Replay(ctx, r, actual, sent)
	} else {
		st, err = s.Store.Settle(ctx, r, actual)
	}
	s.observe("replay", start, err)
	return st, err
}

// Cancel implements buckets.Replayer (op "cancel"): reservations whose
// reply was lost, cancelled once the store answers again. A wrapped store
// that cannot cancel settles them at zero.
func (s *Store) Cancel(ctx context.Context, r *buckets.Reservation) error {
	start := time.Now()
	var err error
	if rp, ok := s.Store.(buckets.Replayer); ok {
		err = rp.Cancel(ctx, r)
	} else {
		rc := *r
		rc.Spent = 0
		_, err = s.Store.Settle(ctx, &rc, 0)
	}
	s.observe("cancel", start, err)
	return err
}

// Lender is a lease lender wrapped with the store's latency and error
// metrics under op "lease" (S20): how often leased buckets reach Redis.
type Lender struct {
	l lease.Lender
	s *Store
}

// InstrumentLender returns l wrapped with latency and error metrics.
func (m *Metrics) InstrumentLender(l lease.Lender) *Lender {
	return &Lender{l: l, s: &Store{m: m}}
}

// Lease implements lease.Lender.
func (l *Lender) Lease(ctx context.Context, ops []buckets.LeaseOp) error {
	start := time.Now()
	err := l.l.Lease(ctx, ops)
	l.s.observe("lease", start, err)
	return err
}

// refuses says, of every decision extproc reports (extproc.Outcome.Decision),
// whether it refused the request: admitted and unmetered let the request on
// to the upstream; the others answered it in the upstream's place
// (docs/budgets.md, Every exit of a request). It is the one list of which
// decisions are refusals: the budget page lists only these, and the GenAI
// metrics observe only the others.
var refuses = map[string]bool{
	"admitted":         false,
	"unmetered":        false,
	"refused_tokens":   true,
	"refused_requests": true,
	"refused_budget":   true,
	"never_admissible": true,
	"bad_request":      true,
	"unauthorized":     true,
	"store_error":      true,
}

// Refusals is what this gateway refused since it started, read back from
// its own counters: the store keeps spend, not refusals, and each gateway
// of a fleet counts its own. A budget page shows them beside the spend.
type Refusals struct {
	// Decisions maps policy to decision to requests, for every decision
	// that refused the request (tokengate_requests_total): not admitted,
	// not unmetered.
	Decisions map[string]map[string]int
	// Quotas maps policy to quota to the requests it refused
	// (tokengate_quota_exhausted_total).
	Quotas map[string]map[string]int
}

// Refusals reads the refusals counted so far.
func (m *Metrics) Refusals() Refusals {
	return Refusals{
		Decisions: counts(m.requests, "decision", func(d string) bool { return refuses[d] }),
		Quotas:    counts(m.exhausted, "quota", func(q string) bool { return q != "" }),
	}
}

// counts reads a counter labelled policy and label, by policy and label,
// keeping the label values that keep accepts.
func counts(v *prometheus.CounterVec, label string, keep func(string) bool) map[string]map[string]int {
	ch := make(chan prometheus.Metric, 64)
	go func() {
		v.Collect(ch)
		close(ch)
	}()
	out := map[string]map[string]int{}
	for metric := range ch {
		var d dto.Metric
		if metric.Write(&d) != nil {
			continue
		}
		var policy, value string
		for _, l := range d.GetLabel() {
			switch l.GetName() {
			case "policy":
				policy = l.GetValue()
			case label:
				value = l.GetValue()
			}
		}
		if !keep(value) {
			continue
		}
		if out[policy] == nil {
			out[policy] = map[string]int{}
		}
		out[policy][value] = int(d.GetCounter().GetValue())
	}
	return out
}

var _ buckets.Charger = (*Store)(nil)

// Charge implements buckets.Charger (op "charge"): the hits of the
// rate-limit service. A wrapped store that cannot charge answers an error
// wrapping errors.ErrUnsupported.
func (s *Store) Charge(ctx context.Context, r *buckets.Reservation, actual float64) ([]buckets.BucketState, error) {
	ch, ok := s.Store.(buckets.Charger)
	if !ok {
		return nil, fmt.Errorf("metrics: charge: %T: %w", s.Store, errors.ErrUnsupported)
	}
	start := time.Now()
	st, err := ch.Charge(ctx, r, actual)
	s.observe("charge", start, err)
	return st, err
}

var _ buckets.AsyncCharger = (*Store)(nil)

// ChargeAsync implements buckets.AsyncCharger, charging at once when the
// wrapped store cannot queue; the latency observed runs until done.
func (s *Store) ChargeAsync(r *buckets.Reservation, actual float64, done func([]buckets.BucketState, error)) {
	start := time.Now()
	buckets.ChargeLater(s.Store, r, actual, func(st []buckets.BucketState, err error) {
		s.observe("charge", start, err)
		if done != nil {
			done(st, err)
		}
	})
}
