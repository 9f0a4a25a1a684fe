package pricing

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"sync"

	yaml "go.yaml.in/yaml/v3"

	"github.com/tokengate/tokengate/internal/billing"
)

//go:embed prices.yaml
var shippedYAML []byte

// shipped is the layout of prices.yaml.
type shipped struct {
	Currency string  `yaml:"currency"`
	Models   []Entry `yaml:"models"`
}

var defaults = sync.OnceValue(func() *Table {
	t, err := parseShipped(shippedYAML)
	if err != nil {
		// prices.yaml is compiled in and checked by the package's tests.
		panic("pricing: the shipped price table is invalid: " + err.Error())
	}
	return t
})

// Defaults is the shipped price table (prices.yaml in this package): the
// prices of current OpenAI and Anthropic models in USD, at the standard
// tier and, where a page gives them, OpenAI's fast and flex tiers, with
// each model's limits, each entry with the page and day it was read. It
// refuses unknown models.
func Defaults() *Table { return defaults() }

// parseShipped decodes the shipped table strictly (unknown keys, a second
// document, a missing source or date are errors).
func parseShipped(data []byte) (*Table, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var f shipped
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPrice, err)
	}
	var extra any
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: more than one YAML document", ErrInvalidPrice)
	}
	var p problems
	if f.Currency != "USD" {
		p.add("currency", "%q: the shipped table is in USD", f.Currency)
	}
	t := p.build(f.Currency, f.Models, len(f.Models), true)
	if err := p.err(); err != nil {
		return nil, err
	}
	return t, nil
}

// Config is the pricing section of tokengate's configuration, the Go shape
// it decodes into:
//
//	pricing:
//	  currency: USD            # ISO 4217; default USD
//	  defaults: shipped        # or none: start from an empty table
//	  unknown_models: refuse   # or fallback: price them at fallback
//	  fallback: {input: "5.00", output: "25.00"}
//	  project_service_tier: standard  # or fast, flex: the OpenAI project's setting
//	  models:                  # add models, or replace shipped entries (model and tier) whole
//	    - model: gpt-6.2-sol
//	      input: "1.80"        # a negotiated discount
//	      cached_input: "0.09"
//	      output: "9.00"
//	    - model: my-azure-gpt  # a model the names cannot resolve
//	      aliases: [prod-deployment-eu]
//	      input: "2.00"
//	      output: "10.00"
//	      context_window: 1050000
//	      max_output_tokens: 128000
//
// The zero Config is the shipped table in USD, refusing unknown models.
type Config struct {
	Currency      string  `yaml:"currency"`
	Defaults      string  `yaml:"defaults"`
	UnknownModels string  `yaml:"unknown_models"`
	Fallback      *Entry  `yaml:"fallback"`
	Models        []Entry `yaml:"models"`
	// ProjectServiceTier is the tier OpenAI processes a request in that
	// sends no service_tier or "auto": the Service Tier setting of the
	// OpenAI project behind the gateway's key. Default standard.
	ProjectServiceTier string `yaml:"project_service_tier"`
}

// Table checks c and builds its table. The error joins a FieldError for
// every problem, with paths relative to the pricing section
// ("models[1].cached_input", "fallback.output").
func (c Config) Table() (*Table, error) {
	var p problems
	currency := c.Currency
	if currency == "" {
		currency = "USD"
	}
	if !isCurrency(currency) {
		p.add("currency", "%q: want an ISO 4217 code such as USD or EUR", c.Currency)
	}
	base := &Table{currency: currency}
	switch c.Defaults {
	case "", "shipped":
		if d := Defaults(); currency != d.Currency() {
			p.add("defaults", "the shipped prices are in %s, not %s: set defaults: none and price every model in %s", d.Currency(), currency, currency)
		} else {
			base = d
		}
	case "none":
	default:
		p.add("defaults", "%q: want shipped or none", c.Defaults)
	}
	var fallback *Price
	switch c.UnknownModels {
	case "", "refuse":
		if c.Fallback != nil {
			p.add("fallback", "set, but unknown_models is refuse: set unknown_models: fallback to use it")
		}
	case "fallback":
		if c.Fallback == nil {
			p.add("fallback", "required when unknown_models is fallback: the price of every model without an entry")
			break
		}
		f := *c.Fallback
		if f.Model != "" {
			p.add("fallback.model", "%q: leave it out; the fallback prices every model without an entry", f.Model)
		}
		if len(f.Aliases) > 0 {
			p.add("fallback.aliases", "leave them out; the fallback prices every model without an entry")
		}
		for _, x := range []struct {
			field string
			set   bool
		}{{"snapshots", len(f.Snapshots) > 0}, {"shares_snapshots", f.SharesSnapshots}, {"service_tier", f.ServiceTier != ""}} {
			if x.set {
				p.add("fallback."+x.field, "leave it out; the fallback prices every model without an entry, at every tier")
			}
		}
		f.Model, f.Aliases, f.Snapshots, f.SharesSnapshots, f.ServiceTier = FallbackModel, nil, nil, false, ""
		pr := p.price("fallback.", f, false)
		fallback = &pr
	default:
		p.add("unknown_models", "%q: want refuse or fallback", c.UnknownModels)
	}
	project := Standard
	if c.ProjectServiceTier != "" {
		var ok bool
		if project, ok = billing.Parse(c.ProjectServiceTier); !ok {
			p.add("project_service_tier", "%q: want standard, fast or flex, as the OpenAI project's Service Tier setting is", c.ProjectServiceTier)
		}
	}
	t := base.merge(&p, c.Models)
	if err := p.err(); err != nil {
		return nil, err
	}
	t.project = project
	if fallback != nil {
		t = t.WithFallback(*fallback)
	}
	return t, nil
}

// FallbackModel is the Model of the fallback price.
const FallbackModel = "*"
