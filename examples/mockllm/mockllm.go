// Package mockllm is a mock LLM provider for tests and the demo: an http.Handler that speaks
// the OpenAI chat completions API and the Anthropic messages API, streamed (SSE) or not.
//
// Its answers are predictable: N output tokens, where N is the request's max_tokens /
// max_completion_tokens (finish reason "length" / stop reason "max_tokens") or else
// [Config.DefaultTokens] (finish reason "stop" / "end_turn"). The text is "tok tok tok ...":
// the first delta is "tok", every later one " tok", each one token in cl100k_base and
// o200k_base, so the live count of a stream equals the usage it reports. The server records
// every request, including whether the client went away before the end ([Server.Requests]).
//
// Request headers script failures: "x-mock-status: 429" (or 500, 503, ...) answers that status
// with a provider-shaped JSON error and, for 429, "retry-after" from "x-mock-retry-after"
// (default "1"); "x-mock-tokens: N" overrides N.
//
// [Replay] serves a recorded provider response byte for byte instead.
package mockllm

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Config configures a [Server]. The zero value is usable.
type Config struct {
	// Model is reported when the request names none (default "mock-llm").
	Model string
	// DefaultTokens is N when the request sets no output cap (default 16).
	DefaultTokens int
	// TokenDelay paces streams: the delay before each output token (default 0).
	TokenDelay time.Duration
	// Pace, if set, is called before output token i (0-based) of a stream instead of waiting
	// TokenDelay; returning an error ends the stream as if the client went away. Tests use it
	// to hold a stream at a chosen token.
	Pace func(ctx context.Context, i int) error
	// PromptTokens reports the prompt tokens of a request body; nil means [EstimatePrompt].
	PromptTokens func(body []byte) int
	// MaxOutputTokens bounds output caps; a larger or negative cap is answered 400, as
	// providers do (default 100000).
	MaxOutputTokens int
	// Created is the "created" timestamp of OpenAI responses (default 1700000000).
	Created int64
}

// Record describes one request the server answered. Records are values; [Server.Requests]
// returns copies (Header and Body are shared and must not be modified).
type Record struct {
	Path   string
	Header http.Header
	Body   []byte
	Model  string
	Stream bool
	// IncludeUsage is stream_options.include_usage.
	IncludeUsage bool
	// MaxTokens is the largest output cap in the request (0 if none).
	MaxTokens int
	// Status is the HTTP status answered.
	Status int
	// PromptTokens is the input usage reported.
	PromptTokens int
	// TokensPlanned is N; TokensSent how many output tokens were written.
	TokensPlanned, TokensSent int
	// Cancelled reports that the client went away before the response ended.
	Cancelled bool
}

// Server is the mock LLM, an http.Handler. Create it with [New] (the zero value is not
// usable); it is safe for concurrent use.
type Server struct {
	cfg Config

	mu      sync.Mutex
	records []Record
	changed chan struct{}
	seq     int
}

// New returns a Server; zero fields of cfg take their defaults.
func New(cfg Config) *Server {
	if cfg.Model == "" {
		cfg.Model = "mock-llm"
	}
	if cfg.DefaultTokens <= 0 {
		cfg.DefaultTokens = 16
	}
	if cfg.PromptTokens == nil {
		cfg.PromptTokens = EstimatePrompt
	}
	if cfg.MaxOutputTokens <= 0 {
		cfg.MaxOutputTokens = 100000
	}
	if cfg.Created == 0 {
		cfg.Created = 1700000000
	}
	return &Server{cfg: cfg, changed: make(chan struct{})}
}

// Requests returns the finished requests, in finishing order.
func (s *Server) Requests() []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Record(nil), s.records...)
}

// WaitRequests waits until at least n requests finished and returns them.
func (s *Server) WaitRequests(ctx context.Context, n int) ([]Record, error) {
	for {
		s.mu.Lock()
		if len(s.records) >= n {
			r := append([]Record(nil), s.records...)
			s.mu.Unlock()
			return r, nil
		}
		ch := s.changed
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return s.Requests(), fmt.Errorf("mockllm: waiting for %d requests: %w", n, ctx.Err())
		}
	}
}

func (s *Server) record(r Record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.records = append(s.records, r)
	close(s.changed)
	s.changed = make(chan struct{})
}

