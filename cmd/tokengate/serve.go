package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tokengate/tokengate/config"
)

// runServe runs the ext_proc server until ctx is cancelled, then shuts down
// gracefully: health NOT_SERVING first, in-flight streams get the configured
// grace, every open reservation is settled, then the listeners close.
func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("config", "", "tokengate configuration file (embedded defaults when empty)")
	level := fs.String("log-level", "info", "log level: debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("serve takes no arguments, got %q", fs.Args())}
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*level)); err != nil {
		return usageError{fmt.Sprintf("--log-level: %v", err)}
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: lvl}))

	cfg := config.Default()
	if *path != "" {
		c, err := config.Load(*path)
		if err != nil {
			return err
		}
		cfg = c
		logger.Info("tokengate starting", "config", *path, "store", cfg.Store.Type, "policies", len(cfg.Policies))
	} else {
		logger.Info("tokengate starting on embedded defaults (no --config given): memory store, policy \"default\"",
			"store", cfg.Store.Type, "grpc", cfg.Listeners.GRPC, "admin", cfg.Listeners.Admin)
	}
	return serve(ctx, cfg, logger, nil)
}

// listeners lets tests pick the sockets; nil listens on the configured
// addresses.
type listeners struct{ grpc, admin net.Listener }

func serve(ctx context.Context, cfg *config.Config, logger *slog.Logger, ls *listeners) error {
	parts, err := build(ctx, cfg, logger)
	if err != nil {
		return err
	}
	defer parts.close()

	if ls == nil {
		ls = &listeners{}
		if ls.grpc, err = net.Listen("tcp", cfg.Listeners.GRPC); err != nil {
			return fmt.Errorf("listeners.grpc: %w", err)
		}
		if ls.admin, err = net.Listen("tcp", cfg.Listeners.Admin); err != nil {
			ls.grpc.Close()
			return fmt.Errorf("listeners.admin: %w", err)
		}
	}

	// The ext_proc server's own options: a gRPC receive limit above the body
	// limit, so that an oversized body gets tokengate's 413.
	gs := grpc.NewServer(parts.server.ServerOptions()...)
	parts.server.Register(gs)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("envoy.service.ext_proc.v3.ExternalProcessor", healthpb.HealthCheckResponse_SERVING)

	admin := &http.Server{Handler: parts.adminHandler(), ReadHeaderTimeout: 5 * time.Second}

	errc := make(chan error, 2)
	go func() { errc <- gs.Serve(ls.grpc) }()
	go func() {
		if err := admin.Serve(ls.admin); !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	logger.Info("listening", "grpc", ls.grpc.Addr().String(), "admin", ls.admin.Addr().String())

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
	if err := parts.server.Shutdown(sctx); err != nil {
		logger.Warn("shutdown: streams still open at the deadline were settled", "err", err)
	}
	select {
	case <-stopped:
	case <-sctx.Done():
		gs.Stop()
		<-stopped
	}
	actx, acancel := context.WithTimeout(context.Background(), time.Second)
	defer acancel()
	_ = admin.Shutdown(actx)
	logger.Info("stopped")
	return serveErr
}
