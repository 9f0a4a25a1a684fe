package extproc

import (
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tokengate/tokengate/buckets"
)

// S16: reset and Retry-After formats.
func TestFormats(t *testing.T) {
	for _, tc := range []struct {
		d           time.Duration
		reset, wait string
	}{
		{0, "0s", "1"},
		{250 * time.Millisecond, "250ms", "1"},
		{1500 * time.Microsecond, "2ms", "1"},
		{12 * time.Second, "12s", "12"},
		{12*time.Second + time.Millisecond, "13s", "13"},
		{90 * time.Second, "1m30s", "90"},
		{2*time.Hour + 5*time.Second, "2h0m5s", "7205"},
	} {
		if got := formatReset(tc.d); got != tc.reset {
			t.Errorf("formatReset(%v) = %q, want %q", tc.d, got, tc.reset)
		}
		if got := retryAfter(tc.d); got != tc.wait {
			t.Errorf("retryAfter(%v) = %q, want %q", tc.d, got, tc.wait)
		}
	}
}

// S9a: keys are escaped so that no identity forges another key, and hashed
// identities never show the raw value.
func TestKeys(t *testing.T) {
	if a, b := bucketKey("p", "user", identityPart("a:b")), bucketKey("p", "user:a", identityPart("b")); a == b {
		t.Errorf("keys collide: %q", a)
	}
	if got := bucketKey("gold", "user", identityPart("alice")); got != "tg:gold:user:alice" {
		t.Errorf("key %q", got)
	}
	hm := headersOf("authorization", "Bearer sk-secret")
	v, ok, err := lookupIdentity(Identity{Name: "k", Header: "authorization", Hash: true}, hm, headerMap(hm), nil)
	if !ok || err != nil || strings.Contains(v, "secret") || !strings.HasPrefix(v, "h.") {
		t.Errorf("hashed identity %q (%v)", v, err)
	}
	md := map[string]*structpb.Struct{"jwt": mustStruct(t, map[string]any{"claims": map[string]any{"sub": "u1", "n": 7.0}})}
	for path, want := range map[string]string{"claims.sub": "u1", "claims.n": "7", "claims.x": "", "claims": ""} {
		got, _, _ := lookupIdentity(Identity{Name: "u", Metadata: "jwt", Path: path}, nil, nil, md)
		if got != want {
			t.Errorf("metadata %s = %q, want %q", path, got, want)
		}
	}
}

func mustStruct(t *testing.T, m map[string]any) *structpb.Struct {
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// NewServer refuses only what no configuration file can get wrong; the
// policies' rules live in package config.
func TestConfigErrors(t *testing.T) {
	_, err := NewServer(Config{Policies: []Policy{{Name: "p", Buckets: []BucketRule{{Name: "b", Limit: buckets.Limit{Capacity: 1, Rate: 1}}}}}})
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"Store is required", "Counter is required"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

// Logs carry the request's policy, id and decision, never the prompt or the
// key (STYLE: no prompts or keys above debug).
func TestLogsNoSecrets(t *testing.T) {
	var buf syncBuffer
	pol := Policy{Name: "p", Identities: []Identity{{Name: "key", Header: "authorization", Hash: true}},
		Buckets: []BucketRule{{Name: "user", Per: "key", Limit: buckets.Limit{Capacity: 100, Rate: 1}}}}
	r := newRig(t, nil, rigOptions{policies: []Policy{pol}, logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	r.post(t, chatPath, `{"model":"m","max_tokens":500,"messages":[{"role":"user","content":"my secret prompt"}]}`,
		map[string]string{"authorization": "Bearer sk-secret-123", "x-request-id": "req-42"})
	r.outcome(t)
	logs := buf.String()
	for _, want := range []string{`"policy":"p"`, `"request_id":"req-42"`, `"decision":"never_admissible"`} {
		if !strings.Contains(logs, want) {
			t.Errorf("logs lack %s:\n%s", want, logs)
		}
	}
	for _, secret := range []string{"sk-secret", "secret prompt"} {
		if strings.Contains(logs, secret) {
			t.Errorf("logs show %q:\n%s", secret, logs)
		}
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// S7: the learned output estimate is per choice: a request with n choices
// reports the output of all of them, and the estimate is multiplied by n
// again when the next request asks for n choices. The server hands the
// estimator the whole output with the request's count; the fake learns it
// per choice as tokenizer.Counter.Observe does (TestObservePerChoice).
func TestLearnedEstimateRecordsPerChoiceOutput(t *testing.T) {
	u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(
		`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":30,"total_tokens":40}}`)}}
	r := newRig(t, u, rigOptions{})
	r.post(t, chatPath, `{"model":"m","n":3,"messages":[]}`, nil)
	if o := r.outcome(t); o.Settled != 40 {
		t.Fatalf("outcome %+v, want the reported 40 settled", o)
	}
	r.counter.mu.Lock()
	defer r.counter.mu.Unlock()
	if diff := cmp.Diff([]int{10}, r.counter.observed); diff != "" {
		t.Errorf("observed output per request (-want +got):\n%s", diff)
	}
}
