package standin

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkEcho measures one chat request through the stand-in with the recommended modes
// (BUFFERED request, FULL_DUPLEX_STREAMED response) against an echoing ext_proc server.
// Compare with BenchmarkDirect, the same request straight to the upstream.
func BenchmarkEcho(b *testing.B) {
	events := []string{sseA, sseB, sseA, sseB, sseC}
	h := newHarness(b, Config{}, echo, sse(events...), false)
	bench(b, h.client(false), h.front.URL, strings.Join(events, ""))
}

func BenchmarkDirect(b *testing.B) {
	events := []string{sseA, sseB, sseA, sseB, sseC}
	up := httptest.NewServer(&upstream{serve: sse(events...), gone: make(chan struct{}, 1)})
	defer up.Close()
	bench(b, &http.Client{Transport: &http.Transport{}}, up.URL, strings.Join(events, ""))
}

func bench(b *testing.B, c *http.Client, base, want string) {
	b.ReportAllocs()
	for b.Loop() {
		resp, err := c.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true}`))
		if err != nil {
			b.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != want {
			b.Fatalf("got %d %q, %v", resp.StatusCode, got, err)
		}
	}
}

// Many requests in a row through one stand-in (this found a stall once).
func TestEchoRepeated(t *testing.T) {
	events := []string{sseA, sseB, sseA, sseB, sseC}
	h := newHarness(t, Config{}, echo, sse(events...), false)
	c := h.client(false)
	for i := range 300 {
		resp, err := c.Post(h.front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(got) != strings.Join(events, "") {
			e := h.entry(t, i+1)
			t.Fatalf("request %d: %d %q %v; entry %+v", i, resp.StatusCode, got, err, e)
		}
	}
}
