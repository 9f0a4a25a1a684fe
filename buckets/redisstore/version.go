package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// ErrServerTooOld is the error of CheckServer for a Redis older than the
// store's scripts need.
var ErrServerTooOld = errors.New("redisstore: Redis too old")

// minMajor and minMinor are the oldest Redis the scripts run on, 7.0: they
// use SET with NX and GET together and PEXPIRE's GT, which older servers
// refuse as a syntax error at the first call that needs them.
const minMajor, minMinor = 7, 0

// CheckServer asks Redis for its version (INFO server) and returns an error
// wrapping ErrServerTooOld, naming the version, when it is older than the
// scripts need; nil when it is recent enough or does not say (a proxy's
// INFO may leave it out). It writes nothing.
func (s *Store) CheckServer(ctx context.Context) error {
	cmd := redis.NewStringCmd(ctx, "info", "server")
	if err := s.c.Process(ctx, cmd); err != nil {
		return fmt.Errorf("redisstore: INFO server: %w", err)
	}
	if v, ok := infoField(cmd.Val(), "redis_version"); ok {
		return checkVersion(v)
	}
	return nil
}

// checkVersion is CheckServer's answer for a server of version v.
func checkVersion(v string) error {
	if !versionAtLeast(v, minMajor, minMinor) {
		return fmt.Errorf("%w: the server is Redis %.20q; tokengate needs Redis %d.%d or later", ErrServerTooOld, v, minMajor, minMinor)
	}
	return nil
}

// infoField is field's value in an INFO reply.
func infoField(info, field string) (string, bool) {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v), true
		}
	}
	return "", false
}

// versionAtLeast reports whether version v (major.minor.patch) is at least
// major.minor. A version it cannot read counts as recent enough: the
// scripts themselves then tell.
func versionAtLeast(v string, major, minor int) bool {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return true
	}
	ma, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return true
	}
	return ma > major || ma == major && mi >= minor
}
