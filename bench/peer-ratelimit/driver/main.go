// Command peerdriver is a closed-loop load driver that compares, in one run,
// envoyproxy/ratelimit (gRPC RateLimitService/ShouldRateLimit with a token
// count in hits_addend, as Envoy AI Gateway uses it) with tokengate (an
// ext_proc server that reserves at request time and settles at response end).
//
// It talks only to the addresses it is given (run.sh passes 127.0.0.1 ports),
// sends a bounded number of requests, and reads CPU from /proc/PID/stat of
// the two servers and INFO cpu / INFO commandstats of their shared Redis.
//
// Systems measured (each a "decision" = one simulated LLM request):
//
//	rl1  one ShouldRateLimit, descriptor user=<id>, descriptor hits_addend = -hits
//	rl2  the AI Gateway shape: ShouldRateLimit with hits_addend 0 at request
//	     time (check only), then ShouldRateLimit with hits_addend = -hits at
//	     stream end (the charge)
//	tg   one ext_proc Process stream in tokengate's recommended mode (request
//	     body BUFFERED, response body FULL_DUPLEX_STREAMED): request_headers,
//	     request_body (reserve), response_headers, response_body with usage
//	     (settle); the client half-closes and waits for the server to end the
//	     stream, which it does only after settlement.
//	bare the same exchange with a server that answers every message at once
//	     and does nothing else (-bare-server): what the protocol itself costs,
//	     the floor of any ext_proc server.
//
// Rounds interleave the systems (order rotated per round) at every
// concurrency level, so machine noise hits all of them.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

var (
	rlsAddr   = flag.String("rls", "", "ratelimit gRPC address (host:port)")
	rlsPID    = flag.Int("rls-pid", 0, "ratelimit server PID (CPU from /proc)")
	tgAddr    = flag.String("tg", "", "tokengate ext_proc gRPC address (host:port)")
	tgPID     = flag.Int("tg-pid", 0, "tokengate server PID")
	bareAddr  = flag.String("bare", "", "address of a bare ext_proc server (-bare-server), for system bare")
	barePID   = flag.Int("bare-pid", 0, "PID of the bare ext_proc server")
	bareServe = flag.String("bare-server", "", "run only a bare ext_proc server on this address: it answers every message at once with an empty CONTINUE (the response body echoed as a streamed response, end of stream with it)")
	trAddr    = flag.String("tgrls", "", "tokengate's RateLimitService address (systems tr1, tr2: the rl1 and rl2 shapes sent to tokengate)")
	trPID     = flag.Int("tgrls-pid", 0, "PID of the tokengate serving -tgrls")
	redisAddr = flag.String("redis", "", "redis address shared by both (INFO cpu / commandstats)")
	nReq      = flag.Int("n", 20000, "decisions per (system, concurrency, round)")
	warmup    = flag.Int("warmup", 2000, "unmeasured decisions per system before round 1")
	concList  = flag.String("conc", "1,16,64", "concurrency levels")
	rounds    = flag.Int("rounds", 3, "rounds")
	conns     = flag.Int("conns", 2, "gRPC connections per system (Envoy opens one per worker thread)")
	users     = flag.Int("users", 1000, "distinct user ids")
	hits      = flag.Uint64("hits", 500, "token count charged per request through ratelimit (hits_addend)")
	domain    = flag.String("domain", "ai-gateway", "ratelimit domain")
	descKey   = flag.String("key", "user", "ratelimit descriptor key")
	policy    = flag.String("policy", "bench", "tokengate policy (x-tokengate-policy initial metadata)")
	idHeader  = flag.String("id-header", "x-user-id", "identity header tokengate's policy reads")
	systems   = flag.String("systems", "rl1,rl2,tg", "systems to measure")
	offPathF  = flag.Bool("offpath", true, "do what Envoy does off the client's path in the background, as Envoy does: rl2's charge (apply_on_stream_done) and waiting for tokengate's end of stream after the half-close (its settlement); the round waits for all of it before it reads CPU, so it is counted, but the next request of a worker does not wait for it")
	outFile   = flag.String("out", "", "write one JSON line per measurement here")
	timeout   = flag.Duration("timeout", 10*time.Second, "per-decision deadline")
	freePorts = flag.Int("freeports", 0, "print this many free 127.0.0.1 TCP ports and exit (for run.sh)")
	statsSink = flag.String("statsd-sink", "", "run only a TCP listener on this address that discards what it gets (a stand-in for the statsd receiver of ratelimit's USE_STATSD=true, whose gostats sink speaks TCP)")
)

