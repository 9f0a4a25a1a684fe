package standin_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"

	rlfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/tokengate/tokengate/envoy/standin"
)

// limitBob is a rate-limit service that refuses user bob.
type limitBob struct {
	rlsv3.UnimplementedRateLimitServiceServer
}

func (limitBob) ShouldRateLimit(_ context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	code := rlsv3.RateLimitResponse_OK
	if req.GetDescriptors()[0].GetEntries()[0].GetValue() == "bob" {
		code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	return &rlsv3.RateLimitResponse{OverallCode: code}, nil
}

func ExampleNewRateLimitProxy() {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	gs := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(gs, limitBob{})
	go gs.Serve(lis)
	defer gs.Stop()
	rls, err := standin.Dial(lis.Addr().String(), nil)
	if err != nil {
		panic(err)
	}
	defer rls.Close()

	llm := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") }))
	defer llm.Close()
	upstream, _ := url.Parse(llm.URL)

	// The filter as Envoy YAML would give it, in its JSON form.
	var filter rlfilterv3.RateLimit
	if err := protojson.Unmarshal([]byte(`{
		"domain": "ai-gateway", "timeout": "5s", "failure_mode_deny": true,
		"rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}}, "transport_api_version": "V3"},
		"rate_limits": [{"actions": [{"request_headers": {"header_name": "x-user-id", "descriptor_key": "user"}}]}]
	}`), &filter); err != nil {
		panic(err)
	}
	p, err := standin.NewRateLimitProxy(standin.RateLimitConfig{RLS: rls, Filter: &filter, Upstream: upstream})
	if err != nil {
		panic(err)
	}
	defer p.Close()
	front := httptest.NewServer(p.Handler())
	defer front.Close()

	for _, user := range []string{"alice", "bob"} {
		req, _ := http.NewRequest("GET", front.URL+"/v1/models", nil)
		req.Header.Set("x-user-id", user)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(user, resp.StatusCode, resp.Header.Get("x-envoy-ratelimited"), string(body))
	}
	// Output:
	// alice 200  hello
	// bob 429 true
}
