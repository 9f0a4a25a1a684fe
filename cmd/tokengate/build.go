package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/statsd_exporter/pkg/mapper"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/tokengate/tokengate/admin"
	"github.com/tokengate/tokengate/admission"
	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/failover"
	"github.com/tokengate/tokengate/buckets/lease"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/internal/statsdmap"
	"github.com/tokengate/tokengate/metrics"
	"github.com/tokengate/tokengate/rls"
	"github.com/tokengate/tokengate/rls/rlconfig"
	"github.com/tokengate/tokengate/tokenizer"
)

// parts is everything serve runs, built from one configuration.
type parts struct {
	server *extproc.Server
	// rls is the rate-limit service, on the same store and policies.
	rls      *rls.Service
	store    buckets.Store
	failover *failover.Store // nil for the memory store
	counter  *tokenizer.Counter
	registry *prometheus.Registry
	metrics  *metrics.Metrics
	// ratelimit are the ratelimit-named metrics of
	// listeners.ratelimit_metrics; nil when it is not set.
	ratelimit *metrics.Ratelimit
	ready     atomic.Bool
	closers   []func() error
	// admin serves the admin listener and keeps the overrides in force.
	admin *admin.Server
	// configMu orders the swaps of the configuration in force: reloads of
	// the file and xDS snapshots (ratelimit.xds).
	configMu sync.Mutex
	// xdsFiles are the last xDS snapshot's files, which a reload imports
	// again; nil before the first.
	xdsFiles []*rlconfig.File
}

// background runs the failover store's work (failover.Store.Run) until
// the returned function is called: heartbeats announcing this gateway to
// the fleet sharing the store (store.fleet), and, while the store is down,
// probes that replay what it missed as soon as it answers. The returned
// function takes the gateway out of the fleet and returns once it has.
// Serve runs it for as long as it serves, and stops it after the last
// settlement is written. For the memory store it does nothing.
func (p *parts) background() (stop func()) {
	if p.failover == nil {
		return func() {}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.failover.Run(ctx)
	}()
	return func() {
		cancel()
		<-done
	}
}

// loadPending queues the writes a previous run saved to file
// (store.replay_file) for replay, and removes the file: each applies once
// however often it is replayed, so a run that dies before replaying them
// loses them, but never charges them twice.
func (p *parts) loadPending(file string, logger *slog.Logger) error {
	if file == "" {
		return nil
	}
	f, err := os.Open(file)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("store.replay_file: %w", err)
	}
	defer f.Close()
	n, err := p.failover.LoadPending(f)
	if err != nil {
		return fmt.Errorf("store.replay_file %s: %w", file, err)
	}
	if err := os.Remove(file); err != nil {
		return fmt.Errorf("store.replay_file: %w", err)
	}
	logger.Info("writes the store missed before the last shutdown are queued for replay", "file", file, "count", n)
	return nil
}

// flushRLS waits for the rate-limit service's deferred charges
// (rls.deferred_charges), within what is left of ctx (the shutdown grace;
// at least a second), and writes what the store still queues.
func (p *parts) flushRLS(ctx context.Context) error {
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.Background(), time.Second)
		defer cancel()
	}
	err := p.rls.Drain(ctx)
	if as, ok := p.store.(buckets.AsyncSettler); ok {
		err = errors.Join(err, as.Flush(ctx))
	}
	return err
}

// drain replays, within what is left of ctx (the shutdown grace; at least
// a second), what the store missed during an outage. What it cannot
// replay it saves to file (store.replay_file) for the next start, or,
// without one, logs as lost: those reservations stay charged.
func (p *parts) drain(ctx context.Context, file string, logger *slog.Logger) {
	if p.failover == nil || p.failover.Pending() == 0 {
		return
	}
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.Background(), time.Second)
		defer cancel()
	}
	left := p.failover.Drain(ctx)
	switch {
	case left == 0:
		logger.Info("shutdown: every write the store missed during the outage is replayed")
	case file == "":
		logger.Error("shutdown: writes the store missed during the outage are lost (store.replay_file is not set): their reservations stay charged", "count", left)
	default:
		if n, err := p.savePending(file); err != nil {
			logger.Error("shutdown: writes the store missed during the outage could not be saved: their reservations stay charged", "count", left, "file", file, "err", err)
		} else {
			logger.Warn("shutdown: writes the store missed during the outage are saved for replay at the next start", "count", n, "file", file)
		}
	}
}

