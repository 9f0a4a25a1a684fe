package extproc

import (
	"context"
	"strings"
	"sync"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/tokenizer"
)

// spyCounter is the real tokenizer, recording every count the processor
// asks for and the Precount it hands over (nil through Count).
type spyCounter struct {
	tokenizerCounter
	mu     sync.Mutex
	counts []spied
}

type spied struct {
	pre *tokenizer.Precount
	c   tokenizer.Count
	err error
}

func (s *spyCounter) Count(req tokenizer.Request) (tokenizer.Count, error) {
	return s.CountPrecounted(req, nil)
}

func (s *spyCounter) CountPrecounted(req tokenizer.Request, pre *tokenizer.Precount) (tokenizer.Count, error) {
	c, err := s.Counter.CountPrecounted(req, pre)
	s.mu.Lock()
	s.counts = append(s.counts, spied{pre, c, err})
	s.mu.Unlock()
	return c, err
}

func (s *spyCounter) last(t *testing.T) spied {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.counts) == 0 {
		t.Fatal("the request was not counted")
	}
	return s.counts[len(s.counts)-1]
}

// precountBody is a chat request with two long prompts (escapes, CJK,
// emoji: chunks cut through UTF-8 sequences and escapes) whose model comes
// last, as SDKs that sort keys send it.
func precountBody() []byte {
	long := strings.TrimSuffix(strings.TrimPrefix(string(bigChat(40_000)), `{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"`), `"}]}`)
	return []byte(`{"messages":[{"role":"system","content":"` + long + `"},{"role":"user","content":[{"type":"text","text":"` + long + `"}]}],"model":"gpt-4o-mini","stream":true}`)
}

// In STREAMED and FULL_DUPLEX_STREAMED mode the body's long strings are
// counted as the chunks arrive, and the count at the end is the count of
// the whole body, field by field (S7), whatever the chunks; a BUFFERED body
// is counted whole.
func TestPrecountedBodyModes(t *testing.T) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	body := precountBody()
	want, err := tc.Count(tokenizer.Request{Path: chatPath, Policy: "p", Body: body})
	if err != nil {
		t.Fatal(err)
	}
	spy := &spyCounter{tokenizerCounter: tokenizerCounter{tc}}
	s, outcomes := requestServer(t, 1e9, spy, 1<<20)
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{buffered, streamed, duplex} {
		for _, size := range []int{7_919, 32 << 10, len(body) - 1} {
			for _, trailers := range []bool{false, true} {
				drive(t, s, exchange(mode, body, size, size%2 == 0, trailers))
				if o := <-outcomes; o.Decision != "admitted" {
					t.Fatalf("%v size %d trailers %v: %s", mode, size, trailers, o.Decision)
				}
				got := spy.last(t)
				if got.err != nil {
					t.Fatalf("%v size %d trailers %v: %v", mode, size, trailers, got.err)
				}
				if diff := cmp.Diff(want, got.c); diff != "" {
					t.Errorf("%v size %d trailers %v: count differs from the whole body's (-want +got):\n%s", mode, size, trailers, diff)
				}
				if mode == buffered {
					if got.pre != nil {
						t.Errorf("BUFFERED size %d: a Precount for a body in one message", size)
					}
					continue
				}
				if got.pre == nil {
					t.Fatalf("%v size %d trailers %v: the body was not precounted", mode, size, trailers)
				}
				if strs, used := got.pre.Precounted(); strs != 2 || used != 2 {
					t.Errorf("%v size %d trailers %v: %d strings precounted, %d used; want 2, 2", mode, size, trailers, strs, used)
				}
			}
		}
	}
}

// The Precount goes with the decision, and with a body refused for its
// size: nothing of it outlives the request phase.
func TestPrecountReleased(t *testing.T) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	body := precountBody()
	for _, tt := range []struct {
		name    string
		maxBody int
		want    string
	}{
		{"decided", 1 << 20, "headers"},
		{"too large", len(body) - 1000, "immediate 413"},
	} {
		for _, mode := range []filterv3.ProcessingMode_BodySendMode{streamed, duplex} {
			s, outcomes := requestServer(t, 1e9, tokenizerCounter{tc}, tt.maxBody)
			p := newProcessor(context.Background(), s, s.live.Load(), "p")
			var kinds []string
			precounted := false
			for _, m := range exchange(mode, body, 4096, false, false) {
				if p.done {
					break
				}
				if err := p.handle(m, func(r *extprocv3.ProcessingResponse) error {
					kinds = append(kinds, kindOf(r))
					return nil
				}); err != nil {
					t.Fatal(err)
				}
				precounted = precounted || p.req.pre != nil
			}
			if !precounted {
				t.Errorf("%s %v: the body was never precounted", tt.name, mode)
			}
			if p.req.pre != nil {
				t.Errorf("%s %v: the Precount outlives the request phase", tt.name, mode)
			}
			if !strings.Contains(strings.Join(kinds, ","), tt.want) {
				t.Errorf("%s %v: answers %v, want %s among them", tt.name, mode, kinds, tt.want)
			}
			p.finish()
			<-outcomes
		}
	}
}
