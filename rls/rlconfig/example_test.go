package rlconfig_test

import (
	"fmt"

	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"

	"github.com/tokengate/tokengate/rls/rlconfig"
)

func Example() {
	f, err := rlconfig.Parse("config.yaml", []byte(`
domain: ai-gateway
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: user
    value: vip-*
    rate_limit: {unit: minute, requests_per_unit: 5000}
`))
	if err != nil {
		fmt.Println(err)
		return
	}
	c, err := rlconfig.Load([]*rlconfig.File{f}, rlconfig.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, user := range []string{"alice", "vip-bob"} {
		d := &commonv3.RateLimitDescriptor{Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "user", Value: user}}}
		rule, _ := c.Limit("ai-gateway", d)
		fmt.Println(user, rule.RequestsPerUnit, rule.Unit, c.StatsKey("ai-gateway", d))
	}
	// Output:
	// alice 1000 MINUTE ai-gateway.user
	// vip-bob 5000 MINUTE ai-gateway.user_vip-*
}
