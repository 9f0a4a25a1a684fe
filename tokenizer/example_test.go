package tokenizer_test

import (
	"fmt"

	"github.com/tokengate/tokengate/tokenizer"
)

func ExampleCounter_Count() {
	c, err := tokenizer.New(tokenizer.Options{DefaultOutputTokens: 1000})
	if err != nil {
		panic(err)
	}
	body := []byte(`{"model":"gpt-4o","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Name a prime."}],"max_tokens":20}`)
	n, err := c.Count(tokenizer.Request{Path: "/v1/chat/completions", Body: body})
	if err != nil {
		panic(err)
	}
	fmt.Println(n.Encoding, n.InputTokens, n.OutputAllowance, n.AllowanceSource, n.Reservation())
	// Output: o200k_base 19 20 request 39
}

func ExampleStream() {
	c, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		panic(err)
	}
	s := c.NewStream(tokenizer.O200kBase)
	for _, delta := range []string{"The answer", " is 4", "2, of cour", "se."} {
		s.Write(delta)
	}
	whole, _ := c.CountText(tokenizer.O200kBase, "The answer is 42, of course.")
	fmt.Println(s.Tokens(), whole)
	// Output: 9 9
}