// The request and response bodies of the simulated LLM call.
const (
	chatBody = `{"model":"gpt-4o-mini","max_tokens":50,"messages":[{"role":"user","content":"hello"}]}`
	respBody = `{"id":"chatcmpl-bench","object":"chat.completion","created":1764547200,"model":"gpt-4o-mini-2024-07-18",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help you today?"},"logprobs":null,"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":8,"completion_tokens":9,"total_tokens":17},"system_fingerprint":"fp_bench"}`
)

type result struct {
	Round      int                   `json:"round"`
	System     string                `json:"system"`
	Conc       int                   `json:"conc"`
	N          int                   `json:"n"`
	Errors     int64                 `json:"errors"`
	FirstErr   string                `json:"first_error,omitempty"`
	WallS      float64               `json:"wall_s"`
	RPS        float64               `json:"rps"`
	P50us      float64               `json:"p50_us"`
	P99us      float64               `json:"p99_us"`
	AdmitP50us float64               `json:"admit_p50_us"` // until the request may go upstream
	AdmitP99us float64               `json:"admit_p99_us"`
	ServerUS   float64               `json:"server_cpu_us_per_req"`
	RedisUS    float64               `json:"redis_cpu_us_per_req"`
	RedisCmdUS float64               `json:"redis_cmd_us_per_req"` // INFO commandstats usec of top-level commands
	RedisCalls float64               `json:"redis_calls_per_req"`  // top-level commands per decision
	ClientUS   float64               `json:"client_cpu_us_per_req"`
	RedisMemB  float64               `json:"redis_mem_bytes_per_req"` // INFO memory used_memory growth
	Cmds       map[string][2]float64 `json:"redis_cmds"`              // per decision: calls, usec
}

// op runs one decision; admit is the time until the request could be sent
// upstream (rl2: the check; tg: the request body answer; rl1: the call).
type op func(ctx context.Context, worker int, i int64) (admit time.Duration, err error)

