package buckets_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

func TestLimitValidate(t *testing.T) {
	tests := []struct {
		limit buckets.Limit
		field string // empty: valid
	}{
		{buckets.Limit{Capacity: 3, Rate: 2}, ""},
		{buckets.PerMinute(60000, 0), ""},
		{buckets.Limit{}, "capacity"},
		{buckets.Limit{Capacity: -1, Rate: 1}, "capacity"},
		{buckets.Limit{Capacity: math.NaN(), Rate: 1}, "capacity"},
		{buckets.Limit{Capacity: math.Inf(1), Rate: 1}, "capacity"},
		{buckets.Limit{Capacity: 1}, "rate"},
		{buckets.Limit{Capacity: 1, Rate: math.Inf(1)}, "rate"},
		{buckets.PerMinute(0, 0), "capacity"},
	}
	for _, tt := range tests {
		err := tt.limit.Validate()
		if tt.field == "" {
			if err != nil {
				t.Errorf("%+v: Validate() = %v, want nil", tt.limit, err)
			}
			continue
		}
		if !errors.Is(err, buckets.ErrInvalidLimit) || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%+v: Validate() = %v, want ErrInvalidLimit naming %q", tt.limit, err, tt.field)
		}
	}
}

func TestPerMinute(t *testing.T) {
	if diff := cmp.Diff(buckets.Limit{Capacity: 90000, Rate: 1000}, buckets.PerMinute(60000, 90000)); diff != "" {
		t.Errorf("PerMinute(60000, 90000) (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(buckets.Limit{Capacity: 60000, Rate: 1000}, buckets.PerMinute(60000, 0)); diff != "" {
		t.Errorf("PerMinute(60000, 0) (-want +got):\n%s", diff)
	}
}

// TestProviderLimit checks S19: a safety factor (default 0.9) on burst and
// rate, and headroom as a share of the capacity.
func TestProviderLimit(t *testing.T) {
	tests := []struct {
		name  string
		p     buckets.ProviderLimit
		want  buckets.Bucket
		field string
	}{
		{"default safety factor", buckets.ProviderLimit{TokensPerMinute: 60000},
			buckets.Bucket{Name: "provider", Key: "k", Limit: buckets.Limit{Capacity: 54000, Rate: 900}}, ""},
		{"headroom", buckets.ProviderLimit{TokensPerMinute: 60000, Burst: 120000, SafetyFactor: 0.5, PriorityHeadroom: 0.25},
			buckets.Bucket{Name: "provider", Key: "k", Limit: buckets.Limit{Capacity: 60000, Rate: 500}, Headroom: 15000}, ""},
		{"no limit", buckets.ProviderLimit{}, buckets.Bucket{}, "tokens_per_minute"},
		{"safety factor above one", buckets.ProviderLimit{TokensPerMinute: 1, SafetyFactor: 1.5}, buckets.Bucket{}, "safety_factor"},
		{"negative burst", buckets.ProviderLimit{TokensPerMinute: 1, Burst: -1}, buckets.Bucket{}, "burst"},
		{"headroom of all", buckets.ProviderLimit{TokensPerMinute: 1, PriorityHeadroom: 1}, buckets.Bucket{}, "priority_headroom"},
	}
	for _, tt := range tests {
		got, err := tt.p.Bucket("provider", "k")
		if tt.field != "" {
			if !errors.Is(err, buckets.ErrInvalidLimit) || !strings.Contains(err.Error(), tt.field) {
				t.Errorf("%s: error = %v, want ErrInvalidLimit naming %q", tt.name, err, tt.field)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tt.name, err)
		}
		if diff := cmp.Diff(tt.want, got, cmp.Comparer(func(a, b float64) bool { return math.Abs(a-b) < 1e-9 })); diff != "" {
			t.Errorf("%s (-want +got):\n%s", tt.name, diff)
		}
	}
}
