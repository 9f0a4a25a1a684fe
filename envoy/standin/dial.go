package standin

import (
	"crypto/tls"
	"math"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Dial returns a connection to the ext_proc server at target (host:port) for
// [Config.ExtProc], set up as Envoy's cluster for it would be: HTTP/2 in
// plaintext when tlsConfig is nil, else TLS with tlsConfig, like an
// UpstreamTlsContext transport_socket (RootCAs verifies the server,
// Certificates is the client certificate of mTLS, ServerName the SNI). As with
// Envoy's default max_receive_message_length, answers of any size are accepted.
// The connection is established lazily; the caller closes it.
func Dial(target string, tlsConfig *tls.Config) (*grpc.ClientConn, error) {
	creds := insecure.NewCredentials()
	if tlsConfig != nil {
		creds = credentials.NewTLS(tlsConfig)
	}
	return grpc.NewClient(target, grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32)))
}
