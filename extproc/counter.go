package extproc

import "github.com/tokengate/tokengate/tokenizer"

// tokenizerCounter is the tokenCounter of a *tokenizer.Counter.
type tokenizerCounter struct{ *tokenizer.Counter }

// NewLive returns the tokenizer's incremental stream counter (S13): text
// already counted is never tokenized again, only the last open piece is
// held back. An unknown encoding counts with o200k_base.
func (c tokenizerCounter) NewLive(encoding string) liveCounter {
	return c.Counter.NewStream(encoding)
}
