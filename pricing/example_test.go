package pricing_test

import (
	"fmt"

	"github.com/tokengate/tokengate/pricing"
)

func ExampleTable_Cost() {
	table, err := pricing.Config{
		Models: []pricing.Entry{{Model: "gpt-4o-mini", Snapshots: []string{"gpt-4o-mini-2024-07-18"},
			Input: "0.15", CachedInput: "0.075", Output: "0.60"}},
	}.Table()
	if err != nil {
		panic(err)
	}
	// OpenAI usage: prompt_tokens 1200 of which cached_tokens 1024,
	// completion_tokens 250. The router prefix and the snapshot the entry
	// names resolve to the gpt-4o-mini entry.
	usage := pricing.Usage{InputTokens: 1200, CachedInputTokens: 1024, OutputTokens: 250}
	cost, err := table.Cost("openai/gpt-4o-mini-2024-07-18", usage)
	if err != nil {
		panic(err)
	}
	// 176×0.15 + 1024×0.075 + 250×0.60 = 253.2 micro-dollars, rounded up.
	fmt.Println(int64(cost), "micro-USD =", cost, table.Currency())

	reserve, _ := table.MaxCost("gpt-4o-mini", 1200, 4096)
	fmt.Println("reservation for 1200 in, 4096 out:", reserve)

	_, err = table.Cost("gpt-9", usage)
	fmt.Println(err)
	// Output:
	// 254 micro-USD = 0.000254 USD
	// reservation for 1200 in, 4096 out: 0.002638
	// no price for model "gpt-9"
}
