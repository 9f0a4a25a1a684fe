package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/metrics"
	"github.com/tokengate/tokengate/tokenizer"
)

// parts is everything serve runs, built from one configuration.
type parts struct {
	server   *extproc.Server
	store    buckets.Store
	failover *failover.Store // nil for the memory store
	counter  *tokenizer.Counter
	registry *prometheus.Registry
	metrics  *metrics.Metrics
	ready    atomic.Bool
	closers  []func() error
}

func (p *parts) close() {
	for i := len(p.closers) - 1; i >= 0; i-- {
		_ = p.closers[i]()
	}
}

func build(ctx context.Context, cfg *config.Config, logger *slog.Logger) (*parts, error) {
	p := &parts{registry: prometheus.NewRegistry()}
	p.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	p.metrics = metrics.New(p.registry)
	store, closeStore, err := buildStore(ctx, cfg, logger)
	if err != nil {
		return nil, err
	}
	if closeStore != nil {
		p.closers = append(p.closers, closeStore)
	}
	store = p.metrics.Instrument(store)
	if cfg.Store.Type != "memory" {
		opts := failover.Options{Mode: failover.Closed, Logger: logger, OnFallback: p.metrics.Fallback}
		if cfg.Store.OnFailure == "open" {
			opts.Mode = failover.Open
			opts.Fallback = buckets.PerMinute(cfg.Store.Fallback.TokensPerMinute, cfg.Store.Fallback.Burst)
		}
		p.failover = failover.New(store, opts)
		store = p.failover
	}
	p.store = store
	p.counter, err = tokenizer.New(tokenizer.Options{
		FallbackEncoding:    cfg.Tokenizer.FallbackEncoding,
		DefaultOutputTokens: cfg.Tokenizer.DefaultOutputTokens,
		MaxOutputTokens:     cfg.Tokenizer.MaxOutputTokens,
	})
	if err != nil {
		p.close()
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	sc := serverConfig(cfg, store, p.counter, logger)
	sc.OnFinish = p.metrics.Finish
	p.server, err = extproc.NewServer(sc)
	if err != nil {
		p.close()
		return nil, err
	}
	p.ready.Store(true)
	return p, nil
}

// serverConfig maps the configuration file onto the server's plain data.
func serverConfig(cfg *config.Config, store buckets.Store, counter *tokenizer.Counter, logger *slog.Logger) extproc.Config {
	sc := extproc.Config{
		DefaultPolicy:     cfg.DefaultPolicy,
		PolicyMetadataKey: cfg.PolicyMetadataKey,
		Store:             store,
		Counter:           counter,
		Namespace:         cfg.Namespace,
		MaxBodyBytes:      cfg.Listeners.MaxRecvMsgBytes,
		Logger:            logger,
	}
	for _, cp := range cfg.Policies {
		p := extproc.Policy{
			Name:            cp.Name,
			Anonymous:       cp.Anonymous,
			MaxOutputTokens: cp.MaxOutputTokens,
			ClampOutput:     cp.ClampOutput != nil && *cp.ClampOutput,
			InjectUsage:     cp.InjectUsage == nil || *cp.InjectUsage,
			PriorityHeader:  cp.PriorityHeader,

			UnknownEndpoints:      cp.UnknownEndpoints,
			UnknownEndpointTokens: cp.UnknownEndpointTokens,
		}
		if cp.Wait != nil {
			p.MaxWait, p.MaxQueue = cp.Wait.MaxWait, cp.Wait.MaxQueue
		}
		for _, id := range cp.Identities {
			p.Identities = append(p.Identities, extproc.Identity{
				Name: id.Name, Header: id.Header, Metadata: id.Metadata, Path: id.Path, Hash: id.Hash,
			})
		}
		for _, b := range cp.Buckets {
			r := extproc.BucketRule{Name: b.Name, Per: b.Per, Hard: b.Hard, MaxDebt: b.MaxDebt}
			if pl := b.ProviderLimit; pl != nil {
				bp := buckets.ProviderLimit{TokensPerMinute: pl.TokensPerMinute, PriorityHeadroom: pl.PriorityHeadroom}
				if pl.SafetyFactor != nil {
					bp.SafetyFactor = *pl.SafetyFactor
				}
				// The configuration was validated, so the derivation cannot fail.
				pb, _ := bp.Bucket(b.Name, "")
				r.Limit, r.Headroom, r.Provider = pb.Limit, pb.Headroom, true
			} else {
				r.Limit = buckets.PerMinute(b.TokensPerMinute, b.Burst)
			}
			p.Buckets = append(p.Buckets, r)
		}
		for _, c := range cp.Concurrency {
			p.Concurrency = append(p.Concurrency, extproc.ConcurrencyRule{Name: c.Name, Per: c.Per, Max: c.Max, Lease: c.Lease})
		}
		sc.Policies = append(sc.Policies, p)
	}
	return sc
}

func (p *parts) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		switch {
		case !p.ready.Load():
			http.Error(w, "not ready: shutting down", http.StatusServiceUnavailable)
		case p.failover != nil && !p.failover.Healthy() && !p.failover.FailsOpen():
			http.Error(w, "not ready: bucket store unreachable (failing closed)", http.StatusServiceUnavailable)
		default:
			w.Write([]byte("ready\n"))
		}
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(p.registry, promhttp.HandlerOpts{Registry: p.registry}))
	return mux
}

