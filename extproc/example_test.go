package extproc_test

import (
	"fmt"
	"log"
	"time"

	"google.golang.org/grpc"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/extproc"
	"github.com/tokengate/tokengate/tokenizer"
)

// A server with one policy: each API key (hashed) gets 30k tokens a minute,
// the provider account 900k, and no answer may exceed 4096 tokens.
func ExampleNewServer() {
	counter, err := tokenizer.New(tokenizer.Options{FallbackEncoding: tokenizer.O200kBase})
	if err != nil {
		log.Fatal(err)
	}
	srv, err := extproc.NewServer(extproc.Config{
		Policies: []extproc.Policy{{
			Name:       "default",
			Identities: []extproc.Identity{{Name: "key", Header: "authorization", Hash: true}},
			Buckets: []extproc.BucketRule{
				{Name: "key", Per: "key", Limit: buckets.PerMinute(30_000, 0)},
				{Name: "openai", Provider: true, Limit: buckets.PerMinute(900_000, 0)},
			},
			MaxOutputTokens: 4096,
			InjectUsage:     true,
			MaxWait:         2 * time.Second,
			MaxQueue:        100,
		}},
		DefaultPolicy: "default",
		Store:         buckets.NewMemory(buckets.MemoryOptions{}),
		Counter:       counter,
	})
	if err != nil {
		log.Fatal(err)
	}
	g := grpc.NewServer()
	srv.Register(g)
	fmt.Println("ready")
	// Output: ready
}

// A missing part is reported; policies are validated by package config
// before they get here.
func ExampleNewServer_invalid() {
	_, err := extproc.NewServer(extproc.Config{
		Policies: []extproc.Policy{{Name: "p", Buckets: []extproc.BucketRule{{Name: "b", Limit: buckets.Limit{Capacity: 100, Rate: 10}}}}},
		Store:    buckets.NewMemory(buckets.MemoryOptions{}),
	})
	fmt.Println(err)
	// Output:
	// extproc config: Counter is required
}
