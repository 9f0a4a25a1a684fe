package standin

import (
	"log/slog"
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// sender writes one side stream's messages in order on a goroutine of its own, as Envoy's
// async gRPC client does: the filter hands a message over and goes on, so a Send held up by
// gRPC flow control never keeps it from reading the server's answers. (A filter that sent
// synchronously would stall whenever both sides have more than a flow-control window in
// flight: it waits for the server to read, while the server waits for it to read.) Envoy
// bounds that queue only with watermarks that pause its own reading, which the stand-in
// does not emulate: the queue is unbounded.
type sender struct {
	stream extprocv3.ExternalProcessor_ProcessClient
	log    *slog.Logger

	mu     sync.Mutex
	cond   sync.Cond
	queue  []*extprocv3.ProcessingRequest
	closed bool          // half-close once the queue is sent
	done   chan struct{} // closed when the goroutine returns
}

func startSender(s extprocv3.ExternalProcessor_ProcessClient, log *slog.Logger) *sender {
	sn := &sender{stream: s, log: log, done: make(chan struct{})}
	sn.cond.L = &sn.mu
	go sn.run()
	return sn
}

// send queues m; it never blocks.
func (sn *sender) send(m *extprocv3.ProcessingRequest) {
	sn.mu.Lock()
	if !sn.closed {
		sn.queue = append(sn.queue, m)
	}
	sn.mu.Unlock()
	sn.cond.Signal()
}

// close half-closes the stream after the messages queued so far. A reset of the call (its
// context cancelled) ends a Send still blocked, and the messages after it are dropped, as
// Envoy drops what it had not written when it resets the stream.
func (sn *sender) close() {
	sn.mu.Lock()
	sn.closed = true
	sn.mu.Unlock()
	sn.cond.Signal()
}

func (sn *sender) run() {
	defer close(sn.done)
	failed := false
	for {
		sn.mu.Lock()
		for len(sn.queue) == 0 && !sn.closed {
			sn.cond.Wait()
		}
		if len(sn.queue) == 0 {
			sn.mu.Unlock()
			break
		}
		m := sn.queue[0]
		sn.queue[0] = nil
		sn.queue = sn.queue[1:]
		sn.mu.Unlock()
		if failed {
			continue
		}
		// A failed Send means the call ended; Recv reports why.
		if err := sn.stream.Send(m); err != nil {
			failed = true
		}
	}
	if failed {
		return
	}
	// CloseSend fails only when the call has ended already.
	if err := sn.stream.CloseSend(); err != nil {
		sn.log.Debug("ext_proc half-close", "err", err)
	}
}
