package rls

import (
	"errors"
	"io"
	"net/http"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
)

// MaxJSONBody bounds a request of POST /json.
const MaxJSONBody = 1 << 20

// JSONHandler serves ShouldRateLimit over HTTP, as envoyproxy/ratelimit's
// /json (docs/envoy-ratelimit.md §3.7), while rls.json_endpoint is on in
// the configuration in force (404 otherwise): a RateLimitRequest in
// protobuf's JSON form in, the answer in it out, 200 when OK, 429 when
// over the limit, 500 when UNKNOWN. The call is the gRPC call's, counted
// alike. A body that is not a request gets 400 saying why, a refused call
// its error's code in HTTP terms (httpStatus; ratelimit answers 400 to
// every error, a store's failure included).
func (s *Service) JSONHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if m := s.live.Load(); m == nil || !m.json {
			http.Error(w, "POST /json is off: set rls.json_endpoint", http.StatusNotFound)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxJSONBody))
		var tooLarge *http.MaxBytesError
		switch {
		case errors.As(err, &tooLarge):
			http.Error(w, "the request is larger than 1 MiB", http.StatusRequestEntityTooLarge)
			return
		case err != nil:
			http.Error(w, "reading the request: "+err.Error(), http.StatusBadRequest)
			return
		}
		var req rlsv3.RateLimitRequest
		if err := protojson.Unmarshal(body, &req); err != nil {
			http.Error(w, "not a RateLimitRequest in protobuf's JSON form: "+err.Error(), http.StatusBadRequest)
			return
		}
		resp, err := s.ShouldRateLimit(r.Context(), &req)
		if err != nil {
			st := status.Convert(err)
			http.Error(w, st.Message(), httpStatus(st.Code()))
			return
		}
		out, err := protojson.Marshal(resp)
		if err != nil {
			http.Error(w, "encoding the answer: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		switch resp.GetOverallCode() {
		case rlsv3.RateLimitResponse_OVER_LIMIT:
			w.WriteHeader(http.StatusTooManyRequests)
		case rlsv3.RateLimitResponse_UNKNOWN:
			w.WriteHeader(http.StatusInternalServerError)
		}
		w.Write(out)
	})
}

// httpStatus is the HTTP status of a refused call's gRPC code: 400 for a
// call refused as ratelimit refuses it (an empty domain or descriptor
// list, none configured: its plain errors, UNKNOWN over gRPC) or as
// invalid, 503 while the store is unavailable.
func httpStatus(c codes.Code) int {
	switch c {
	case codes.InvalidArgument, codes.Unknown:
		return http.StatusBadRequest
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	case codes.Canceled:
		return 499 // the client went; it reads nothing
	}
	return http.StatusInternalServerError
}
