package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// specialIDs are the special tokens of each encoding, for the one published
// vector that allows them; user text never gets them (it is ordinary text).
var specialIDs = map[string]map[string]int{
	Cl100kBase: {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
	O200kBase:  {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
}

// TestEncodeVectors checks the published tiktoken vectors token for token.
func TestEncodeVectors(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(providersDir, "tiktoken", "encode-vectors", "vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var vectors []struct {
		Encoding       string `json:"encoding"`
		Text           string `json:"text"`
		Tokens         []int  `json:"tokens"`
		Count          int    `json:"count"`
		AllowedSpecial string `json:"allowed_special"`
	}
	if err := json.Unmarshal(data, &vectors); err != nil {
		t.Fatal(err)
	}
	if len(vectors) < 18 {
		t.Fatalf("read %d vectors, want 18", len(vectors))
	}
	c := newTestCounter(t)
	for _, v := range vectors {
		got := []int{}
		rest := v.Text
		for rest != "" {
			// With allowed_special "all", special-token strings are the
			// special token; otherwise everything is ordinary text.
			cut, id := len(rest), -1
			if v.AllowedSpecial == "all" {
				for s, sid := range specialIDs[v.Encoding] {
					if i := strings.Index(rest, s); i >= 0 && i < cut {
						cut, id = i, sid
					}
				}
			}
			ids, err := c.Encode(v.Encoding, rest[:cut])
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, ids...)
			if id < 0 {
				break
			}
			got = append(got, id)
			for s, sid := range specialIDs[v.Encoding] {
				if sid == id {
					rest = rest[cut+len(s):]
				}
			}
		}
		if diff := cmp.Diff(v.Tokens, got); diff != "" {
			t.Errorf("%s %q (-want +got):\n%s", v.Encoding, v.Text, diff)
		}
		if v.AllowedSpecial == "" {
			if n, _ := c.CountText(v.Encoding, v.Text); n != v.Count {
				t.Errorf("%s CountText(%q) = %d, want %d", v.Encoding, v.Text, n, v.Count)
			}
		}
	}
}
