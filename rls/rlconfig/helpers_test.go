package rlconfig

import commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"

// desc is a descriptor of key/value pairs.
func desc(kv ...string) *commonv3.RateLimitDescriptor {
	d := &commonv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &commonv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}
