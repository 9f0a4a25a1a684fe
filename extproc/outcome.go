package extproc

import (
	"time"

	"github.com/tokengate/tokengate/extproc/provider"
)

// The parts of an Outcome that describe the exchange with the upstream
// rather than the charge: what observers such as the GenAI metrics read.

// responseModel is the model the upstream's answer names: a stream's, read
// from its events, or a non-streamed body's, read with its usage.
func (p *processor) responseModel() string {
	if p.resp.stream != nil {
		return p.resp.stream.Model()
	}
	return p.resp.model
}

// providerUsage is the usage the provider reported, the zero value when it
// reported none.
func (s *progress) providerUsage() provider.Usage {
	if !s.usageOK {
		return provider.Usage{}
	}
	return s.usage
}

// sinceStart is how long after the request's headers t came; zero for a
// zero t.
func (p *processor) sinceStart(t time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return t.Sub(p.started)
}
