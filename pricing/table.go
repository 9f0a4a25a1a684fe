package pricing

import (
	"cmp"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/tokengate/tokengate/internal/billing"
	"github.com/tokengate/tokengate/internal/modelname"
)

// ErrUnpriced is wrapped by the error for a model the table has no price
// for when unknown models are refused.
var ErrUnpriced = errors.New("no price for model")

// Entry is one model's prices as written in configuration and in the
// shipped defaults: decimal strings per million tokens in units of the
// table's currency, read exactly (ParseRate), so "2.50" is 2,500,000 Micros
// per million tokens.
//
// Input and Output are required. A rate left empty takes the rate a
// provider bills such tokens at when it has no price of its own for them:
// CachedInput and CacheWrite default to Input (a provider without a cache
// discount or surcharge), CacheWriteExtended to CacheWrite, Reasoning to
// Output (reasoning billed as output, as by every provider today).
type Entry struct {
	// Model is the name requests use, matched as modelname.Canonical
	// reads it (case and router prefixes do not matter).
	Model string `yaml:"model"`
	// Aliases are other names that resolve to this entry, such as an Azure
	// OpenAI deployment name.
	Aliases []string `yaml:"aliases,omitempty"`
	// Snapshots are dated snapshots of Model (modelname.Snapshot) that the
	// provider bills at this entry's prices. SharesSnapshots says every
	// snapshot of Model is: a promise for snapshots not yet released,
	// which a provider may break (gpt-4o-2024-05-13 costs twice what
	// gpt-4o does). A snapshot neither names is priced by an entry of its
	// own, or not at all.
	Snapshots       []string `yaml:"snapshots,omitempty"`
	SharesSnapshots bool     `yaml:"shares_snapshots,omitempty"`
	// ServiceTier is the tier these prices are for: standard (the
	// default), fast (OpenAI priority or fast, Anthropic fast mode) or flex.
	// An entry of another tier than standard prices the model of a
	// standard entry, whose names and limits it shares: it sets neither.
	ServiceTier        string `yaml:"service_tier,omitempty"`
	Input              string `yaml:"input"`
	CachedInput        string `yaml:"cached_input,omitempty"`
	CacheWrite         string `yaml:"cache_write,omitempty"`
	CacheWriteExtended string `yaml:"cache_write_extended,omitempty"`
	Output             string `yaml:"output"`
	Reasoning          string `yaml:"reasoning,omitempty"`
	// AudioInput and AudioOutput price audio tokens (OpenAI
	// prompt_tokens_details.audio_tokens, completion_tokens_details.
	// audio_tokens); they default to Input and Output.
	AudioInput  string `yaml:"audio_input,omitempty"`
	AudioOutput string `yaml:"audio_output,omitempty"`
	// LongContext prices a whole request above a prompt length.
	LongContext *LongContextEntry `yaml:"long_context,omitempty"`
	// ContextWindow and MaxOutputTokens are what the model can do: the
	// most tokens of prompt and answer one call holds, and the most it
	// generates. They bound the usage a provider may report for a request
	// (usage_bound); 0 leaves the configured defaults.
	ContextWindow   int `yaml:"context_window,omitempty"`
	MaxOutputTokens int `yaml:"max_output_tokens,omitempty"`
	// Source is the https page the prices were read from, and Date
	// (YYYY-MM-DD) the day they were read. Both are required in the
	// shipped defaults and optional in configuration.
	Source string `yaml:"source,omitempty"`
	Date   string `yaml:"date,omitempty"`
}

// LongContextEntry is Entry's long-context tier: rates for every token of a
// request whose prompt has more than AboveInputTokens tokens. Input and
// Output are required; the other rates default within the tier as in
// Entry, and no rate may be lower than the base rate it replaces.
type LongContextEntry struct {
	AboveInputTokens   int    `yaml:"above_input_tokens"`
	Input              string `yaml:"input"`
	CachedInput        string `yaml:"cached_input,omitempty"`
	CacheWrite         string `yaml:"cache_write,omitempty"`
	CacheWriteExtended string `yaml:"cache_write_extended,omitempty"`
	Output             string `yaml:"output"`
	Reasoning          string `yaml:"reasoning,omitempty"`
	AudioInput         string `yaml:"audio_input,omitempty"`
	AudioOutput        string `yaml:"audio_output,omitempty"`
}

