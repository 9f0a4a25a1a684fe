package rlconfig

import (
	"fmt"

	rlsconfv3 "github.com/envoyproxy/go-control-plane/ratelimit/config/ratelimit/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// FromXDS reads a RateLimitConfig resource, as Envoy Gateway and Envoy AI
// Gateway push it over xDS (state of the world, type URL
// type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig), into
// the form Parse gives a file, as ratelimit converts it (§3.9): the
// resource's name stands for the file name, a unit is its enum name (so
// UNKNOWN is refused by Load unless the rule is unlimited), and the
// resource has no value_to_metric or share_threshold. Load then applies
// the same checks as to a file; ratelimit NACKs a snapshot that fails
// them and keeps the configuration it had.
func FromXDS(c *rlsconfv3.RateLimitConfig) *File {
	return &File{Name: c.GetName(), Domain: c.GetDomain(), Descriptors: xdsDescriptors(c.GetDescriptors(), "descriptors")}
}

func xdsDescriptors(ds []*rlsconfv3.RateLimitDescriptor, path string) []Descriptor {
	if len(ds) == 0 {
		return nil
	}
	out := make([]Descriptor, len(ds))
	for i, d := range ds {
		field := fmt.Sprintf("%s[%d]", path, i)
		out[i] = Descriptor{
			Key: d.GetKey(), Value: d.GetValue(),
			ShadowMode: d.GetShadowMode(), QuotaMode: d.GetQuotaMode(), DetailedMetric: d.GetDetailedMetric(),
			Descriptors: xdsDescriptors(d.GetDescriptors(), field+".descriptors"),
			Field:       field,
		}
		if m := d.GetMetadata(); len(m.GetFields()) > 0 {
			out[i].Metadata = proto.CloneOf(m)
		}
		if p := d.GetRateLimit(); p != nil {
			rl := &RateLimit{RequestsPerUnit: p.GetRequestsPerUnit(), Unit: p.GetUnit().String(), Unlimited: p.GetUnlimited(), Name: p.GetName()}
			for _, r := range p.GetReplaces() {
				rl.Replaces = append(rl.Replaces, r.GetName())
			}
			out[i].RateLimit = rl
		}
	}
	return out
}

// ConfigTypeURL is the xDS type URL of RateLimitConfig resources.
const ConfigTypeURL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"

// DecodeXDS unpacks the resources of one state-of-the-world response, each
// a RateLimitConfig, into files for Load. An error is the text a client
// NACKs the response with.
func DecodeXDS(resources []*anypb.Any) ([]*File, error) {
	files := make([]*File, 0, len(resources))
	for i, r := range resources {
		if r.GetTypeUrl() != ConfigTypeURL {
			return nil, fmt.Errorf("resource %d has type %q, want %s", i, r.GetTypeUrl(), ConfigTypeURL)
		}
		var c rlsconfv3.RateLimitConfig
		if err := r.UnmarshalTo(&c); err != nil {
			return nil, fmt.Errorf("resource %d: %w", i, err)
		}
		files = append(files, FromXDS(&c))
	}
	return files, nil
}
