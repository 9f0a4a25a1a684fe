package extproc

import (
	"strings"
	"testing"

	"github.com/tokengate/tokengate/tokenizer"
)

// The live count over any split of a text equals counting it whole (S13),
// exactly: nothing is counted twice and no boundary is lost.
func TestLiveTextMatchesWholeCount(t *testing.T) {
	tc, err := tokenizer.New(tokenizer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	text := "The quick brown fox 🙂 jumps over the lazy dog.\nÜber straße — naïve café; 東京は晴れです。" + strings.Repeat("x", 300)
	want, err := tc.CountText(tokenizer.O200kBase, text)
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []int{1, 2, 3, 5, 17, len(text)} {
		l := tokenizerCounter{tc}.NewLive(tokenizer.O200kBase)
		for i := 0; i < len(text); i += size {
			l.Write(text[i:min(i+size, len(text))])
		}
		if got := l.Tokens(); got != want {
			t.Errorf("split %d: %d tokens, want %d", size, got, want)
		}
	}
}
