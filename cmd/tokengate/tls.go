package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/tokengate/tokengate/config"
)

// listenerTLS is the transport security of the two listeners, built from a
// validated configuration: gRPC server options for ext_proc (none for
// plaintext) and the admin listener's TLS configuration (nil for plain HTTP).
type listenerTLS struct {
	grpc  []grpc.ServerOption
	admin *tls.Config
	mode  string // for the start-up log: "mtls", "tls" or "plaintext"
}

func newListenerTLS(l config.Listeners, logger *slog.Logger) (*listenerTLS, error) {
	lt := &listenerTLS{mode: "plaintext"}
	if t := l.GRPCTLS; t != nil {
		// gRPC needs HTTP/2, negotiated by ALPN (grpc-go refuses TLS without it).
		c, err := newServerTLS("listeners.grpc_tls", *t, []string{"h2"}, logger)
		if err != nil {
			return nil, err
		}
		lt.grpc = []grpc.ServerOption{grpc.Creds(credentials.NewTLS(c))}
		lt.mode = "tls"
		if t.ClientCAFile != "" {
			lt.mode = "mtls"
		}
	}
	if t := l.AdminTLS; t != nil {
		c, err := newServerTLS("listeners.admin_tls", *t, []string{"http/1.1"}, logger)
		if err != nil {
			return nil, err
		}
		lt.admin = c
	}
	return lt, nil
}

// newServerTLS returns a server TLS configuration that serves the files of
// t and reads them again when they change (see tlsFiles). The files must be
// readable and valid now; field names the configuration in errors and logs.
func newServerTLS(field string, t config.ListenerTLS, protos []string, logger *slog.Logger) (*tls.Config, error) {
	f := &tlsFiles{field: field, files: t, protos: protos, log: logger}
	if err := f.reload(nil); err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, GetConfigForClient: f.configForClient}, nil
}

// tlsFiles serves a listener's certificate, and the CA its clients'
// certificates must chain to, from files that may be replaced at any time
// (cert-manager, a Kubernetes secret volume, a cron job). Every handshake
// stats the files, which is cheap, and reloads them when one changed; a new
// connection then sees the new files, open connections keep theirs. A
// rotation caught half-way (a key that does not match its certificate yet, a
// file briefly missing) keeps the previous files in service and is logged
// once; the next handshake tries again. Safe for concurrent use.
type tlsFiles struct {
	field  string
	files  config.ListenerTLS
	protos []string
	log    *slog.Logger

	cur     atomic.Pointer[tlsState]
	mu      sync.Mutex // serialises reloads
	lastErr string     // the last reload error logged, so a broken rotation logs once
}

// tlsState is one loaded generation of the files.
type tlsState struct {
	stamps []os.FileInfo // of cert, key and (if any) CA file, as loaded
	config *tls.Config   // what handshakes use; never modified once stored
}

func (f *tlsFiles) paths() []string {
	p := []string{f.files.CertFile, f.files.KeyFile}
	if f.files.ClientCAFile != "" {
		p = append(p, f.files.ClientCAFile)
	}
	return p
}

// stat returns the current stamps of the files.
func (f *tlsFiles) stat() ([]os.FileInfo, error) {
	paths := f.paths()
	out := make([]os.FileInfo, len(paths))
	for i, p := range paths {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		out[i] = fi
	}
	return out, nil
}

func changed(a, b []os.FileInfo) bool {
	if len(a) != len(b) {
		return true
	}
	for i := range a {
		// A rename over the file changes its identity; an in-place rewrite
		// its time or size.
		if !os.SameFile(a[i], b[i]) || !a[i].ModTime().Equal(b[i].ModTime()) || a[i].Size() != b[i].Size() {
			return true
		}
	}
	return false
}

func (f *tlsFiles) configForClient(*tls.ClientHelloInfo) (*tls.Config, error) {
	st := f.cur.Load()
	stamps, err := f.stat()
	if err == nil && !changed(st.stamps, stamps) {
		return st.config, nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		err = f.reload(stamps)
	}
	if err != nil {
		if msg := err.Error(); msg != f.lastErr {
			f.lastErr = msg
			f.log.Warn("TLS files changed but cannot be loaded; serving the previous ones", "listener", f.field, "err", err)
		}
	}
	return f.cur.Load().config, nil
}

// reload loads the files if their stamps differ from the loaded ones (always
// when none are loaded) and stores the new generation. stamps are the stamps
// seen before reading, or nil to stat now. The caller holds f.mu, or is the
// constructor.
func (f *tlsFiles) reload(stamps []os.FileInfo) error {
	if stamps == nil {
		var err error
		if stamps, err = f.stat(); err != nil {
			return err
		}
	}
	if st := f.cur.Load(); st != nil && !changed(st.stamps, stamps) {
		return nil // another handshake reloaded them meanwhile
	}
	cert, err := tls.LoadX509KeyPair(f.files.CertFile, f.files.KeyFile)
	if err != nil {
		return fmt.Errorf("cert_file and key_file: %w", err)
	}
	c := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{cert},
		NextProtos:   f.protos,
	}
	if f.files.ClientCAFile != "" {
		pem, err := os.ReadFile(f.files.ClientCAFile)
		if err != nil {
			return fmt.Errorf("client_ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("client_ca_file %s: %w", f.files.ClientCAFile, errNoPEMCertificates)
		}
		c.ClientCAs = pool
		c.ClientAuth = tls.RequireAndVerifyClientCert
		// Every connection proves its client certificate against the current
		// CA: no session resumption past a CA rotation.
		c.SessionTicketsDisabled = true
	}
	first := f.cur.Load() == nil
	f.cur.Store(&tlsState{stamps: stamps, config: c})
	f.lastErr = ""
	if !first && cert.Leaf != nil {
		f.log.Info("TLS files reloaded", "listener", f.field, "subject", cert.Leaf.Subject.String(), "not_after", cert.Leaf.NotAfter)
	}
	return nil
}

var errNoPEMCertificates = errors.New("no PEM certificates found")
