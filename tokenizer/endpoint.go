package tokenizer

import (
	"net/url"
	"path"
	"strings"
)

// EndpointClass says whether a request generates tokens that a bucket
// should be charged for.
type EndpointClass uint8

const (
	// Unknown endpoints are neither known to generate tokens nor known to
	// be free: images, audio, batches, realtime sessions, and every path
	// this package does not recognise. What happens to them is a policy
	// decision (pass, charge a flat cost, or refuse). It is the zero value.
	Unknown EndpointClass = iota
	// Metered endpoints generate (or embed) tokens the provider bills:
	// Count them, reserve, settle.
	Metered
	// Free endpoints generate nothing: reads, deletes, token counting,
	// moderation, file uploads. Pass them through and charge nothing.
	Free
)

func (c EndpointClass) String() string {
	switch c {
	case Metered:
		return "metered"
	case Free:
		return "free"
	}
	return "unknown"
}

// Endpoint is what a request's method and path say about its cost.
type Endpoint struct {
	Class EndpointClass
	// API is the body's shape when Class is Metered, else empty.
	API API
	// Name is a fixed label for logs and metrics, never text from the
	// request: for Metered "chat", "completions", "embeddings",
	// "responses", "messages", "gemini_generate", "gemini_embed"; for
	// Free "read", "delete", "count_tokens", "moderations",
	// "stored_completions", "response_cancel", "files", "conversations";
	// for Unknown "images", "audio", "batches", "realtime", "other".
	Name string
}

// Classify tells from the method and the :path alone whether a request
// is metered, free or unknown. The path may carry any prefix before the
// provider's own (/openai/v1/…, /api/v1/…, Azure's
// /openai/deployments/NAME/…?api-version=…); it is matched after
// percent-decoding, removing dot segments and folding ASCII case, so no
// spelling of a generation endpoint passes as free. Classify is cheap and
// safe for concurrent use.
func Classify(method, rawPath string) Endpoint {
	seg := pathSegments(rawPath)
	last := ""
	if len(seg) > 0 {
		last = seg[len(seg)-1]
	}
	// Realtime and live sessions open with a GET (a WebSocket upgrade) and
	// then generate: never free, whatever the method.
	if contains(seg, "realtime") || strings.Contains(last, "bidigeneratecontent") {
		return Endpoint{Name: "realtime"}
	}
	switch strings.ToUpper(method) {
	case "GET", "HEAD", "OPTIONS":
		return Endpoint{Class: Free, Name: "read"}
	case "DELETE":
		return Endpoint{Class: Free, Name: "delete"}
	case "POST":
	default:
		return Endpoint{Name: "other"}
	}
	// Gemini and Vertex AI name the method after a colon:
	// …/models/NAME:generateContent.
	if i := strings.LastIndexByte(last, ':'); i >= 0 {
		switch last[i+1:] {
		case "generatecontent", "streamgeneratecontent":
			return Endpoint{Class: Metered, API: Gemini, Name: "gemini_generate"}
		case "embedcontent", "batchembedcontents":
			return Endpoint{Class: Metered, API: Gemini, Name: "gemini_embed"}
		case "counttokens":
			return Endpoint{Class: Free, Name: "count_tokens"}
		}
		return Endpoint{Name: "other"}
	}
	// Azure names the deployment in the path: what follows it is the
	// endpoint, so a deployment called "chat" cannot make
	// /openai/deployments/chat/completions look like chat completions.
	if k := index(seg, "deployments"); k >= 0 && k+2 <= len(seg) {
		seg = seg[k+2:]
	}
	switch {
	case hasTail(seg, "v1", "messages", "count_tokens"), hasTail(seg, "responses", "input_tokens"):
		return Endpoint{Class: Free, Name: "count_tokens"}
	case hasTail(seg, "v1", "messages"):
		return Endpoint{Class: Metered, API: Messages, Name: "messages"}
	case hasTail(seg, "chat", "completions"):
		return Endpoint{Class: Metered, API: ChatCompletions, Name: "chat"}
	case hasTail(seg, "completions"):
		return Endpoint{Class: Metered, API: Completions, Name: "completions"}
	case hasTail(seg, "embeddings"):
		return Endpoint{Class: Metered, API: Embeddings, Name: "embeddings"}
	case hasTail(seg, "responses"):
		return Endpoint{Class: Metered, API: Responses, Name: "responses"}
	case hasTail(seg, "moderations"):
		return Endpoint{Class: Free, Name: "moderations"}
	case len(seg) >= 3 && seg[len(seg)-3] == "chat" && seg[len(seg)-2] == "completions":
		// POST /v1/chat/completions/{id} updates a stored completion.
		return Endpoint{Class: Free, Name: "stored_completions"}
	case len(seg) >= 3 && seg[len(seg)-3] == "responses" && last == "cancel":
		return Endpoint{Class: Free, Name: "response_cancel"}
	case contains(seg, "images"):
		return Endpoint{Name: "images"}
	case contains(seg, "audio"):
		return Endpoint{Name: "audio"}
	case contains(seg, "batches"):
		return Endpoint{Name: "batches"}
	}
	if k := index(seg, "files"); k >= 1 && apiRoot(seg[k-1]) {
		return Endpoint{Class: Free, Name: "files"}
	}
	if k := index(seg, "uploads"); k >= 1 && apiRoot(seg[k-1]) {
		return Endpoint{Class: Free, Name: "files"}
	}
	if k := index(seg, "conversations"); k >= 1 && apiRoot(seg[k-1]) {
		return Endpoint{Class: Free, Name: "conversations"}
	}
	return Endpoint{Name: "other"}
}

