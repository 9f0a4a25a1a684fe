package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/metrics"
)

// reloadPoll is how often serve looks at its configuration file's and its
// ratelimit files' sizes and modification times. Polling a stat needs no
// dependency and follows a file replaced by a rename or a Kubernetes
// ConfigMap's symlink swap, which watching the file's inode would miss.
const reloadPoll = 500 * time.Millisecond

// reloadSource is where serve's configuration came from, so it can be read
// again: the file, and the flags that replace its listeners.
type reloadSource struct {
	path        string // "" on the embedded defaults
	grpc, admin string
	// stamps are path's and the ratelimit files' as they were when serve
	// read them (reloader.watched); those of serve's ratelimit files are
	// taken when the reloader starts.
	stamps []fileStamp
	hup    <-chan os.Signal
	// load, when set, reads the configuration instead of path: `tokengate
	// ratelimit` maps its environment again (listing the files again).
	load func() (*config.Config, error)
	// files, with load, lists the ratelimit files the environment names
	// now: a file added to or removed from its directory is a change too.
	files func() []string
}

// fileStamp is what tells a changed file: its size and modification time.
type fileStamp struct {
	path string
	mod  int64 // Unix nanoseconds
	size int64
	ok   bool // the file could be read
}

func stampOf(path string) fileStamp {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{path: path}
	}
	return fileStamp{path: path, mod: fi.ModTime().UnixNano(), size: fi.Size(), ok: true}
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

// run reloads on SIGHUP and when the file or a ratelimit file changes (or,
// under `tokengate ratelimit`, one is added or removed), until ctx ends.
func (r *reloader) run(ctx context.Context) {
	t := time.NewTicker(reloadPoll)
	defer t.Stop()
	stamps := r.src.stamps
	if r.src.load == nil {
		for _, f := range r.ratelimitFiles() {
			stamps = append(stamps, stampOf(f))
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.src.hup:
			r.reload("sighup")
		case <-t.C:
			if r.src.path == "" && r.src.load == nil {
				continue
			}
			if s := r.watched(); !slices.Equal(s, stamps) {
				stamps = s
				// A file being replaced may be missing for a moment.
				if !slices.ContainsFunc(s, func(f fileStamp) bool { return !f.ok }) {
					r.reload("file")
				}
			}
		}
	}
}

// watched stamps the files a reload reads: the configuration file, and the
// ratelimit files (ratelimit.files of the configuration in force, or those
// `tokengate ratelimit`'s environment names now).
func (r *reloader) watched() []fileStamp {
	var s []fileStamp
	if r.src.path != "" {
		s = append(s, stampOf(r.src.path))
	}
	for _, f := range r.ratelimitFiles() {
		s = append(s, stampOf(f))
	}
	return s
}

// ratelimitFiles are the paths of the ratelimit files a reload reads.
func (r *reloader) ratelimitFiles() []string {
	if r.src.files != nil {
		return r.src.files()
	}
	rl := r.parts.admin.Config().Ratelimit
	if rl == nil {
		return nil
	}
	paths := make([]string, len(rl.Files))
	for i, f := range rl.Files {
		if !filepath.IsAbs(f) { // as config reads them: beside the file
			f = filepath.Join(filepath.Dir(r.src.path), f)
		}
		paths[i] = f
	}
	return paths
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
		r.parts.configLoaded(false)
		log.Error("configuration not reloaded: it is invalid; the configuration in force keeps serving", "err", err.Error())
		return
	}
	// The last xDS snapshot's domains stay beside the file's.
	r.parts.configMu.Lock()
	defer r.parts.configMu.Unlock()
	if cfg, err = r.parts.withXDS(cfg); err != nil {
		r.parts.metrics.Reloaded(metrics.ReloadInvalid)
		r.parts.configLoaded(false)
		log.Error("configuration not reloaded: it is invalid with the last xDS snapshot; the configuration in force keeps serving", "err", err.Error())
		return
	}
	if keys := r.parts.admin.Config().NeedsRestart(cfg); len(keys) > 0 {
		r.parts.metrics.Reloaded(metrics.ReloadRestartRequired)
		r.parts.configLoaded(false)
		log.Error("configuration not reloaded: it changes keys that only a restart applies (a reload applies policies, default_policy and rls); the configuration in force keeps serving",
			"keys", keys)
		return
	}
	if err := r.parts.apply(cfg); err != nil {
		r.parts.metrics.Reloaded(metrics.ReloadInvalid)
		r.parts.configLoaded(false)
		log.Error("configuration not reloaded; the configuration in force keeps serving", "err", err.Error())
		return
	}
	r.parts.metrics.Reloaded(metrics.ReloadApplied)
	r.parts.configLoaded(true)
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
