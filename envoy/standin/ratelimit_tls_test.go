package standin

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// testPKI is a CA with a server and a client certificate.
type testPKI struct {
	pool           *x509.CertPool
	server, client tls.Certificate
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	caKey := key()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	leaf := func(serial int64, usage x509.ExtKeyUsage, dns string) tls.Certificate {
		k := key()
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: dns},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			ExtKeyUsage: []x509.ExtKeyUsage{usage}, DNSNames: []string{dns},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return &testPKI{pool: pool, server: leaf(2, x509.ExtKeyUsageServerAuth, "envoy-ratelimit"), client: leaf(3, x509.ExtKeyUsageClientAuth, "envoy")}
}

// serveRLSOn serves the recording service on a loopback TCP port, over TLS
// when creds is set.
func serveRLSOn(t *testing.T, rls *recordingRLS, creds credentials.TransportCredentials) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var opts []grpc.ServerOption
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	gs := grpc.NewServer(opts...)
	rlsv3.RegisterRateLimitServiceServer(gs, rls)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	return lis.Addr().String()
}

// Scenario 35 (§4.5, §5.2): the transports controllers configure. Envoy
// Gateway: mTLS to the service, Envoy presenting a client certificate and
// checking the server against the CA; without a client certificate the
// call fails and the failure mode applies. Envoy AI Gateway: plaintext
// h2c with a 5s timeout.
func TestRateLimitScenario35Transports(t *testing.T) {
	pki := newTestPKI(t)
	clientCN := make(chan string, 8)
	rls := &recordingRLS{arrived: make(chan rlsCall, 8), answer: func(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
		if p, ok := peer.FromContext(ctx); ok {
			if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
				clientCN <- ti.State.PeerCertificates[0].Subject.CommonName
			}
		}
		return ok(ctx, req)
	}}
	server := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{pki.server}, ClientCAs: pki.pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13,
	})
	addr := serveRLSOn(t, rls, server)
	for _, tt := range []struct {
		name   string
		certs  []tls.Certificate
		status int
	}{{"with a client certificate", []tls.Certificate{pki.client}, 200}, {"without", nil, 500}} {
		t.Run(tt.name, func(t *testing.T) {
			cc, err := Dial(addr, &tls.Config{RootCAs: pki.pool, Certificates: tt.certs, ServerName: "envoy-ratelimit", MaxVersion: tls.VersionTLS13})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cc.Close() })
			h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"failure_mode_deny: true\n"), RLS: cc}, nil, nil)
			if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != tt.status {
				t.Errorf("status %d, want %d (calls %+v)", res.status, tt.status, h.entry(t, 1).Calls)
			}
		})
	}
	if cn := <-clientCN; cn != "envoy" {
		t.Errorf("the service saw client certificate %q", cn)
	}

	plain := &recordingRLS{arrived: make(chan rlsCall, 8), answer: ok}
	cc, err := Dial(serveRLSOn(t, plain, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	h := newRLHarness(t, RateLimitConfig{Filter: filterConfig(t, userLimit+"timeout: 5s\n"), RLS: cc}, nil, nil)
	if res := h.do(t, "GET", "/", "", "x-user-id", "a"); res.status != 200 || len(plain.seen()) != 1 || plain.seen()[0].deadline > 5*time.Second {
		t.Errorf("plaintext: status %d, calls %v", res.status, plain.seen())
	}
}
