package extproc

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A body over the body limit gets tokengate's 413 (S23), not a gRPC
// message-size error that Envoy turns into a 500: ServerOptions sets the
// gRPC receive limit above the body limit.
func TestBodyOverLimitGetsTokengates413(t *testing.T) {
	r := newRig(t, nil, rigOptions{maxBodyBytes: 1 << 20, bufferLimit: 16 << 20})
	body := `{"model":"m","messages":[],"pad":"` + strings.Repeat("x", 3<<20/2) + `"}`
	resp, got := r.post(t, chatPath, body, nil)
	if resp.StatusCode != 413 || !strings.Contains(got, `"request_too_large"`) {
		t.Errorf("%d %.200s, want tokengate's 413 request_too_large", resp.StatusCode, got)
	}
}

// An SSE stream without event boundaries is not buffered without bound:
// past MaxEventBytes of one unfinished event, the stream is forwarded
// unread and settled at the reservation (Outcome.StreamUnread).
func TestSSEWithoutEventBoundariesIsBounded(t *testing.T) {
	// Small enough to stay within one gRPC flow-control window (64 KiB):
	// the Envoy stand-in, unlike Envoy, blocks on sending while it does not
	// read.
	const limit = 8 << 10
	line := "data: " + strings.Repeat("x", 48<<10) // one event, never ended
	u := &upstream{Chunks: [][]byte{sse(words(3)...), []byte(line[:len(line)/2]), []byte(line[len(line)/2:])}, Hang: true}
	r := newRig(t, u, rigOptions{maxEventBytes: limit, chunkSize: 2 << 10})
	req, err := http.NewRequest("POST", r.front.URL+chatPath, strings.NewReader(`{"model":"m","stream":true,"max_tokens":50,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	want := string(sse(words(3)...)) + line
	got := make([]byte, len(want))
	read := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(resp.Body, got)
		read <- err
	}()
	select {
	case err := <-read:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the unfinished event was held back: nothing of it reached the client")
	}
	resp.Body.Close()
	if string(got) != want {
		t.Error("the client did not get the stream byte for byte")
	}
	o := r.outcome(t)
	if !o.StreamUnread || o.Settled != o.Reserved || o.Reserved != 60 {
		t.Errorf("outcome %+v, want the stream unread and settled at the reservation (60)", o)
	}
}

// A non-streamed body kept to read its usage is bounded and gap-free: once
// a chunk would pass the bound, nothing more is kept, so usage is never read
// from a body with a hole in it; the reservation stands.
func TestNonSSEBodyKeptGapFree(t *testing.T) {
	pad := strings.Repeat("x", 1250)
	body := `{"pad":"` + pad + `","usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`
	// Chunks of 600 bytes: the second would pass the 1 KiB bound; the
	// first and third joined are valid JSON with a usage.
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(body)}}
	r := newRig(t, u, rigOptions{maxBodyBytes: 1 << 10, chunkSize: 600})
	if len(body) <= 1200 || len(body) > 1800 {
		t.Fatalf("body of %d bytes does not make three chunks", len(body))
	}
	r.post(t, chatPath, `{"model":"m","max_tokens":50,"messages":[]}`, nil)
	if o := r.outcome(t); o.Usage || o.Settled != 60 {
		t.Errorf("outcome %+v, want no usage read and the reservation (60) settled", o)
	}
}

// A stream on which Envoy sends nothing for StreamIdleTimeout is ended.
func TestIdleStreamEnded(t *testing.T) {
	r := newRig(t, nil, rigOptions{idleTimeout: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := extprocv3.NewExternalProcessorClient(r.conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = st.Recv()
	if status.Code(err) != codes.DeadlineExceeded || ctx.Err() != nil {
		t.Errorf("idle stream: %v, want it ended by the server with DeadlineExceeded", err)
	}
}

// At most MaxStreams streams are open at once; one more is refused with
// ResourceExhausted.
func TestStreamCapRefusesBeyondMax(t *testing.T) {
	r := newRig(t, nil, rigOptions{maxStreams: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	client := extprocv3.NewExternalProcessorClient(r.conn)
	for range 2 {
		if _, err := client.Process(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for open := 0; open < 2; {
		r.srv.mu.Lock()
		open = len(r.srv.open)
		r.srv.mu.Unlock()
		if ctx.Err() != nil {
			t.Fatalf("the server has %d streams open, want 2", open)
		}
		time.Sleep(time.Millisecond) // polling a deadline
	}
	st, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("third stream: %v, want ResourceExhausted", err)
	}
}
