package extproc

import (
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

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
	if a, b := bucketKey("p", "user", "a:b"), bucketKey("p", "user:a", "b"); a == b {
		t.Errorf("keys collide: %q", a)
	}
	if got := bucketKey("gold", "user", "alice"); got != "tg:gold:user:alice" {
		t.Errorf("key %q", got)
	}
	v, ok := lookupIdentity(Identity{Name: "k", Header: "authorization", Hash: true}, map[string]string{"authorization": "Bearer sk-secret"}, nil)
	if !ok || strings.Contains(v, "secret") || !strings.HasPrefix(v, "h.") {
		t.Errorf("hashed identity %q", v)
	}
	md := map[string]*structpb.Struct{"jwt": mustStruct(t, map[string]any{"claims": map[string]any{"sub": "u1", "n": 7.0}})}
	for path, want := range map[string]string{"claims.sub": "u1", "claims.n": "7", "claims.x": "", "claims": ""} {
		got, _ := lookupIdentity(Identity{Name: "u", Metadata: "jwt", Path: path}, nil, md)
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

// S1, S23: every configuration problem is reported at once, naming its
// field.
func TestConfigErrors(t *testing.T) {
	_, err := NewServer(Config{
		DefaultPolicy: "nope",
		Policies: []Policy{{
			Name: "p", Anonymous: "maybe",
			Identities: []Identity{{Name: "k"}, {Name: "model", Header: "x"}},
			Buckets: []BucketRule{
				{Name: "a", Per: "ghost", Limit: buckets.Limit{Capacity: 0, Rate: 1}},
				{Name: "a", Limit: buckets.Limit{Capacity: 10, Rate: -1}, Headroom: 10},
			},
			Concurrency:     []ConcurrencyRule{{Name: "c", Max: 0}},
			MaxOutputTokens: -1,
		}, {Name: "p"}},
	})
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{
		"Store: is required", "Counter: is required", "DefaultPolicy: names no policy",
		"Policies[0].Anonymous", "Policies[0].Identities[0]: one of Header or Metadata",
		"Policies[0].Identities[1].Name", "Policies[0].Buckets[0].Per", "Policies[0].Buckets[0].Limit.Capacity",
		"Policies[0].Buckets[1].Name: duplicate", "Policies[0].Buckets[1].Limit.Rate", "Policies[0].Buckets[1].Headroom",
		"Policies[0].Concurrency[0].Max", "Policies[0].MaxOutputTokens", "Policies[1].Name: duplicate",
		"Policies[1].Buckets: at least one",
	} {
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
