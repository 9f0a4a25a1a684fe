package mockllm_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/examples/mockllm"
)

// cutter is an ext_proc server that passes everything and ends the response after the
// first response body chunk with a closing event, as a budget cut-off does.
type cutter struct {
	extprocv3.UnimplementedExternalProcessorServer
}

const closing = "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n"

func (cutter) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	cut := false
	for {
		m, err := s.Recv()
		if err != nil {
			return nil
		}
		var r *extprocv3.ProcessingResponse
		switch {
		case m.GetRequestHeaders() != nil:
			r = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
		case m.GetRequestBody() != nil:
			r = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
		case m.GetResponseHeaders() != nil:
			r = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
		case m.GetResponseBody() != nil && !cut:
			cut = true
			r = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: []byte(closing), EndOfStream: true}}}}}}}
		default:
			continue // late messages after the cut are ignored
		}
		if err := s.Send(r); err != nil {
			return nil
		}
	}
}

// The mock LLM behind the Envoy stand-in: a cut-off ends the client's stream cleanly and
// cancels generation, which the mock records.
func TestCutOffThroughStandin(t *testing.T) {
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, cutter{})
	go gs.Serve(lis)
	defer gs.Stop()
	cc, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()

	llm := mockllm.New(mockllm.Config{Pace: func(ctx context.Context, i int) error {
		if i == 3 { // hold the stream here until the client goes away
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}})
	up := httptest.NewServer(llm)
	defer up.Close()
	u, _ := url.Parse(up.URL)
	p, err := standin.New(standin.Config{ExtProc: cc, Upstream: u, MessageTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	front := httptest.NewServer(p)
	defer front.Close()

	resp, err := http.Post(front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true,"max_tokens":50}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || string(b) != closing {
		t.Fatalf("got %d %q %v, want the closing events", resp.StatusCode, b, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	recs, err := llm.WaitRequests(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if r := recs[0]; !r.Cancelled || r.TokensSent >= r.TokensPlanned {
		t.Errorf("mock record = %+v, want a cancelled, unfinished stream", r)
	}
	if es, err := p.WaitLog(ctx, 1); err != nil || !es[0].UpstreamCancelled {
		t.Errorf("stand-in log = %+v, %v", es, err)
	}
}

// Example serves the mock and asks it for three tokens.
func Example() {
	srv := httptest.NewServer(mockllm.New(mockllm.Config{PromptTokens: func([]byte) int { return 5 }}))
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, strings.Contains(string(b), `"content":"tok tok tok"`), strings.Contains(string(b), `"completion_tokens":3`))
	// Output: 200 true true
}

// ExampleReplay serves a recorded OpenAI stream in 64-byte chunks.
func ExampleReplay() {
	h, err := mockllm.Replay("../../testdata/providers/openai/chat-stream-gpt-4o-mini", 64)
	if err != nil {
		panic(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, resp.Header.Get("content-type"), len(b))
	// Output: 200 text/event-stream; charset=utf-8 3222
}