// FieldError is one problem with one field of a price table, named by its
// YAML path relative to the table ("models[2].cached_input"), so that the
// configuration can point at the file and line.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// FieldErrors returns every FieldError joined in err, in order.
func FieldErrors(err error) []*FieldError {
	var out []*FieldError
	var walk func(error)
	walk = func(err error) {
		if fe, ok := err.(*FieldError); ok {
			out = append(out, fe)
			return
		}
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
		}
	}
	walk(err)
	return out
}

// problems collects FieldErrors.
type problems []error

func (p *problems) add(field, format string, args ...any) {
	*p = append(*p, &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)})
}

func (p problems) err() error {
	if len(p) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrInvalidPrice, errors.Join(p...))
}

// rate parses one rate field into *dst; an empty optional field keeps *dst.
func (p *problems) rate(field, s string, required bool, dst *Rate) {
	if s == "" {
		if required {
			p.add(field, "required: the price per million tokens, such as 2.50")
		}
		return
	}
	r, err := parseMicros(s, int64(MaxRate))
	if err != nil {
		p.add(field, "%q: %v", s, err)
		return
	}
	*dst = Rate(r)
}

// rateFields are the rate fields of an entry or of its long-context tier,
// as written.
type rateFields struct {
	input, cachedInput, cacheWrite, cacheWriteExtended, output, reasoning, audioInput, audioOutput string
}

// rates parses a set of rate fields, filling the optional ones.
func (p *problems) rates(path string, f rateFields) Rates {
	var r Rates
	p.rate(path+"input", f.input, true, &r.Input)
	p.rate(path+"output", f.output, true, &r.Output)
	r.CachedInput, r.CacheWrite, r.AudioInput = r.Input, r.Input, r.Input
	p.rate(path+"cached_input", f.cachedInput, false, &r.CachedInput)
	p.rate(path+"cache_write", f.cacheWrite, false, &r.CacheWrite)
	r.CacheWriteExtended = r.CacheWrite
	p.rate(path+"cache_write_extended", f.cacheWriteExtended, false, &r.CacheWriteExtended)
	r.Reasoning, r.AudioOutput = r.Output, r.Output
	p.rate(path+"reasoning", f.reasoning, false, &r.Reasoning)
	p.rate(path+"audio_input", f.audioInput, false, &r.AudioInput)
	p.rate(path+"audio_output", f.audioOutput, false, &r.AudioOutput)
	return r
}

