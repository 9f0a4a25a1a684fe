package standin

import (
	"io"
	"net/http"
	"sync"
)

// pipe is an unbounded in-memory pipe: writes never block, so the exchange loop that feeds
// the upstream request body never waits on the upstream. Safe for one reader and one writer.
type pipe struct {
	mu     sync.Mutex
	cond   sync.Cond
	buf    []byte
	err    error // returned once buf is drained (io.EOF on a clean end)
	closed bool  // reader closed

	// trailer is the upstream request's Trailer map. It belongs to the reader (the
	// transport reads it after the body's EOF), so the trailers set by the writer are
	// copied into it by Read, just before the reader sees io.EOF.
	trailer  http.Header
	trailers []header
	copied   bool
}

func newPipe() *pipe {
	p := &pipe{}
	p.cond.L = &p.mu
	return p
}

func (p *pipe) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.buf) == 0 && p.err == nil && !p.closed {
		p.cond.Wait()
	}
	if p.closed {
		return 0, io.ErrClosedPipe
	}
	if len(p.buf) == 0 {
		if p.err == io.EOF && p.trailer != nil && !p.copied {
			p.copied = true
			for k := range p.trailer {
				delete(p.trailer, k)
			}
			for _, t := range p.trailers {
				p.trailer.Add(t.key, t.value)
			}
		}
		return 0, p.err
	}
	n := copy(b, p.buf)
	p.buf = p.buf[n:]
	return n, nil
}

// Close is called by the reader (the HTTP transport).
func (p *pipe) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cond.Broadcast()
	return nil
}

func (p *pipe) write(b []byte) {
	if len(b) == 0 {
		return
	}
	p.mu.Lock()
	if p.err == nil {
		p.buf = append(p.buf, b...)
	}
	p.mu.Unlock()
	p.cond.Broadcast()
}

// endWithTrailers finishes the body cleanly, followed by trailers.
func (p *pipe) endWithTrailers(trailers []header) {
	p.mu.Lock()
	p.trailers = trailers
	p.mu.Unlock()
	p.end(io.EOF)
}

// end finishes the body with err (io.EOF for a clean end).
func (p *pipe) end(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
	p.cond.Broadcast()
}
