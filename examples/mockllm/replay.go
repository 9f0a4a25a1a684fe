package mockllm

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// replayMeta is the part of a recorded case's meta.json that Replay reads.
type replayMeta struct {
	Status              int            `json:"status"`
	ResponseContentType string         `json:"response_content_type"`
	ResponseHeaders     map[string]any `json:"response_headers"`
	Files               struct {
		Response *string `json:"response"`
	} `json:"files"`
}

// replayed response headers that describe the transfer or the recording, not the answer.
var replaySkip = map[string]bool{
	"content-length": true, "content-encoding": true, "transfer-encoding": true, "connection": true,
	"keep-alive": true, "date": true, "set-cookie": true, "content-type": true,
}

// Replay returns a handler that answers every request with the recorded response of one case
// of testdata/providers (caseDir is e.g. ".../providers/openai/chat-stream-gpt-4o-mini"):
// status and content-type from meta.json, the recorded response headers (except transfer and
// x-envoy ones), and response.sse or response.json byte for byte. chunkSize > 0 writes and
// flushes the body in pieces of that many bytes (down to 1); 0 writes it at once.
func Replay(caseDir string, chunkSize int) (http.Handler, error) {
	raw, err := os.ReadFile(filepath.Join(caseDir, "meta.json"))
	if err != nil {
		return nil, fmt.Errorf("mockllm: replay: %w", err)
	}
	var m replayMeta
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("mockllm: replay %s: meta.json: %w", caseDir, err)
	}
	if m.Files.Response == nil {
		return nil, fmt.Errorf("mockllm: replay %s: the case has no recorded response", caseDir)
	}
	if m.Status < 100 || m.Status > 599 {
		return nil, fmt.Errorf("mockllm: replay %s: meta.json status %d is not an HTTP status", caseDir, m.Status)
	}
	if chunkSize < 0 {
		return nil, errors.New("mockllm: replay: negative chunk size")
	}
	body, err := os.ReadFile(filepath.Join(caseDir, *m.Files.Response))
	if err != nil {
		return nil, fmt.Errorf("mockllm: replay: %w", err)
	}
	h := http.Header{}
	for k, v := range m.ResponseHeaders {
		lk := strings.ToLower(k)
		if replaySkip[lk] || strings.HasPrefix(lk, "x-envoy") {
			continue
		}
		switch v := v.(type) {
		case string:
			h.Add(k, v)
		case []any:
			for _, e := range v {
				if s, ok := e.(string); ok {
					h.Add(k, s)
				}
			}
		}
	}
	if m.ResponseContentType != "" {
		h.Set("content-type", m.ResponseContentType)
	}
	stream := strings.HasSuffix(*m.Files.Response, ".sse")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		for k, v := range h {
			w.Header()[k] = v
		}
		if !stream {
			w.Header().Set("content-length", strconv.Itoa(len(body)))
		}
		w.WriteHeader(m.Status)
		rc := http.NewResponseController(w)
		if chunkSize == 0 {
			_, _ = w.Write(body)
			return
		}
		for b := body; len(b) > 0; {
			k := min(chunkSize, len(b))
			if _, err := w.Write(b[:k]); err != nil {
				return
			}
			if err := rc.Flush(); err != nil {
				return
			}
			b = b[k:]
		}
	}), nil
}