// price checks one entry at path (with a trailing dot, or empty) and
// resolves it. provenance requires Source and Date.
func (p *problems) price(path string, e Entry, provenance bool) Price {
	pr := Price{Model: modelname.Canonical(e.Model), Source: e.Source, Date: e.Date}
	switch {
	case e.Model == "":
		p.add(path+"model", "required: the model name requests use, such as gpt-4o")
	case strings.ContainsAny(pr.Model, " \t\n"):
		p.add(path+"model", "%q: a model name has no spaces", e.Model)
	}
	for i, a := range e.Aliases {
		if modelname.Canonical(a) == "" {
			p.add(fmt.Sprintf("%saliases[%d]", path, i), "empty alias")
		}
	}
	for i, s := range e.Snapshots {
		if f, ok := modelname.Snapshot(modelname.Canonical(s)); !ok || f != pr.Model {
			p.add(fmt.Sprintf("%ssnapshots[%d]", path, i), "%q is not a dated snapshot of %q (such as %s-2025-01-31); name other models in aliases", s, e.Model, pr.Model)
		}
	}
	pr.Rates = p.rates(path, rateFields{e.Input, e.CachedInput, e.CacheWrite, e.CacheWriteExtended, e.Output, e.Reasoning, e.AudioInput, e.AudioOutput})
	pr.Tier = Standard
	if e.ServiceTier != "" {
		if t, ok := billing.Parse(e.ServiceTier); ok {
			pr.Tier = t
		} else {
			p.add(path+"service_tier", "%q: want standard, fast or flex", e.ServiceTier)
		}
	}
	if pr.Tier != Standard {
		for _, f := range []struct {
			name string
			set  bool
		}{{"aliases", len(e.Aliases) > 0}, {"snapshots", len(e.Snapshots) > 0}, {"shares_snapshots", e.SharesSnapshots},
			{"context_window", e.ContextWindow != 0}, {"max_output_tokens", e.MaxOutputTokens != 0}} {
			if f.set {
				p.add(path+f.name, "set it on the model's standard entry: a %s entry shares the standard entry's names and limits", pr.Tier)
			}
		}
	}
	if e.ContextWindow < 0 {
		p.add(path+"context_window", "%d: want the model's context window in tokens, such as 1000000", e.ContextWindow)
	}
	if e.MaxOutputTokens < 0 {
		p.add(path+"max_output_tokens", "%d: want the most tokens the model generates in one call, such as 128000", e.MaxOutputTokens)
	}
	pr.ContextWindow, pr.MaxOutputTokens = e.ContextWindow, e.MaxOutputTokens
	if lc := e.LongContext; lc != nil {
		lp := path + "long_context."
		if lc.AboveInputTokens <= 0 {
			p.add(lp+"above_input_tokens", "required: the prompt length in tokens above which these rates apply, such as 200000")
		}
		n := len(*p)
		r := p.rates(lp, rateFields{lc.Input, lc.CachedInput, lc.CacheWrite, lc.CacheWriteExtended, lc.Output, lc.Reasoning, lc.AudioInput, lc.AudioOutput})
		if len(*p) == n && !r.atLeast(pr.Rates) {
			p.add(lp[:len(lp)-1], "a long-context rate is lower than the base rate it replaces; a longer prompt never costs less per token")
		}
		pr.LongContext = &LongContext{AboveInputTokens: lc.AboveInputTokens, Rates: r}
	}
	if e.Source != "" || provenance {
		if u, err := url.Parse(e.Source); err != nil || u.Scheme != "https" || u.Host == "" {
			p.add(path+"source", "%q: want the https address of the page the prices were read from", e.Source)
		}
	}
	if e.Date != "" || provenance {
		if _, err := time.Parse(time.DateOnly, e.Date); err != nil {
			p.add(path+"date", "%q: want the day the prices were read, as YYYY-MM-DD", e.Date)
		}
	}
	return pr
}

// Table maps model names to prices. Build one with NewTable, Defaults or
// Config.Table; the zero Table prices nothing and refuses every model.
//
// A Table is immutable, and safe for concurrent use.
type Table struct {
	currency string
	entries  []Entry          // as given, for Merge
	prices   map[string]Price // by canonical model name, alias and snapshot named
	families map[string]bool  // models whose entry prices every snapshot (SharesSnapshots)
	fallback *Price           // prices unknown models; nil refuses them
	project  Tier             // what an OpenAI request that leaves the tier to its project is billed at
}

// NewTable checks every entry and builds a table that prices in currency
// (an ISO 4217 code such as USD). The error joins a FieldError for every
// problem, with paths "models[i].field".
func NewTable(currency string, entries []Entry) (*Table, error) {
	var p problems
	if !isCurrency(currency) {
		p.add("currency", "%q: want an ISO 4217 code such as USD", currency)
	}
	t := p.build(currency, entries, len(entries), false)
	if err := p.err(); err != nil {
		return nil, err
	}
	return t, nil
}

