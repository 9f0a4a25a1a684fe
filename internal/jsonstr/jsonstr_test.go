package jsonstr

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// differ runs Scan and Append on the JSON string literal lit and
// encoding/json on the same text, and says how they differ: they must
// accept and refuse the same strings; a refused one is refused at the
// same byte (encoding/json's offset is one past it) unless the input ends
// first; an accepted one decodes to the same text, where encoding/json's
// U+FFFD for each byte of invalid UTF-8 stands for the byte Append keeps.
func differ(lit []byte) string {
	end, err := Scan(lit, 0)
	ours := err == nil && end == len(lit)
	var want string
	jerr := json.Unmarshal(lit, &want)
	if ours != (jerr == nil) {
		return "Scan: end " + strconv.Itoa(end) + " of " + strconv.Itoa(len(lit)) + ", " + errString(err) + "; encoding/json: " + errString(jerr)
	}
	if err != nil {
		var e *Error
		var syn *json.SyntaxError
		if !errors.As(err, &e) || e.Off < 0 || e.Off > len(lit) {
			return "Scan's error " + err.Error() + " has no offset within the input"
		}
		if errors.As(jerr, &syn) && !errors.Is(jerr, io.ErrUnexpectedEOF) && e.What != EndOfInput && int(syn.Offset)-1 != e.Off {
			return "Scan: " + err.Error() + "; encoding/json: " + jerr.Error() + " at offset " + strconv.Itoa(int(syn.Offset))
		}
		return ""
	}
	if !ours {
		return ""
	}
	got := Append([]byte("prefix"), lit[1:len(lit)-1])
	if !bytes.HasPrefix(got, []byte("prefix")) {
		return "Append did not append"
	}
	if g := string([]rune(string(got[len("prefix"):]))); g != want {
		return "Append = " + strings.ToValidUTF8(g, "?") + ", encoding/json " + want
	}
	return ""
}

func errString(err error) string {
	if err == nil {
		return "accepted"
	}
	return err.Error()
}

