package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokengate/tokengate/config"
)

// testCA issues certificates for tests; nothing is written to the repository.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

var serials atomic.Int64

func newTestCA(t testing.TB, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serials.Add(1)),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

func (ca *testCA) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// issue returns a leaf certificate and its key as PEM, and its serial number.
// A server certificate is valid for 127.0.0.1 and "tokengate", or the
// names given; a client one for client authentication.
func (ca *testCA) issue(t testing.TB, name string, server bool, dnsNames ...string) (certPEM, keyPEM []byte, serial int64) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial = serials.Add(1)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
		tmpl.DNSNames = []string{"tokengate"}
		if len(dnsNames) > 0 {
			tmpl.DNSNames = dnsNames
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), serial
}

func (ca *testCA) clientCert(t testing.TB, name string) tls.Certificate {
	t.Helper()
	c, k, _ := ca.issue(t, name, false)
	cert, err := tls.X509KeyPair(c, k)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

// replace writes data to path the way certificate rotation does: a new file
// renamed over the old one, so a reader sees the old or the new file whole.
func replace(t testing.TB, path string, data []byte) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// dialAccepted handshakes with addr and waits for the server's greeting,
// which it sends once it accepted the handshake (with TLS 1.3 a refused
// client certificate shows only then).
func dialAccepted(addr string, cfg *tls.Config) (*tls.Conn, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(conn, make([]byte, 1)); err != nil {
		conn.Close()
		return nil, err
	}
	conn.SetReadDeadline(time.Time{})
	return conn, nil
}

// serverSerial returns the serial number of the certificate the server at
// addr presents, or the handshake's error.
func serverSerial(addr string, cfg *tls.Config) (int64, error) {
	conn, err := dialAccepted(addr, cfg)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.Int64(), nil
}

// Certificates, keys and client CAs rotate without a restart: each new
// handshake sees the files as they are now; a rotation caught half-way keeps
// the previous files in service and is logged once.
func TestTLSReload(t *testing.T) {
	dir := t.TempDir()
	files := config.ListenerTLS{
		CertFile:     filepath.Join(dir, "server.crt"),
		KeyFile:      filepath.Join(dir, "server.key"),
		ClientCAFile: filepath.Join(dir, "clients.crt"),
	}
	serverCA, clientsA, clientsB := newTestCA(t, "server CA"), newTestCA(t, "clients A"), newTestCA(t, "clients B")
	cert1, key1, serial1 := serverCA.issue(t, "tokengate", true)
	replace(t, files.CertFile, cert1)
	replace(t, files.KeyFile, key1)
	replace(t, files.ClientCAFile, clientsA.pem)

	var logs syncBuffer
	cfg, err := newServerTLS("listeners.grpc_tls", files, []string{"h2"}, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if c.(*tls.Conn).Handshake() != nil {
					return
				}
				if _, err := c.Write([]byte("k")); err == nil { // the greeting
					io.Copy(c, c)
				}
			}()
		}
	}()
	addr := lis.Addr().String()
	client := func(ca *testCA) *tls.Config {
		return &tls.Config{RootCAs: serverCA.pool(), ServerName: "tokengate", NextProtos: []string{"h2"},
			Certificates: []tls.Certificate{ca.clientCert(t, "envoy")}}
	}

	if got, err := serverSerial(addr, client(clientsA)); err != nil || got != serial1 {
		t.Fatalf("first handshake: serial %d, %v; want %d", got, err, serial1)
	}
	if _, err := serverSerial(addr, client(clientsB)); err == nil {
		t.Fatal("a client certificate from another CA was accepted")
	}
	noCert := client(clientsA)
	noCert.Certificates = nil
	if _, err := serverSerial(addr, noCert); err == nil {
		t.Fatal("a client without a certificate was accepted")
	}

	// An open connection is not affected by a rotation.
	open, err := dialAccepted(addr, client(clientsA))
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()

	// A rotation caught half-way: the new certificate, the old key.
	cert2, key2, serial2 := serverCA.issue(t, "tokengate", true)
	replace(t, files.CertFile, cert2)
	for range 3 {
		if got, err := serverSerial(addr, client(clientsA)); err != nil || got != serial1 {
			t.Fatalf("half-way rotation: serial %d, %v; want the previous %d", got, err, serial1)
		}
	}
	if n := strings.Count(logs.String(), "cannot be loaded"); n != 1 {
		t.Errorf("the half-way rotation was logged %d times, want once:\n%s", n, logs.String())
	}
	replace(t, files.KeyFile, key2)
	if got, err := serverSerial(addr, client(clientsA)); err != nil || got != serial2 {
		t.Fatalf("after rotation: serial %d, %v; want %d", got, err, serial2)
	}
	if !strings.Contains(logs.String(), "TLS files reloaded") {
		t.Errorf("the reload was not logged:\n%s", logs.String())
	}
	if _, err := fmt.Fprint(open, "x"); err != nil {
		t.Errorf("open connection after rotation: %v", err)
	} else if _, err := io.ReadFull(open, make([]byte, 1)); err != nil {
		t.Errorf("open connection after rotation: %v", err)
	}

	// The client CA rotates too: B's clients in, A's out.
	replace(t, files.ClientCAFile, clientsB.pem)
	if _, err := serverSerial(addr, client(clientsB)); err != nil {
		t.Errorf("client of the new CA refused: %v", err)
	}
	if _, err := serverSerial(addr, client(clientsA)); err == nil {
		t.Error("client of the retired CA accepted")
	}
}

