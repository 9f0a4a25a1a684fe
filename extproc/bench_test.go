package extproc

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/lease"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/envoy/standin"
	"github.com/tokengate/tokengate/internal/redistest"
	"github.com/tokengate/tokengate/tokenizer"
)

// bareServer is the protocol's own cost: it answers every message with an
// empty CONTINUE (in FULL_DUPLEX_STREAMED, the response body echoed back).
type bareServer struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (bareServer) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		req, err := s.Recv()
		if err != nil {
			return nil
		}
		var resp *extprocv3.ProcessingResponse
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
		case *extprocv3.ProcessingRequest_RequestBody:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
				Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
					StreamedResponse: &extprocv3.StreamedBodyResponse{Body: r.ResponseBody.GetBody(), EndOfStream: r.ResponseBody.GetEndOfStream()},
				}}},
			}}}
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
		default:
			continue
		}
		if err := s.Send(resp); err != nil {
			return nil
		}
	}
}

// benchBody is a chat request of about 1 KB.
var benchBody = func() string {
	text := strings.TrimSpace(strings.Repeat("The quick brown fox jumps over the lazy dog. ", 21))
	return fmt.Sprintf(`{"model":"gpt-4o-mini","stream":true,"max_tokens":256,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":%q}]}`, text)
}()

// benchStream is a streamed answer of 200 one-token events and its usage,
// written by the upstream in 10 flushes.
var benchStream = func() [][]byte {
	var chunks [][]byte
	for range 10 {
		chunks = append(chunks, sse(words(20)...))
	}
	chunks = append(chunks, streamOf(`{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":230,"completion_tokens":200,"total_tokens":430}}`))
	return chunks
}()

type benchTarget struct {
	name     string
	register func(testing.TB, *grpc.Server)
	// calls, when set, counts the target's calls to Redis.
	calls *redisCalls
}

// redisCalls is a go-redis hook that counts the script calls a benchmark
// makes, and those that touch the provider bucket, which every request
// shares: the hot key.
type redisCalls struct{ all, hot atomic.Int64 }

func (c *redisCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *redisCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := cmd.Name(); n == "evalsha" || n == "eval" {
			c.all.Add(1)
			for _, a := range cmd.Args() {
				if k, ok := a.(string); ok && strings.Contains(k, ":provider:") {
					c.hot.Add(1)
					break
				}
			}
		}
		return next(ctx, cmd)
	}
}

func (c *redisCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// BenchmarkDecisionPath drives the whole decision path through real gRPC on
// loopback and the Envoy stand-in (FULL_DUPLEX_STREAMED responses): a 1 KB
// chat request and a streamed 200-token answer, 64 concurrent streams. The
// bare server is the protocol's own cost; compare req/s of the others with
// it. p50/p99 are per request, end to end. redis-lease leases both buckets
// (lease: auto, S20); the Redis targets report their script calls per
// request, in all and on the provider bucket every request shares.
func BenchmarkDecisionPath(b *testing.B) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := tc.Count(tokenizer.Request{Path: chatPath, Body: []byte(benchBody)}); err != nil {
		b.Fatal(err)
	}
	policy := []Policy{{Name: "bench", InjectUsage: true,
		Identities: []Identity{{Name: "key", Header: "authorization", Hash: true}},
		Buckets: []BucketRule{
			{Name: "user", Per: "key", Limit: buckets.Limit{Capacity: 1e12, Rate: 1e9}},
			{Name: "provider", Provider: true, Hard: true, Limit: buckets.Limit{Capacity: 1e12, Rate: 1e9}},
		}}}
	leased := []Policy{policy[0]}
	leased[0].Buckets = slices.Clone(policy[0].Buckets)
	for i := range leased[0].Buckets {
		leased[0].Buckets[i].Lease = &buckets.Lease{}
	}
	serve := func(policy []Policy, store func(testing.TB) buckets.Store) func(testing.TB, *grpc.Server) {
		return func(tb testing.TB, g *grpc.Server) {
			s, err := NewServer(Config{Policies: policy, DefaultPolicy: "bench", Store: store(tb),
				Counter: tc, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				tb.Fatal(err)
			}
			s.Register(g)
		}
	}
	tokengate := func(store func(testing.TB) buckets.Store) func(testing.TB, *grpc.Server) { return serve(policy, store) }
	redisStore := func(tb testing.TB, calls *redisCalls) *redisstore.Store {
		srv := redistest.Start(tb)
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 128})
		c.AddHook(calls)
		tb.Cleanup(func() { c.Close() })
		return redisstore.New(c, redisstore.Options{})
	}
	plainCalls, leaseCalls := new(redisCalls), new(redisCalls)
	targets := []benchTarget{
		{"bare", func(_ testing.TB, g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, bareServer{}) }, nil},
		{"memory", tokengate(func(testing.TB) buckets.Store { return buckets.NewMemory(buckets.MemoryOptions{}) }), nil},
		{"redis", tokengate(func(tb testing.TB) buckets.Store { return redisStore(tb, plainCalls) }), plainCalls},
		{"redis-lease", serve(leased, func(tb testing.TB) buckets.Store {
			rs := redisStore(tb, leaseCalls)
			ls := lease.New(rs, rs, lease.Options{})
			tb.Cleanup(func() {
				if err := ls.Close(context.Background()); err != nil {
					tb.Error(err)
				}
			})
			return ls
		}), leaseCalls},
	}
	for _, tg := range targets {
		b.Run(tg.name, func(b *testing.B) { benchPath(b, tg, 64) })
	}
	// One stream at a time: the latency tokengate adds, without queueing.
	for _, tg := range targets {
		b.Run(tg.name+"-serial", func(b *testing.B) { benchPath(b, tg, 1) })
	}
}

