package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/tokengate/tokengate/admin"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/rls"
)

const serveHelp = `
Runs the ext_proc gRPC server Envoy talks to, the gRPC health service, and
an admin HTTP listener with /metrics, /healthz and /readyz. Logs are JSON
lines on stderr.

Without --config it runs on the embedded defaults (config/default.yaml:
memory store, one policy limiting per hashed API key and globally) and says
so in its first log line. --grpc and --admin replace the listener addresses
of the configuration.

On SIGTERM or SIGINT health turns NOT_SERVING first, in-flight streams get
shutdown_grace, and whatever is still open is settled before it exits.

SIGHUP, or a change of the --config file, reloads it: a valid configuration
applies its policies (tiers and overrides included) and default_policy to
new requests, while streams in flight settle as they started; bucket levels
carry over. A file with problems, or one that changes anything else
(listeners, store, tokenizer, admin, metadata keys, shutdown_grace: those
need a restart), is refused and logged, and the configuration in force
keeps serving. tokengate_config_reload_total{result} counts both.

With ratelimit.xds set it subscribes to that xDS management server for
envoyproxy/ratelimit's RateLimitConfig, as ratelimit does, and swaps each
snapshot in beside ratelimit.files (a reload keeps the last one); a
snapshot that does not validate is NACKed and the configuration in force
keeps serving. It redials after 1s, doubling to 60s, when the stream ends.

With admin_api.token_env set, the admin listener also serves the admin API:
/v1/limits (per-identity overrides, see tokengate limits) and /v1/usage
(see tokengate usage), each needing that bearer token.`

// runServe runs the ext_proc server until ctx is cancelled, then shuts down
// gracefully: health NOT_SERVING first, in-flight streams get the configured
// grace, every open reservation is settled, then the listeners close.
func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("serve")
	path := fs.String("config", "", "tokengate configuration `FILE` (embedded defaults when empty)")
	level := fs.String("log-level", "info", "log `LEVEL`: debug, info, warn or error")
	grpcAddr := fs.String("grpc", "", "listen `ADDR`ess of ext_proc and gRPC health, replacing listeners.grpc")
	adminAddr := fs.String("admin", "", "listen `ADDR`ess of /metrics, /healthz and /readyz, replacing listeners.admin")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Sprintf("serve: takes no arguments, got %q (the configuration file goes after --config)", rest)}
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return usageError{fmt.Sprintf("serve: --log-level %q: want debug, info, warn or error", *level)}
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: lvl}))
	routeRedisLogs(logger, lvl)

	// SIGHUP reloads the configuration; without this it would end the
	// process. The file's stamp is taken before it is read, so that a
	// change made meanwhile is seen.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	src := &reloadSource{path: *path, grpc: *grpcAddr, admin: *adminAddr, hup: hup}
	if *path != "" {
		src.stamps = []fileStamp{stampOf(*path)}
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	if cfg, err = cfg.WithListeners(*grpcAddr, *adminAddr); err != nil {
		return usageError{fmt.Sprintf("serve: %v", err)}
	}
	if *path != "" {
		logger.Info("tokengate starting", "config", *path, "store", cfg.Store.Type, "policies", len(cfg.Policies))
	} else {
		logger.Info("tokengate starting on embedded defaults (no --config given): memory store, policy \"default\"",
			"store", cfg.Store.Type, "grpc", cfg.Listeners.GRPC, "admin", cfg.Listeners.Admin)
	}
	return serveWith(ctx, cfg, logger, nil, src)
}

// loadConfig is the configuration serve and count run on: the file at path,
// validated by package config exactly as `tokengate validate` does, or the
// embedded defaults when path is empty.
func loadConfig(path string) (*config.Config, error) {
	if path == "" {
		return config.Default(), nil
	}
	return config.Load(path)
}

// listeners lets tests pick the sockets; nil listens on the configured
// addresses (ratelimit's too when it is nil).
type listeners struct{ grpc, admin, ratelimit net.Listener }

// connectionAge is the gRPC server option of listeners.max_connection_age:
// none when it is 0. A grace of 0 is gRPC's own, infinite: streams on an
// aged connection run until they end.
func connectionAge(l config.Listeners) []grpc.ServerOption {
	if l.MaxConnectionAge == 0 {
		return nil
	}
	p := keepalive.ServerParameters{MaxConnectionAge: l.MaxConnectionAge, MaxConnectionAgeGrace: l.MaxConnectionAgeGrace}
	if p.MaxConnectionAgeGrace == 0 {
		p.MaxConnectionAgeGrace = infinity
	}
	return []grpc.ServerOption{grpc.KeepaliveParams(p)}
}

// healthEvery is how often the gRPC health of "ratelimit" is brought in
// line with readiness.
const healthEvery = 250 * time.Millisecond

// followReadiness keeps the gRPC health of service SERVING while ready
// says so, NOT_SERVING while it gives a reason, from now until ctx ends
// (or hs is shut down, which ends every service's health), checking every
// period.
func followReadiness(ctx context.Context, hs *health.Server, service string, ready func() error, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			setHealth(hs, service, ready)
		}
	}
}

// setHealth sets the gRPC health of service as ready says.
func setHealth(hs *health.Server, service string, ready func() error) {
	st := healthpb.HealthCheckResponse_SERVING
	if ready() != nil {
		st = healthpb.HealthCheckResponse_NOT_SERVING
	}
	hs.SetServingStatus(service, st)
}

// infinity is gRPC's "never" for keepalive durations.
const infinity = time.Duration(math.MaxInt64)

