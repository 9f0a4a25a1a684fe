package main

import (
	"context"
	"log/slog"
	"os"
	"time"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/metrics"
)

// reloadPoll is how often serve looks at its configuration file's size and
// modification time. Polling a stat needs no dependency and follows a file
// replaced by a rename or a Kubernetes ConfigMap's symlink swap, which
// watching the file's inode would miss.
const reloadPoll = 500 * time.Millisecond

// reloadSource is where serve's configuration came from, so it can be read
// again: the file, and the flags that replace its listeners.
type reloadSource struct {
	path        string // "" on the embedded defaults
	grpc, admin string
	stamp       fileStamp // the file as it was when serve read it
	hup         <-chan os.Signal
	// load, when set, reads the configuration instead of path: `tokengate
	// ratelimit` maps its environment again (listing the files again).
	load func() (*config.Config, error)
}

// fileStamp is what tells a changed file: its size and modification time.
type fileStamp struct {
	mod  time.Time
	size int64
	ok   bool // the file could be read
}

func stampOf(path string) fileStamp {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}
	}
	return fileStamp{mod: fi.ModTime(), size: fi.Size(), ok: true}
}

// reloader applies a changed configuration file, on SIGHUP or when the
// file changes: a valid one whose changes need no restart replaces the
// policies (with their tiers and overrides) for new requests; anything else
// is refused, logged and counted, and the configuration in force stays.
// Bucket levels carry over: they live in the store under keys that do not
// depend on limits.
type reloader struct {
	src    *reloadSource
	parts  *parts
	logger *slog.Logger
}

// newReloader makes a reloader of p's configuration; it counts reloads in
// tokengate_config_reload_total{result} (package metrics).
func newReloader(src *reloadSource, p *parts, logger *slog.Logger) *reloader {
	return &reloader{src: src, parts: p, logger: logger}
}

// run reloads on SIGHUP and when the file changes, until ctx ends.
func (r *reloader) run(ctx context.Context) {
	t := time.NewTicker(reloadPoll)
	defer t.Stop()
	stamp := r.src.stamp
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.src.hup:
			r.reload("sighup")
		case <-t.C:
			if r.src.path == "" {
				continue
			}
			if s := stampOf(r.src.path); s != stamp {
				stamp = s
				if s.ok { // a file being replaced may be missing for a moment
					r.reload("file")
				}
			}
		}
	}
}

// reload reads the file again and applies it if it is valid and needs no
// restart.
func (r *reloader) reload(trigger string) {
	if r.src.path == "" && r.src.load == nil {
		r.logger.Warn("nothing to reload: serve runs on the embedded defaults (no --config)", "trigger", trigger)
		return
	}
	var cfg *config.Config
	var err error
	log := r.logger.With("trigger", trigger, "config", r.src.path)
	if r.src.load != nil {
		log = r.logger.With("trigger", trigger, "config", config.RatelimitEnvFile)
		cfg, err = r.src.load()
	} else if cfg, err = config.Load(r.src.path); err == nil {
		cfg, err = cfg.WithListeners(r.src.grpc, r.src.admin)
	}
	if err != nil {
		r.parts.metrics.Reloaded(metrics.ReloadInvalid)
		log.Error("configuration not reloaded: it is invalid; the configuration in force keeps serving", "err", err.Error())
		return
	}
	// The last xDS snapshot's domains stay beside the file's.
	r.parts.configMu.Lock()
	defer r.parts.configMu.Unlock()
	if cfg, err = r.parts.withXDS(cfg); err != nil {
		r.parts.metrics.Reloaded(metrics.ReloadInvalid)
		log.Error("configuration not reloaded: it is invalid with the last xDS snapshot; the configuration in force keeps serving", "err", err.Error())
		return
	}
	if keys := r.parts.admin.Config().NeedsRestart(cfg); len(keys) > 0 {
		r.parts.metrics.Reloaded(metrics.ReloadRestartRequired)
		log.Error("configuration not reloaded: it changes keys that only a restart applies (a reload applies policies, default_policy and rls); the configuration in force keeps serving",
			"keys", keys)
		return
	}
	if err := r.parts.apply(cfg); err != nil {
		r.parts.metrics.Reloaded(metrics.ReloadInvalid)
		log.Error("configuration not reloaded; the configuration in force keeps serving", "err", err.Error())
		return
	}
	r.parts.metrics.Reloaded(metrics.ReloadApplied)
	log.Info("configuration reloaded: new requests follow it", "policies", len(cfg.Policies), "default_policy", cfg.DefaultPolicy)
}

// apply makes cfg the configuration in force: its policies for new
// requests and rate-limit calls, its rls mapping, its overrides, and the stored overrides checked against it.
// cfg is validated and needs no restart (config.NeedsRestart).
func (p *parts) apply(cfg *config.Config) error {
	pols, err := policies(cfg)
	if err != nil {
		return err
	}
	// The rate-limit mapping first: it is the one that can refuse.
	if err := loadRLS(p.rls, cfg); err != nil {
		return err
	}
	p.server.Reload(pols, cfg.DefaultPolicy)
	p.admin.SetConfig(cfg)
	return nil
}