func benchPath(b *testing.B, tg benchTarget, streams int) {
	g := grpc.NewServer()
	tg.register(b, g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go g.Serve(lis)
	defer g.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("content-type", "text/event-stream")
		f := w.(http.Flusher)
		for _, c := range benchStream {
			w.Write(c)
			f.Flush()
		}
	}))
	defer up.Close()
	upURL, _ := url.Parse(up.URL)
	proxy, err := standin.New(standin.Config{ExtProc: conn, Upstream: upURL, MessageTimeout: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer proxy.Close()
	front := httptest.NewServer(proxy)
	defer front.Close()
	tr := &http.Transport{MaxIdleConnsPerHost: 256}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}

	var mu sync.Mutex
	var lat []time.Duration
	b.SetParallelism(max(1, streams/runtimeProcs()))
	b.ResetTimer()
	var all0, hot0 int64
	if tg.calls != nil {
		all0, hot0 = tg.calls.all.Load(), tg.calls.hot.Load()
	}
	start, cpu0 := time.Now(), cpuTime()
	run := b.RunParallel
	if streams == 1 {
		run = func(body func(*testing.PB)) { body(nil) }
	}
	run(func(pb *testing.PB) {
		var mine []time.Duration
		next := func() bool { return pb.Next() }
		if pb == nil {
			n := 0
			next = func() bool { n++; return n <= b.N }
		}
		for i := 0; next(); i++ {
			t0 := time.Now()
			req, _ := http.NewRequest("POST", front.URL+chatPath, strings.NewReader(benchBody))
			req.Header.Set("authorization", fmt.Sprintf("Bearer sk-%d", i%16))
			resp, err := client.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			n, err := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || n < 200*50 {
				b.Errorf("status %d, %d bytes, %v", resp.StatusCode, n, err)
				return
			}
			mine = append(mine, time.Since(t0))
		}
		mu.Lock()
		lat = append(lat, mine...)
		mu.Unlock()
	})
	elapsed, cpu := time.Since(start), cpuTime()-cpu0
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
	// CPU time of the whole process (client, stand-in, upstream and server)
	// per request: unlike req/s, it does not depend on what else runs on
	// the machine.
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/req")
	if tg.calls != nil {
		b.ReportMetric(float64(tg.calls.all.Load()-all0)/float64(b.N), "redis-calls/req")
		b.ReportMetric(float64(tg.calls.hot.Load()-hot0)/float64(b.N), "hot-key-calls/req")
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
		b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkResponseChunk is the per-chunk work of a metered stream, without
// gRPC: frame, read, count live and forward one chunk of 20 events.
func BenchmarkResponseChunk(b *testing.B) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		b.Fatal(err)
	}
	s, err := NewServer(Config{
		Policies:      []Policy{{Name: "p", Buckets: []BucketRule{{Name: "g", Hard: true, Limit: buckets.Limit{Capacity: 1e12, Rate: 1e9}}}}},
		DefaultPolicy: "p", Store: buckets.NewMemory(buckets.MemoryOptions{}), Counter: tc,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		b.Fatal(err)
	}
	chunk := sse(words(20)...)
	send := func(*extprocv3.ProcessingResponse) error { return nil }
	newStream := func() *processor {
		p := newProcessor(context.Background(), s, s.live.Load(), "p")
		p.respMode = 4 // FULL_DUPLEX_STREAMED
		if err := p.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: []byte(benchBody), EndOfStream: true}}}, send); err != nil {
			b.Fatal(err)
		}
		if err := p.handle(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
			ResponseHeaders: &extprocv3.HttpHeaders{Headers: headersOf(":status", "200", "content-type", "text/event-stream")}}}, send); err != nil {
			b.Fatal(err)
		}
		return p
	}
	p := newStream()
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: chunk}}}
	b.ReportAllocs()
	b.SetBytes(int64(len(chunk)))
	for i := 0; b.Loop(); i++ {
		if i%10 == 9 { // a stream is 10 chunks (200 tokens) long
			p.settle()
			p = newStream()
		}
		if err := p.handle(msg, send); err != nil {
			b.Fatal(err)
		}
	}
}