// savePending writes what waits for replay to file, whole or not at all.
func (p *parts) savePending(file string) (int, error) {
	tmp, err := os.CreateTemp(filepath.Dir(file), filepath.Base(file)+".*")
	if err != nil {
		return 0, err
	}
	defer os.Remove(tmp.Name())
	n, err := p.failover.SavePending(tmp)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), file)
	}
	return n, err
}

func (p *parts) close() {
	for i := len(p.closers) - 1; i >= 0; i-- {
		_ = p.closers[i]()
	}
}

// buildOptions lets the demo run serve's wiring on a clock it can advance,
// watch each request's outcome and sign in with a token of its own; serve
// leaves them zero.
type buildOptions struct {
	now      func() time.Time      // the store's and the server's clock; nil is time.Now
	onFinish func(extproc.Outcome) // called after the metrics see each outcome
	// adminToken is the admin token of a configuration without
	// admin_api.token_env: the demo's, made at start.
	adminToken string
}

// build makes everything serve runs from one validated configuration.
func build(ctx context.Context, cfg *config.Config, logger *slog.Logger, opts buildOptions) (*parts, error) {
	p := &parts{registry: prometheus.NewRegistry()}
	p.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	p.metrics = metrics.New(p.registry, metrics.Options{Prices: cfg.Prices(), MaxModels: *cfg.Metrics.MaxModels})
	if cfg.Listeners.RatelimitMetrics != "" {
		var m *mapper.MetricMapper // nil: ratelimit's default mapping
		if f := cfg.Listeners.RatelimitMetricsMapper; f != "" {
			data, err := config.ReadFile(f)
			if err == nil {
				m, err = statsdmap.Parse(data)
			}
			if err != nil {
				return nil, fmt.Errorf("listeners.ratelimit_metrics_mapper: %w", err)
			}
		}
		p.ratelimit = metrics.NewRatelimit(m)
	}
	primary, closeStore, err := buildStore(ctx, cfg, logger, opts.now)
	if err != nil {
		return nil, err
	}
	if closeStore != nil {
		p.closers = append(p.closers, closeStore)
	}
	var store buckets.Store = p.metrics.Instrument(primary)
	if cfg.Store.Type != "memory" {
		opts := failover.Options{Mode: failover.Closed, Logger: logger, OnFallback: p.metrics.Fallback, OnState: p.metrics.StoreState}
		// Probes bypass the metrics wrapper: they are not bucket
		// operations.
		opts.Probe, _ = primary.(failover.Pinger)
		// Writes saved by a release before quotas recorded their unit
		// meant this currency for quotas of money.
		if t := cfg.Prices(); t != nil {
			opts.Currency = t.Currency()
		}
		if cfg.Store.OnFailure == "open" {
			opts.Mode = failover.Open
			opts.Fallback = cfg.Store.Fallback.Limit()
			if f := cfg.Store.Fleet; f != nil {
				// The fleet is counted in the shared store itself; its
				// heartbeats are not bucket operations, so they bypass
				// the metrics wrapper.
				fleet, ok := primary.(failover.Fleet)
				if !ok {
					p.close()
					return nil, fmt.Errorf("store.fleet: the %s store cannot count a fleet", cfg.Store.Type)
				}
				opts.Fleet, opts.HeartbeatEvery, opts.OnShare = fleet, f.Heartbeat, p.metrics.Share
				if f.Floor != nil {
					opts.FallbackFloor = f.Floor.Limit()
				}
			}
		}
		p.failover = failover.New(store, opts)
		store = p.failover
		if err := p.loadPending(cfg.Store.ReplayFile, logger); err != nil {
			p.close()
			return nil, err
		}
	}
	store = withLeases(cfg, store, primary, p.metrics, logger, opts.now, &p.closers)
	p.store = store
	p.counter, err = newCounter(cfg)
	if err != nil {
		p.close()
		return nil, err
	}
	sc, err := serverConfig(cfg, store, p.counter, logger)
	if err != nil {
		p.close()
		return nil, err
	}
	sc.Now = opts.now
	sc.OnFinish = p.metrics.Finish
	if f := opts.onFinish; f != nil {
		sc.OnFinish = func(o extproc.Outcome) { p.metrics.Finish(o); f(o) }
	}
	p.server, err = extproc.NewServer(sc)
	if err != nil {
		p.close()
		return nil, err
	}
	if p.rls, err = buildRLS(cfg, store, p.metrics, p.ratelimit, logger); err != nil {
		p.close()
		return nil, err
	}
	if err := p.buildAdmin(ctx, cfg, primary, logger, opts.adminToken); err != nil {
		p.close()
		return nil, err
	}
	// As ratelimit counts loads: one that gives it domains (an xDS
	// subscription counts its snapshots).
	if cfg.RLS != nil && len(cfg.RLS.Domains) > 0 {
		p.configLoaded(true)
	}
	p.ready.Store(true)
	return p, nil
}

