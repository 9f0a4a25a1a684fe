package modelname

import (
	"strings"
	"testing"
)

func TestCanonical(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"gpt-4o", "gpt-4o"}, {" GPT-4o\n", "gpt-4o"}, {"openai/gpt-4o", "gpt-4o"},
		{"models/gemini-2.5-pro", "gemini-2.5-pro"}, {"a/b/claude-x", "claude-x"},
		{"ft:gpt-4o-mini:org::id", "ft:gpt-4o-mini:org::id"}, {"openai/ft:gpt-4o:org::x", "ft:gpt-4o:org::x"},
		{"", ""}, {"/", ""},
	} {
		if got := Canonical(tt.in); got != tt.want {
			t.Errorf("Canonical(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestFineTune(t *testing.T) {
	for _, tt := range []struct {
		in, base string
		ok       bool
	}{
		{"ft:gpt-4o-mini-2024-07-18:org:suffix:abc", "gpt-4o-mini-2024-07-18", true},
		{"ft:davinci-002:org::id", "davinci-002", true},
		{"ft:", "", false}, {"ft::org", "", false}, {"gpt-4o", "", false}, {"xft:gpt-4o", "", false},
	} {
		if base, ok := FineTune(tt.in); base != tt.base || ok != tt.ok {
			t.Errorf("FineTune(%q) = %q, %v; want %q, %v", tt.in, base, ok, tt.base, tt.ok)
		}
	}
	if Base("ft:gpt-4o:org::id") != "gpt-4o" || Base("gpt-4o") != "gpt-4o" || Base("ft:") != "ft:" {
		t.Error("Base does not unwrap fine-tunes alone")
	}
}

func TestSnapshot(t *testing.T) {
	for _, tt := range []struct{ in, family string }{
		{"gpt-4o-2024-08-06", "gpt-4o"}, {"claude-opus-4-5-20251101", "claude-opus-4-5"},
		{"claude-opus-4-5@20251101", "claude-opus-4-5"}, {"gpt-4-0613", "gpt-4"}, {"gpt-3.5-turbo-0125", "gpt-3.5-turbo"},
		{"gemini-1.5-pro-002", "gemini-1.5-pro"}, {"gemini-2.5-pro-preview-05-06", "gemini-2.5-pro-preview"},
		// Not snapshots: another model, another price, or no date.
		{"gpt-6.2-sol-fast", ""}, {"gpt-4o-mini", ""}, {"gpt-4o-2024-08", ""}, {"gpt-4o-12345678", ""},
		{"babbage-002", ""}, {"text-embedding-ada-002", ""}, {"claude-x-0613", ""}, {"gemini-2.5-flash", ""}, {"", ""},
	} {
		family, ok := Snapshot(tt.in)
		if family != tt.family || ok != (tt.family != "") {
			t.Errorf("Snapshot(%q) = %q, %v; want %q", tt.in, family, ok, tt.family)
		}
	}
}

// Key folds every spelling the provider bills and limits as one model into
// one key; client text cannot grow a key or put odd bytes into it.
func TestKey(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"gpt-4o", "gpt-4o"}, {"GPT-4o", "gpt-4o"}, {"openai/gpt-4o-2024-08-06", "gpt-4o"},
		{"ft:gpt-4o-mini-2024-07-18:org::abc123", "gpt-4o-mini"}, {"openai/ft:gpt-4o:org::x", "gpt-4o"},
		{"models/gemini-2.0-flash-001", "gemini-2.0-flash"}, {"claude-sonnet-4-5@20250929", "claude-sonnet-4-5"},
		{"", ""}, {"  ", ""},
	} {
		if got := Key(tt.in); got != tt.want {
			t.Errorf("Key(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
	for _, m := range []string{strings.Repeat("x", MaxKey+1), "gpt\n4o", "gpt 4o", "gpt-4o{x}"} {
		got := Key(m)
		if !strings.HasPrefix(got, "sha256:") || len(got) != len("sha256:")+24 || got != Key(m) {
			t.Errorf("Key(%q) = %q, want a stable sha256: key", m, got)
		}
	}
}

func FuzzKey(f *testing.F) {
	for _, s := range []string{"gpt-4o", "openai/ft:gpt-4o:org::x", "gemini-2.5-pro-preview-05-06", "claude-x@20250101"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k := Key(s)
		if len(k) > MaxKey || strings.TrimLeft(k, "abcdefghijklmnopqrstuvwxyz0123456789._:-") != "" {
			t.Errorf("Key(%q) = %q: too long or odd bytes", s, k)
		}
		if (k == "") != (Canonical(s) == "") {
			t.Errorf("Key(%q) = %q: empty for a name, or a key for none", s, k)
		}
	})
}
