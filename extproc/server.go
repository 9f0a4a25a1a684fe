package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tokengate/tokengate/buckets"
)

// Server is the ext_proc gRPC service. Each Process call (one per HTTP
// request) runs one processor on the stream's goroutine. A Server is safe for
// concurrent use. Its policies change only through Reload and its
// per-identity overrides through SetOverrides, each swapped whole for new
// requests; the rest of its configuration is immutable after NewServer. Use
// NewServer; the zero value is not usable.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	cfg Config
	// live holds the policies of new requests; Reload replaces them, and a
	// stream keeps those it started with. overrides holds the limits set
	// per identity (SetOverrides). Both are immutable once stored.
	live      atomic.Pointer[policySet]
	overrides atomic.Pointer[Overrides]
	reloadMu  sync.Mutex // serializes Reload
	pauses    sync.Map   // bucket key → time.Time: provider pauses seen here (S18)

	// loops runs the streams' loops (streamLoop); Shutdown closes it.
	loops *goroutines

	mu      sync.Mutex
	closing bool
	open    map[*processor]struct{}
	wg      sync.WaitGroup
}

// NewServer returns a Server for cfg, whose policies come from a validated
// configuration (package config); it fills defaults and refuses only a
// missing Store or Counter.
func NewServer(cfg Config) (*Server, error) {
	if err := cfg.normalize(); err != nil {
		return nil, fmt.Errorf("extproc config: %w", err)
	}
	s := &Server{cfg: cfg, open: map[*processor]struct{}{}, loops: newGoroutines()}
	s.live.Store(newPolicySet(cfg.Policies, cfg.DefaultPolicy, nil))
	s.overrides.Store(&Overrides{})
	return s, nil
}

// Register registers the ExternalProcessor service on g.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
}

// Process serves one HTTP request's ext_proc stream. io.EOF and
// cancellation from Recv are normal ends. It never ends a stream with OK
// while the request is still being metered by its own choice: it returns
// when Envoy ends the stream, or with DEADLINE_EXCEEDED when Envoy sent
// nothing for StreamIdleTimeout.
//
// Recv blocks until Envoy sends or the stream ends, and only returning
// from Process ends a stream, so the messages are received and handled on
// a goroutine of its own (see stream), which ends with the stream; Process
// waits for it or for the idle limit.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	ctx := stream.Context()
	p, err := s.start(ctx)
	if err != nil {
		return err
	}
	st := &streamLoop{s: s, p: p, stream: stream, end: make(chan error, 1)}
	p.receiveAhead = st.receiveAhead
	st.heard.Store(time.Now().UnixNano())
	s.loops.run(st.run)
	idle := time.NewTimer(s.cfg.StreamIdleTimeout)
	defer idle.Stop()
	for {
		select {
		case err := <-st.end:
			if err == nil || status.Code(err) != codes.Unknown {
				return err
			}
			return status.Error(codes.Internal, err.Error())
		case <-idle.C:
		}
		// The limit counts from the last message, which the loop notes
		// without touching the timer: rearm for what is left of it.
		if left := s.cfg.StreamIdleTimeout - time.Since(time.Unix(0, st.heard.Load())); left > 0 {
			idle.Reset(left)
			continue
		}
		if !st.state.CompareAndSwap(waiting, over) {
			idle.Reset(s.cfg.StreamIdleTimeout) // a message is being handled
			continue
		}
		p.logAt(slog.LevelWarn, "stream ended: Envoy sent nothing within the idle limit", "limit", s.cfg.StreamIdleTimeout)
		s.stop(p)
		return status.Error(codes.DeadlineExceeded, "ext_proc stream idle")
	}
}

// streamLoop receives a stream's messages and has its processor handle
// each, on one goroutine, until the stream ends or a message fails; then
// it finishes the processor (Server.stop) and end receives nil (a normal
// end) or the error. Once Process has given the stream up as idle (state
// over), the loop touches nothing of the processor again, which Process
// then finishes.
//
// While its processor waits for tokens, and only then, a receive runs on a
// goroutine of its own (receiveAhead), so that the wait sees the stream
// end; the loop then takes what that receive got instead of receiving
// itself, and the stream has one receiver at a time.
type streamLoop struct {
	s      *Server
	p      *processor
	stream extprocv3.ExternalProcessor_ProcessServer
	end    chan error // buffered: Process may have returned
	state  atomic.Int32
	heard  atomic.Int64 // when the last message arrived, in Unix nanoseconds
	ahead  *received    // the receive receiveAhead started, until the loop takes it
}

// received is what a receive started by receiveAhead got: once done is
// closed, the message or the error that ended the stream.
type received struct {
	done chan struct{}
	req  *extprocv3.ProcessingRequest
	err  error
}

// The states of a streamLoop.
const (
	waiting int32 = iota // in Recv, or waiting for the receive started ahead
	busy                 // handling a message
	over                 // given up by Process
)

func (l *streamLoop) run() {
	for {
		req, err := l.receive()
		if !l.state.CompareAndSwap(waiting, busy) {
			return
		}
		if err != nil {
			if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || errors.Is(err, context.Canceled) {
				err = nil
			}
			l.finish(err)
			return
		}
		l.heard.Store(time.Now().UnixNano())
		// After an immediate response or a cut-off, Envoy may still send
		// what was in flight: it is read and dropped.
		if !l.p.done {
			if err := l.p.handle(req, l.stream.Send); err != nil {
				l.finish(err)
				return
			}
		}
		l.state.Store(waiting)
	}
}