// build checks entries and builds a table of them. The first named entries
// are the caller's (indexed in problem paths); the rest come from a table
// being merged into and are reported through the caller's entries.
func (p *problems) build(currency string, entries []Entry, named int, provenance bool) *Table {
	t := &Table{currency: currency, entries: slices.Clone(entries), prices: make(map[string]Price, 2*len(entries)), families: map[string]bool{}}
	type claim struct {
		entry int
		field string
	}
	owner := map[string]claim{}
	take := func(i int, field, name string) {
		prev, ok := owner[name]
		switch {
		case !ok || prev.entry == i:
			owner[name] = claim{i, field}
		case i < named && prev.entry >= named:
			p.add(field, "%q names an entry of the table merged into; replace that entry by giving its model name instead", name)
		case i < named:
			if model, tier, ok := strings.Cut(name, "\x00"); ok {
				p.add(field, "%q is already priced at tier %s by models[%d]", model, tier, prev.entry)
				return
			}
			p.add(field, "%q is already priced by models[%d]", name, prev.entry)
		default:
			p.add(prev.field, "%q names an entry of the table merged into; replace that entry by giving its model name instead", name)
		}
	}
	prices := make([]Price, len(entries))
	tiers := map[string]map[Tier]Price{} // every tier of a model, by its standard name
	for i, e := range entries {
		path := fmt.Sprintf("models[%d].", i)
		pr := p.price(path, e, provenance)
		prices[i] = pr
		if pr.Model == "" {
			continue
		}
		if pr.Tier != Standard {
			// One entry per model and tier; the tier's name space is its own.
			take(i, path+"model", pr.Model+"\x00"+string(pr.Tier))
			continue
		}
		take(i, path+"model", pr.Model)
		tiers[pr.Model] = map[Tier]Price{}
	}
	for i, pr := range prices {
		if pr.Model == "" || pr.Tier == Standard {
			continue
		}
		if tiers[pr.Model] == nil {
			p.add(fmt.Sprintf("models[%d].service_tier", i), "%s prices for %q, which has no standard entry: price its standard tier too", pr.Tier, pr.Model)
			continue
		}
		tiers[pr.Model][pr.Tier] = pr
	}
	for i, e := range entries {
		pr := prices[i]
		if pr.Model == "" || pr.Tier != Standard {
			continue
		}
		path := fmt.Sprintf("models[%d].", i)
		all := tiers[pr.Model]
		pr.tiers = all
		for tier, tp := range all {
			tp.tiers, tp.ContextWindow, tp.MaxOutputTokens = all, pr.ContextWindow, pr.MaxOutputTokens
			all[tier] = tp
		}
		all[Standard] = pr
		t.prices[pr.Model] = pr
		if e.SharesSnapshots {
			t.families[pr.Model] = true
		}
		names := func(field string, list []string) {
			for k, a := range list {
				a = modelname.Canonical(a)
				take(i, fmt.Sprintf("%s%s[%d]", path, field, k), a)
				if _, ok := t.prices[a]; !ok {
					t.prices[a] = pr
				}
			}
		}
		names("aliases", e.Aliases)
		names("snapshots", e.Snapshots)
	}
	return t
}

func isCurrency(s string) bool {
	if len(s) != 3 {
		return false
	}
	for i := 0; i < 3; i++ {
		if s[i] < 'A' || s[i] > 'Z' {
			return false
		}
	}
	return true
}

// Currency is the ISO 4217 code of the table's prices.
func (t *Table) Currency() string { return t.currency }

// Merge returns a new table with overrides applied: an override replaces
// the entry of the same model entirely (all its rates, aliases and long
// context), and an override for a model the table lacks adds it. The
// receiver is unchanged. The error joins a FieldError for every problem,
// with paths "models[i].field" indexing overrides.
func (t *Table) Merge(overrides []Entry) (*Table, error) {
	var p problems
	nt := t.merge(&p, overrides)
	if err := p.err(); err != nil {
		return nil, err
	}
	return nt, nil
}

