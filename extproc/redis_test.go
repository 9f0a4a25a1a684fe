package extproc

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
	"github.com/tokengate/tokengate/internal/redistest"
)

// The same request flow on the Redis store (S20): admitted, streamed, cut
// at a hard bucket, settled exactly once, then refused while the hard budget
// is spent.
func TestRedisStoreEndToEnd(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { c.Close() })
	u := &upstream{Chunks: [][]byte{sse(words(50)...)}, Hang: true}
	pol := Policy{Name: "p", Buckets: []BucketRule{
		{Name: "team", Hard: true, Limit: buckets.Limit{Capacity: 40, Rate: 1e-6}},
		{Name: "provider", Provider: true, Limit: buckets.Limit{Capacity: 1e6, Rate: 1e3}},
	}}
	r := newRig(t, u, rigOptions{policies: []Policy{pol}, store: redisstore.New(c, redisstore.Options{})})
	resp, got := r.post(t, chatPath, `{"model":"m","stream":true,"max_tokens":5,"stream_options":{"include_usage":true},"messages":[]}`, nil)
	if resp.StatusCode != 200 || !strings.HasSuffix(got, "data: [DONE]\n\n") || !strings.Contains(got, `"finish_reason":"length"`) {
		t.Fatalf("status %d, stream:\n%s", resp.StatusCode, got)
	}
	o := r.outcome(t)
	// 10 input + 5 reserved output, extended in batches while the hard
	// bucket allows: 30 more output tokens delivered, the 31st cut.
	if !o.CutOff || o.Settled != 10+31 || o.Reserved != 40 {
		t.Errorf("outcome %+v, want cut off with 40 reserved and 41 settled", o)
	}
	r.store.settlements(t)
	if resp, _ := r.post(t, chatPath, `{"model":"m","max_tokens":1,"messages":[]}`, nil); resp.StatusCode != 429 {
		t.Errorf("with the hard budget spent: %d, want 429", resp.StatusCode)
	}
}
