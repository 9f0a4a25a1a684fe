// Package statsdmap reads the statsd_exporter mappings that
// envoyproxy/ratelimit's Prometheus output names its stats by
// (PROMETHEUS_MAPPER_YAML; docs/envoy-ratelimit.md §3.6), with
// statsd_exporter's own mapper.
package statsdmap

import (
	"bytes"
	"fmt"

	"github.com/prometheus/statsd_exporter/pkg/mapper"
	yaml "go.yaml.in/yaml/v3"
)

// MaxBytes bounds a mapping file.
const MaxBytes = 1 << 20

// Parse reads a mapping as ratelimit's statsd_exporter (v0.26) reads it.
// Its timer_type, which ratelimit's default mapping and Envoy Gateway's
// use and which statsd_exporter has since dropped for observer_type, is
// read as observer_type (an observer_type beside it wins, as it did).
func Parse(data []byte) (*mapper.MetricMapper, error) {
	if len(data) > MaxBytes {
		return nil, fmt.Errorf("%d bytes, more than the %d a mapping may have", len(data), MaxBytes)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	if len(doc.Content) == 1 && doc.Content[0].Kind == yaml.MappingNode {
		root := doc.Content[0]
		for i := 0; i+1 < len(root.Content); i += 2 {
			switch v := root.Content[i+1]; root.Content[i].Value {
			case "defaults":
				timerType(v)
			case "mappings":
				if v.Kind == yaml.SequenceNode {
					for _, m := range v.Content {
						timerType(m)
					}
				}
			}
		}
		var buf bytes.Buffer
		enc := yaml.NewEncoder(&buf)
		if err := enc.Encode(&doc); err != nil {
			return nil, err
		}
		if err := enc.Close(); err != nil {
			return nil, err
		}
		data = buf.Bytes()
	}
	m := &mapper.MetricMapper{}
	if err := m.InitFromYAMLString(string(data)); err != nil {
		return nil, err
	}
	return m, nil
}

// timerType renames a mapping's timer_type to observer_type, or drops it
// beside an observer_type.
func timerType(m *yaml.Node) {
	if m.Kind != yaml.MappingNode {
		return
	}
	timer, observer := -1, false
	for i := 0; i+1 < len(m.Content); i += 2 {
		switch m.Content[i].Value {
		case "timer_type":
			timer = i
		case "observer_type":
			observer = true
		}
	}
	switch {
	case timer < 0:
	case observer:
		m.Content = append(m.Content[:timer], m.Content[timer+2:]...)
	default:
		m.Content[timer].Value = "observer_type"
	}
}
