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
}

// Watch subscribes to RateLimitConfig resources over ADS on conn and calls
// apply with each response's files once they load; a response whose
// resources do not decode, do not load, or that apply refuses is NACKed
// with the reason, and apply is not called again until a later response
// loads. Watch returns when ctx ends or the stream fails, with the error;
// the caller redials, with backoff (ratelimit waits 10s to 60s).
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
	for {
		resp, err := c.Fetch()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("rlxds: %w", err)
		}
		if reason := accept(resp.Resources, opts.Load, apply); reason != nil {
			err = c.Nack(reason.Error())
		} else {
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
