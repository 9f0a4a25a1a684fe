package extproc

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/tokenizer"
)

// prose returns a chat request whose prompt is about n bytes of varied
// text: random words of Latin, accented and CJK letters with punctuation,
// so that no run repeats for the tokenizer to take a short cut on.
func prose(n int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, 2))
	const latin = "etaoinshrdlucmfwypvbgkjqxz"
	accented := []rune("éèàüößçñ")
	cjk := []rune("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年")
	var b strings.Builder
	b.Grow(n + 64)
	b.WriteString(`{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"`)
	for b.Len() < n {
		switch k := rng.IntN(20); {
		case k < 16:
			for range 1 + rng.IntN(9) {
				b.WriteByte(latin[rng.IntN(len(latin))])
			}
		case k < 18:
			b.WriteRune(accented[rng.IntN(len(accented))])
			b.WriteString(strconv.Itoa(rng.IntN(1000)))
		default:
			for range 1 + rng.IntN(4) {
				b.WriteRune(cjk[rng.IntN(len(cjk))])
			}
		}
		b.WriteString([]string{" ", " ", " ", ", ", ". ", "\\n"}[rng.IntN(6)])
	}
	b.WriteString(`"}]}`)
	return []byte(b.String())
}

// hugeServer is a server that admits prompts of up to limit bytes (a
// memory store, the real tokenizer, no rewrite). Without precount it
// counts every body whole once it is complete, as it did before bodies
// were counted as they arrive.
func hugeServer(b *testing.B, tc *tokenizer.Counter, limit int, precount bool) *Server {
	b.Helper()
	pol := Policy{Name: "p", Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e12, Rate: 1}}}}
	var counter tokenCounter = tokenizerCounter{tc}
	if !precount {
		counter = wholeCounter{counter}
	}
	s, err := NewServer(Config{Policies: []Policy{pol}, DefaultPolicy: "p", Store: buckets.NewMemory(buckets.MemoryOptions{}),
		counter: counter, MaxBodyBytes: limit, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// wholeCounter hides the tokenizer's Precount: bodies are counted whole.
type wholeCounter struct{ tokenCounter }

// duplexPrompt sends body as Envoy does in FULL_DUPLEX_STREAMED mode: the
// headers with the content-length, then chunks of 32 KiB, each a buffer of
// its own as gRPC hands it over, and returns the bytes sent back and the
// time from handing over the last chunk to the decision (the headers
// answer, which FULL_DUPLEX_STREAMED withholds until then).
func duplexPrompt(b *testing.B, s *Server, body []byte, contentLength bool) (back int, wait time.Duration) {
	p := newProcessor(context.Background(), s, s.live.Load(), "p")
	defer p.finish()
	var last time.Time
	send := func(r *extprocv3.ProcessingResponse) error {
		if imm := r.GetImmediateResponse(); imm != nil {
			return fmt.Errorf("refused: %s", imm.GetBody())
		}
		if r.GetRequestHeaders() != nil {
			wait = time.Since(last)
		}
		back += len(r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody())
		return nil
	}
	hdr := []string{":path", chatPath, ":method", "POST"}
	if contentLength {
		hdr = append(hdr, "content-length", strconv.Itoa(len(body)))
	}
	msgs := []*extprocv3.ProcessingRequest{{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headersOf(hdr...)}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: duplex, ResponseBodyMode: duplex},
	}}
	if err := p.handle(msgs[0], send); err != nil {
		b.Fatal(err)
	}
	const chunk = 32 << 10
	for i := 0; i < len(body); i += chunk {
		end := min(i+chunk, len(body))
		m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: bytes.Clone(body[i:end]), EndOfStream: end == len(body)}}}
		if end == len(body) {
			last = time.Now()
		}
		if err := p.handle(m, send); err != nil {
			b.Fatal(err)
		}
	}
	return back, wait
}

