package standin

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"golang.org/x/net/http/httpguts"
)

// header is one header line as Envoy's HeaderMap holds it: lower-case key, raw value.
type header struct {
	key   string
	value string
}

// hopByHop headers never travel through Envoy's header map.
var hopByHop = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true, "transfer-encoding": true,
	"upgrade": true, "te": true, "http2-settings": true, "trailer": true,
}

func requestHeaders(r *http.Request) []header {
	path := r.URL.RequestURI()
	hs := []header{
		{":authority", r.Host}, {":path", path}, {":method", r.Method}, {":scheme", "http"},
	}
	hs = appendHeaderMap(hs, r.Header)
	// Envoy's connection manager generates x-request-id before any filter runs.
	if get(hs, "x-request-id") == "" {
		hs = append(hs, header{"x-request-id", newRequestID()})
	}
	if get(hs, "x-forwarded-proto") == "" {
		hs = append(hs, header{"x-forwarded-proto", "http"})
	}
	if r.ContentLength > 0 && get(hs, "content-length") == "" {
		hs = append(hs, header{"content-length", strconv.FormatInt(r.ContentLength, 10)})
	}
	return hs
}

// newRequestID returns a random UUID (version 4) string.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

func responseHeaders(resp *http.Response) []header {
	hs := []header{{":status", strconv.Itoa(resp.StatusCode)}}
	hs = appendHeaderMap(hs, resp.Header)
	if resp.ContentLength >= 0 && get(hs, "content-length") == "" && !bodyless(resp) {
		hs = append(hs, header{"content-length", strconv.FormatInt(resp.ContentLength, 10)})
	}
	return hs
}

func appendHeaderMap(hs []header, h http.Header) []header {
	for k, vs := range h {
		lk := strings.ToLower(k)
		if hopByHop[lk] || lk == "host" {
			continue
		}
		for _, v := range vs {
			hs = append(hs, header{lk, v})
		}
	}
	return hs
}

func get(hs []header, key string) string {
	for _, h := range hs {
		if h.key == key {
			return h.value
		}
	}
	return ""
}

func del(hs []header, key string) []header {
	out := hs[:0]
	for _, h := range hs {
		if h.key != key {
			out = append(out, h)
		}
	}
	return out
}

func headerMap(hs []header) *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, 0, len(hs))}
	for _, h := range hs {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: h.key, RawValue: []byte(h.value)})
	}
	return m
}

// copyTo writes the non-pseudo headers to dst.
func copyTo(dst http.Header, hs []header) {
	for _, h := range hs {
		if !strings.HasPrefix(h.key, ":") {
			dst.Add(h.key, h.value)
		}
	}
}

// errMutation marks a header mutation Envoy refuses with an error (not silently).
var errMutation = errors.New("invalid header mutation")

// mutate applies m to hs following Envoy's default mutation rules (docs §6.1): changes to
// host, :authority, :method, :scheme and x-envoy* are ignored, as is removing host or any
// pseudo-header, an invalid :status, and content-length when dropCL is set. Values come from
// raw_value; setting only value writes an empty header; setting both, or an invalid name or
// value, is an error.
func mutate(hs []header, m *extprocv3.HeaderMutation, dropCL bool) ([]header, error) {
	if m == nil {
		return hs, nil
	}
	for _, o := range m.GetSetHeaders() {
		h := o.GetHeader()
		if h == nil {
			continue
		}
		key := strings.ToLower(h.GetKey())
		if h.GetValue() != "" && len(h.GetRawValue()) > 0 {
			return hs, fmt.Errorf("%w: %q has both value and raw_value", errMutation, key)
		}
		val := string(h.GetRawValue())
		if key == "" || (!strings.HasPrefix(key, ":") && !httpguts.ValidHeaderFieldName(key)) {
			return hs, fmt.Errorf("%w: header name %q", errMutation, key)
		}
		if !httpguts.ValidHeaderFieldValue(val) {
			return hs, fmt.Errorf("%w: value of %q", errMutation, key)
		}
		if forbidden(key) || (dropCL && key == "content-length") {
			continue
		}
		if key == ":status" {
			if n, err := strconv.Atoi(val); err != nil || n < 200 || n > 999 {
				continue
			}
		}
		if strings.HasPrefix(key, ":") && key != ":path" && key != ":status" {
			continue
		}
		if o.GetAppend().GetValue() && !strings.HasPrefix(key, ":") {
			hs = append(hs, header{key, val})
			continue
		}
		hs = append(del(hs, key), header{key, val})
	}
	for _, k := range m.GetRemoveHeaders() {
		key := strings.ToLower(k)
		if strings.HasPrefix(key, ":") || key == "host" || forbidden(key) {
			continue
		}
		hs = del(hs, key)
	}
	return hs, nil
}

func forbidden(key string) bool {
	switch key {
	case "host", ":authority", ":method", ":scheme":
		return true
	}
	return strings.HasPrefix(key, "x-envoy")
}
