package config

import "testing"

// Only a loopback ext_proc listener may run without client certificates and
// without insecure: true.
func TestLoopbackListener(t *testing.T) {
	for _, tc := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:50051", true},
		{"127.1.2.3:50051", true},
		{"[::1]:50051", true},
		{"localhost:50051", true},
		{"LocalHost:50051", true},
		{"0.0.0.0:50051", false},
		{":50051", false},
		{"[::]:50051", false},
		{"10.0.0.5:50051", false},
		{"tokengate:50051", false},
		{"localhost.example.com:50051", false},
	} {
		_, err := Parse("x.yaml", []byte("listeners: {grpc: \""+tc.addr+"\"}\npolicies: [{name: p, buckets: [{name: g, tokens_per_minute: 1}]}]\n"))
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v, want accepted=%v", tc.addr, err, tc.ok)
		}
	}
}