// request is the part of both APIs' request bodies the mock reads.
type request struct {
	Model               string          `json:"model"`
	Stream              bool            `json:"stream"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	Messages            json.RawMessage `json:"messages"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// ServeHTTP answers POST /v1/chat/completions and POST /v1/messages.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	anthropic := r.URL.Path == "/v1/messages"
	if r.URL.Path != "/v1/chat/completions" && !anthropic {
		writeError(w, anthropic, http.StatusNotFound, "not_found_error", "unknown path "+r.URL.Path)
		return
	}
	body, err := io.ReadAll(r.Body)
	rec := Record{Path: r.URL.Path, Header: r.Header.Clone(), Body: body}
	defer func() { s.record(rec) }()
	if err != nil {
		rec.Cancelled = true
		return
	}
	if r.Method != http.MethodPost {
		rec.Status = http.StatusMethodNotAllowed
		writeError(w, anthropic, rec.Status, "invalid_request_error", "use POST")
		return
	}
	var req request
	if err := json.Unmarshal(body, &req); err != nil {
		rec.Status = http.StatusBadRequest
		writeError(w, anthropic, rec.Status, "invalid_request_error", "invalid JSON body: "+err.Error())
		return
	}
	rec.Model, rec.Stream = req.Model, req.Stream
	rec.IncludeUsage = req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	if rec.Model == "" {
		rec.Model = s.cfg.Model
	}
	for _, p := range []*int{req.MaxTokens, req.MaxCompletionTokens} {
		if p == nil {
			continue
		}
		if *p < 1 || *p > s.cfg.MaxOutputTokens {
			rec.Status = http.StatusBadRequest
			writeError(w, anthropic, rec.Status, "invalid_request_error",
				fmt.Sprintf("output cap %d outside 1..%d", *p, s.cfg.MaxOutputTokens))
			return
		}
		rec.MaxTokens = max(rec.MaxTokens, *p)
	}
	if v := r.Header.Get("x-mock-status"); v != "" {
		code, err := strconv.Atoi(v)
		if err != nil || code < 400 || code > 599 {
			code = http.StatusBadRequest
		}
		rec.Status = code
		if code == http.StatusTooManyRequests {
			ra := r.Header.Get("x-mock-retry-after")
			if ra == "" {
				ra = "1"
			}
			w.Header().Set("retry-after", ra)
		}
		typ := map[bool]string{true: "rate_limit_error", false: "api_error"}[code == http.StatusTooManyRequests]
		writeError(w, anthropic, code, typ, "scripted error "+v)
		return
	}
	n, capped := s.cfg.DefaultTokens, false
	if rec.MaxTokens > 0 {
		n, capped = rec.MaxTokens, true
	}
	if v := r.Header.Get("x-mock-tokens"); v != "" {
		if k, err := strconv.Atoi(v); err == nil && k >= 0 && k <= s.cfg.MaxOutputTokens {
			n = k
		}
	}
	rec.TokensPlanned = n
	rec.PromptTokens = s.cfg.PromptTokens(body)
	rec.Status = http.StatusOK
	s.mu.Lock()
	s.seq++
	id := s.seq
	s.mu.Unlock()
	a := answer{s: s, w: w, ctx: r.Context(), rec: &rec, id: id, capped: capped}
	switch {
	case anthropic && req.Stream:
		a.anthropicStream()
	case anthropic:
		a.anthropicJSON()
	case req.Stream:
		a.openAIStream()
	default:
		a.openAIJSON()
	}
}

// EstimatePrompt is the default prompt count: a quarter token per byte of the body's
// messages, plus 3 per message and 3 for the reply, as chat formats add.
func EstimatePrompt(body []byte) int {
	var req struct {
		Messages []json.RawMessage `json:"messages"`
		System   json.RawMessage   `json:"system"`
	}
	if json.Unmarshal(body, &req) != nil {
		return (len(body) + 3) / 4
	}
	n := 3 + (len(req.System)+3)/4
	for _, m := range req.Messages {
		n += 3 + (len(m)+3)/4
	}
	return n
}

func writeError(w http.ResponseWriter, anthropic bool, code int, typ, msg string) {
	w.Header().Set("content-type", "application/json")
	w.WriteHeader(code)
	var v any
	if anthropic {
		v = map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": msg}}
	} else {
		v = map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": nil}}
	}
	_ = json.NewEncoder(w).Encode(v)
}

// answer writes one successful response.
type answer struct {
	s      *Server
	w      http.ResponseWriter
	ctx    context.Context
	rec    *Record
	id     int
	capped bool
}

func word(i int) string {
	if i == 0 {
		return "tok"
	}
	return " tok"
}

func text(n int) string {
	b := make([]byte, 0, 4*n)
	for i := range n {
		b = append(b, word(i)...)
	}
	return string(b)
}

// pace waits before token i; false means the client went away.
func (a *answer) pace(i int) bool {
	if a.s.cfg.Pace != nil {
		if err := a.s.cfg.Pace(a.ctx, i); err != nil {
			return false
		}
	} else if d := a.s.cfg.TokenDelay; d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-a.ctx.Done():
		}
	}
	return a.ctx.Err() == nil
}

// event writes one SSE event and flushes; false means the client went away.
func (a *answer) event(name string, v any) bool {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only maps of plain values are marshalled
	}
	var out []byte
	if name != "" {
		out = append(out, "event: "+name+"\n"...)
	}
	out = append(append(append(out, "data: "...), b...), "\n\n"...)
	return a.write(out)
}

func (a *answer) write(b []byte) bool {
	if _, err := a.w.Write(b); err != nil {
		return false
	}
	if err := http.NewResponseController(a.w).Flush(); err != nil {
		return false
	}
	return a.ctx.Err() == nil
}

