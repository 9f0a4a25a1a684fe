package billing

import "testing"

// TestReadings pins how each provider's values are read; the tokenizer
// and the provider package test them on real bodies.
func TestReadings(t *testing.T) {
	openai := map[string]Tier{"": Auto, "auto": Auto, "default": Standard, "standard": Standard, "scale": Standard,
		"priority": Fast, "fast": Fast, "flex": Flex, "Priority": Unknown, "turbo": Unknown}
	for v, want := range openai {
		if got := OpenAI(v); got != want {
			t.Errorf("OpenAI(%q) = %q, want %q", v, got, want)
		}
	}
	anthropic := map[string]Tier{"": Standard, "standard": Standard, "fast": Fast, "warp": Unknown}
	for v, want := range anthropic {
		if got := Anthropic(v); got != want {
			t.Errorf("Anthropic(%q) = %q, want %q", v, got, want)
		}
	}
	for v, want := range map[string]bool{"": false, "in_memory": false, "24h": true, "1h": true} {
		if got := ExtendedRetention(v); got != want {
			t.Errorf("ExtendedRetention(%q) = %v", v, got)
		}
	}
	for _, name := range []string{"standard", "fast", "flex"} {
		if tier, ok := Parse(name); !ok || string(tier) != name {
			t.Errorf("Parse(%q) = %q, %v", name, tier, ok)
		}
	}
	for _, name := range []string{"", "auto", "unknown", "priority"} {
		if _, ok := Parse(name); ok {
			t.Errorf("Parse(%q) accepted a name configuration does not use", name)
		}
	}
}
