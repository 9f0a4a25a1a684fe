package main

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/redistest"
)

// The configuration file maps onto the server's policies: rates per second,
// the provider's safety factor and priority headroom (S19), defaults.
func TestServerConfigMapping(t *testing.T) {
	cfg, err := config.Parse("t.yaml", []byte(`
default_policy: p
policies:
  - name: p
    identities: [{name: key, header: authorization, hash: true}]
    buckets:
      - {name: key, per: key, tokens_per_minute: 600, burst: 100, hard: true}
      - name: provider
        per: model
        provider_limit: {tokens_per_minute: 60000, priority_headroom: 0.1}
    concurrency: [{name: key, per: key, max: 3}]
    wait: {max_wait: 2s, max_queue: 5}
    max_output_tokens: 500
    clamp_output: true
    unknown_endpoints: charge
    unknown_endpoint_tokens: 25
`))
	if err != nil {
		t.Fatal(err)
	}
	sc, err := serverConfig(cfg, buckets.NewMemory(buckets.MemoryOptions{}), nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	want := []extproc.Policy{{
		Name:       "p",
		Identities: []extproc.Identity{{Name: "key", Header: "authorization", Hash: true}},
		Anonymous:  "shared",
		Buckets: []extproc.BucketRule{
			{Name: "key", Per: "key", Limit: buckets.Limit{Capacity: 100, Rate: 10}, Hard: true},
			{Name: "provider", Per: "model", Limit: buckets.Limit{Capacity: 54000, Rate: 900}, Headroom: 5400, Provider: true},
		},
		Concurrency:     []extproc.ConcurrencyRule{{Name: "key", Per: "key", Max: 3, Lease: 10 * time.Minute}},
		MaxWait:         2 * time.Second,
		MaxQueue:        5,
		MaxOutputTokens: 500,
		ClampOutput:     true,
		InjectUsage:     true,

		UnknownEndpoints:      "charge",
		UnknownEndpointTokens: 25,
	}}
	if d := cmp.Diff(want, sc.Policies, cmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })); d != "" {
		t.Errorf("policies (-want +got):\n%s", d)
	}
	if sc.DefaultPolicy != "p" || sc.PolicyMetadataKey != "x-tokengate-policy" || sc.Namespace != "tokengate" {
		t.Errorf("server config = %q %q %q", sc.DefaultPolicy, sc.PolicyMetadataKey, sc.Namespace)
	}
}

// The stream bounds and the bound on reported usage reach the server as
// configured, and their defaults are the server's own.
func TestServerConfigStreamBounds(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want [7]any
	}{
		{`
listeners: {max_streams: 7, stream_idle_timeout: 90s, max_event_bytes: 131072}
usage_bound: {margin: 2, slack: 100, context_window: 500000}
tokenizer: {max_output_tokens: 200000}
policies: [{name: p, buckets: [{name: g, tokens_per_minute: 600}]}]
`, [7]any{7, 90 * time.Second, 131072, 2.0, 100, 500000, 200000}},
		{`
policies: [{name: p, buckets: [{name: g, tokens_per_minute: 600}]}]
`, [7]any{10000, 10 * time.Minute, 4 << 20, 4.0, 4096, 2_000_000, 1 << 20}},
	} {
		cfg, err := config.Parse("t.yaml", []byte(tc.yaml))
		if err != nil {
			t.Fatal(err)
		}
		sc, err := serverConfig(cfg, buckets.NewMemory(buckets.MemoryOptions{}), nil, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		got := [7]any{sc.MaxStreams, sc.StreamIdleTimeout, sc.MaxEventBytes, sc.UsageMargin, sc.UsageSlack, sc.UsageContextWindow, sc.UsageMaxOutputTokens}
		if got != tc.want {
			t.Errorf("%s: max_streams, stream_idle_timeout, max_event_bytes, margin, slack, context window, max output = %v, want %v", tc.yaml, got, tc.want)
		}
	}
}

// store.redis.settle_window reaches the Redis store serve builds: the
// default 2ms, or the configured window.
func TestRedisSettleWindow(t *testing.T) {
	addr := redistest.Start(t).Addr
	for yaml, want := range map[string]time.Duration{
		"":                      2 * time.Millisecond,
		", settle_window: 10ms": 10 * time.Millisecond,
	} {
		cfg, err := config.Parse("w.yaml", []byte("store: {type: redis, redis: {addrs: ["+addr+"]"+yaml+"}}\npolicies: [{name: p, buckets: [{name: g, tokens_per_minute: 60}]}]\n"))
		if err != nil {
			t.Fatal(err)
		}
		store, closeStore, err := buildStore(context.Background(), cfg, slog.New(slog.DiscardHandler), nil)
		if err != nil {
			t.Fatal(err)
		}
		rs, ok := store.(*redisstore.Store)
		if !ok {
			t.Fatalf("store %T, want *redisstore.Store", store)
		}
		if got := rs.SettleWindow(); got != want {
			t.Errorf("settle window %v with %q, want %v", got, yaml, want)
		}
		if err := closeStore(); err != nil {
			t.Error(err)
		}
	}
}
