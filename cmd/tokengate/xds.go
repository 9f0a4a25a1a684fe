package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/rls/rlconfig"
	"github.com/tokengate/tokengate/rls/rlxds"
)

// The xDS client's redial: after a stream ends it waits xdsRetryFirst,
// doubling up to xdsRetryMax while the server stays away (ratelimit waits
// 10s to 60s); a stream that delivered a snapshot starts it over.
const (
	xdsRetryFirst = time.Second
	xdsRetryMax   = time.Minute
)

// nextRetry is the wait after d: twice d, at most xdsRetryMax.
func nextRetry(d time.Duration) time.Duration { return min(2*d, xdsRetryMax) }

// xdsCredentials are the transport credentials of ratelimit.xds:
// plaintext with insecure, else TLS with its CA, client certificate and
// server name (empty: the address's host, as gRPC takes it).
func xdsCredentials(x *config.RatelimitXDS) (credentials.TransportCredentials, error) {
	if x.Insecure {
		return insecure.NewCredentials(), nil
	}
	tc, err := tlsConfig(&config.TLS{CAFile: x.CAFile, CertFile: x.CertFile, KeyFile: x.KeyFile, ServerName: x.ServerName})
	if err != nil {
		return nil, fmt.Errorf("ratelimit.xds: %w", err)
	}
	return credentials.NewTLS(tc), nil
}

// runXDS keeps the configuration in force in step with the management
// server of ratelimit.xds until ctx ends: it dials, watches (rlxds.Watch,
// each snapshot applied by parts.applyXDS, a refused one NACKed), and
// redials with backoff (wait) when the stream ends. wait returns false when
// ctx ended while it waited.
func runXDS(ctx context.Context, x *config.RatelimitXDS, merge bool, creds credentials.TransportCredentials, p *parts, logger *slog.Logger,
	wait func(context.Context, time.Duration) bool) {
	log := logger.With("xds", x.Address, "node", x.NodeID)
	opts := rlxds.Options{NodeID: x.NodeID, NodeMetadata: x.NodeMetadata, Load: rlconfig.Options{MergeDomains: merge}}
	delay := xdsRetryFirst
	for {
		applied := false
		dial := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
		if x.MaxMessageBytes > 0 {
			dial = append(dial, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(x.MaxMessageBytes)))
		}
		conn, err := grpc.NewClient(x.Address, dial...)
		if err == nil {
			err = rlxds.Watch(ctx, conn, opts, func(files []*rlconfig.File) error {
				if err := p.applyXDS(files); err != nil {
					log.Error("xDS snapshot refused (NACKed); the configuration in force keeps serving", "err", err.Error())
					return err
				}
				applied = true
				log.Info("xDS snapshot applied: rate-limit calls follow it", "files", len(files))
				return nil
			})
			conn.Close()
		}
		if ctx.Err() != nil {
			return
		}
		if applied {
			delay = xdsRetryFirst
		}
		if status.Code(err) == codes.ResourceExhausted {
			log.Error("xDS snapshot larger than the client takes: raise ratelimit.xds.max_message_bytes (XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES); the configuration in force keeps serving",
				"max_message_bytes", x.MaxMessageBytes, "err", err.Error())
		}
		log.Warn("xDS stream ended; redialling", "err", err.Error(), "after", delay.String())
		if !wait(ctx, delay) {
			return
		}
		delay = nextRetry(delay)
	}
}

// waitTimer waits d or until ctx ends; false when ctx ended.
func waitTimer(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// applyXDS makes an xDS snapshot's files part of the configuration in
// force: the file's own configuration with them imported beside
// ratelimit.files (config.WithRatelimitXDS), validated, and applied as a
// reload applies a file. A snapshot that does not validate is an error
// and nothing changes. A later reload of the file imports the same files
// again.
func (p *parts) applyXDS(files []*rlconfig.File) error {
	p.configMu.Lock()
	defer p.configMu.Unlock()
	cfg, err := p.admin.Config().WithRatelimitXDS(files)
	if err == nil {
		err = p.apply(cfg)
	}
	p.configLoaded(err == nil)
	if err != nil {
		return err
	}
	p.xdsFiles = files
	return nil
}

// withXDS is cfg, read again from its file, with the last xDS snapshot's
// files imported as they were; cfg itself without ratelimit.xds or before
// the first snapshot. The caller holds configMu.
func (p *parts) withXDS(cfg *config.Config) (*config.Config, error) {
	if p.xdsFiles == nil || cfg.Ratelimit == nil || cfg.Ratelimit.XDS == nil {
		return cfg, nil
	}
	return cfg.WithRatelimitXDS(p.xdsFiles)
}
