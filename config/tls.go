package config

import (
	"net"
	"strings"
)

// validateListenerTLS checks the listeners' TLS and who may reach the ext_proc
// listener: on an address other than loopback it needs client certificates
// (grpc_tls.client_ca_file), or insecure: true when a mesh authenticates
// clients instead. Whoever reaches ext_proc chooses the identity of every
// request it sends, so this is checked here, once, for validate and serve alike.
func (v *validator) validateListenerTLS(l *Listeners) {
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
	host, _, err := net.SplitHostPort(l.GRPC)
	if err != nil {
		return // validateListeners reports it
	}
	mtls := l.GRPCTLS != nil && l.GRPCTLS.ClientCAFile != ""
	switch {
	case isLoopback(host):
		if l.Insecure {
			v.add("listeners.insecure", "only applies when listeners.grpc is not a loopback address (it is %q)", l.GRPC)
		}
	case mtls:
		if l.Insecure {
			v.add("listeners.insecure", "contradicts listeners.grpc_tls.client_ca_file: clients are verified; remove one")
		}
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