// vmHWM resets the process's peak resident set (Linux clear_refs 5) and
// returns a function that reads how far it rose above the resident set at
// the reset, in MiB; -1 where /proc cannot tell.
func vmHWM() func() float64 {
	rss := func(field string) float64 {
		f, err := os.Open("/proc/self/status")
		if err != nil {
			return -1
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
				kb, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 64)
				if err != nil {
					return -1
				}
				return kb / 1024
			}
		}
		return -1
	}
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		return func() float64 { return -1 }
	}
	base := rss("VmRSS")
	return func() float64 {
		if base < 0 {
			return -1
		}
		return rss("VmHWM") - base
	}
}

// BenchmarkHugePrompt: a prompt of 5 and 50 MB in FULL_DUPLEX_STREAMED
// mode, as Envoy sends it (32 KiB chunks), through the processor: gathered,
// counted as it arrives, reserved and sent back in 64 KiB chunks, with a
// content-length ("duplex") and without ("chunked"); the same counted whole
// once it is complete ("whole", as before bodies were counted as they
// arrive); against counting the same body with the tokenizer alone
// ("count"). Each iteration runs the four in turn, so that their ratios
// come from the same moments of a shared machine. wait-ms is the time from
// handing over the last chunk to the decision; cpu-s the process's CPU
// time, user and system. peak-MiB is how far the process's resident set
// rose during one of them above where it stood before, with the heap
// returned to the OS first (the benchmark's own copy of the body is already
// in it); the largest of the iterations.
//
//	go test ./extproc -run '^$' -bench HugePrompt -benchtime 3x
func BenchmarkHugePrompt(b *testing.B) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		b.Fatal(err)
	}
	sizes := []int{5, 50}
	if raceEnabled {
		sizes = []int{1} // still run once by make test, not for its figures
	}
	for _, mb := range sizes {
		body := prose(mb<<20, 1)
		s, whole := hugeServer(b, tc, 64<<20, true), hugeServer(b, tc, 64<<20, false)
		want, err := tc.Count(tokenizer.Request{Path: chatPath, Body: body})
		if err != nil {
			b.Fatal(err)
		}
		prompt := func(s *Server, contentLength bool) func() time.Duration {
			return func() time.Duration {
				back, wait := duplexPrompt(b, s, body, contentLength)
				if back != len(body) {
					b.Fatalf("%d bytes sent back, want %d", back, len(body))
				}
				return wait
			}
		}
		ops := []struct {
			name string
			run  func() time.Duration // the wait for the decision after the last chunk
		}{
			{"count", func() time.Duration {
				if c, err := tc.Count(tokenizer.Request{Path: chatPath, Body: body}); err != nil || c.InputTokens != want.InputTokens {
					b.Fatalf("count %d, %v", c.InputTokens, err)
				}
				return 0
			}},
			{"duplex", prompt(s, true)},
			{"chunked", prompt(s, false)},
			{"whole", prompt(whole, true)},
		}
		b.Run(fmt.Sprintf("%dMB", mb), func(b *testing.B) {
			took := make([]time.Duration, len(ops))
			wait := make([]time.Duration, len(ops))
			cpu := make([]time.Duration, len(ops))
			peak := make([]float64, len(ops))
			for b.Loop() {
				for i, op := range ops {
					debug.FreeOSMemory()
					read := vmHWM()
					start, cpu0 := time.Now(), cpuTime()
					wait[i] += op.run()
					took[i] += time.Since(start)
					cpu[i] += cpuTime() - cpu0
					peak[i] = max(peak[i], read())
				}
			}
			const whole = 3
			for i, op := range ops {
				b.ReportMetric(took[i].Seconds()/float64(b.N), op.name+"-s/op")
				b.ReportMetric(cpu[i].Seconds()/float64(b.N), op.name+"-cpu-s/op")
				b.ReportMetric(peak[i], op.name+"-peak-MiB")
				if i > 0 {
					b.ReportMetric(float64(took[i])/float64(took[0]), op.name+"/count")
					b.ReportMetric(float64(wait[i].Microseconds())/1e3/float64(b.N), op.name+"-wait-ms")
				}
				if i > 0 && i != whole {
					b.ReportMetric(float64(wait[i])/float64(wait[whole]), op.name+"-wait/whole")
					b.ReportMetric(float64(cpu[i])/float64(cpu[whole]), op.name+"-cpu/whole")
				}
			}
			b.ReportMetric(float64(want.InputTokens), "tokens")
		})
	}
}
