package standin

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
)

// Envoy never stops reading the server's answers while it sends: its gRPC client queues what
// it writes. With more than a flow-control window in flight both ways, a filter that waited
// in Send would stall for good — the server waits for it to read, it waits for the server.
// Here the server answers the first response chunk with 8 MiB of its own before reading on,
// while the upstream sends 8 MiB in 1 MiB chunks; the client must get the server's bytes.
func TestSendDoesNotBlockAnswers(t *testing.T) {
	const size, chunk = 8 << 20, 1 << 20
	h := newHarness(t, Config{ChunkSize: chunk}, func(ps *procStream) error {
		burst := false
		for {
			m, err := ps.recv()
			if err != nil {
				return nil
			}
			var answer *extprocv3.ProcessingResponse
			switch {
			case m.GetResponseBody() != nil && !burst:
				// Before reading on, the server sends all it has to say.
				burst = true
				for i := 0; i < size/chunk; i++ {
					if err := ps.send(responseBody(streamed(bytes.Repeat([]byte{'x'}, chunk), false))); err != nil {
						return nil
					}
				}
				answer = responseBody(streamed(nil, m.GetResponseBody().GetEndOfStream()))
			case m.GetResponseBody() != nil:
				answer = responseBody(streamed(nil, m.GetResponseBody().GetEndOfStream()))
			default:
				answer = echoAnswer(m, &extprocv3.ProtocolConfiguration{ResponseBodyMode: RecommendedMode().ResponseBodyMode}, nil)
			}
			if err := ps.send(answer); err != nil {
				return nil
			}
		}
	}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(200)
		w.Write(bytes.Repeat([]byte{'u'}, size))
	}, false)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", h.front.URL+"/v1/models", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h.client(false).Do(req)
	if err != nil {
		t.Fatalf("no response headers: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || len(b) != size || strings.Trim(string(b), "x") != "" {
		t.Fatalf("client got %d bytes (%v), want the server's %d: the stand-in stalled on flow control", len(b), err, size)
	}
}

func responseBody(m *extprocv3.BodyMutation) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
		Response: &extprocv3.CommonResponse{BodyMutation: m}}}}
}

// Config.Cuts cuts request and response bodies into chunks of exactly the sizes it gives, the
// last size repeating, whatever sizes the reads deliver; a body that ends on a boundary ends
// with an empty end_of_stream chunk.
func TestCuts(t *testing.T) {
	const reqBody, respBody = "abcdefghijklmnop", "0123456789"
	h := newHarness(t, Config{Mode: duplexRequestMode(), Cuts: func(r *http.Request, response bool) []int {
		if response {
			return []int{4, 3}
		}
		return []int{1, 0, 5}
	}}, echo, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "text/event-stream")
		w.WriteHeader(200)
		io.WriteString(w, respBody)
	}, false)
	if res := h.do(t, "POST", "/v1/chat/completions", reqBody); res.status != 200 || res.body != respBody {
		t.Fatalf("got %d %q", res.status, res.body)
	}
	if _, _, bodies := h.up.snapshot(); len(bodies) != 1 || string(bodies[0]) != reqBody {
		t.Errorf("upstream got %q, want %q", bodies, reqBody)
	}
	type piece struct {
		Body string
		EOS  bool
	}
	var req, resp []piece
	for _, m := range ended(t, h.next(t)).messages() {
		if b := m.GetRequestBody(); b != nil {
			req = append(req, piece{string(b.Body), b.EndOfStream})
		}
		if b := m.GetResponseBody(); b != nil {
			resp = append(resp, piece{string(b.Body), b.EndOfStream})
		}
	}
	wantReq := []piece{{"a", false}, {"b", false}, {"cdefg", false}, {"hijkl", false}, {"mnop", true}}
	wantResp := []piece{{"0123", false}, {"456", false}, {"789", false}, {"", true}}
	if diff := cmp.Diff(wantReq, req); diff != "" {
		t.Errorf("request chunks (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantResp, resp); diff != "" {
		t.Errorf("response chunks (-want +got):\n%s", diff)
	}
}