func (a *answer) startSSE() {
	a.w.Header().Set("content-type", "text/event-stream")
	a.w.Header().Set("cache-control", "no-cache")
	a.w.WriteHeader(http.StatusOK)
}

// finish marks the record cancelled when the client went away before the end.
func (a *answer) finish(ok bool) {
	if !ok || a.ctx.Err() != nil {
		a.rec.Cancelled = true
	}
}

func (a *answer) openAIUsage() map[string]any {
	n := a.rec.TokensPlanned
	return map[string]any{"prompt_tokens": a.rec.PromptTokens, "completion_tokens": n, "total_tokens": a.rec.PromptTokens + n}
}

func (a *answer) finishReason() string {
	if a.capped {
		return "length"
	}
	return "stop"
}

func (a *answer) openAIChunk(delta map[string]any, finish any) map[string]any {
	c := map[string]any{
		"id": fmt.Sprintf("chatcmpl-mock-%d", a.id), "object": "chat.completion.chunk",
		"created": a.s.cfg.Created, "model": a.rec.Model,
		"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}},
	}
	if a.rec.IncludeUsage {
		c["usage"] = nil // as OpenAI sends it on every chunk but the last
	}
	return c
}

func (a *answer) openAIStream() {
	a.startSSE()
	ok := a.stream(func() bool {
		return a.event("", a.openAIChunk(map[string]any{"role": "assistant", "content": ""}, nil))
	}, func(i int) bool {
		return a.event("", a.openAIChunk(map[string]any{"content": word(i)}, nil))
	}, func() bool {
		if !a.event("", a.openAIChunk(map[string]any{}, a.finishReason())) {
			return false
		}
		if a.rec.IncludeUsage {
			c := a.openAIChunk(nil, nil)
			c["choices"] = []any{}
			c["usage"] = a.openAIUsage()
			if !a.event("", c) {
				return false
			}
		}
		return a.write([]byte("data: [DONE]\n\n"))
	})
	a.finish(ok)
}

// stream writes head, the N tokens paced, then tail.
func (a *answer) stream(head func() bool, token func(i int) bool, tail func() bool) bool {
	if !head() {
		return false
	}
	for i := range a.rec.TokensPlanned {
		if !a.pace(i) || !token(i) {
			return false
		}
		a.rec.TokensSent++
	}
	return tail()
}

func (a *answer) openAIJSON() {
	a.rec.TokensSent = a.rec.TokensPlanned
	a.writeJSON(map[string]any{
		"id": fmt.Sprintf("chatcmpl-mock-%d", a.id), "object": "chat.completion",
		"created": a.s.cfg.Created, "model": a.rec.Model,
		"choices": []any{map[string]any{"index": 0, "message": map[string]any{"role": "assistant", "content": text(a.rec.TokensPlanned)}, "finish_reason": a.finishReason()}},
		"usage":   a.openAIUsage(),
	})
}

func (a *answer) writeJSON(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only maps of plain values are marshalled
	}
	a.w.Header().Set("content-type", "application/json")
	a.w.Header().Set("content-length", strconv.Itoa(len(b)))
	a.w.WriteHeader(http.StatusOK)
	_, err = a.w.Write(b)
	a.finish(err == nil)
}

func (a *answer) stopReason() string {
	if a.capped {
		return "max_tokens"
	}
	return "end_turn"
}

func (a *answer) anthropicStream() {
	a.startSSE()
	ok := a.stream(func() bool {
		return a.event("message_start", map[string]any{"type": "message_start", "message": map[string]any{
			"id": fmt.Sprintf("msg_mock_%d", a.id), "type": "message", "role": "assistant", "model": a.rec.Model,
			"content": []any{}, "stop_reason": nil, "stop_sequence": nil,
			"usage": map[string]any{"input_tokens": a.rec.PromptTokens, "output_tokens": 1},
		}}) && a.event("content_block_start", map[string]any{"type": "content_block_start", "index": 0,
			"content_block": map[string]any{"type": "text", "text": ""}})
	}, func(i int) bool {
		return a.event("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
			"delta": map[string]any{"type": "text_delta", "text": word(i)}})
	}, func() bool {
		return a.event("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0}) &&
			a.event("message_delta", map[string]any{"type": "message_delta",
				"delta": map[string]any{"stop_reason": a.stopReason(), "stop_sequence": nil},
				"usage": map[string]any{"output_tokens": a.rec.TokensPlanned}}) &&
			a.event("message_stop", map[string]any{"type": "message_stop"})
	})
	a.finish(ok)
}

func (a *answer) anthropicJSON() {
	a.rec.TokensSent = a.rec.TokensPlanned
	a.writeJSON(map[string]any{
		"id": fmt.Sprintf("msg_mock_%d", a.id), "type": "message", "role": "assistant", "model": a.rec.Model,
		"content":     []any{map[string]any{"type": "text", "text": text(a.rec.TokensPlanned)}},
		"stop_reason": a.stopReason(), "stop_sequence": nil,
		"usage": map[string]any{"input_tokens": a.rec.PromptTokens, "output_tokens": a.rec.TokensPlanned},
	})
}
