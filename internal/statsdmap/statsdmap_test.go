package statsdmap

import (
	"strings"
	"testing"

	"github.com/prometheus/statsd_exporter/pkg/mapper"
)

// Parse reads timer_type as observer_type (an observer_type beside it
// wins), and refuses what the mapper refuses, and a mapping too large.
func TestParse(t *testing.T) {
	m, err := Parse([]byte(`defaults:
  timer_type: histogram
mappings:
  - match: "a.*"
    name: "a_x"
    timer_type: summary
    labels: {kk: "$1"}
  - match: "b.*"
    name: "b_x"
    timer_type: summary
    observer_type: histogram
`))
	if err != nil {
		t.Fatal(err)
	}
	if m.Defaults.ObserverType != mapper.ObserverTypeHistogram {
		t.Errorf("defaults' observer type %q, want timer_type's histogram", m.Defaults.ObserverType)
	}
	for name, want := range map[string]mapper.ObserverType{"a.q": mapper.ObserverTypeSummary, "b.q": mapper.ObserverTypeHistogram} {
		mp, labels, ok := m.GetMapping(name, mapper.MetricTypeObserver)
		if !ok || mp.ObserverType != want {
			t.Errorf("%s: mapped %v, observer type %v, want %q", name, ok, mp, want)
		}
		if name == "a.q" && labels["kk"] != "q" {
			t.Errorf("%s: labels %v, want kk=q", name, labels)
		}
	}
	for _, bad := range []struct{ yaml, want string }{
		{"mappings:\n  - match: a.*\n    name: x\n    labels: {k: $1}\n", "invalid label key"},
		{"mappings:\n  - match: a.*\n    name: x\n    nonsense: 1\n", "nonsense"},
		{"mappings: [", "yaml"},
	} {
		if _, err := Parse([]byte(bad.yaml)); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: %v, want an error naming %q", bad.yaml, err, bad.want)
		}
	}
	if _, err := Parse(make([]byte, MaxBytes+1)); err == nil {
		t.Error("a mapping past MaxBytes was read")
	}
}

// Whatever Parse is given, it answers, without a panic.
func FuzzParse(f *testing.F) {
	f.Add([]byte("mappings:\n  - match: \"a.*\"\n    name: x\n    timer_type: histogram\n"))
	f.Add([]byte("defaults: {timer_type: summary}\nmappings: []\n"))
	f.Add([]byte("- 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := Parse(data)
		if err == nil && m == nil {
			t.Fatal("no mapper and no error")
		}
	})
}