// Files that are missing or invalid at start-up stop serve with the field's
// name; nothing starts on a certificate that cannot be read.
func TestTLSStartupErrors(t *testing.T) {
	dir := t.TempDir()
	ca := newTestCA(t, "ca")
	cert, key, _ := ca.issue(t, "tokengate", true)
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		replace(t, p, data)
		return p
	}
	good, goodKey := write("c.pem", cert), write("k.pem", key)
	for _, tc := range []struct {
		name  string
		files config.ListenerTLS
		want  string
	}{
		{"missing certificate", config.ListenerTLS{CertFile: filepath.Join(dir, "nope.pem"), KeyFile: goodKey}, "nope.pem"},
		{"key of another certificate", config.ListenerTLS{CertFile: good, KeyFile: write("other.pem", func() []byte { _, k, _ := ca.issue(t, "x", true); return k }())}, "cert_file and key_file"},
		{"client CA without certificates", config.ListenerTLS{CertFile: good, KeyFile: goodKey, ClientCAFile: write("ca.pem", []byte("not PEM"))}, "no PEM certificates"},
	} {
		_, err := newListenerTLS(config.Listeners{GRPCTLS: &tc.files}, slog.New(slog.DiscardHandler))
		if err == nil || !strings.Contains(err.Error(), "listeners.grpc_tls") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want it to name listeners.grpc_tls and %q", tc.name, err, tc.want)
		}
	}
}

// tlsBench is a listener configuration on files with mTLS, and a client for it.
func tlsBench(b *testing.B) (server, client *tls.Config, f *tlsFiles) {
	dir := b.TempDir()
	serverCA, clients := newTestCA(b, "server CA"), newTestCA(b, "clients")
	cert, key, _ := serverCA.issue(b, "tokengate", true)
	files := config.ListenerTLS{CertFile: filepath.Join(dir, "c"), KeyFile: filepath.Join(dir, "k"), ClientCAFile: filepath.Join(dir, "ca")}
	for p, d := range map[string][]byte{files.CertFile: cert, files.KeyFile: key, files.ClientCAFile: clients.pem} {
		if err := os.WriteFile(p, d, 0o600); err != nil {
			b.Fatal(err)
		}
	}
	f = &tlsFiles{field: "bench", files: files, protos: []string{"h2"}, log: slog.New(slog.DiscardHandler)}
	if err := f.reload(nil); err != nil {
		b.Fatal(err)
	}
	server = &tls.Config{MinVersion: tls.VersionTLS12, GetConfigForClient: f.configForClient}
	client = &tls.Config{RootCAs: serverCA.pool(), ServerName: "tokengate", NextProtos: []string{"h2"},
		Certificates: []tls.Certificate{clients.clientCert(b, "envoy")}}
	return server, client, f
}

// BenchmarkTLSFilesCheck is what the reload check adds to every handshake (a
// stat of each file); compare with BenchmarkTLSHandshake, a whole mTLS
// handshake of the same configuration.
func BenchmarkTLSFilesCheck(b *testing.B) {
	_, _, f := tlsBench(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := f.configForClient(nil); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkTLSHandshake(b *testing.B) {
	server, client, _ := tlsBench(b)
	b.ReportAllocs()
	for b.Loop() {
		c, s := net.Pipe()
		errc := make(chan error, 1)
		go func() { errc <- tls.Server(s, server).Handshake() }()
		if err := tls.Client(c, client).Handshake(); err != nil {
			b.Fatal(err)
		}
		if err := <-errc; err != nil {
			b.Fatal(err)
		}
		c.Close()
		s.Close()
	}
}
