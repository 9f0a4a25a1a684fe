// Package rlxds keeps envoyproxy/ratelimit's configuration in step with an
// xDS management server, as ratelimit's GRPC_XDS_SOTW provider does
// (docs/envoy-ratelimit.md §3.9): a wildcard state-of-the-world
// subscription over ADS to RateLimitConfig resources, every response
// replacing the whole configuration, ACKed when it loads and NACKed with
// the reason when it does not, the configuration in force staying. Envoy
// Gateway serves node "envoy-ratelimit" (§4.3), Envoy AI Gateway node
// "envoy-ai-gateway-ratelimit" (§5.2).
package rlxds

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	sotw "github.com/envoyproxy/go-control-plane/pkg/client/sotw/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

// Options configure a Watch. The zero value is node "default", as
// ratelimit's CONFIG_GRPC_XDS_NODE_ID defaults.
type Options struct {
	// NodeID is the node the management server keeps a snapshot for.
	NodeID string
	// NodeMetadata is the node's metadata (CONFIG_GRPC_XDS_NODE_METADATA).
	NodeMetadata map[string]string
	// Load are the load options each snapshot is checked with.
	Load rlconfig.Options

	// wait, in tests, stands in for the pause before the repeat-th NACK
	// of one refusal in a row (nackPause).
	wait func(ctx context.Context, repeat int) error
}

// A management server with go-control-plane's snapshot cache answers a
// NACK at once with the snapshot it holds, which is the one refused: a
// client that NACKs at once again spins with it, thousands of round trips
// a second while the bad configuration stands. The first NACK of a
// refusal goes at once; the same refusal again waits first, 100 ms and
// doubling up to 5 s, so that a configuration fixed meanwhile applies
// within 5 s (the NACK, when it goes, fetches it).
const (
	nackPauseFirst = 100 * time.Millisecond
	nackPauseMax   = 5 * time.Second
)

// nackPause is the pause before the repeat-th NACK of one refusal in a
// row (repeat ≥ 1).
func nackPause(repeat int) time.Duration {
	d := nackPauseFirst
	for range repeat - 1 {
		if d *= 2; d >= nackPauseMax {
			return nackPauseMax
		}
	}
	return d
}

// pause waits nackPause(repeat), or until ctx ends.
func pause(ctx context.Context, repeat int) error {
	t := time.NewTimer(nackPause(repeat))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Watch subscribes to RateLimitConfig resources over ADS on conn and calls
// apply with each response's files once they load; a response whose
// resources do not decode, do not load, or that apply refuses is NACKed
// with the reason, and apply is not called again until a later response
// loads. The same refusal again in a row is NACKed after a pause
// (nackPause), not at once. Watch returns when ctx ends or the stream
// fails, with the error; the caller redials, with backoff (ratelimit waits
// 10s to 60s).
func Watch(ctx context.Context, conn grpc.ClientConnInterface, opts Options, apply func([]*rlconfig.File) error) error {
	node := &corev3.Node{Id: opts.NodeID}
	if node.Id == "" {
		node.Id = "default"
	}
	if len(opts.NodeMetadata) > 0 {
		fields := make(map[string]any, len(opts.NodeMetadata))
		for k, v := range opts.NodeMetadata {
			fields[k] = v
		}
		md, err := structpb.NewStruct(fields)
		if err != nil {
			return fmt.Errorf("rlxds: node metadata: %w", err)
		}
		node.Metadata = md
	}
	c := sotw.NewADSClient(ctx, node, rlconfig.ConfigTypeURL)
	if err := c.InitConnect(conn); err != nil {
		return fmt.Errorf("rlxds: %w", err)
	}
	wait := opts.wait
	if wait == nil {
		wait = pause
	}
	refused, repeats := "", 0 // the last NACK's reason, and how often in a row
	for {
		resp, err := c.Fetch()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("rlxds: %w", err)
		}
		if reason := accept(resp.Resources, opts.Load, apply); reason != nil {
			if msg := reason.Error(); msg != refused {
				refused, repeats = msg, 0
			} else if repeats++; wait(ctx, repeats) != nil {
				return ctx.Err()
			}
			err = c.Nack(refused)
		} else {
			refused, repeats = "", 0
			err = c.Ack()
		}
		if err != nil {
			return fmt.Errorf("rlxds: %w", err)
		}
	}
}

// accept decodes, loads and applies one response; the error is the NACK's
// message.
func accept(resources []*anypb.Any, opts rlconfig.Options, apply func([]*rlconfig.File) error) error {
	files, err := rlconfig.DecodeXDS(resources)
	if err != nil {
		return err
	}
	if _, err := rlconfig.Load(files, opts); err != nil {
		return err
	}
	if err := apply(files); err != nil {
		return errors.Join(errors.New("the configuration was refused"), err)
	}
	return nil
}