// stringCases are the seeds of FuzzDifferential and the table of
// TestAgreesWithEncodingJSON: escapes of every kind, surrogate pairs and
// lone or mismatched halves, invalid UTF-8 (a stray continuation, a cut
// sequence, an overlong form, an encoded surrogate), control bytes raw and
// escaped, DEL, and specials on each side of the eight- and sixteen-byte
// boundaries of Plain's word reads.
var stringCases = []string{
	`""`, `"plain"`, `"\"\\\/\b\f\n\r\t"`, `"\u00e9\u20AC"`, `"\ud83d\ude00"`,
	`"\ud83d"`, `"\ude00x"`, `"\ud83d\u0041"`, `"\ud83d\ud83d\ude00"`, `"a\u0000b"`, `"ünïcödé 😀"`,
	"\"\xff\"", "\"a\xc3\"", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "\"\x80abc\"", "\"\x7f\"",
	"\"\x00\"", "\"\x1f\"", "\"a\tb\"", "\"a\nb\"",
	`"\x"`, `"\u12"`, `"\uZZZZ"`, `"\u12G4"`, `"abc\"`, `"abc`, `"`, `"\`, `"\u`, `"a"b"`,
	`"0123456789abcdef\n"`, `"0123456\"89abcdef"`, `"01234567\u0041bcdefghijk"`, "\"0123456789abcde\x01\"",
	`"` + strings.Repeat("long plain text, ", 20) + `\"end\"` + `"`,
	"\"" + strings.Repeat("x", 15) + "\xe2\x82\xac" + strings.Repeat("y", 17) + "\"",
}

func TestAgreesWithEncodingJSON(t *testing.T) {
	for _, in := range stringCases {
		if d := differ([]byte(in)); d != "" {
			t.Errorf("%q: %s", in, d)
		}
	}
}

// Plain stops where a byte-at-a-time scan stops, from any offset.
func TestPlainStopsAtTheFirstSpecialByte(t *testing.T) {
	for _, in := range stringCases {
		checkPlain(t, []byte(in))
	}
}

func checkPlain(t *testing.T, b []byte) {
	t.Helper()
	for i := range len(b) + 1 {
		want := i
		for want < len(b) && b[want] >= 0x20 && b[want] != '"' && b[want] != '\\' {
			want++
		}
		if got := Plain(b, i); got != want {
			t.Fatalf("Plain(%q, %d) = %d, want %d", b, i, got, want)
		}
	}
}

// FuzzDifferential holds Scan and Append to encoding/json on any bytes
// between two quotes, and Plain to a byte-at-a-time scan.
func FuzzDifferential(f *testing.F) {
	for _, in := range stringCases {
		f.Add([]byte(in[1:max(1, len(in)-1)]))
	}
	f.Fuzz(func(t *testing.T, inside []byte) {
		lit := append(append([]byte{'"'}, inside...), '"')
		if d := differ(lit); d != "" {
			t.Fatalf("%q: %s", lit, d)
		}
		checkPlain(t, lit)
		// Append never panics, whatever it is given.
		Append(nil, inside)
	})
}

// literal is one JSON string of the recorded traffic where it is: at
// doc[at:end].
type literal struct {
	doc     []byte
	at, end int
}

func (l literal) text() []byte { return l.doc[l.at:l.end] }

// literals are the JSON string literals of the recorded provider traffic:
// request bodies, answers, and the data of every stream event.
func literals(tb testing.TB) []literal {
	tb.Helper()
	var docs [][]byte
	err := filepath.WalkDir("../../testdata/providers", func(p string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		switch {
		case err != nil:
			return err
		case strings.HasSuffix(p, ".json"):
			docs = append(docs, b)
		case strings.HasSuffix(p, ".sse"):
			for _, l := range bytes.Split(b, []byte("\n")) {
				if d, ok := bytes.CutPrefix(l, []byte("data:")); ok {
					docs = append(docs, bytes.TrimSpace(d))
				}
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	var out []literal
	for _, d := range docs {
		for i := 0; i < len(d); i++ {
			if d[i] != '"' {
				continue
			}
			end, err := Scan(d, i)
			if err != nil {
				break
			}
			out = append(out, literal{d, i, end})
			i = end - 1
		}
	}
	if len(out) < 1000 {
		tb.Fatalf("only %d strings in the recordings", len(out))
	}
	return out
}

// Every string of the recordings decodes as encoding/json decodes it.
func TestRecordedStringsAgreeWithEncodingJSON(t *testing.T) {
	for _, l := range literals(t) {
		if d := differ(bytes.Clone(l.text())); d != "" {
			t.Fatalf("%q: %s", l.text(), d)
		}
	}
}

// BenchmarkScan and BenchmarkAppend read every string of the recordings
// where it is, in its document as the readers meet it, short (up to 24
// bytes: keys, ids, a stream's tokens) and long apart.
func BenchmarkScan(b *testing.B) {
	for name, set := range bySize(b) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(size(set)))
			for b.Loop() {
				for _, l := range set {
					if _, err := Scan(l.doc, l.at); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}

func BenchmarkAppend(b *testing.B) {
	for name, set := range bySize(b) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(size(set)))
			b.ReportAllocs()
			var buf []byte
			for b.Loop() {
				for _, l := range set {
					buf = Append(buf[:0], l.doc[l.at+1:l.end-1])
				}
			}
		})
	}
}

func bySize(b *testing.B) map[string][]literal {
	out := map[string][]literal{}
	for _, l := range literals(b) {
		k := "long"
		if l.end-l.at <= 24 {
			k = "short"
		}
		out[k] = append(out[k], l)
	}
	return out
}

func size(set []literal) int {
	n := 0
	for _, l := range set {
		n += l.end - l.at
	}
	return n
}
