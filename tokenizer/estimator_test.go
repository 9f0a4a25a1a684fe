package tokenizer

import (
	"sync"
	"testing"
)

// noCap is a chat body without an output cap.
var noCap = []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`)

// TestEstimatorSteps walks the learned allowance (S7) through its life: the
// default until enough completions are seen, then a high quantile of them,
// then it follows a change in the traffic as old completions decay.
func TestEstimatorSteps(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000, Estimator: EstimatorOptions{Quantile: 0.9, HalfLife: 20, MinSamples: 10}})
	if err != nil {
		t.Fatal(err)
	}
	count := func() Count {
		t.Helper()
		got, err := c.Count(Request{Policy: "p", Body: noCap})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	steps := []struct {
		name    string
		observe []int // completion lengths fed back before counting
		source  AllowanceSource
		lo, hi  int // allowance bounds
	}{
		{name: "nothing learned: default", source: FromDefault, lo: 1000, hi: 1000},
		{name: "too few samples: default", observe: repeat(100, 9), source: FromDefault, lo: 1000, hi: 1000},
		{name: "enough samples: about their length", observe: repeat(100, 1), source: FromHistory, lo: 100, hi: 110},
		// 90% of 100 and 10% of 500: the 0.9 quantile sits at the border;
		// adding more long ones moves it to the long ones.
		{name: "a heavier tail raises the quantile", observe: repeat(500, 10), source: FromHistory, lo: 500, hi: 550},
		{name: "recent short completions decay the old long ones", observe: repeat(50, 200), source: FromHistory, lo: 50, hi: 55},
	}
	uncapped := count()
	for _, s := range steps {
		for _, n := range s.observe {
			c.Observe("p", uncapped, n)
		}
		got := count()
		if got.AllowanceSource != s.source || got.OutputAllowance < s.lo || got.OutputAllowance > s.hi {
			t.Errorf("%s: allowance %d from %s, want [%d, %d] from %s", s.name, got.OutputAllowance, got.AllowanceSource, s.lo, s.hi, s.source)
		}
	}
	// Another policy and a request with its own cap are unaffected.
	if got, _ := c.Count(Request{Policy: "other", Body: noCap}); got.AllowanceSource != FromDefault {
		t.Errorf("other policy: allowance from %s, want default", got.AllowanceSource)
	}
	capped := []byte(`{"model":"gpt-4o","messages":[],"max_tokens":7}`)
	if got, _ := c.Count(Request{Policy: "p", Body: capped}); got.OutputAllowance != 7 || got.AllowanceSource != FromRequest {
		t.Errorf("capped request: allowance %d from %s, want 7 from request", got.OutputAllowance, got.AllowanceSource)
	}
}

func repeat(n, times int) []int {
	out := make([]int, times)
	for i := range out {
		out[i] = n
	}
	return out
}

// TestEstimatorBoundedKeys checks that hostile model names cannot grow the
// estimator without bound.
func TestEstimatorBoundedKeys(t *testing.T) {
	c, err := New(Options{Estimator: EstimatorOptions{MaxKeys: 3}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		c.Observe("p", Count{ModelKey: string(rune('a'+i%26)) + string(rune('a'+i/26)), Choices: 1, AllowanceSource: FromDefault}, 10)
	}
	if n := len(c.est.hists); n != 3 {
		t.Errorf("estimator holds %d keys, want 3", n)
	}
}

// TestEstimatorConcurrent exercises Observe and Count from many goroutines
// (run with -race).
func TestEstimatorConcurrent(t *testing.T) {
	c := newTestCounter(t)
	uncapped, err := c.Count(Request{Policy: "p", Body: noCap})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 200 {
				c.Observe("p", uncapped, 10*g+i)
				if _, err := c.Count(Request{Policy: "p", Body: noCap}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	got, _ := c.Count(Request{Policy: "p", Body: noCap})
	if got.AllowanceSource != FromHistory {
		t.Errorf("allowance from %s after 800 observations, want history", got.AllowanceSource)
	}
}

func TestBucketBounds(t *testing.T) {
	for _, n := range []int{0, 1, 2, 3, 7, 100, 1000, 12345, 1 << 20} {
		b := bucketOf(n)
		if up := bucketUpper(b); up < n || float64(up) > float64(n)*1.1+1 {
			t.Errorf("bucketUpper(bucketOf(%d)) = %d, want in [n, 1.1n+1]", n, up)
		}
	}
}

// TestObservePerChoice: the learned estimate is per choice. A request with
// n=4 that generated 400 tokens in all taught 100 per choice, so the next
// n=4 request reserves about 4 × 100, not 4 × 400 (S7).
func TestObservePerChoice(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000, Estimator: EstimatorOptions{MinSamples: 4}})
	if err != nil {
		t.Fatal(err)
	}
	four := []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"n":4}`)
	first, err := c.Count(Request{Policy: "p", Body: four})
	if err != nil {
		t.Fatal(err)
	}
	if first.Choices != 4 || first.ChoiceAllowance != 1000 || first.OutputAllowance != 4000 {
		t.Fatalf("before learning: choices %d, per choice %d, allowance %d; want 4, 1000, 4000", first.Choices, first.ChoiceAllowance, first.OutputAllowance)
	}
	for range 4 {
		c.Observe("p", first, 400)
	}
	got, err := c.Count(Request{Policy: "p", Body: four})
	if err != nil {
		t.Fatal(err)
	}
	if got.AllowanceSource != FromHistory || got.ChoiceAllowance < 100 || got.ChoiceAllowance > 110 || got.OutputAllowance != 4*got.ChoiceAllowance {
		t.Errorf("after learning: per choice %d, allowance %d from %s; want per choice in [100, 110], allowance 4× that, from history",
			got.ChoiceAllowance, got.OutputAllowance, got.AllowanceSource)
	}
	one, err := c.Count(Request{Policy: "p", Body: noCap})
	if err != nil {
		t.Fatal(err)
	}
	if one.OutputAllowance < 100 || one.OutputAllowance > 110 {
		t.Errorf("n=1 after learning: allowance %d, want in [100, 110]", one.OutputAllowance)
	}
}

