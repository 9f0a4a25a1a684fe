package provider

import (
	"bytes"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestFramerSteps drives a Framer through chunk sequences and checks, after
// each Feed, which events come out and what stays pending (S13).
func TestFramerSteps(t *testing.T) {
	type step struct {
		feed    string
		events  []string
		pending string
	}
	for _, tc := range []struct {
		name  string
		steps []step
		flush string
	}{
		{
			name: "LF events across chunks",
			steps: []step{
				{feed: "data: {\"a\"", pending: "data: {\"a\""},
				{feed: ":1}\n", pending: "data: {\"a\":1}\n"},
				{feed: "\ndata: 2\n\nda", events: []string{"data: {\"a\":1}\n\n", "data: 2\n\n"}, pending: "da"},
			},
			flush: "da",
		},
		{
			name: "CRLF split between CR and LF",
			steps: []step{
				{feed: "data: x\r", pending: "data: x\r"},
				{feed: "\n\r", pending: "data: x\r\n\r"},
				{feed: "\n", events: []string{"data: x\r\n\r\n"}},
			},
		},
		{
			name: "CR line ends wait for the next byte",
			steps: []step{
				{feed: "data: a\r\r", pending: "data: a\r\r"},
				{feed: "data: b\r\r", events: []string{"data: a\r\r"}, pending: "data: b\r\r"},
			},
			flush: "data: b\r\r",
		},
		{
			name: "mixed line ends",
			steps: []step{
				{feed: "event: x\rdata: 1\r\n\ndata: 2\n\r\nid: 3\n\n", events: []string{"event: x\rdata: 1\r\n\n", "data: 2\n\r\n", "id: 3\n\n"}},
			},
		},
		{
			name: "comment blocks come out at once",
			steps: []step{
				{feed: ": keep-alive\n\n: again\n", events: []string{": keep-alive\n\n"}, pending: ": again\n"},
				{feed: "data: 1\n\n", events: []string{": again\ndata: 1\n\n"}},
			},
		},
		{
			name: "last event without blank line at end of stream",
			steps: []step{
				{feed: "data: 1\n\ndata: 2\n", events: []string{"data: 1\n\n"}, pending: "data: 2\n"},
			},
			flush: "data: 2\n",
		},
		{
			name: "one byte at a time, multi-byte UTF-8",
			steps: func() []step {
				var s []step
				in := "data: \"é€😀\"\n\n"
				for i := range len(in) - 1 {
					s = append(s, step{feed: in[i : i+1], pending: in[:i+1]})
				}
				return append(s, step{feed: "\n", events: []string{in}})
			}(),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f Framer
			for i, st := range tc.steps {
				f.Feed([]byte(st.feed))
				var got []string
				for ev, ok := f.Next(); ok; ev, ok = f.Next() {
					got = append(got, string(ev))
				}
				if diff := cmp.Diff(st.events, got); diff != "" {
					t.Errorf("step %d: events (-want +got):\n%s", i, diff)
				}
				if p := string(f.Pending()); p != st.pending {
					t.Errorf("step %d: Pending() = %q, want %q", i, p, st.pending)
				}
			}
			if got := string(f.Flush()); got != tc.flush {
				t.Errorf("Flush() = %q, want %q", got, tc.flush)
			}
			if f.Flush() != nil || len(f.Pending()) != 0 {
				t.Errorf("Framer not reset after Flush")
			}
		})
	}
}

// TestFramerReuseAfterFlush: a flushed Framer frames a new stream from
// scratch.
func TestFramerReuseAfterFlush(t *testing.T) {
	var f Framer
	f.Feed([]byte("data: 1\n\ndata: tail"))
	f.Next()
	f.Flush()
	f.Feed([]byte("data: 2\n\n"))
	ev, ok := f.Next()
	if !ok || string(ev) != "data: 2\n\n" {
		t.Errorf("Next() = %q, %v; want the new stream's event", ev, ok)
	}
}

// FuzzFramer feeds arbitrary bytes in arbitrary chunks: the Framer never
// panics, every event ends with a blank line, the events followed by the
// pending tail re-join to the input, and the events do not depend on the
// chunking.
func FuzzFramer(f *testing.F) {
	f.Add([]byte("data: 1\n\n: c\n\ndata: 2\r\n\r\ndata: 3\r\r"), []byte{1, 2, 3})
	f.Add([]byte("event: x\ndata: {}\n\ndata"), []byte{0})
	f.Fuzz(func(t *testing.T, stream, sizes []byte) {
		frame := func(cuts []byte) (events [][]byte, tail []byte) {
			var fr Framer
			rest := stream
			for k := 0; len(rest) > 0; k++ {
				n := len(rest)
				if len(cuts) > 0 {
					n = min(n, 1+int(cuts[k%len(cuts)]))
				}
				fr.Feed(rest[:n])
				rest = rest[n:]
				for ev, ok := fr.Next(); ok; ev, ok = fr.Next() {
					events = append(events, bytes.Clone(ev))
				}
			}
			return events, bytes.Clone(fr.Flush())
		}
		whole, wholeTail := frame(nil)
		events, tail := frame(sizes)
		var joined []byte
		for _, ev := range events {
			if !endsWithBlankLine(ev) {
				t.Fatalf("event %q does not end with a blank line", ev)
			}
			joined = append(joined, ev...)
		}
		joined = append(joined, tail...)
		if !bytes.Equal(joined, stream) {
			t.Fatalf("events re-join to %q, want %q", joined, stream)
		}
		if !cmp.Equal(whole, events) || !bytes.Equal(wholeTail, tail) {
			t.Fatalf("chunking changed the events:\nwhole %q + %q\nchunked %q + %q", whole, wholeTail, events, tail)
		}
	})
}

func endsWithBlankLine(ev []byte) bool {
	for _, end := range []string{"\n\n", "\r\r", "\r\n\r\n", "\n\r\n", "\r\n\n", "\r\r\n", "\n\r"} {
		if bytes.HasSuffix(ev, []byte(end)) {
			return true
		}
	}
	return bytes.Equal(ev, []byte("\n")) || bytes.Equal(ev, []byte("\r\n")) || bytes.Equal(ev, []byte("\r"))
}