// configLoaded counts a configuration loaded (ok) or refused in the
// ratelimit-named metrics, when they are served.
func (p *parts) configLoaded(ok bool) {
	if p.ratelimit != nil {
		p.ratelimit.ConfigLoad(ok)
	}
}

// withLeases wraps store in a lease store on Redis (S20), leasing from the
// shared Redis store. It wraps whether or not a bucket asks for leases
// now, so that a reload may add one: buckets without a lease pass straight
// through to the store underneath. It goes on top of the
// failover store: while Redis is down, requests take from the leases this
// gateway still holds, and what they cannot take the failover store
// decides. Its closer, which returns what the gateway holds, runs before
// the Redis client's: after the server has settled every stream.
func withLeases(cfg *config.Config, store, shared buckets.Store, m *metrics.Metrics, logger *slog.Logger, now func() time.Time, closers *[]func() error) buckets.Store {
	lender, ok := shared.(lease.Lender)
	if !ok || cfg.Store.Type != "redis" {
		return store // the memory store has nothing to lease
	}
	ls := lease.New(store, m.InstrumentLender(lender), lease.Options{Now: now, Logger: logger})
	*closers = append(*closers, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := ls.Close(ctx); err != nil {
			logger.Warn("leases not returned at shutdown: their tokens come back by refill", "err", err)
			return err
		}
		return nil
	})
	return ls
}

// newCounter is the token counter of a configuration: serve, the demo and
// count all build theirs here, so they count and allow output alike.
func newCounter(cfg *config.Config) (*tokenizer.Counter, error) {
	c, err := tokenizer.New(tokenizer.Options{
		FallbackEncoding:    cfg.Tokenizer.FallbackEncoding,
		DefaultOutputTokens: cfg.Tokenizer.DefaultOutputTokens,
		MaxOutputTokens:     cfg.Tokenizer.MaxOutputTokens,
	})
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	return c, nil
}

// serverConfig maps a validated configuration onto the server's plain data.
func serverConfig(cfg *config.Config, store buckets.Store, counter *tokenizer.Counter, logger *slog.Logger) (extproc.Config, error) {
	sc := extproc.Config{
		DefaultPolicy:        cfg.DefaultPolicy,
		PolicyMetadataKey:    cfg.PolicyMetadataKey,
		Store:                store,
		Counter:              counter,
		Prices:               cfg.Prices(),
		Namespace:            cfg.Namespace,
		MaxBodyBytes:         cfg.Listeners.MaxRecvMsgBytes,
		MaxStreams:           cfg.Listeners.MaxStreams,
		StreamIdleTimeout:    cfg.Listeners.StreamIdleTimeout,
		MaxEventBytes:        cfg.Listeners.MaxEventBytes,
		UsageMargin:          *cfg.UsageBound.Margin,
		UsageSlack:           *cfg.UsageBound.Slack,
		UsageContextWindow:   cfg.UsageBound.ContextWindow,
		UsageMaxOutputTokens: cfg.Tokenizer.MaxOutputTokens,
		Logger:               logger,
	}
	policies, err := policies(cfg)
	sc.Policies = policies
	return sc, err
}

