package tokenizer

import (
	"sync"
	"testing"

	"github.com/pkoukk/tiktoken-go"
	tiktoken_loader "github.com/pkoukk/tiktoken-go-loader"
)

// The oracle is tiktoken-go with its offline loader: counts must be
// identical to its EncodeOrdinary. It is used only by tests.
var (
	oracleOnce sync.Once
	oracles    map[string]*tiktoken.Tiktoken
	oracleErr  error
)

func oracle(t testing.TB, encoding string) *tiktoken.Tiktoken {
	t.Helper()
	oracleOnce.Do(func() {
		tiktoken.SetBpeLoader(tiktoken_loader.NewOfflineLoader())
		oracles = make(map[string]*tiktoken.Tiktoken)
		for _, e := range []string{O200kBase, Cl100kBase} {
			tk, err := tiktoken.GetEncoding(e)
			if err != nil {
				oracleErr = err
				return
			}
			oracles[e] = tk
		}
	})
	if oracleErr != nil {
		t.Fatalf("load tiktoken-go oracle: %v", oracleErr)
	}
	return oracles[encoding]
}

func newTestCounter(t testing.TB) *Counter {
	t.Helper()
	c, err := New(Options{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return c
}