func (t *Table) merge(p *problems, overrides []Entry) *Table {
	type key struct{ model, tier string }
	keyOf := func(e Entry) key { return key{modelname.Canonical(e.Model), cmp.Or(e.ServiceTier, string(Standard))} }
	replaced := map[key]bool{}
	for _, o := range overrides {
		replaced[keyOf(o)] = true
	}
	// Overrides come first, so that problem paths index them.
	merged := slices.Clone(overrides)
	for _, e := range t.entries {
		if !replaced[keyOf(e)] {
			merged = append(merged, e)
		}
	}
	nt := p.build(t.currency, merged, len(overrides), false)
	nt.fallback = t.fallback
	return nt
}

// WithFallback returns a new table that prices every model it has no entry
// for at fallback, instead of refusing it.
func (t *Table) WithFallback(fallback Price) *Table {
	nt := *t
	nt.fallback = &fallback
	return &nt
}

// Price returns the table's price for model: by its canonical name, an
// alias or a snapshot an entry names (Entry.Snapshots), else, for a dated
// snapshot, by the entry of the model it belongs to when that entry
// shares its price with every snapshot (Entry.SharesSnapshots). ok is
// false when the table has no entry; the fallback does not apply here.
func (t *Table) Price(model string) (Price, bool) {
	m := modelname.Canonical(model)
	if p, ok := t.prices[m]; ok {
		return p, true
	}
	// A fine-tune ("ft:gpt-4o-mini:org::id") is not its base model here,
	// unlike for the tokenizer and per-model limits: it is billed at rates
	// of its own (modelname's package documentation says why). Nor is a
	// snapshot its family unless the table says so: providers price some
	// snapshots apart.
	if family, ok := modelname.Snapshot(m); ok && t.families[family] {
		p, ok := t.prices[family]
		return p, ok
	}
	return Price{}, false
}

// Resolve returns the price of model, or the fallback price for a model
// the table has no entry for. Without a fallback the error wraps
// ErrUnpriced.
func (t *Table) Resolve(model string) (Price, error) {
	if p, ok := t.Price(model); ok {
		return p, nil
	}
	if t.fallback != nil {
		return *t.fallback, nil
	}
	if model == "" {
		return Price{}, fmt.Errorf("%w: the request names no model", ErrUnpriced)
	}
	return Price{}, fmt.Errorf("%w %q", ErrUnpriced, model)
}

// Cost is Resolve(model), then the price at u.ServiceTier (Price.AtTier),
// then Price.Cost(u).
func (t *Table) Cost(model string, u Usage) (Micros, error) {
	p, err := t.Resolve(model)
	if err != nil {
		return 0, err
	}
	tp, ok := p.AtTier(u.ServiceTier)
	if !ok {
		return 0, fmt.Errorf("%w %q at service tier %s", ErrUnpriced, model, u.ServiceTier)
	}
	return tp.Cost(u), nil
}

// MaxCost is Resolve(model) then Price.MaxCost(inputTokens, outputTokens).
func (t *Table) MaxCost(model string, inputTokens, outputTokens int) (Micros, error) {
	p, err := t.Resolve(model)
	if err != nil {
		return 0, err
	}
	return p.MaxCost(inputTokens, outputTokens), nil
}

// ProjectTier is the service tier an OpenAI request that names none (or
// "auto") is processed in: its project's Service Tier setting, as
// Config.ProjectServiceTier gives it. Standard unless configured.
func (t *Table) ProjectTier() Tier { return cmp.Or(t.project, Standard) }

// TierFor is the service tier a request asking for requested (as
// tokenizer.Count.ServiceTier reads it) is reserved at: the dearest it can
// be billed at. Auto (no tier named, or OpenAI "auto") is the project's
// tier (ProjectTier); a value not known is Fast; Fast is Fast, though the
// provider may serve it at Standard; no tier named at all ("") is
// Standard.
func (t *Table) TierFor(requested Tier) Tier {
	switch requested {
	case billing.Auto:
		return t.ProjectTier()
	case billing.Unknown:
		return Fast
	case "":
		return Standard
	}
	return requested
}

// Models returns the canonical names of the table's entries, sorted.
func (t *Table) Models() []string {
	var out []string
	for name, p := range t.prices {
		if name == p.Model {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}
