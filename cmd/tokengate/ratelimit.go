package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/tokengate/tokengate/config"
)

// ratelimitHealthName is the gRPC health service name envoyproxy/ratelimit
// registers (docs/envoy-ratelimit.md §3.7).
const ratelimitHealthName = "ratelimit"

const ratelimitHelp = `
Serves as envoyproxy/ratelimit's binary does, configured by its environment
variables instead of a file: the rate-limit service on GRPC_HOST:GRPC_PORT
(0.0.0.0:8081), /healthcheck, /healthz, /readyz and /metrics on HOST:PORT
(0.0.0.0:8080), the limits of ratelimit's files (CONFIG_TYPE=FILE, every
.yaml and .yml under RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY)
or of an xDS management server (CONFIG_TYPE=GRPC_XDS_SOTW), counted in Redis
(REDIS_SOCKET_TYPE=tcp, REDIS_URL) or, without REDIS_URL, in memory. It then
serves exactly as tokengate serve with that configuration; --print-config
prints it instead. The image's /bin/ratelimit runs this command, so Envoy
Gateway's rate-limit Deployment runs tokengate unchanged. docs/rls.md lists
every variable.

A variable tokengate does without is logged as a warning naming it (never
its value); one that cannot be served as asked is an error. The admin API
is off: the admin listener answers health and metrics only. A file of
RUNTIME_ROOT changed, added or removed (a ConfigMap's update included) is
read again within a second, as ratelimit's watch reads it; so is every
file on SIGHUP, which maps the environment again.`

// runRatelimit maps ratelimit's environment (getenv) onto a configuration
// and serves it as serve does.
func runRatelimit(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := newFlagSet("ratelimit")
	printConfig := fs.Bool("print-config", false, "print the tokengate configuration the environment maps onto, and exit")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Sprintf("ratelimit: takes no arguments, got %q (it is configured by envoyproxy/ratelimit's environment variables)", rest)}
	}
	env, err := config.FromRatelimitEnv(getenv)
	if err != nil {
		return fmt.Errorf("ratelimit: the environment cannot be served as envoyproxy/ratelimit's:\n%w", err)
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(env.LogLevel)); err != nil {
		return err
	}
	logger := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: lvl}))
	for _, w := range env.Warnings {
		logger.Warn(w, "source", config.RatelimitEnvFile)
	}
	if *printConfig {
		_, err := stdout.Write(env.YAML)
		return err
	}
	routeRedisLogs(logger, lvl)
	var stamps []fileStamp // the files as they are before they are read
	for _, f := range env.Files {
		stamps = append(stamps, stampOf(f))
	}
	cfg, err := config.Parse(config.RatelimitEnvFile, env.YAML)
	if err != nil {
		return err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	src := &reloadSource{hup: hup, load: func() (*config.Config, error) {
		env, err := config.FromRatelimitEnv(getenv)
		if err != nil {
			return nil, err
		}
		return config.Parse(config.RatelimitEnvFile, env.YAML)
	}, files: func() []string {
		// An environment that no longer maps lists nothing: the change is
		// seen, and its reload says what is wrong.
		env, err := config.FromRatelimitEnv(getenv)
		if err != nil {
			return nil
		}
		return env.Files
	}}
	src.stamps = stamps
	logger.Info("tokengate starting as envoyproxy/ratelimit", "store", cfg.Store.Type, "policies", len(cfg.Policies),
		"xds", cfg.Ratelimit.XDS != nil, "grpc", cfg.Listeners.GRPC, "admin", cfg.Listeners.Admin)
	return serveWith(ctx, cfg, logger, nil, src)
}
