package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/logging"
)

// redisLogger hands go-redis's own diagnostics (pool and dial trouble,
// cluster topology changes) to slog, so every line tokengate writes is JSON.
// go-redis gives its messages no level; they are about trouble, so they go
// out as warnings.
type redisLogger struct{ l *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	r.l.Log(ctx, slog.LevelWarn, strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: "), "component", "go-redis")
}

// routeRedisLogs installs logger as go-redis's logger. go-redis has one
// logger per process, so this is set once, at start-up, like the
// tokenizer's offline loader; below debug its informational chatter is
// silenced.
func routeRedisLogs(logger *slog.Logger, level slog.Level) {
	redis.SetLogger(redisLogger{logger})
	if level <= slog.LevelDebug {
		logging.SetLogLevel(logging.LogLevelDebug)
	} else {
		logging.SetLogLevel(logging.LogLevelWarn)
	}
}
