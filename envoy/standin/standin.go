// Package standin plays Envoy's part in front of an ext_proc server, or of a rate-limit
// service, for tests and the demo. Production traffic goes through Envoy; this package is a
// test and demo tool. [RateLimitProxy] is the global rate-limit filter
// (envoy.filters.http.ratelimit) in front of an upstream, following docs/envoy-ratelimit.md;
// the rest of this comment is about the ext_proc stand-in.
//
// A [Proxy] is an HTTP front (HTTP/1.1 and h2c) that, for every downstream request, opens an
// ext_proc side stream (envoy.service.ext_proc.v3.ExternalProcessor/Process) over a real
// *grpc.ClientConn and drives it the way Envoy's ext_proc HTTP filter does
// (docs/envoy-ext-proc.md §1–§7, §9.1; Envoy 1.37 by default, see [Config.EnvoyMinor]):
//
//   - processing modes per direction (NONE, BUFFERED, STREAMED, FULL_DUPLEX_STREAMED) with held
//     headers, the merged first STREAMED chunk, 1:1 STREAMED answers that keep the original
//     end_of_stream, duplex streamed_response answers (M:N), request and response trailers
//     (no end_of_stream on a body message when trailers follow);
//   - exactly one answer per message where Envoy expects one; spurious answers fail the request
//     (1.35+) or make the server ignored; ImmediateResponse per phase: a local reply while the
//     client has no response headers yet, a stream reset afterwards;
//   - header mutations with Envoy's default rules (raw_value, forbidden headers, x-envoy prefix,
//     content-length removal and the BUFFERED length check → status_on_error);
//   - the per-message timeout (never armed for a duplex direction), override_message_timeout,
//     mode_override, failure_mode_allow, server OK-close and error-close;
//   - protocol_config on the first message, metadata_context on every message, per-route
//     grpc_initial_metadata and disabled routes, receiving namespaces for dynamic metadata;
//   - the request buffer limit (413), upstream cancellation when a duplex answer ends the
//     response early, and side-stream reset when the client goes away;
//   - FULL_DUPLEX_STREAMED requests: body chunks go to the server at once, the upstream is
//     contacted only after the headers answer and receives only the server's
//     streamed_response chunks (chunked, content-length removed); a body answer before the
//     headers answer, before any chunk, or after end_of_stream is spurious;
//   - a local reply to a request already on its way upstream (STREAMED or duplex) resets the
//     downstream stream and the upstream request; an HTTP/1 connection whose request was not
//     read to its end is closed after a local reply;
//   - side-stream messages written in order from a goroutine of their own, as Envoy's async
//     gRPC client queues them: answers are read while a Send waits on flow control, so the
//     two sides never stall each other with large bodies in flight both ways;
//   - side-stream close: a half-close followed at once by a reset, as Envoy does by default,
//     or the graceful close of the runtime guard ext_proc_graceful_grpc_close
//     ([Config.GracefulClose]).
//
// Each finished request is logged as an [Entry] (status, response code details, reset,
// upstream cancelled, dynamic metadata, ...) for assertions. Where Envoy would reset a stream
// the stand-in aborts the handler: HTTP/1 clients see the connection close mid-body, HTTP/2
// clients a RST_STREAM.
//
// Not emulated: BUFFERED_PARTIAL and GRPC body modes, observability mode,
// request/response attributes (CEL), send_body_without_waiting_for_header_response,
// StreamedImmediateResponse, route cache clearing, mutation_rules other than the defaults,
// local_reply_config, flow-control watermarks, and Envoy's HTTP/2 reset codes.
package standin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/h2c"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// Config configures a [Proxy]. Only ExtProc and Upstream are required; the zero value of every
// other field means Envoy's default. [New] copies the Config; later changes have no effect.
type Config struct {
	// ExtProc is the connection to the ext_proc server. The Proxy does not close it.
	ExtProc *grpc.ClientConn
	// Upstream is the base URL of the upstream (the LLM); the downstream path and query are
	// appended to its path.
	Upstream *url.URL
	// Mode is the filter's processing_mode. Nil means the modes recommended for LLM routes
	// (docs §5.2): request headers SEND, request body BUFFERED, response headers SEND,
	// response body FULL_DUPLEX_STREAMED, response trailers SEND, request trailers SKIP.
	Mode *filterv3.ProcessingMode
	// Routes are matched by path prefix, first match wins. No routes means one default route.
	// A request that matches no route is answered 404 with details "route_not_found".
	Routes []Route
	// MessageTimeout is the per-message timeout (default 200ms, as in Envoy).
	MessageTimeout time.Duration
	// MaxMessageTimeout bounds override_message_timeout; 0 disables the override, as in Envoy.
	MaxMessageTimeout time.Duration
	// FailureModeAllow continues requests unprocessed when the side stream fails.
	FailureModeAllow bool
	// AllowModeOverride honours mode_override in answers to headers messages.
	AllowModeOverride bool
	// StatusOnError is the local reply status for side-stream errors and rejected mutations
	// (default 500; Envoy before 1.36 always uses 500).
	StatusOnError int
	// RequestBufferLimit is per_connection_buffer_limit_bytes (default 1 MiB). It bounds
	// buffered request bodies (413) and buffered response bodies (500).
	RequestBufferLimit int
	// ChunkSize re-splits upstream response bodies into chunks of at most this many bytes
	// (down to 1). Zero passes chunks as read from the upstream.
	ChunkSize int
	// Cuts, if set, returns how the body of a request (response false) or of its upstream
	// response (response true) is cut into body messages: the sizes of successive chunks,
	// the last size repeating (sizes below 1 count as 1). The stand-in then waits for each
	// chunk to fill, or the body to end, before passing it on, so that chunk boundaries do
	// not depend on how the bytes arrived; a body that ends on a boundary ends with an empty
	// end_of_stream chunk. ChunkSize still applies to response chunks. Nil, or no sizes,
	// passes request chunks as read and response chunks as ChunkSize says.
	Cuts func(r *http.Request, response bool) []int
	// EOSOnLastChunk makes the last response body chunk carry end_of_stream (HTTP/2 style).
	// False sends an HTTP/1 style final empty chunk with end_of_stream.
	EOSOnLastChunk bool
	// ReceivingNamespaces lists the dynamic metadata namespaces applied from the server's
	// answers (metadata_options.receiving_namespaces.untyped); others are dropped.
	ReceivingNamespaces []string
	// Metadata, if set, returns the dynamic metadata forwarded as metadata_context on every
	// message of the request's side stream (for example JWT claims set by an auth filter).
	Metadata func(*http.Request) *corev3.Metadata
	// GracefulClose closes side streams as Envoy does with the runtime guard
	// ext_proc_graceful_grpc_close (1.34+, off by default): half-close, then wait up to
	// RemoteCloseTimeout for the server to end the call, then reset it. Without it the
	// stand-in closes as Envoy does by default (docs §2.5): a half-close immediately followed
	// by a reset, so the server sees io.EOF and/or codes.Canceled and a message still in
	// flight may be lost.
	GracefulClose bool
	// RemoteCloseTimeout bounds the wait of a graceful close (default 1s, Envoy's
	// remote_close_timeout_milliseconds). It applies only with GracefulClose.
	RemoteCloseTimeout time.Duration
	// EnvoyMinor selects the emulated Envoy 1.x minor version (34..37); 0 means 37.
	// Before 35 spurious answers are ignored instead of failing the request; before 36
	// StatusOnError is not honoured. (HTTP/2 reset codes are Go's, not Envoy's.)
	EnvoyMinor int
	// Transport carries upstream requests; nil means a private *http.Transport.
	Transport http.RoundTripper
	// Logger receives debug logs; nil discards them.
	Logger *slog.Logger
}