// policies maps the configuration's policies onto the server's
// (admission.FromConfig).
func policies(cfg *config.Config) ([]extproc.Policy, error) { return admission.FromConfig(cfg) }

// buildRLS makes the rate-limit service on the ext_proc server's store,
// with the configuration's rls mapping loaded; without an rls section it
// answers every call as ratelimit does before its first configuration.
// With rl (listeners.ratelimit_metrics) it also counts ratelimit's stats.
func buildRLS(cfg *config.Config, store buckets.Store, m *metrics.Metrics, rl *metrics.Ratelimit, logger *slog.Logger) (*rls.Service, error) {
	c := rls.Config{
		Store: store, Prices: cfg.Prices(), Logger: logger,
		OnDescriptor: func(r rls.Result) { m.RLSDescriptor(r.Domain, r.Policy, r.Kind, r.Code, r.Shadow, r.Hits, r.Negative) },
		OnError:      m.RLSError,
	}
	if rl != nil {
		c.OnStats = rl.Stats
		c.OnGlobalShadowMode = rl.GlobalShadowMode
		c.OnError = func(reason string) { m.RLSError(reason); rl.Error(reason) }
	}
	svc, err := rls.New(c)
	if err != nil {
		return nil, err
	}
	if err := loadRLS(svc, cfg); err != nil {
		return nil, err
	}
	return svc, nil
}

// loadRLS makes cfg's rls mapping the service's; without an rls section
// it unloads it.
func loadRLS(svc *rls.Service, cfg *config.Config) error {
	if cfg.RLS == nil {
		return svc.Load(rls.Mapping{})
	}
	pols, err := policies(cfg)
	if err != nil {
		return err
	}
	return svc.Load(rls.Mapping{Config: cfg, Policies: pols})
}

// buildAdmin makes the admin server: overrides kept where the bucket
// store keeps its buckets (primary), with the admin token read from
// admin_api.token_env, or else token. The overrides of the configuration
// and of the store apply before it returns.
func (p *parts) buildAdmin(ctx context.Context, cfg *config.Config, primary buckets.Store, logger *slog.Logger, token string) error {
	var overrides admin.OverrideStore = &buckets.MemoryOverrides{}
	if rs, ok := primary.(*redisstore.Store); ok {
		overrides = rs.Overrides()
	}
	source := "the token tokengate demo printed"
	if env := cfg.AdminAPI.TokenEnv; env != "" {
		tok, err := admin.ReadToken(env)
		if err != nil {
			return err
		}
		token, source = tok, "the value of "+env
	}
	p.admin = admin.New(ctx, admin.Options{
		Config: cfg, Gateway: p.server, OnOverrides: p.rls.SetOverrides, Overrides: overrides, Metrics: p.metrics, Gatherer: p.registry,
		Ready: p.readiness, Token: token, TokenSource: source, Logger: logger, RateLimitJSON: p.rls.JSONHandler(),
	})
	return nil
}

// readiness is what /readyz answers: nil while serving, or why not.
func (p *parts) readiness() error {
	switch {
	case !p.ready.Load():
		return errors.New("shutting down")
	case p.failover != nil && !p.failover.Healthy() && !p.failover.FailsOpen():
		return errors.New("bucket store unreachable (failing closed)")
	}
	if r := p.admin.Config().RLS; r != nil && r.ReadyNeedsDomain && len(r.Domains) == 0 {
		return errors.New("no rate-limit domain loaded (rls.ready_needs_domain)")
	}
	return nil
}

