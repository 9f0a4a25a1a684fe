package main

import (
	"context"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// listeners.max_connection_age (ratelimit's GRPC_MAX_CONNECTION_AGE): the
// served tokengate ends a connection once it is that old, so the client
// dials again and its next calls may reach a replica added since; a
// stream open on the aged connection goes on meanwhile (no grace limit).
func TestMaxConnectionAgeMovesClients(t *testing.T) {
	bin := tokengateBinary(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, "store: {type: memory}\nlisteners: {max_connection_age: 1s}\npolicies: [{name: default, buckets: [{name: all, tokens_per_minute: 60000}]}]\n")
	p := startServe(t, bin, nil, "--config", file)

	var dials atomic.Int32
	conn, err := grpc.NewClient(p.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			dials.Add(1)
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	watch, err := health.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := watch.Recv(); err != nil || st.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("watch: %v, %v", st, err)
	}
	watchErr := make(chan error, 1)
	go func() {
		_, err := watch.Recv() // nothing more comes while the gateway serves
		watchErr <- err
	}()
	deadline := time.Now().Add(20 * time.Second)
	for dials.Load() < 2 {
		if _, err := health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Logf("check while the connection ages: %v", err) // one may meet the GOAWAY
		}
		if time.Now().After(deadline) {
			t.Fatalf("one connection after 20s, want a second once the first is 1s old")
		}
		time.Sleep(20 * time.Millisecond) // polling the dials, with the deadline above
	}
	if _, err := health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("check on the new connection: %v", err)
	}
	select {
	case err := <-watchErr:
		t.Errorf("the stream open on the aged connection ended: %v", err)
	default:
	}
	cancel() // the watch ends, and serve stops without waiting for it
	if err := <-watchErr; err == nil {
		t.Error("the watch ended without an error")
	}
	p.stop(t)
}