func main() {
	flag.Parse()
	if *freePorts > 0 {
		printFreePorts(*freePorts)
		return
	}
	if *statsSink != "" {
		discardTCP(*statsSink)
		return
	}
	if *bareServe != "" {
		serveBare(*bareServe)
		return
	}
	levels := parseInts(*concList)
	sysNames := strings.Split(*systems, ",")

	ops := map[string]op{}
	pids := map[string]int{}
	for _, s := range sysNames {
		switch s {
		case "rl1", "rl2":
			if *rlsAddr == "" {
				fatalf("-rls is required for %s", s)
			}
			pids[s] = *rlsPID
		case "tr1", "tr2":
			if *trAddr == "" {
				fatalf("-tgrls is required for %s", s)
			}
			pids[s] = *trPID
		case "tg":
			if *tgAddr == "" {
				fatalf("-tg is required for tg")
			}
			pids[s] = *tgPID
		case "bare":
			if *bareAddr == "" {
				fatalf("-bare is required for bare")
			}
			pids[s] = *barePID
		default:
			fatalf("unknown system %q", s)
		}
	}
	var rlsClients []rlsv3.RateLimitServiceClient
	if *rlsAddr != "" {
		for range *conns {
			cc := dial(*rlsAddr)
			rlsClients = append(rlsClients, rlsv3.NewRateLimitServiceClient(cc))
		}
	}
	var trClients []rlsv3.RateLimitServiceClient
	if *trAddr != "" {
		for range *conns {
			trClients = append(trClients, rlsv3.NewRateLimitServiceClient(dial(*trAddr)))
		}
	}
	var tgClients []extprocv3.ExternalProcessorClient
	if *tgAddr != "" {
		for range *conns {
			cc := dial(*tgAddr)
			tgClients = append(tgClients, extprocv3.NewExternalProcessorClient(cc))
		}
	}
	var bareClients []extprocv3.ExternalProcessorClient
	if *bareAddr != "" {
		for range *conns {
			bareClients = append(bareClients, extprocv3.NewExternalProcessorClient(dial(*bareAddr)))
		}
	}
	rlShape1 := func(clients *[]rlsv3.RateLimitServiceClient) op {
		return func(ctx context.Context, w int, i int64) (time.Duration, error) {
			c := (*clients)[w%len(*clients)]
			t0 := time.Now()
			err := shouldRateLimit(ctx, c, userID(i), *hits)
			return time.Since(t0), err
		}
	}
	rlShape2 := func(clients *[]rlsv3.RateLimitServiceClient) op {
		return func(ctx context.Context, w int, i int64) (time.Duration, error) {
			c := (*clients)[w%len(*clients)]
			t0 := time.Now()
			u := userID(i)
			if err := shouldRateLimit(ctx, c, u, 0); err != nil { // request time: check only
				return 0, err
			}
			admit := time.Since(t0)
			return admit, offPath(ctx, func(ctx context.Context) error { return shouldRateLimit(ctx, c, u, *hits) }) // stream end: charge the tokens
		}
	}
	ops["tr1"], ops["tr2"] = rlShape1(&trClients), rlShape2(&trClients)
	ops["rl1"] = func(ctx context.Context, w int, i int64) (time.Duration, error) {
		c := rlsClients[w%len(rlsClients)]
		t0 := time.Now()
		err := shouldRateLimit(ctx, c, userID(i), *hits)
		return time.Since(t0), err
	}
	ops["rl2"] = func(ctx context.Context, w int, i int64) (time.Duration, error) {
		c := rlsClients[w%len(rlsClients)]
		t0 := time.Now()
		u := userID(i)
		if err := shouldRateLimit(ctx, c, u, 0); err != nil { // request time: check only
			return 0, err
		}
		admit := time.Since(t0)
		return admit, offPath(ctx, func(ctx context.Context) error { return shouldRateLimit(ctx, c, u, *hits) }) // stream end: charge the tokens
	}
	ops["tg"] = func(ctx context.Context, w int, i int64) (time.Duration, error) {
		return extProcExchange(ctx, tgClients[w%len(tgClients)], userID(i), i)
	}
	ops["bare"] = func(ctx context.Context, w int, i int64) (time.Duration, error) {
		return extProcExchange(ctx, bareClients[w%len(bareClients)], userID(i), i)
	}

	var out *os.File
	if *outFile != "" {
		var err error
		out, err = os.Create(*outFile)
		if err != nil {
			fatalf("%v", err)
		}
		defer out.Close()
	}

	// Warm-up: connections, Redis keys for every user, scripts loaded,
	// tokengate's tokenizer and output estimate.
	for _, s := range sysNames {
		r := measure(ops[s], s, 0, 16, *warmup, 0)
		fmt.Printf("warmup %-3s %d decisions, %d errors %s\n", s, r.N, r.Errors, r.FirstErr)
		if r.Errors > 0 {
			fatalf("warm-up of %s failed: %s", s, r.FirstErr)
		}
	}

	var all []result
	fmt.Printf("%-5s %-4s %5s %9s %9s %9s %9s %9s %10s %10s %9s %7s %9s %8s %6s\n",
		"round", "sys", "conc", "req/s", "p50 us", "p99 us", "adm50 us", "adm99 us", "srvCPU us", "redisCPU", "redisCmd", "calls", "clientCPU", "memB", "errs")
	for r := 1; r <= *rounds; r++ {
		for li, c := range levels {
			// rotate the order per round and level
			order := rotate(sysNames, (r-1)+li)
			for _, s := range order {
				res := measure(ops[s], s, pids[s], c, *nReq, r)
				all = append(all, res)
				fmt.Printf("%-5d %-4s %5d %9.0f %9.0f %9.0f %9.0f %9.0f %10.1f %10.1f %9.1f %7.2f %9.1f %8.1f %6d\n",
					r, s, c, res.RPS, res.P50us, res.P99us, res.AdmitP50us, res.AdmitP99us, res.ServerUS, res.RedisUS, res.RedisCmdUS, res.RedisCalls, res.ClientUS, res.RedisMemB, res.Errors)
				if res.FirstErr != "" {
					fmt.Printf("      first error: %s\n", res.FirstErr)
				}
				if out != nil {
					b, _ := json.Marshal(res)
					out.Write(append(b, '\n'))
				}
			}
		}
	}
	summarize(all, levels, sysNames)
}

// printFreePorts holds n loopback listeners open at once (so the ports
// differ), prints their ports and closes them.
func printFreePorts(n int) {
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fatalf("%v", err)
		}
		ls = append(ls, l)
	}
	for _, l := range ls {
		fmt.Println(l.Addr().(*net.TCPAddr).Port)
		l.Close()
	}
}