// receive returns the stream's next message: what the receive started
// ahead got, once it has, or Recv's.
func (l *streamLoop) receive() (*extprocv3.ProcessingRequest, error) {
	if a := l.ahead; a != nil {
		l.ahead = nil
		<-a.done
		return a.req, a.err
	}
	return l.stream.Recv()
}

// receiveAhead starts the stream's next receive on a goroutine of its own,
// unless one is started already, and returns it. It is called on the
// loop's goroutine while it handles a message, so it is not in Recv; the
// receive ends when a message arrives or the stream ends, at the latest
// when Process returns.
func (l *streamLoop) receiveAhead() *received {
	if l.ahead == nil {
		a := &received{done: make(chan struct{})}
		l.ahead = a
		go func() {
			a.req, a.err = l.stream.Recv()
			close(a.done)
		}()
	}
	return l.ahead
}

// finish finishes the processor on the loop's goroutine, whose stack
// has grown already, and hands err to Process.
func (l *streamLoop) finish(err error) {
	l.s.stop(l.p)
	l.end <- err
}

// goroutines runs functions on goroutines it keeps, up to maxParked of
// them waiting for work, until it is closed: a stream's loop starts with
// the stack an earlier one grew, where a new goroutine grows its own,
// copying it at every doubling (a tenth of the CPU of a short stream).
type goroutines struct {
	work   chan func()
	quit   chan struct{}
	once   sync.Once
	parked atomic.Int32
}

// maxParked bounds the goroutines kept waiting, and so the stacks kept.
const maxParked = 256

func newGoroutines() *goroutines {
	return &goroutines{work: make(chan func()), quit: make(chan struct{})}
}

// run runs f on a waiting goroutine, or on a new one.
func (g *goroutines) run(f func()) {
	select {
	case g.work <- f:
	default:
		go g.loop(f)
	}
}

func (g *goroutines) loop(f func()) {
	for {
		f()
		if g.parked.Add(1) > maxParked {
			g.parked.Add(-1)
			return
		}
		select {
		case f = <-g.work:
			g.parked.Add(-1)
		case <-g.quit:
			g.parked.Add(-1)
			return
		}
	}
}

// close ends the waiting goroutines, and each busy one once its function
// returns.
func (g *goroutines) close() { g.once.Do(func() { close(g.quit) }) }

// ServerOptions are the gRPC server options the ext_proc service needs:
// a receive limit above MaxBodyBytes, so that a body over the limit reaches
// tokengate, which answers 413, instead of failing as a gRPC message-size
// error that Envoy turns into a 500. Pass them to grpc.NewServer.
func (s *Server) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.MaxRecvMsgSize(s.RecvLimit())}
}

// RecvLimit is the gRPC receive limit ServerOptions sets: twice
// MaxBodyBytes, and at least MaxBodyBytes + 1 MiB. A body up to it gets
// tokengate's 413; Envoy's buffer limit for BUFFERED bodies should not be
// larger.
func (s *Server) RecvLimit() int {
	b := s.cfg.MaxBodyBytes
	return b + max(b, 1<<20)
}

func (s *Server) start(ctx context.Context) (*processor, error) {
	set := s.live.Load()
	policy := set.defaultPolicy
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get(s.cfg.PolicyMetadataKey); len(v) > 0 && v[0] != "" {
			policy = v[0]
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return nil, status.Error(codes.Unavailable, "tokengate is shutting down")
	}
	if len(s.open) >= s.cfg.MaxStreams {
		return nil, status.Error(codes.ResourceExhausted, "tokengate has the most streams open it allows")
	}
	p := newProcessor(ctx, s, set, policy)
	p.started = s.cfg.Now()
	s.open[p] = struct{}{}
	s.wg.Add(1)
	return p, nil
}

func (s *Server) stop(p *processor) {
	p.finish()
	s.mu.Lock()
	delete(s.open, p)
	s.mu.Unlock()
	s.wg.Done()
}

// Shutdown stops taking new streams and waits for the open ones to end
// until ctx is done; then it settles every reservation still open, by the
// rule its own end would follow at that point (docs/budgets.md): a request
// forwarded and waiting for its non-streamed answer keeps its reservation,
// a stream pays what was counted. Last, when the store settles
// asynchronously (buckets.AsyncSettler), it flushes every settlement still
// queued, waiting up to SettleTimeout for them. It returns ctx's error when
// streams were still open, or the flush's. Call it before
// grpc.Server.GracefulStop, and Stop the gRPC server afterwards.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.closing = true
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		s.wg.Wait()
		close(done)
	}()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		s.mu.Lock()
		open := make([]*processor, 0, len(s.open))
		for p := range s.open {
			open = append(open, p)
		}
		s.mu.Unlock()
		for _, p := range open {
			p.abandon()
		}
		err = ctx.Err()
	}
	s.loops.close()
	if as, ok := s.cfg.Store.(buckets.AsyncSettler); ok {
		fctx, cancel := context.WithTimeout(context.Background(), s.cfg.SettleTimeout)
		defer cancel()
		if ferr := as.Flush(fctx); ferr != nil {
			err = errors.Join(err, fmt.Errorf("settlements still queued: %w", ferr))
		}
	}
	return err
}

// pausedUntil returns the latest provider pause this server has seen for
// any of keys.
func (s *Server) pausedUntil(keys []string, now time.Time) time.Time {
	var until time.Time
	for _, k := range keys {
		if v, ok := s.pauses.Load(k); ok {
			if t := v.(time.Time); t.After(until) && t.After(now) {
				until = t
			}
		}
	}
	return until
}

func (s *Server) logger() *slog.Logger { return s.cfg.Logger }