// Route is a per-route ext_proc configuration (ExtProcPerRoute). Its zero value is invalid:
// Prefix must start with "/" ("/" matches every path).
type Route struct {
	// Prefix is matched against the request path.
	Prefix string
	// InitialMetadata is sent as gRPC metadata when the side stream opens
	// (overrides.grpc_initial_metadata), e.g. {"x-tokengate-policy": "gold"}.
	// The value "%REQ(name)%" is replaced with the request header name.
	InitialMetadata map[string]string
	// Disabled turns ext_proc off for the route: no side stream at all.
	Disabled bool
	// Mode overrides the filter's processing mode for the route (overrides.processing_mode).
	Mode *filterv3.ProcessingMode
	// Timeout is the route timeout for the upstream response headers; 0 means none.
	Timeout time.Duration
}

// Entry describes one finished downstream request, like an access log line. Entries are
// values; [Proxy.Log] returns copies.
type Entry struct {
	// RequestID is the request's x-request-id (generated when the client sent none).
	RequestID string
	Method    string
	Path      string
	// Route is the prefix of the matched route.
	Route string
	// Status is the status code sent to the client (0 if none was sent).
	Status int
	// Details is %RESPONSE_CODE_DETAILS%: "via_upstream", "request_payload_too_large",
	// "ext_proc_error_per-message_timeout_exceeded", an ImmediateResponse's details, ...
	Details string
	// Reset reports that the downstream stream was reset instead of ended cleanly.
	Reset bool
	// SideStream reports that an ext_proc stream was opened.
	SideStream bool
	// Sent lists the kinds of messages sent to the server, in order
	// ("request_headers", "request_body", "response_headers", ...).
	Sent []string
	// UpstreamRequested reports that the request reached the upstream.
	UpstreamRequested bool
	// UpstreamCancelled reports that the upstream request was cancelled before its response
	// ended (duplex early end, reset, client disconnect).
	UpstreamCancelled bool
	// ClientCancelled reports that the downstream client went away before the response ended.
	ClientCancelled bool
	// BytesToClient counts response body bytes written to the client.
	BytesToClient int64
	// DynamicMetadata holds the dynamic metadata received, by namespace.
	DynamicMetadata map[string]*structpb.Struct
}