// discardTCP accepts connections and drops what they send until the
// process is killed.
func discardTCP(addr string) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		fatalf("%v", err)
	}
	for {
		c, err := l.Accept()
		if err != nil {
			fatalf("%v", err)
		}
		go func() { io.Copy(io.Discard, c); c.Close() }()
	}
}

func rotate(s []string, k int) []string {
	n := len(s)
	o := make([]string, n)
	for i := range s {
		o[i] = s[(i+k)%n]
	}
	return o
}

func dial(addr string) *grpc.ClientConn {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fatalf("dial %s: %v", addr, err)
	}
	return cc
}

func userID(i int64) string { return "u" + strconv.FormatInt(i%int64(*users), 10) }

func shouldRateLimit(ctx context.Context, c rlsv3.RateLimitServiceClient, user string, addend uint64) error {
	resp, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{
		Domain: *domain,
		Descriptors: []*rlcommon.RateLimitDescriptor{{
			Entries:    []*rlcommon.RateLimitDescriptor_Entry{{Key: *descKey, Value: user}},
			HitsAddend: wrapperspb.UInt64(addend), // per descriptor, as Envoy's hits_addend action sends it; 0 = check only
		}},
	})
	if err != nil {
		return err
	}
	if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		return fmt.Errorf("ratelimit answered %v", resp.GetOverallCode())
	}
	if len(resp.GetStatuses()) != 1 || resp.GetStatuses()[0].GetCurrentLimit() == nil {
		return fmt.Errorf("ratelimit matched no limit (statuses %v): check the config's domain/descriptor", resp.GetStatuses())
	}
	return nil
}

func hdrs(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(kv)/2)}
	for i := 0; i < len(kv); i += 2 {
		// current Envoy sends the value in raw_value only
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

var reqCounter atomic.Int64

// extProcExchange plays Envoy's ext_proc filter for one LLM request in
// tokengate's recommended mode and returns the time until the request body
// was answered (the reservation; Envoy would now contact the upstream).
func extProcExchange(ctx context.Context, c extprocv3.ExternalProcessorClient, user string, i int64) (time.Duration, error) {
	t0 := time.Now()
	ctx = metadata.NewOutgoingContext(ctx, metadata.Pairs("x-tokengate-policy", *policy))
	if *offPathF {
		ctx = context.WithoutCancel(ctx) // the stream outlives this call (offPath)
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer func() { cancel() }()
	st, err := c.Process(ctx)
	if err != nil {
		return 0, err
	}
	rid := fmt.Sprintf("bench-%d-%d", os.Getpid(), reqCounter.Add(1))
	msgs := []*extprocv3.ProcessingRequest{
		{
			Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs(
				":authority", "llm.local", ":path", "/v1/chat/completions", ":method", "POST", ":scheme", "http",
				"user-agent", "OpenAI/Python 1.99.0", "content-type", "application/json",
				"content-length", strconv.Itoa(len(chatBody)), *idHeader, user,
				"x-forwarded-proto", "http", "x-request-id", rid,
			)}},
			MetadataContext: &corev3.Metadata{},
			ProtocolConfig: &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  filterv3.ProcessingMode_BUFFERED,
				ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			},
		},
		{
			Request:         &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(chatBody), EndOfStream: true}},
			MetadataContext: &corev3.Metadata{},
		},
		{
			Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: hdrs(
				":status", "200", "content-type", "application/json", "content-length", strconv.Itoa(len(respBody)),
				"date", "Mon, 01 Dec 2026 00:00:00 GMT", "x-envoy-upstream-service-time", "1",
			)}},
			MetadataContext: &corev3.Metadata{},
		},
		{
			Request:         &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(respBody), EndOfStream: true}},
			MetadataContext: &corev3.Metadata{},
		},
	}
	var admit time.Duration
	for k, m := range msgs {
		if err := st.Send(m); err != nil {
			return 0, fmt.Errorf("send %d: %w", k, err)
		}
		resp, err := st.Recv()
		if err != nil {
			return 0, fmt.Errorf("recv %d: %w", k, err)
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			return 0, fmt.Errorf("immediate response %v: %s", ir.GetStatus().GetCode(), ir.GetBody())
		}
		switch k {
		case 0:
			if resp.GetRequestHeaders() == nil {
				return 0, fmt.Errorf("answer to request headers is %T", resp.GetResponse())
			}
		case 1:
			if resp.GetRequestBody() == nil {
				return 0, fmt.Errorf("answer to request body is %T", resp.GetResponse())
			}
			admit = time.Since(t0)
		case 2:
			if resp.GetResponseHeaders() == nil {
				return 0, fmt.Errorf("answer to response headers is %T", resp.GetResponse())
			}
		case 3:
			// FULL_DUPLEX_STREAMED: streamed_response chunks until end_of_stream
			for {
				sr := resp.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
				if sr == nil {
					return 0, fmt.Errorf("answer to response body is not a streamed_response: %v", resp)
				}
				if sr.GetEndOfStream() {
					break
				}
				if resp, err = st.Recv(); err != nil {
					return 0, fmt.Errorf("recv body: %w", err)
				}
			}
		}
	}
	// Envoy half-closes the side stream once the response is complete; the
	// server settles before it reads that end, so waiting for the server's
	// end of stream includes the settlement.
	if err := st.CloseSend(); err != nil {
		return 0, err
	}
	keep := cancel
	cancel = func() {} // the stream lives on until the off-path wait ends
	return admit, offPath(ctx, func(context.Context) error {
		defer keep()
		for {
			_, err := st.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("stream end: %w", err)
			}
		}
	})
}