// pathSegments returns the segments of the path part of rawPath,
// percent-decoded, without dot segments, in lower case.
func pathSegments(rawPath string) []string {
	p, _, _ := strings.Cut(rawPath, "?")
	p, _, _ = strings.Cut(p, "#")
	if u, err := url.PathUnescape(p); err == nil {
		p = u
	}
	p = strings.ToLower(path.Clean("/" + p))
	if p == "/" {
		return nil
	}
	return strings.Split(p[1:], "/")
}

// hasTail reports whether seg ends with tail.
func hasTail(seg []string, tail ...string) bool {
	if len(seg) < len(tail) {
		return false
	}
	for i, t := range tail {
		if seg[len(seg)-len(tail)+i] != t {
			return false
		}
	}
	return true
}

func index(seg []string, s string) int {
	for i, x := range seg {
		if x == s {
			return i
		}
	}
	return -1
}

func contains(seg []string, s string) bool { return index(seg, s) >= 0 }

// apiRoot reports whether a segment is where a provider's API starts: a
// version (v1, v1beta, v2alpha) or Azure's "openai".
func apiRoot(s string) bool {
	if s == "openai" {
		return true
	}
	if len(s) < 2 || s[0] != 'v' || !isDigit(s[1]) {
		return false
	}
	rest := strings.TrimLeft(s[1:], "0123456789")
	return rest == "" || strings.HasPrefix(rest, "beta") || strings.HasPrefix(rest, "alpha")
}

// modelFromPath finds the model in an Azure deployment path
// (/openai/deployments/NAME/...) or a Gemini path (.../models/NAME:verb).
func modelFromPath(rawPath string) string {
	if d := deploymentFromPath(rawPath); d != "" {
		return d
	}
	p, _, _ := strings.Cut(rawPath, "?")
	if _, rest, ok := strings.Cut(p, "/models/"); ok {
		name, _, _ := strings.Cut(rest, ":")
		name, _, _ = strings.Cut(name, "/")
		return name
	}
	return ""
}

// deploymentFromPath returns the Azure deployment named in the path, or "".
func deploymentFromPath(rawPath string) string {
	p, _, _ := strings.Cut(rawPath, "?")
	if _, rest, ok := strings.Cut(p, "/deployments/"); ok {
		name, _, _ := strings.Cut(rest, "/")
		return name
	}
	return ""
}
