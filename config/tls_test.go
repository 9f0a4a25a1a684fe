package config

import (
	"strings"
	"testing"
)

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

// The admin API off loopback without TLS is refused unless
// listeners.insecure says a mesh provides it, as the ext_proc listener
// is: one rule for the file and for serve's --grpc and --admin.
func TestAdminListenerOffLoopbackNeedsTLS(t *testing.T) {
	const policies = "policies: [{name: p, buckets: [{name: g, tokens_per_minute: 60}]}]\n"
	const refused = `is not a loopback address and has no TLS, but it serves the admin API`
	for _, tt := range []struct {
		name, yaml, grpc, admin, want string
	}{
		{"admin API moved off loopback", "admin_api: {token_env: T}\n", "", "0.0.0.0:9090", refused},
		{"admin API off loopback in a mesh", "listeners: {admin: \"0.0.0.0:9090\", insecure: true}\nadmin_api: {token_env: T}\n", "", "0.0.0.0:9191", ""},
		{"admin API off loopback over TLS", "listeners: {admin_tls: {cert_file: c, key_file: k}}\nadmin_api: {token_env: T}\n", "", "0.0.0.0:9090", ""},
		{"no admin API off loopback", "", "", "0.0.0.0:9090", ""},
		{"ext_proc moved off loopback", "", "0.0.0.0:50051", "", `listeners.grpc: "0.0.0.0:50051" is not a loopback address and has no TLS`},
		{"a mesh's file on loopback", "listeners: {grpc: \"0.0.0.0:50051\", insecure: true}\n", "127.0.0.1:0", "127.0.0.1:0", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse("t.yaml", []byte(tt.yaml+policies))
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.WithListeners(tt.grpc, tt.admin)
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("WithListeners(%q, %q): %v, want no problem", tt.grpc, tt.admin, err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("WithListeners(%q, %q): %v, want %q", tt.grpc, tt.admin, err, tt.want)
			}
		})
	}
}