// buildStore makes the configured bucket store. The returned function closes
// its connections.
func buildStore(ctx context.Context, cfg *config.Config, logger *slog.Logger, now func() time.Time) (buckets.Store, func() error, error) {
	switch cfg.Store.Type {
	case "memory":
		return buckets.NewMemory(buckets.MemoryOptions{Now: now}), nil, nil
	case "redis":
		rc := cfg.Store.Redis
		user, pw, err := redisCredentials("store.redis", rc.Username, rc.PasswordEnv, rc.AuthEnv)
		if err != nil {
			return nil, nil, err
		}
		opts := &redis.UniversalOptions{
			Addrs:         redisAddrs(&rc),
			Username:      user,
			Password:      pw,
			DB:            rc.DB,
			DialTimeout:   rc.DialTimeout,
			ReadTimeout:   rc.Timeout,
			WriteTimeout:  rc.Timeout,
			PoolSize:      rc.PoolSize,
			IsClusterMode: rc.Cluster,
		}
		if len(rc.Addrs) == 1 {
			if _, unix := config.UnixSocket(rc.Addrs[0]); unix {
				// Maintenance notifications move TCP endpoints; for a
				// socket go-redis would only warn that a path is no host.
				opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
			}
		}
		if sn := rc.Sentinel; sn != nil {
			opts.MasterName = sn.Master
			if opts.SentinelUsername, opts.SentinelPassword, err = redisCredentials("store.redis.sentinel", sn.Username, sn.PasswordEnv, sn.AuthEnv); err != nil {
				return nil, nil, err
			}
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
		st := redisstore.New(client, redisstore.Options{Prefix: rc.KeyPrefix, Cluster: rc.Cluster, SettleWindow: rc.SettleWindow})
		if err := client.Ping(pctx).Err(); err != nil {
			// Not fatal: the failure mode (S21) decides what requests see
			// until Redis answers.
			logger.Warn("redis not reachable at start-up", "addrs", opts.Addrs, "master", opts.MasterName, "err", err)
		} else if err := st.CheckServer(pctx); errors.Is(err, redisstore.ErrServerTooOld) {
			client.Close()
			return nil, nil, fmt.Errorf("store.redis: %w", err)
		} else if err != nil {
			logger.Warn("redis did not say its version", "err", err)
		}
		return st, client.Close, nil
	}
	return nil, nil, fmt.Errorf("store.type: unknown store %q", cfg.Store.Type)
}

// redisCredentials are the user and password of a Redis connection (field is
// its configuration's): username and password_env's variable, or
// auth_env's variable split at its first colon as envoyproxy/ratelimit
// splits REDIS_AUTH (no colon: the password alone). A variable named but
// not set is an error naming it, never a value.
func redisCredentials(field, username, passwordEnv, authEnv string) (user, password string, err error) {
	name, key := passwordEnv, "password_env"
	if authEnv != "" {
		name, key = authEnv, "auth_env"
	}
	if name == "" {
		return username, "", nil
	}
	v, ok := os.LookupEnv(name)
	if !ok {
		return "", "", fmt.Errorf("%s.%s: environment variable %s is not set", field, key, name)
	}
	if authEnv == "" {
		return username, v, nil
	}
	if u, p, found := strings.Cut(v, ":"); found {
		return u, p, nil
	}
	return "", v, nil
}

// redisAddrs are the addresses go-redis dials: the sentinels' with
// Sentinel, else the servers', a unix socket as its path (go-redis dials
// an address starting with / as one).
func redisAddrs(rc *config.Redis) []string {
	if rc.Sentinel != nil {
		return rc.Sentinel.Addrs
	}
	addrs := make([]string, len(rc.Addrs))
	for i, a := range rc.Addrs {
		if path, ok := config.UnixSocket(a); ok {
			a = path
		}
		addrs[i] = a
	}
	return addrs
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