// Proxy is the Envoy stand-in, an http.Handler. Create it with [New] (the zero value is not
// usable); it is safe for concurrent use by many requests.
type Proxy struct {
	cfg    Config
	client extprocv3.ExternalProcessorClient
	rt     http.RoundTripper
	ownRT  *http.Transport
	log    *slog.Logger

	mu      sync.Mutex
	entries []Entry
	changed chan struct{} // closed and replaced whenever entries grows

	// hook, when set by tests before use, observes body data reaching the filter
	// ("request_data", "response_data"), "processing_complete" and "local_reply".
	hook func(event string, eos bool)
}

// New validates cfg and returns a Proxy.
func New(cfg Config) (*Proxy, error) {
	var errs []error
	if cfg.ExtProc == nil {
		errs = append(errs, errors.New("standin: Config.ExtProc is nil"))
	}
	if cfg.Upstream == nil || cfg.Upstream.Host == "" {
		errs = append(errs, errors.New("standin: Config.Upstream must be an absolute URL"))
	}
	if cfg.MessageTimeout < 0 || cfg.MaxMessageTimeout < 0 || cfg.RequestBufferLimit < 0 || cfg.ChunkSize < 0 || cfg.RemoteCloseTimeout < 0 {
		errs = append(errs, errors.New("standin: negative MessageTimeout, MaxMessageTimeout, RequestBufferLimit, ChunkSize or RemoteCloseTimeout"))
	}
	if cfg.EnvoyMinor != 0 && (cfg.EnvoyMinor < 34 || cfg.EnvoyMinor > 37) {
		errs = append(errs, fmt.Errorf("standin: Config.EnvoyMinor %d not in 34..37", cfg.EnvoyMinor))
	}
	if cfg.StatusOnError != 0 && (cfg.StatusOnError < 200 || cfg.StatusOnError > 599) {
		errs = append(errs, fmt.Errorf("standin: Config.StatusOnError %d is not an HTTP status", cfg.StatusOnError))
	}
	if err := validateMode("Config.Mode", cfg.Mode); err != nil {
		errs = append(errs, err)
	}
	for i, r := range cfg.Routes {
		if err := validateMode(fmt.Sprintf("Config.Routes[%d].Mode", i), r.Mode); err != nil {
			errs = append(errs, err)
		}
		if !strings.HasPrefix(r.Prefix, "/") {
			errs = append(errs, fmt.Errorf("standin: Config.Routes[%d].Prefix %q must start with /", i, r.Prefix))
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	if cfg.MessageTimeout == 0 {
		cfg.MessageTimeout = 200 * time.Millisecond
	}
	if cfg.StatusOnError == 0 {
		cfg.StatusOnError = http.StatusInternalServerError
	}
	if cfg.RequestBufferLimit == 0 {
		cfg.RequestBufferLimit = 1 << 20
	}
	if cfg.RemoteCloseTimeout == 0 {
		cfg.RemoteCloseTimeout = time.Second
	}
	if cfg.EnvoyMinor == 0 {
		cfg.EnvoyMinor = 37
	}
	if cfg.EnvoyMinor < 36 {
		cfg.StatusOnError = http.StatusInternalServerError
	}
	if cfg.Mode == nil {
		cfg.Mode = RecommendedMode()
	}
	if len(cfg.Routes) == 0 {
		cfg.Routes = []Route{{Prefix: "/"}}
	}
	p := &Proxy{
		cfg:     cfg,
		client:  extprocv3.NewExternalProcessorClient(cfg.ExtProc),
		rt:      cfg.Transport,
		log:     cfg.Logger,
		changed: make(chan struct{}),
	}
	if p.rt == nil {
		p.ownRT = &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 16}
		p.rt = p.ownRT
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	return p, nil
}

// RecommendedMode returns the processing mode recommended for LLM routes (docs §5.2).
func RecommendedMode() *filterv3.ProcessingMode {
	return &filterv3.ProcessingMode{
		RequestHeaderMode:   filterv3.ProcessingMode_SEND,
		RequestBodyMode:     filterv3.ProcessingMode_BUFFERED,
		RequestTrailerMode:  filterv3.ProcessingMode_SKIP,
		ResponseHeaderMode:  filterv3.ProcessingMode_SEND,
		ResponseBodyMode:    filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		ResponseTrailerMode: filterv3.ProcessingMode_SEND,
	}
}

func validateMode(field string, m *filterv3.ProcessingMode) error {
	if m == nil {
		return nil
	}
	var errs []error
	for _, b := range []struct {
		name    string
		body    filterv3.ProcessingMode_BodySendMode
		trailer filterv3.ProcessingMode_HeaderSendMode
	}{
		{"request", m.RequestBodyMode, m.RequestTrailerMode},
		{"response", m.ResponseBodyMode, m.ResponseTrailerMode},
	} {
		switch b.body {
		case filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_STREAMED:
		case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
			if b.trailer != filterv3.ProcessingMode_SEND {
				errs = append(errs, fmt.Errorf("standin: %s.%s_trailer_mode must be SEND with FULL_DUPLEX_STREAMED", field, b.name))
			}
		default:
			errs = append(errs, fmt.Errorf("standin: %s.%s_body_mode %v is not emulated", field, b.name, b.body))
		}
	}
	return errors.Join(errs...)
}

// Handler returns p wrapped to serve both HTTP/1.1 and HTTP/2 without TLS (h2c, prior
// knowledge or upgrade) on any *http.Server, e.g. httptest.NewServer(p.Handler()).
func (p *Proxy) Handler() http.Handler { return h2c.NewHandler(p, &http2.Server{}) }

// Server returns an *http.Server that serves p over HTTP/1.1 and h2c.
func (p *Proxy) Server() *http.Server {
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	return &http.Server{Handler: p, Protocols: &protos, ReadHeaderTimeout: 10 * time.Second}
}

// Close releases idle upstream connections of the private transport.
func (p *Proxy) Close() {
	if p.ownRT != nil {
		p.ownRT.CloseIdleConnections()
	}
}

// Log returns one entry per finished request, in finishing order.
func (p *Proxy) Log() []Entry {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Entry(nil), p.entries...)
}

// WaitLog waits until at least n requests have finished and returns the log. A client may see
// the end of its response slightly before the stand-in records the request.
func (p *Proxy) WaitLog(ctx context.Context, n int) ([]Entry, error) {
	for {
		p.mu.Lock()
		if len(p.entries) >= n {
			e := append([]Entry(nil), p.entries...)
			p.mu.Unlock()
			return e, nil
		}
		ch := p.changed
		p.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return p.Log(), fmt.Errorf("standin: waiting for %d log entries: %w", n, ctx.Err())
		}
	}
}

func (p *Proxy) record(e Entry) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.entries = append(p.entries, e)
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *Proxy) route(path string) (Route, bool) {
	for _, r := range p.cfg.Routes {
		if strings.HasPrefix(path, r.Prefix) {
			return r, true
		}
	}
	return Route{}, false
}

func (p *Proxy) modeFor(r Route) *filterv3.ProcessingMode {
	if r.Mode != nil {
		return proto.Clone(r.Mode).(*filterv3.ProcessingMode)
	}
	return proto.Clone(p.cfg.Mode).(*filterv3.ProcessingMode)
}
