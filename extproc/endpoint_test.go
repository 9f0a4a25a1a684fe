package extproc

import (
	"encoding/json"
	"testing"

	"github.com/tokengate/tokengate/buckets"
)

// S22: a request whose path and body match no API tokengate meters follows
// the policy's UnknownEndpoints: refused with 400 unknown_api (the
// default), passed unmetered, or charged a flat cost through the policy's
// buckets — settled at that cost, or nothing when the upstream fails.
func TestUnknownEndpointsPolicy(t *testing.T) {
	const path = "/v1/moderations"
	body := `{"input":"hello"}`
	for _, tc := range []struct {
		action   string
		statuses []int // of three requests, the third with an upstream error
		reserved []float64
		settled  []float64
	}{
		{"", []int{400, 400, 400}, nil, nil},
		{unknownRefuse, []int{400, 400, 400}, nil, nil},
		{unknownPass, []int{200, 200, 500}, nil, nil},
		{unknownCharge, []int{200, 200, 500}, []float64{40, 40, 40}, []float64{40, 40, 0}},
	} {
		t.Run(tc.action, func(t *testing.T) {
			pol := Policy{Name: "p", UnknownEndpoints: tc.action, UnknownEndpointTokens: 40,
				Buckets: []BucketRule{{Name: "g", Limit: buckets.Limit{Capacity: 1000, Rate: 1e-9}}}}
			u := &upstream{ContentType: "application/json", Chunks: [][]byte{[]byte(`{"results":[]}`)}}
			r := newRig(t, u, rigOptions{policies: []Policy{pol}})
			for i, want := range tc.statuses {
				if i == 2 {
					u.Status = 500
				}
				resp, got := r.post(t, path, body, nil)
				if resp.StatusCode != want {
					t.Errorf("request %d: %d %s, want %d", i, resp.StatusCode, got, want)
				}
				o := r.outcome(t)
				if want == 400 {
					var e errorBody
					if err := json.Unmarshal([]byte(got), &e); err != nil || e.Error.Code != "unknown_api" {
						t.Errorf("request %d: body %s, want the unknown_api error", i, got)
					}
					continue
				}
				wantDecision := "admitted"
				if tc.action == unknownPass {
					wantDecision = "unmetered"
				}
				if o.Decision != wantDecision {
					t.Errorf("request %d: outcome %+v, want decision %s", i, o, wantDecision)
				}
			}
			r.store.mu.Lock()
			var reserved []float64
			for _, c := range r.store.reserved {
				reserved = append(reserved, c)
			}
			r.store.mu.Unlock()
			if len(reserved) != len(tc.reserved) {
				t.Errorf("reserved %v, want %v", reserved, tc.reserved)
			}
			settled := r.store.settlements(t)
			var sum, want float64
			for _, s := range settled {
				sum += s
			}
			for _, s := range tc.settled {
				want += s
			}
			if sum != want {
				t.Errorf("settled %v, want %v", settled, tc.settled)
			}
		})
	}
}