// buildStore makes the configured bucket store. The returned function closes
// its connections.
func buildStore(ctx context.Context, cfg *config.Config, logger *slog.Logger) (buckets.Store, func() error, error) {
	switch cfg.Store.Type {
	case "memory":
		return buckets.NewMemory(buckets.MemoryOptions{}), nil, nil
	case "redis":
		rc := cfg.Store.Redis
		opts := &redis.UniversalOptions{
			Addrs:         rc.Addrs,
			Username:      rc.Username,
			DB:            rc.DB,
			DialTimeout:   rc.DialTimeout,
			ReadTimeout:   rc.Timeout,
			WriteTimeout:  rc.Timeout,
			PoolSize:      rc.PoolSize,
			IsClusterMode: rc.Cluster,
		}
		if rc.PasswordEnv != "" {
			pw, ok := os.LookupEnv(rc.PasswordEnv)
			if !ok {
				return nil, nil, fmt.Errorf("store.redis.password_env: environment variable %s is not set", rc.PasswordEnv)
			}
			opts.Password = pw
		}
		if rc.TLS != nil {
			tc, err := tlsConfig(rc.TLS)
			if err != nil {
				return nil, nil, fmt.Errorf("store.redis.tls: %w", err)
			}
			opts.TLSConfig = tc
		}
		client := redis.NewUniversalClient(opts)
		pctx, cancel := context.WithTimeout(ctx, rc.DialTimeout+rc.Timeout)
		defer cancel()
		if err := client.Ping(pctx).Err(); err != nil {
			// Not fatal: the failure mode (S21) decides what requests see
			// until Redis answers.
			logger.Warn("redis not reachable at start-up", "addrs", rc.Addrs, "err", err)
		}
		return redisstore.New(client, redisstore.Options{Prefix: rc.KeyPrefix, Cluster: rc.Cluster}), client.Close, nil
	}
	return nil, nil, fmt.Errorf("store.type: unknown store %q", cfg.Store.Type)
}

func tlsConfig(t *config.TLS) (*tls.Config, error) {
	tc := &tls.Config{ServerName: t.ServerName, InsecureSkipVerify: t.InsecureSkipVerify, MinVersion: tls.VersionTLS12}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("ca_file %s holds no PEM certificate", t.CAFile)
		}
		tc.RootCAs = pool
	}
	if t.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, err
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
