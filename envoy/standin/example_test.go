package standin_test

import (
	"crypto/tls"
	"crypto/x509"
	"log"
	"net/http"
	"net/url"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/envoy/standin"
)

// Example puts the stand-in in front of a mock LLM, with tokengate as the ext_proc server
// and a per-route policy passed as gRPC initial metadata.
func Example() {
	cc, err := grpc.NewClient("127.0.0.1:50051", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	upstream, _ := url.Parse("http://127.0.0.1:8081")
	p, err := standin.New(standin.Config{
		ExtProc:  cc,
		Upstream: upstream,
		Routes: []standin.Route{
			{Prefix: "/v1/", InitialMetadata: map[string]string{"x-tokengate-policy": "gold"}},
			{Prefix: "/healthz", Disabled: true},
		},
		ReceivingNamespaces: []string{"tokengate"},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
	srv := p.Server() // HTTP/1.1 and h2c
	srv.Addr = "127.0.0.1:8080"
	if err := srv.ListenAndServe(); err != http.ErrServerClosed {
		log.Fatal(err)
	}
}

// ExampleDial reaches a tokengate that serves ext_proc over mTLS
// (listeners.grpc_tls with client_ca_file), as Envoy's cluster would with an
// UpstreamTlsContext transport_socket.
func ExampleDial() {
	envoyCert, err := tls.LoadX509KeyPair("envoy.crt", "envoy.key") // issued by tokengate's client_ca_file
	if err != nil {
		log.Fatal(err)
	}
	caPEM, err := os.ReadFile("tokengate-ca.crt") // the CA of tokengate's cert_file
	if err != nil {
		log.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	cc, err := standin.Dial("tokengate.internal:50051", &tls.Config{
		Certificates: []tls.Certificate{envoyCert},
		RootCAs:      roots,
		ServerName:   "tokengate.internal",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	upstream, _ := url.Parse("http://127.0.0.1:8081")
	p, err := standin.New(standin.Config{ExtProc: cc, Upstream: upstream})
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
}
