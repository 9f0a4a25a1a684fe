package redisstore_test

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/tokengate/tokengate/buckets"
	"github.com/tokengate/tokengate/buckets/redisstore"
)

// ExampleNew shows a store shared by a fleet of gateways. With a
// *redis.ClusterClient the store splits chains by hash slot by itself.
func ExampleNew() {
	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer client.Close()
	store := redisstore.New(client, redisstore.Options{Prefix: "tg:"})

	ctx := context.Background()
	user := buckets.Bucket{Name: "user", Key: "user:42", Limit: buckets.PerMinute(60000, 0)}
	d, err := store.Reserve(ctx, buckets.Request{Cost: 1200, Buckets: []buckets.Bucket{user}})
	if err != nil {
		fmt.Println("store unavailable:", err) // apply the failure mode (S21)
		return
	}
	if !d.OK {
		fmt.Println("refused by", d.Limiting, "for", d.Wait)
		return
	}
	// … forward the request, count the response, then:
	store.Settle(ctx, d.Reservation, 950)
}