// Off-path work: what Envoy does after the client has its answer.
var (
	offWG   sync.WaitGroup
	offErrs atomic.Int64
	offErr  atomic.Value
)

// offPath runs fn in the background when -offpath is set (the round waits for
// it before reading CPU), inline otherwise.
func offPath(ctx context.Context, fn func(context.Context) error) error {
	if !*offPathF {
		return fn(ctx)
	}
	offWG.Add(1)
	go func() {
		defer offWG.Done()
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), *timeout)
		defer cancel()
		if err := fn(bctx); err != nil {
			offErrs.Add(1)
			offErr.CompareAndSwap(nil, err.Error())
		}
	}()
	return nil
}

// bareServer answers every message of a stream at once and does nothing
// else.
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
		default:
			continue
		}
		if err := s.Send(resp); err != nil {
			return nil
		}
	}
}

func serveBare(addr string) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		fatalf("%v", err)
	}
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, bareServer{})
	if err := g.Serve(l); err != nil {
		fatalf("%v", err)
	}
}

// ---- measurement ----

func measure(f op, sys string, pid, conc, n, round int) result {
	res := result{Round: round, System: sys, Conc: conc, N: n}
	lat := make([]time.Duration, n)
	adm := make([]time.Duration, n)
	var next atomic.Int64
	var errs atomic.Int64
	var firstErr atomic.Value

	srv0 := procCPU(pid)
	red0 := redisCPU()
	mem0 := redisUsedMemory()
	cmd0 := redisCmdStats()
	cli0 := selfCPU()
	start := time.Now()
	var wg sync.WaitGroup
	for w := range conc {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), *timeout)
				t0 := time.Now()
				a, err := f(ctx, w, i)
				lat[i] = time.Since(t0)
				adm[i] = a
				cancel()
				if err != nil {
					errs.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
			}
		}(w)
	}
	wg.Wait()
	wall := time.Since(start) // the client's closed loop
	offWG.Wait()              // off-path work done before CPU is read
	if e := offErrs.Swap(0); e > 0 {
		errs.Add(e)
		if v := offErr.Load(); v != nil {
			firstErr.CompareAndSwap(nil, "off path: "+v.(string))
		}
	}
	cli1 := selfCPU()
	cmd1 := redisCmdStats()
	mem1 := redisUsedMemory()
	red1 := redisCPU()
	srv1 := procCPU(pid)

	res.Errors = errs.Load()
	if v := firstErr.Load(); v != nil {
		res.FirstErr = v.(string)
	}
	res.WallS = wall.Seconds()
	res.RPS = float64(n) / wall.Seconds()
	res.P50us, res.P99us = pct(lat, 0.50), pct(lat, 0.99)
	res.AdmitP50us, res.AdmitP99us = pct(adm, 0.50), pct(adm, 0.99)
	fn := float64(n)
	if pid > 0 && srv0 >= 0 && srv1 >= 0 {
		res.ServerUS = (srv1 - srv0) / fn
	}
	if red0 >= 0 && red1 >= 0 {
		res.RedisUS = (red1 - red0) / fn
	}
	res.ClientUS = (cli1 - cli0) / fn
	if mem0 >= 0 && mem1 >= 0 {
		res.RedisMemB = (mem1 - mem0) / fn
	}
	res.Cmds = map[string][2]float64{}
	for k, v1 := range cmd1 {
		v0 := cmd0[k]
		dc, du := v1[0]-v0[0], v1[1]-v0[1]
		if k == "info" || dc <= 0 {
			continue
		}
		res.Cmds[k] = [2]float64{dc / fn, du / fn}
		if !scriptInner[k] || !runsScripts[sys] {
			res.RedisCalls += dc / fn
			res.RedisCmdUS += du / fn
		}
	}
	return res
}

