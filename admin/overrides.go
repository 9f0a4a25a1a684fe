package admin

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/metrics"
)

// liveLimits keeps the gateway's per-identity overrides in step with the
// configuration file's overrides and the store's: it merges the two (the
// store's win) into one immutable table that the gateway swaps in whole,
// so a request looks its limits up in memory, never in the store. It is
// safe for concurrent use.
type liveLimits struct {
	store   OverrideStore
	gateway *extproc.Server
	// also receives every table the gateway is given (Options.OnOverrides).
	also   func(extproc.Overrides)
	logger *slog.Logger
	// metrics counts the overrides in force and failed reads of the
	// store.
	metrics *metrics.Metrics

	// syncMu orders syncs (the poll's and the admin API's), so that an
	// older read is never applied after a newer one.
	syncMu sync.Mutex
	mu     sync.Mutex
	cfg    *config.Config
	stored buckets.OverrideSet
	loaded bool
}

func newLiveLimits(store OverrideStore, gateway *extproc.Server, also func(extproc.Overrides), cfg *config.Config, logger *slog.Logger, m *metrics.Metrics) *liveLimits {
	l := &liveLimits{store: store, gateway: gateway, also: also, cfg: cfg, logger: logger, metrics: m}
	l.mu.Lock()
	l.applyLocked()
	l.mu.Unlock()
	return l
}

// setConfig applies a reloaded configuration's overrides, and checks the
// stored ones against its policies again.
func (l *liveLimits) setConfig(cfg *config.Config) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cfg = cfg
	l.applyLocked()
}

// sync reads the store's version and, when it changed, its overrides, and
// applies them.
func (l *liveLimits) sync(ctx context.Context) error {
	l.syncMu.Lock()
	defer l.syncMu.Unlock()
	v, err := l.store.Version(ctx)
	if err != nil {
		return err
	}
	l.mu.Lock()
	same := l.loaded && v == l.stored.Version
	l.mu.Unlock()
	if same {
		return nil
	}
	set, err := l.store.Load(ctx)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stored, l.loaded = set, true
	l.applyLocked()
	return nil
}

// run syncs every interval until ctx ends. A failed read keeps the
// overrides in force; it is logged once until reads succeed again.
func (l *liveLimits) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := l.sync(sctx)
		cancel()
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			l.metrics.OverrideReadFailed()
			if !failing {
				l.logger.Warn("limit overrides not read from the store; those last read stay in force", "err", err)
			}
			failing = true
		case failing:
			l.logger.Info("limit overrides read from the store again")
			failing = false
		}
	}
}

// applyLocked builds the table of overrides in force and gives it to the
// gateway. A stored override that the configuration no longer allows (its
// rule was removed or changed kind) is left out and logged. The overrides
// in force are counted by where each comes from: a file override that a
// stored one replaced is not in force.
func (l *liveLimits) applyLocked() {
	table := extproc.Overrides{}
	source := map[extproc.OverrideKey]string{}
	for _, p := range l.cfg.Policies {
		for _, o := range p.Overrides {
			t, err := l.cfg.OverrideTarget(p.Name, o.Rule)
			if err != nil {
				continue // a loaded configuration has none such
			}
			ov, err := OverrideOf(o.Limits)
			if err != nil {
				continue // a loaded configuration has none such
			}
			id := o.IdentityKey
			if id == "" {
				id = IdentityKey(t, o.Identity)
			}
			k := extproc.OverrideKey{Policy: p.Name, Rule: o.Rule, Identity: id}
			table[k], source[k] = ov, metrics.OverridesFromFile
		}
	}
	for k, raw := range l.stored.Values {
		lim, err := config.DecodeLimits(raw)
		if err == nil {
			err = l.cfg.CheckOverride(k.Policy, k.Rule, lim)
		}
		var ov extproc.Override
		if err == nil {
			ov, err = OverrideOf(lim)
		}
		if err != nil {
			l.logger.Warn("a stored limit override does not fit the configuration and is not applied; remove it with tokengate limits rm",
				"policy", k.Policy, "rule", k.Rule, "err", err)
			continue
		}
		key := extproc.OverrideKey(k)
		table[key], source[key] = ov, metrics.OverridesFromStore
	}
	l.gateway.SetOverrides(table)
	if l.also != nil {
		l.also(table)
	}
	inForce := map[string]int{}
	for _, from := range source {
		inForce[from]++
	}
	l.metrics.OverridesInForce(inForce[metrics.OverridesFromFile], inForce[metrics.OverridesFromStore])
}

// IdentityKey is the form an identity value given by an operator takes in
// store keys: exactly the form requests' values take (OverrideTarget.Key).
func IdentityKey(t config.OverrideTarget, value string) string { return t.Key(value) }

// OverrideOf maps validated limits onto the gateway's terms
// (admission.OverrideOf).
func OverrideOf(l config.Limits) (extproc.Override, error) { return admission.OverrideOf(l) }
