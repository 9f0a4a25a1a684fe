package extproc

import (
	"slices"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

// S24: Envoy merges the dynamic metadata of every answer of a stream into
// what its access log reads, so an answer carries the running counts only
// when they changed since the last answer that carried them: the response
// headers answer of a request whose counts stand where its decision left
// them carries none, the stream's chunks carry them as the output grows,
// and its end the settled counts. The first answer with metadata carries
// every count, a later one only the counts that changed. What Envoy ends
// up with is every count.
func TestMetadataOnlyWhenTheCountsChange(t *testing.T) {
	s, outcomes := requestServer(t, 1e6, &fakeCounter{input: 10, allowance: 100}, 1<<20)
	body := []byte(`{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	msgs := exchange(buffered, body, 0, true, false)
	msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headersOf(":status", "200", "content-type", "text/event-stream")}}})
	for i := range metadataEvery {
		msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: sse(words(2)...), EndOfStream: i == metadataEvery-1}}})
	}
	answers := drive(t, s, msgs)
	carries := func(k int) bool { return len(answers[k]) == 1 && answers[k][0].GetDynamicMetadata() != nil }
	if !carries(1) {
		t.Error("the decision's answer carries no metadata")
	}
	if carries(2) {
		t.Errorf("the response headers answer carries the decision's counts again: %v", answers[2][0].GetDynamicMetadata())
	}
	last := len(msgs) - 1
	if !carries(last) {
		t.Fatal("the stream's last answer carries no metadata")
	}
	if got, want := fieldNames(answers[1][0]), []string{"decision", "input_tokens", "output_tokens", "reserved_tokens"}; !cmp.Equal(got, want) {
		t.Errorf("the decision's answer carries %v, want %v", got, want)
	}
	if got, want := fieldNames(answers[last][0]), []string{"output_tokens", "settled_tokens"}; !cmp.Equal(got, want) {
		t.Errorf("the last answer carries %v, want only what changed: %v", got, want)
	}
	// What Envoy has at the end: every answer's metadata merged, field by
	// field, in the order of the answers.
	merged := map[string]any{}
	for _, as := range answers {
		for _, a := range as {
			for k, v := range a.GetDynamicMetadata().GetFields()["tokengate"].GetStructValue().AsMap() {
				merged[k] = v
			}
		}
	}
	o := <-outcomes
	want := map[string]any{"decision": "admitted", "input_tokens": 10.0, "output_tokens": float64(o.Output),
		"reserved_tokens": float64(o.Reserved), "settled_tokens": float64(o.Settled)}
	if d := cmp.Diff(want, merged); d != "" {
		t.Errorf("metadata Envoy ends up with (-want +got):\n%s", d)
	}
}

// fieldNames are the names of the tokengate metadata fields answer a
// carries, sorted.
func fieldNames(a *extprocv3.ProcessingResponse) []string {
	var names []string
	for k := range a.GetDynamicMetadata().GetFields()["tokengate"].GetStructValue().GetFields() {
		names = append(names, k)
	}
	slices.Sort(names)
	return names
}

// TestMetadataOfANonStreamedAnswer: a non-streamed answer is not counted
// live; its last answer's metadata carries the output the provider
// reported, beside the settled tokens it makes up.
func TestMetadataOfANonStreamedAnswer(t *testing.T) {
	s, outcomes := requestServer(t, 1e6, &fakeCounter{input: 10, allowance: 100}, 1<<20)
	body := []byte(`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`)
	msgs := exchange(buffered, body, 0, true, false)
	msgs = append(msgs, &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headersOf(":status", "200", "content-type", "application/json")}}},
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
			Body: []byte(`{"id":"c1","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],` +
				`"usage":{"prompt_tokens":10,"completion_tokens":7,"total_tokens":17}}`),
			EndOfStream: true}}})
	merged := map[string]any{}
	for _, as := range drive(t, s, msgs) {
		for _, a := range as {
			for k, v := range a.GetDynamicMetadata().GetFields()["tokengate"].GetStructValue().AsMap() {
				merged[k] = v
			}
		}
	}
	o := <-outcomes
	want := map[string]any{"decision": "admitted", "input_tokens": 10.0, "output_tokens": 7.0,
		"reserved_tokens": float64(o.Reserved), "settled_tokens": 17.0}
	if d := cmp.Diff(want, merged); d != "" {
		t.Errorf("metadata Envoy ends up with (-want +got):\n%s", d)
	}
}

// docs/design.md ("Dynamic metadata"): the last answer carries
// settled_tokens, so that %DYNAMIC_METADATA(tokengate:settled_tokens)%
// shows the settlement. Envoy's last message of a response is its headers
// when they carry end_of_stream (§2.4, a response without body), and, in
// STREAMED mode, the end_of_stream chunk, also when the stream is cut off
// in it (S14).
func TestLastAnswerCarriesSettledTokens(t *testing.T) {
	pol := Policy{Name: "p", MaxOutputTokens: 2, Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1e6, Rate: 1e-9}}}}
	for _, tc := range []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
		want float64
	}{
		{"response headers with end_of_stream", []*extprocv3.ProcessingRequest{
			reqHeadersMsg(buffered, duplex, chatPath),
			reqBodyMsg(`{"model":"m","max_tokens":50,"messages":[]}`, true),
			respHeadersMsg("200", "application/json", true),
		}, 12}, // the reservation stands: 10 + the allowance of 2
		{"STREAMED cut-off in the end_of_stream chunk", []*extprocv3.ProcessingRequest{
			reqHeadersMsg(buffered, streamed, chatPath),
			reqBodyMsg(`{"model":"m","stream":true,"max_tokens":50,"messages":[]}`, true),
			respHeadersMsg("200", "text/event-stream", false),
			respBodyMsg(string(sse(chatChunk("a"), chatChunk("b"), chatChunk("c"), "[DONE]")), true),
		}, 13}, // 10 + the 3 tokens counted, the third over the cap
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, outcomes := policyServer(t, pol, &fakeCounter{input: 10, allowance: 100}, 1<<20)
			answers := drive(t, s, tc.msgs)
			if o := <-outcomes; o.Settled != int(tc.want) {
				t.Fatalf("outcome %+v, want %v settled", o, tc.want)
			}
			last := answers[len(answers)-1]
			if len(last) == 0 {
				t.Fatal("the last message got no answer")
			}
			md := last[len(last)-1].GetDynamicMetadata()
			if v, ok := md.GetFields()["tokengate"].GetStructValue().GetFields()["settled_tokens"]; !ok || v.GetNumberValue() != tc.want {
				t.Errorf("the last answer's metadata %v, want settled_tokens %v", md, tc.want)
			}
		})
	}
}