// Commands a Lua script may call: commandstats counts them too (their time
// is inside the script's), so they are left out of the top-level totals of
// the systems whose server runs scripts. (Whether any script ran during a
// measurement does not tell: tokengate polls its overrides version with one
// while the peer is measured.)
var runsScripts = map[string]bool{"tg": true, "tr1": true, "tr2": true}

var scriptInner = map[string]bool{"mget": true, "set": true, "get": true, "zadd": true, "zrem": true, "zremrangebyscore": true,
	"zcard": true, "pexpire": true, "expire": true, "del": true, "time": true, "hget": true, "hset": true, "hmget": true,
	"exists": true, "incrby": true, "incrbyfloat": true, "psetex": true, "setex": true, "zscore": true, "zcount": true, "mset": true, "unlink": true}

func pct(d []time.Duration, p float64) float64 {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	k := int(math.Ceil(p*float64(len(s)))) - 1
	if k < 0 {
		k = 0
	}
	return float64(s[k]) / float64(time.Microsecond)
}

// procCPU is utime+stime of a process in µs (USER_HZ = 100), or -1.
func procCPU(pid int) float64 {
	if pid <= 0 {
		return -1
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return -1
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	f := strings.Fields(s[i+2:])
	// fields after ")": state(0) ... utime is field 14 overall -> index 11 here
	ut, _ := strconv.ParseFloat(f[11], 64)
	stt, _ := strconv.ParseFloat(f[12], 64)
	return (ut + stt) * 1e6 / 100
}

func selfCPU() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Sec+ru.Stime.Sec)*1e6 + float64(ru.Utime.Usec+ru.Stime.Usec)
}

// ---- a minimal RESP client for INFO ----

