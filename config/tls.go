package config

import (
	"net"
	"strings"
)

// validateListenerTLS checks the listeners' TLS files and who may reach
// each listener (see validateExposure), and that listeners.insecure is set
// only where it lets something through.
func (v *validator) validateListenerTLS(c *Config) {
	l := &c.Listeners
	for _, t := range []struct {
		path string
		tls  *ListenerTLS
	}{{"listeners.grpc_tls", l.GRPCTLS}, {"listeners.admin_tls", l.AdminTLS}} {
		if t.tls == nil {
			continue
		}
		if t.tls.CertFile == "" {
			v.add(join(t.path, "cert_file"), "is required (the listener's certificate, PEM)")
		}
		if t.tls.KeyFile == "" {
			v.add(join(t.path, "key_file"), "is required (the private key of cert_file, PEM)")
		}
	}
	grpcOpen, adminOpen := v.validateExposure(c)
	if !l.Insecure || grpcOpen || adminOpen {
		return
	}
	if l.GRPCTLS != nil && l.GRPCTLS.ClientCAFile != "" {
		v.add("listeners.insecure", "contradicts listeners.grpc_tls.client_ca_file: clients are verified; remove one")
		return
	}
	v.add("listeners.insecure", "only applies when listeners.grpc is not a loopback address (it is %q), "+
		"or listeners.admin is not and serves the admin API without admin_tls", l.GRPC)
}

// validateExposure refuses a listener that anyone on the network can use
// as its owner: the ext_proc listener off loopback without client
// certificates (whoever reaches it chooses the identity of every request
// it sends), and the admin API off loopback without TLS (its bearer token
// and identity values would travel in clear). listeners.insecure lets both
// through, for a mesh whose sidecar provides mTLS. It reports which of the
// two listeners insecure lets through. It is the one rule of validate, of
// serve, and of serve's --grpc and --admin (WithListeners).
func (v *validator) validateExposure(c *Config) (grpcOpen, adminOpen bool) {
	l := &c.Listeners
	// A unix socket is reached only from this host, by whom its file's
	// permissions let in, as loopback is.
	_, unix := UnixSocket(l.GRPC)
	if host, _, err := net.SplitHostPort(l.GRPC); err == nil && !unix && !isLoopback(host) && (l.GRPCTLS == nil || l.GRPCTLS.ClientCAFile == "") {
		grpcOpen = true
		switch {
		case l.Insecure:
		case l.GRPCTLS != nil:
			v.add("listeners.grpc_tls.client_ca_file", "is required when listeners.grpc (%q) is not a loopback address: "+
				"without client certificates anyone who reaches the port can send requests under any identity "+
				"(set listeners.insecure: true if a mesh sidecar authenticates clients)", l.GRPC)
		default:
			v.add("listeners.grpc", "%q is not a loopback address and has no TLS: anyone who reaches the port can send requests "+
				"under any identity; add listeners.grpc_tls with client_ca_file (mTLS), or set listeners.insecure: true "+
				"if a mesh sidecar provides mTLS", l.GRPC)
		}
	}
	if host, _, err := net.SplitHostPort(l.Admin); err == nil && !isLoopback(host) && c.RLS != nil && c.RLS.JSONEndpoint {
		adminOpen = true
		if !l.Insecure {
			v.add("rls.json_endpoint", "is served on listeners.admin (%q), which is not a loopback address: anyone who reaches it can spend any descriptor's limit "+
				"with POST /json, whatever the gRPC listener asks of clients; set listeners.insecure: true if that is meant (a mesh sidecar authenticates clients)", l.Admin)
		}
	}
	if host, _, err := net.SplitHostPort(l.Admin); err == nil && !isLoopback(host) && l.AdminTLS == nil && c.AdminAPI.TokenEnv != "" {
		adminOpen = true
		if !l.Insecure {
			v.add("listeners.admin", "%q is not a loopback address and has no TLS, but it serves the admin API (admin_api.token_env): "+
				"its bearer token and identity values would travel in clear; add listeners.admin_tls, or set listeners.insecure: true "+
				"if a mesh sidecar provides TLS", l.Admin)
		}
	}
	return grpcOpen, adminOpen
}

// isLoopback reports whether a listener host accepts only local connections.
// An empty host or 0.0.0.0 listens everywhere; a name other than localhost
// may resolve to anything.
func isLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
