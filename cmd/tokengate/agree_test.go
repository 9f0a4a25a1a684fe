package main

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
)

// configFixtures is every tokengate configuration in the repository: the
// config package's fixtures, the embedded defaults, the demo's, the
// examples' and the compose stack's.
func configFixtures(t *testing.T) []string {
	t.Helper()
	var files []string
	for _, pattern := range []string{
		"../../config/testdata/valid/*.yaml", "../../config/testdata/invalid/*.yaml",
		"../../config/default.yaml", "demo.yaml",
		"../../examples/configs/*.yaml", "../../examples/compose/tokengate.yaml", "../../examples/rls/tokengate.yaml",
	} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		if len(m) == 0 {
			t.Fatalf("%s matches no file", pattern)
		}
		files = append(files, m...)
	}
	return files
}

// What `validate` refuses, `serve` refuses with the same lines (file:line,
// field path); what `validate` accepts, `serve` builds: store, counter and
// ext_proc server, everything but the listeners (whose addresses config
// checks). Redis configurations build without a reachable Redis: its
// absence is a failure mode (S21), not a configuration error.
func TestValidateAndServeAgree(t *testing.T) {
	// What a configuration names outside it: the Redis password and the
	// admin API's token come from the environment at run time.
	t.Setenv("TOKENGATE_REDIS_PASSWORD", "secret")
	t.Setenv("TOKENGATE_TEST_REDIS_PASSWORD", "secret")
	t.Setenv("TOKENGATE_TEST_SENTINEL_PASSWORD", "secret")
	t.Setenv("TOKENGATE_TEST_ADMIN_TOKEN", "secret")
	valid, invalid := 0, 0
	for _, f := range configFixtures(t) {
		t.Run(strings.TrimPrefix(f, "../../"), func(t *testing.T) {
			var out, errOut bytes.Buffer
			verr := run(context.Background(), []string{"validate", f}, nil, &out, &errOut)
			cfg, serr := loadConfig(f)
			if (verr == nil) != (serr == nil) {
				t.Fatalf("validate: %v\n%s\nserve: %v", verr, errOut.String(), serr)
			}
			if verr != nil {
				invalid++
				var ps config.Problems
				if !errors.As(serr, &ps) {
					t.Fatalf("serve's error is %T, want config.Problems: %v", serr, serr)
				}
				printed := strings.TrimSuffix(errOut.String(), "1 of 1 files failed validation\n")
				if want := serr.Error() + "\n"; printed != want {
					t.Errorf("validate printed:\n%s\nserve says:\n%s", printed, want)
				}
				return
			}
			valid++
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			p, err := build(ctx, cfg, slog.New(slog.DiscardHandler), buildOptions{})
			if err != nil {
				t.Fatalf("validate accepts it, serve refuses: %v", err)
			}
			p.close()
		})
	}
	if valid < 8 || invalid < 20 {
		t.Errorf("%d valid and %d invalid fixtures, want at least 8 and 20", valid, invalid)
	}
}

// Whatever configuration Parse accepts maps onto a server that starts: no
// value config lets through is refused later (by the tokenizer, the mapping
// or the ext_proc server). The Redis store itself is not dialled here.
func FuzzAcceptedConfigsBuild(f *testing.F) {
	for _, pattern := range []string{"../../config/testdata/*/*.yaml", "../../config/default.yaml", "demo.yaml", "../../examples/configs/*.yaml"} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			f.Fatal(err)
		}
		for _, file := range m {
			data, err := os.ReadFile(file)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(data)
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := config.Parse("fuzz.yaml", data)
		if err != nil {
			return
		}
		counter, err := newCounter(cfg)
		if err != nil {
			t.Fatalf("accepted, but the tokenizer refuses it: %v", err)
		}
		sc, err := serverConfig(cfg, buckets.NewMemory(buckets.MemoryOptions{}), counter, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatalf("accepted, but the mapping refuses it: %v", err)
		}
		if _, err := extproc.NewServer(sc); err != nil {
			t.Fatalf("accepted, but the ext_proc server refuses it: %v", err)
		}
		// Nor does the store refuse a request through any policy's chain.
		for _, p := range sc.Policies {
			req := buckets.Request{Cost: 1}
			for _, b := range p.Buckets {
				req.Buckets = append(req.Buckets, buckets.Bucket{Name: b.Name, Key: "b:" + b.Name, Limit: b.Limit, Hard: b.Hard, MaxDebt: b.MaxDebt, Headroom: b.Headroom})
			}
			for _, c := range p.Concurrency {
				req.Slots = append(req.Slots, buckets.Slot{Name: c.Name, Key: "c:" + c.Name, Max: c.Max, Lease: c.Lease})
			}
			if _, err := sc.Store.Reserve(context.Background(), req); err != nil {
				t.Fatalf("accepted, but the store refuses policy %q: %v", p.Name, err)
			}
		}
	})
}