func serve(ctx context.Context, cfg *config.Config, logger *slog.Logger, ls *listeners) error {
	return serveWith(ctx, cfg, logger, ls, &reloadSource{})
}

// serveWith is serve, reloading the configuration from src on SIGHUP and
// when its file changes.
func serveWith(ctx context.Context, cfg *config.Config, logger *slog.Logger, ls *listeners, src *reloadSource) error {
	sec, err := newListenerTLS(cfg.Listeners, logger)
	if err != nil {
		return err
	}
	parts, err := build(ctx, cfg, logger, buildOptions{})
	if err != nil {
		return err
	}
	defer parts.close()
	// Overrides follow the store, and the configuration its file, until
	// shutdown; both stop before the store's connections close.
	bg, stopBG := context.WithCancel(context.Background())
	var background sync.WaitGroup
	defer background.Wait()
	defer stopBG()
	background.Go(func() { parts.admin.Run(bg, admin.DefaultPoll) })
	reload := newReloader(src, parts, logger)
	background.Go(func() { reload.run(bg) })
	if r := cfg.Ratelimit; r != nil && r.XDS != nil {
		creds, err := xdsCredentials(r.XDS)
		if err != nil {
			return err
		}
		background.Go(func() { runXDS(bg, r.XDS, r.MergeDomains, creds, parts, logger, waitTimer) })
	}

	if ls == nil {
		ls = &listeners{}
		if ls.grpc, err = listen(cfg.Listeners.GRPC); err != nil {
			return fmt.Errorf("listeners.grpc: %w", err)
		}
		if ls.admin, err = listen(cfg.Listeners.Admin); err != nil {
			ls.grpc.Close()
			return fmt.Errorf("listeners.admin: %w", err)
		}
	}

	if parts.ratelimit != nil && ls.ratelimit == nil {
		if ls.ratelimit, err = listen(cfg.Listeners.RatelimitMetrics); err != nil {
			ls.grpc.Close()
			ls.admin.Close()
			return fmt.Errorf("listeners.ratelimit_metrics: %w", err)
		}
	}
	if sec.admin != nil {
		ls.admin = tls.NewListener(ls.admin, sec.admin)
	}
	// The ext_proc server's own options: a gRPC receive limit above the body
	// limit, so that an oversized body gets tokengate's 413.
	opts := append(append(sec.grpc, parts.server.ServerOptions()...), connectionAge(cfg.Listeners)...)
	if parts.ratelimit != nil {
		opts = append(opts, grpc.ChainUnaryInterceptor(parts.ratelimit.UnaryInterceptor()))
	}
	gs := grpc.NewServer(opts...)
	parts.server.Register(gs)
	rlsv3.RegisterRateLimitServiceServer(gs, parts.rls)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("envoy.service.ext_proc.v3.ExternalProcessor", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus(rls.ServiceName, healthpb.HealthCheckResponse_SERVING)
	// envoyproxy/ratelimit's own name for its health (§3.7), which
	// follows readiness as ratelimit's follows its components.
	setHealth(hs, ratelimitHealthName, parts.readiness)
	background.Go(func() { followReadiness(bg, hs, ratelimitHealthName, parts.readiness, healthEvery) })

	as := &http.Server{Handler: parts.admin.Handler(), ReadHeaderTimeout: 5 * time.Second}

	errc := make(chan error, 3)
	go func() { errc <- gs.Serve(ls.grpc) }()
	go func() {
		if err := as.Serve(ls.admin); !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	// ratelimit's Prometheus listener (USE_PROMETHEUS): its names only.
	var ms *http.Server
	if parts.ratelimit != nil {
		mux := http.NewServeMux()
		mux.Handle(cfg.Listeners.RatelimitMetricsAt(), parts.ratelimit.Handler())
		ms = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := ms.Serve(ls.ratelimit); !errors.Is(err, http.ErrServerClosed) {
				errc <- err
			}
		}()
		logger.Info("serving ratelimit's metrics", "addr", ls.ratelimit.Addr().String(), "path", cfg.Listeners.RatelimitMetricsAt())
	}
	logger.Info("listening", "grpc", ls.grpc.Addr().String(), "grpc_transport", sec.mode,
		"admin", ls.admin.Addr().String(), "admin_tls", sec.admin != nil)
	// The gateway counts in the fleet (store.fleet) while it serves, and
	// until its last settlement is written.
	stopBackground := parts.background()

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}

	// Shutdown: tell Envoy first, so it sends new streams elsewhere.
	logger.Info("shutting down", "grace", cfg.ShutdownGrace.String())
	hs.Shutdown()
	parts.ready.Store(false)
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownGrace)
	defer cancel()
	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	// Shutdown settles the streams still open at the deadline and writes
	// every settlement the store still queues.
	if err := parts.server.Shutdown(sctx); err != nil {
		logger.Warn("shutdown: streams still open at the deadline were settled", "err", err)
	}
	select {
	case <-stopped:
	case <-sctx.Done():
		gs.Stop()
		<-stopped
	}
	// The rate-limit calls are answered; the charges of deferred domains
	// they queued are written next (or kept for replay).
	if err := parts.flushRLS(sctx); err != nil {
		logger.Warn("shutdown: rate-limit charges still queued at the deadline", "err", err)
	}
	stopBackground()
	parts.drain(sctx, cfg.Store.ReplayFile, logger)
	actx, acancel := context.WithTimeout(context.Background(), time.Second)
	defer acancel()
	_ = as.Shutdown(actx)
	if ms != nil {
		_ = ms.Shutdown(actx)
	}
	logger.Info("stopped")
	return serveErr
}
