package redisstore

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/internal/redistest"
)

// TestVersionAtLeast: the scripts' oldest Redis is 7.0; what cannot be
// read is left to the scripts.
func TestVersionAtLeast(t *testing.T) {
	for v, want := range map[string]bool{
		"7.0.0": true, "7.0.15": true, "7.2.4": true, "8.0.2": true, "10.1.0": true,
		"6.2.14": false, "6.0.16": false, "5.0.7": false, "6.9.9": false,
		"": true, "7": true, "x.y.z": true,
	} {
		if got := versionAtLeast(v, 7, 0); got != want {
			t.Errorf("versionAtLeast(%q, 7, 0) = %v, want %v", v, got, want)
		}
	}
	info := "# Server\r\nredis_version:6.2.14\r\nredis_git_sha1:00000000\r\n"
	if v, ok := infoField(info, "redis_version"); !ok || v != "6.2.14" {
		t.Errorf("infoField = %q, %v; want 6.2.14", v, ok)
	}
	if _, ok := infoField("# Server\r\nos:Linux\r\n", "redis_version"); ok {
		t.Error("infoField found a field the reply does not have")
	}
	err := checkVersion("6.2.14")
	if !errors.Is(err, ErrServerTooOld) || !strings.Contains(err.Error(), `"6.2.14"`) || !strings.Contains(err.Error(), "7.0 or later") {
		t.Errorf("checkVersion(6.2.14) = %v; want ErrServerTooOld naming the version and the one needed", err)
	}
	if err := checkVersion("7.0.15"); err != nil {
		t.Errorf("checkVersion(7.0.15) = %v, want nil", err)
	}
}

// TestCheckServer: the Redis the tests run is recent enough, on standalone
// Redis and the cluster.
func TestCheckServer(t *testing.T) {
	srv := redistest.Start(t)
	cl := redistest.StartCluster(t)
	for name, c := range map[string]Scripter{
		"standalone": redis.NewClient(&redis.Options{Addr: srv.Addr}),
		"cluster":    redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs}),
	} {
		t.Cleanup(func() { c.(interface{ Close() error }).Close() })
		if err := New(c, Options{}).CheckServer(context.Background()); err != nil {
			t.Errorf("%s: CheckServer = %v, want nil", name, err)
		}
	}
}