// TestObserveLearnsOnlyUncapped: an output cut at the client's own cap
// says nothing about uncapped requests, so it does not teach the estimate.
func TestObserveLearnsOnlyUncapped(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000, Estimator: EstimatorOptions{MinSamples: 2}})
	if err != nil {
		t.Fatal(err)
	}
	capped, err := c.Count(Request{Policy: "p", Body: []byte(`{"model":"gpt-4o","messages":[],"max_tokens":5}`)})
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		c.Observe("p", capped, 5)
	}
	got, err := c.Count(Request{Policy: "p", Body: noCap})
	if err != nil {
		t.Fatal(err)
	}
	if got.AllowanceSource != FromDefault || got.OutputAllowance != 1000 {
		t.Errorf("after capped completions: allowance %d from %s, want 1000 from default", got.OutputAllowance, got.AllowanceSource)
	}
}

// TestObserveByModelKey: spellings of one model share one estimate.
func TestObserveByModelKey(t *testing.T) {
	c, err := New(Options{DefaultOutputTokens: 1000, Estimator: EstimatorOptions{MinSamples: 2}})
	if err != nil {
		t.Fatal(err)
	}
	body := func(model string) []byte {
		return []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`)
	}
	learnt, err := c.Count(Request{Policy: "p", Body: body("GPT-4o")})
	if err != nil {
		t.Fatal(err)
	}
	c.Observe("p", learnt, 50)
	c.Observe("p", learnt, 50)
	for _, model := range []string{"gpt-4o", "openai/gpt-4o", "gpt-4o-2024-08-06"} {
		got, err := c.Count(Request{Policy: "p", Body: body(model)})
		if err != nil {
			t.Fatal(err)
		}
		if got.AllowanceSource != FromHistory || got.OutputAllowance > 55 {
			t.Errorf("%s: allowance %d from %s, want about 50 from history", model, got.OutputAllowance, got.AllowanceSource)
		}
	}
}