func redisInfo(section string) string {
	if *redisAddr == "" {
		return ""
	}
	c, err := net.DialTimeout("tcp", *redisAddr, 2*time.Second)
	if err != nil {
		return ""
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(c, "*2\r\n$4\r\nINFO\r\n$%d\r\n%s\r\n", len(section), section)
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil || len(line) < 2 || line[0] != '$' {
		return ""
	}
	n, _ := strconv.Atoi(strings.TrimSpace(line[1:]))
	buf := make([]byte, n+2)
	if _, err := io.ReadFull(r, buf); err != nil {
		return ""
	}
	return string(buf[:n])
}

// redisCPU is used_cpu_sys + used_cpu_user of redis-server in µs, or -1.
func redisCPU() float64 {
	info := redisInfo("cpu")
	var sum float64
	found := 0
	for _, l := range strings.Split(info, "\r\n") {
		k, v, ok := strings.Cut(l, ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, _ := strconv.ParseFloat(v, 64)
			sum += f
			found++
		}
	}
	if found != 2 {
		return -1
	}
	return sum * 1e6
}

// redisUsedMemory is INFO memory used_memory in bytes, or -1.
func redisUsedMemory() float64 {
	for _, l := range strings.Split(redisInfo("memory"), "\r\n") {
		if v, ok := strings.CutPrefix(l, "used_memory:"); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}

// redisCmdStats maps command name -> {calls, usec}.
func redisCmdStats() map[string][2]float64 {
	m := map[string][2]float64{}
	for _, l := range strings.Split(redisInfo("commandstats"), "\r\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok || !strings.HasPrefix(k, "cmdstat_") {
			continue
		}
		var calls, usec float64
		for _, kv := range strings.Split(v, ",") {
			a, b, _ := strings.Cut(kv, "=")
			switch a {
			case "calls":
				calls, _ = strconv.ParseFloat(b, 64)
			case "usec":
				usec, _ = strconv.ParseFloat(b, 64)
			}
		}
		m[strings.TrimPrefix(k, "cmdstat_")] = [2]float64{calls, usec}
	}
	return m
}

// ---- summary ----

func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func summarize(all []result, levels []int, sysNames []string) {
	get := func(sys string, c int, f func(result) float64) []float64 {
		var v []float64
		for _, r := range all {
			if r.System == sys && r.Conc == c {
				v = append(v, f(r))
			}
		}
		return v
	}
	cols := []struct {
		name string
		f    func(result) float64
	}{
		{"req/s", func(r result) float64 { return r.RPS }},
		{"p50 us", func(r result) float64 { return r.P50us }},
		{"p99 us", func(r result) float64 { return r.P99us }},
		{"admit p50", func(r result) float64 { return r.AdmitP50us }},
		{"admit p99", func(r result) float64 { return r.AdmitP99us }},
		{"server CPU us/req", func(r result) float64 { return r.ServerUS }},
		{"Redis CPU us/req", func(r result) float64 { return r.RedisUS }},
		{"Redis cmd us/req", func(r result) float64 { return r.RedisCmdUS }},
		{"Redis calls/req", func(r result) float64 { return r.RedisCalls }},
		{"driver CPU us/req", func(r result) float64 { return r.ClientUS }},
		{"Redis mem B/req", func(r result) float64 { return r.RedisMemB }},
	}
	fmt.Printf("\n## Medians over %d rounds\n\n| system | conc |", *rounds)
	for _, c := range cols {
		fmt.Printf(" %s |", c.name)
	}
	fmt.Printf(" errors |\n|---|---|")
	for range cols {
		fmt.Printf("---|")
	}
	fmt.Printf("---|\n")
	for _, c := range levels {
		for _, s := range sysNames {
			fmt.Printf("| %s | %d |", s, c)
			for _, col := range cols {
				fmt.Printf(" %s |", fmtNum(median(get(s, c, col.f))))
			}
			var e float64
			for _, x := range get(s, c, func(r result) float64 { return float64(r.Errors) }) {
				e += x
			}
			fmt.Printf(" %.0f |\n", e)
		}
	}
	// per-round ratios: tg / rl1, tg / rl2, and tokengate's RLS front against the same shapes
	for _, pair := range [][2]string{{"tg", "rl1"}, {"tg", "rl2"}, {"bare", "rl2"}, {"tg", "bare"}, {"tr1", "rl1"}, {"tr2", "rl2"}} {
		sys, base := pair[0], pair[1]
		if !contains(sysNames, sys) || !contains(sysNames, base) {
			continue
		}
		fmt.Printf("\n## %s / %s, per round (median in brackets)\n\n| conc | req/s | p50 | p99 | server CPU/req | Redis CPU/req |\n|---|---|---|---|---|---|\n", sys, base)
		for _, c := range levels {
			fmt.Printf("| %d |", c)
			for _, col := range []int{0, 1, 2, 5, 6} {
				f := cols[col].f
				var ratios []float64
				for r := 1; r <= *rounds; r++ {
					var a, b float64
					for _, x := range all {
						if x.Round == r && x.Conc == c && x.System == sys {
							a = f(x)
						}
						if x.Round == r && x.Conc == c && x.System == base {
							b = f(x)
						}
					}
					if b != 0 {
						ratios = append(ratios, a/b)
					}
				}
				var parts []string
				for _, x := range ratios {
					parts = append(parts, fmt.Sprintf("%.2f", x))
				}
				fmt.Printf(" %s [%.2f] |", strings.Join(parts, ", "), median(ratios))
			}
			fmt.Println()
		}
	}
}

func fmtNum(x float64) string {
	switch {
	case math.IsNaN(x):
		return "-"
	case math.Abs(x) >= 100:
		return fmt.Sprintf("%.0f", x)
	default:
		return fmt.Sprintf("%.1f", x)
	}
}

func contains(s []string, x string) bool {
	for _, y := range s {
		if y == x {
			return true
		}
	}
	return false
}

func parseInts(s string) []int {
	var v []int
	for _, p := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil {
			fatalf("bad int list %q", s)
		}
		v = append(v, n)
	}
	return v
}

func fatalf(f string, a ...any) {
	fmt.Fprintf(os.Stderr, "peerdriver: "+f+"\n", a...)
	os.Exit(2)
}
