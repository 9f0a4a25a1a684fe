package tokenizer

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/tokengate/tokengate/internal/billing"
)

// DetectAPI returns the shape of a request body: from the HTTP path when it
// names a metered endpoint, else from the body's top-level keys.
func DetectAPI(path string, reqBody []byte) (API, error) {
	if e := Classify("POST", path); e.Class == Metered {
		return e.API, nil
	}
	b, err := parseBody(reqBody)
	if err != nil {
		return "", err
	}
	defer b.release()
	api, _, err := apiFromBody(b)
	return api, err
}

// body holds the top-level fields of a request body as the provider reads
// them (see jsonscan.go): exact keys, the last duplicate wins. Polymorphic
// fields stay JSON values and are read where they are counted. Gemini
// accepts every field in camelCase and in snake_case (protobuf JSON); both
// spellings are kept.
type body struct {
	*doc
	Model                                                 string
	modelAt                                               jval
	Messages, Tools, Functions                            jval
	Prompt, Suffix, Input, Instructions, System, Contents jval
	SystemInstruction, GenerationConfig                   [2]jval // camelCase, snake_case
	Content, Title, Requests                              jval    // Gemini embedContent, batchEmbedContents
	ResponseFormat, AnthropicVersion, PreviousResponseID  jval
	EncodingFormat, Dimensions, Thinking                  jval
	MaxTokens, MaxCompletionTokens, MaxOutputTokens       jval
	N, BestOf                                             jval
	ServiceTier, Speed, PromptCacheRetention              jval
	Stream, IncludeUsage                                  bool
}

// parseBody validates src and reads its top-level fields. The caller
// releases the body once it is done with it and its values.
func parseBody(src []byte) (*body, error) {
	d, err := parseDoc(src)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	root := d.root()
	if root.kind() != '{' {
		err := errShape("the body", root, "an object")
		d.release()
		return nil, err
	}
	b := body{doc: d}
	var stream, streamOptions jval
	for k, v := range root.members() {
		switch string(k) {
		case "model":
			b.modelAt = v
		case "messages":
			b.Messages = v
		case "tools":
			b.Tools = v
		case "functions":
			b.Functions = v
		case "prompt":
			b.Prompt = v
		case "suffix":
			b.Suffix = v
		case "input":
			b.Input = v
		case "instructions":
			b.Instructions = v
		case "system":
			b.System = v
		case "contents":
			b.Contents = v
		case "systemInstruction":
			b.SystemInstruction[0] = v
		case "system_instruction":
			b.SystemInstruction[1] = v
		case "generationConfig":
			b.GenerationConfig[0] = v
		case "generation_config":
			b.GenerationConfig[1] = v
		case "content":
			b.Content = v
		case "title":
			b.Title = v
		case "requests":
			b.Requests = v
		case "response_format":
			b.ResponseFormat = v
		case "anthropic_version":
			b.AnthropicVersion = v
		case "previous_response_id":
			b.PreviousResponseID = v
		case "encoding_format":
			b.EncodingFormat = v
		case "dimensions":
			b.Dimensions = v
		case "thinking":
			b.Thinking = v
		case "max_tokens":
			b.MaxTokens = v
		case "max_completion_tokens":
			b.MaxCompletionTokens = v
		case "max_output_tokens":
			b.MaxOutputTokens = v
		case "n":
			b.N = v
		case "best_of":
			b.BestOf = v
		case "stream":
			stream = v
		case "stream_options":
			streamOptions = v
		case "service_tier":
			b.ServiceTier = v
		case "speed":
			b.Speed = v
		case "prompt_cache_retention":
			b.PromptCacheRetention = v
		}
	}
	if err := b.readFlags(stream, streamOptions); err != nil {
		d.release()
		return nil, err
	}
	return &b, nil
}

// readFlags reads the model and the stream flags.
func (b *body) readFlags(stream, streamOptions jval) error {
	var err error
	if b.Model, err = stringField(b.modelAt, "model"); err != nil {
		return err
	}
	if b.Stream, err = boolField(stream, "stream"); err != nil {
		return err
	}
	if streamOptions.present() {
		if streamOptions.kind() != '{' {
			return errShape("stream_options", streamOptions, "an object")
		}
		var iu jval
		for k, v := range streamOptions.members() {
			if string(k) == "include_usage" {
				iu = v
			}
		}
		if b.IncludeUsage, err = boolField(iu, "stream_options.include_usage"); err != nil {
			return err
		}
	}
	return nil
}

// stringField reads a string field; absent or null is "". The field's
// name, in parts, is joined only for an error.
func stringField(v jval, field ...string) (string, error) {
	switch v.kind() {
	case 0, 'n':
		return "", nil
	case '"':
		return v.str(), nil
	}
	return "", errShape(strings.Join(field, ""), v, "a string")
}

// boolField reads a boolean field; absent or null is false.
func boolField(v jval, field string) (bool, error) {
	switch v.kind() {
	case 0, 'n', 'f':
		return false, nil
	case 't':
		return true, nil
	}
	return false, errShape(field, v, "a boolean")
}

// errShape reports a body field of an unexpected JSON type, by name and
// offset only.
func errShape(field string, v jval, want string) error {
	return fmt.Errorf("%w: %s: want %s, got %s at byte %d", ErrMalformed, field, want, v.kindName(), v.off)
}

// apiFromBody detects the API from the top-level fields a body has, and
// whether a Gemini body is an embedding request.
func apiFromBody(b *body) (api API, embed bool, err error) {
	model := normalizeModel(b.Model)
	switch {
	case b.Contents.present():
		return Gemini, false, nil
	case b.Requests.present() || b.Content.present() && !b.Messages.present():
		return Gemini, true, nil
	case b.Messages.present():
		if b.System.present() || b.AnthropicVersion.present() || strings.HasPrefix(model, "claude") {
			return Messages, false, nil
		}
		return ChatCompletions, false, nil
	case b.Prompt.present():
		return Completions, false, nil
	case b.Input.present():
		if b.Instructions.present() || b.MaxOutputTokens.present() || b.Tools.present() || b.PreviousResponseID.present() {
			return Responses, false, nil
		}
		if b.EncodingFormat.present() || b.Dimensions.present() || strings.HasPrefix(model, "text-embedding") {
			return Embeddings, false, nil
		}
		// An array of items (objects) is Responses; strings and token
		// arrays are Embeddings.
		in := bytes.TrimLeft(b.Input.text(), " \t\r\n[")
		if len(in) > 0 && in[0] == '{' {
			return Responses, false, nil
		}
		return Embeddings, false, nil
	}
	return "", false, fmt.Errorf("%w: none of messages, contents, prompt, input, content or requests at the top level", ErrUnknownAPI)
}

// Count returns what req will cost: its exact input tokens (an estimate for
// Anthropic and Gemini), its output cap and the output allowance (S7).
//
// Without req.API, the shape comes from req.Path as Classify reads it: a
// metered endpoint names its API, a free one is refused with
// ErrFreeEndpoint, a named unknown one (images, audio, batches, realtime)
// with ErrUnknownAPI; a path no rule names, or none, leaves the shape to
// the body's top-level fields. Callers that meter by endpoint call
// Classify first and Count only metered requests.
//
// An output cap that is a number is metered as it is, rounded up and never
// below 0, even one the provider refuses (0, -1, 1.5): the request is
// forwarded for the provider to answer in its own words. A cap above
// Options.MaxOutputTokens, which no reservation covers, or one that is no
// number is refused with ErrInvalidCap.
//
// Errors wrap ErrMalformed, ErrUnknownAPI, ErrUnknownModel, ErrInvalidCap
// or ErrFreeEndpoint; their text names fields and byte offsets, never body
// content. With an error, the Count names only the API, when the path or
// the body told it.
func (c *Counter) Count(req Request) (Count, error) { return c.count(req, nil) }

// count is Count, with the string values pre counted (see Precount).
func (c *Counter) count(req Request, pre *Precount) (res Count, err error) {
	b, err := parseBody(req.Body)
	if err != nil {
		return Count{}, err
	}
	defer b.release()
	api, embed := req.API, false
	if api == "" && req.Path != "" {
		switch e := Classify("POST", req.Path); e.Class {
		case Metered:
			api, embed = e.API, e.Name == "gemini_embed"
		case Free:
			return Count{}, fmt.Errorf("%w: %s", ErrFreeEndpoint, e.Name)
		default:
			// A path no rule names may still carry a known body shape (a
			// proxy's own path); named endpoints that are neither metered
			// nor free (images, audio, batches, realtime) are not counted.
			if e.Name != "other" {
				return Count{}, fmt.Errorf("%w: the %s endpoint is not metered by tokens", ErrUnknownAPI, e.Name)
			}
		}
	}
	if api == "" {
		if api, embed, err = apiFromBody(b); err != nil {
			return Count{}, err
		}
	} else if api == Gemini && !embed && !b.Contents.present() {
		embed = b.Requests.present() || b.Content.present()
	}
	defer func() {
		if err != nil {
			res = Count{API: api} // the API is known: its error shape answers the client
		}
	}()

	model, modelSource := req.Model, "Request.Model"
	pathModel := modelFromPath(req.Path)
	if model == "" {
		switch {
		case api == Gemini && pathModel != "":
			model, modelSource = pathModel, "the path"
		case b.Model != "":
			model, modelSource = b.Model, fmt.Sprintf("model at byte %d", b.modelAt.off)
		default:
			model, modelSource = pathModel, "the path"
		}
	}
	keyModel, deployment := model, ""
	if d := deploymentFromPath(req.Path); d != "" && req.Model == "" {
		keyModel, deployment = d, d // Azure bills and rate-limits the deployment
	}
	fam := familyOf(normalizeModel(model))
	switch api {
	case Messages:
		fam = familyAnthropic
	case Gemini:
		fam = familyGemini
	}
	enc := O200kBase
	var fallback bool
	if fam == familyOpenAI {
		if enc, fallback, err = c.EncodingFor(model); err != nil {
			if errors.Is(err, ErrUnknownModel) {
				if model == "" {
					return Count{}, fmt.Errorf("%w: the request names no model", ErrUnknownModel)
				}
				return Count{}, fmt.Errorf("%w: the model named by %s", ErrUnknownModel, modelSource)
			}
			return Count{}, err
		}
	}
	v, err := c.vocab(enc)
	if err != nil {
		return Count{}, err
	}
	w := c.getWorker()
	defer c.putWorker(w)
	t := &tally{v: v, w: w, model: normalizeModel(model), fam: fam, pre: pre}

	out := Count{API: api, Model: model, ModelKey: modelKey(keyModel), Deployment: deployment, Encoding: enc, Fallback: fallback,
		Exact: fam == familyOpenAI, Choices: 1, CapFloor: 1}
	var caps []capField
	switch api {
	case ChatCompletions:
		if err = t.chat(b); err == nil {
			out.Choices, err = choices(b.N, "n")
		}
		caps = b.openAICaps()
		out.AddCapField = "max_completion_tokens"
	case Completions:
		var prompts int
		prompts, err = t.prompt(b.Prompt, "prompt")
		if err == nil {
			_, err = t.prompt(b.Suffix, "suffix")
		}
		var n, bestOf int
		if err == nil {
			n, err = choices(b.N, "n")
		}
		if err == nil {
			bestOf, err = choices(b.BestOf, "best_of")
		}
		out.Choices = max(n, bestOf) * max(prompts, 1)
		caps = b.openAICaps()
		out.AddCapField = "max_tokens"
	case Embeddings:
		_, err = t.prompt(b.Input, "input")
		out.Embedding = true
	case Responses:
		err = t.responses(b)
		caps = b.openAICaps()
		out.AddCapField, out.CapFloor = "max_output_tokens", 16
	case Messages:
		err = t.anthropic(b)
		caps = []capField{{"max_tokens", b.MaxTokens}}
		out.AddCapField = "max_tokens"
		if budget, enabled := thinking(b.Thinking); enabled && budget > 0 {
			out.CapFloor = budget + 1
		}
	case Gemini:
		if embed {
			err = t.geminiEmbed(b)
			out.Embedding = true
		} else {
			err = t.gemini(b)
			if err == nil {
				caps, out.Choices, out.AddCapField, err = geminiConfig(b)
			}
		}
	default:
		return Count{}, fmt.Errorf("%w: %q", ErrUnknownAPI, api)
	}
	if err != nil {
		return Count{}, err
	}
	out.InputTokens = t.total()
	out.Stream = b.Stream
	out.IncludeUsage = b.IncludeUsage
	out.ServiceTier, out.ExtendedCacheRetention = b.billing(api)
	if out.Embedding {
		out.AllowanceSource = FromRequest
		return out, nil
	}
	out.HiddenReasoning = hiddenReasoning(api, t.model, b)
	for _, cf := range caps {
		n, set, err := c.parseCap(cf.v, cf.name)
		if err != nil {
			return Count{}, err
		}
		if set {
			out.CapFields = append(out.CapFields, cf.name)
			out.OutputCap = max(out.OutputCap, n)
		}
	}
	switch {
	case len(out.CapFields) > 0:
		out.ChoiceAllowance, out.AllowanceSource = out.OutputCap, FromRequest
	case api == Completions:
		// The legacy completions endpoint defaults max_tokens to 16.
		out.ChoiceAllowance, out.AllowanceSource = 16, FromRequest
	default:
		if n, ok := c.est.estimate(estKey{req.Policy, out.ModelKey}); ok {
			out.ChoiceAllowance, out.AllowanceSource = min(n, c.opts.MaxOutputTokens), FromHistory
		} else {
			out.ChoiceAllowance, out.AllowanceSource = c.opts.DefaultOutputTokens, FromDefault
		}
	}
	out.OutputAllowance = satMul(out.ChoiceAllowance, out.Choices)
	return out, nil
}

// billing reads the fields of the body that choose the rates its request is
// billed at, as the provider of api reads them: the service tier it asks
// for, and whether its cache writes take the longer retention. A field of
// the wrong type is left to the provider to refuse; it reads as a value
// not known, which is reserved at the dearest rates.
func (b *body) billing(api API) (tier billing.Tier, extended bool) {
	value := func(v jval) (string, bool) {
		switch v.kind() {
		case 0, 'n':
			return "", true
		case '"':
			return v.str(), true
		}
		return "", false
	}
	switch api {
	case Messages:
		if speed, ok := value(b.Speed); ok {
			return billing.Anthropic(speed), false
		}
		return billing.Unknown, false
	case Gemini:
		return billing.Standard, false
	}
	tier = billing.Unknown
	if v, ok := value(b.ServiceTier); ok {
		tier = billing.OpenAI(v)
	}
	r, ok := value(b.PromptCacheRetention)
	return tier, !ok || billing.ExtendedRetention(r)
}

// capField is one output cap of a body, by its dotted path.
type capField struct {
	name string
	v    jval
}

// openAICaps returns the caps of the OpenAI shapes. Each API documents
// one or two of them, but all are read: where a body carries several, the
// largest counts, so a small decoy cannot buy a large answer (S7).
func (b *body) openAICaps() []capField {
	return []capField{{"max_tokens", b.MaxTokens}, {"max_completion_tokens", b.MaxCompletionTokens}, {"max_output_tokens", b.MaxOutputTokens}}
}

// geminiConfig reads the output caps and the candidate count of
// generationConfig. Google's API takes every field in camelCase and
// snake_case; a body that spells one field both ways (or repeats the
// config) is read conservatively: every cap found counts and the largest
// wins (S7), as does the largest candidate count.
func geminiConfig(b *body) (caps []capField, candidates int, add string, err error) {
	candidates = 1
	add = "generationConfig.maxOutputTokens"
	for i, cfgName := range [2]string{"generationConfig", "generation_config"} {
		cfg := b.GenerationConfig[i]
		if !cfg.present() {
			continue
		}
		if cfg.kind() != '{' {
			return nil, 0, "", errShape(cfgName, cfg, "an object")
		}
		if i == 1 {
			add = "generation_config.max_output_tokens"
		} else {
			add = "generationConfig.maxOutputTokens"
		}
		for k, v := range cfg.members() {
			switch string(k) {
			case "maxOutputTokens", "max_output_tokens":
				caps = append(caps, capField{cfgName + "." + string(k), v})
			case "candidateCount", "candidate_count":
				n, err := choices(v, cfgName+"."+string(k))
				if err != nil {
					return nil, 0, "", err
				}
				candidates = max(candidates, n)
			}
		}
	}
	return caps, candidates, add, nil
}

// hiddenReasoning reports whether a request of api to the normalized model
// may be billed reasoning its answer does not show (Count.HiddenReasoning).
func hiddenReasoning(api API, model string, b *body) bool {
	switch api {
	case ChatCompletions, Completions, Responses:
		return reasoningModel(model)
	case Messages:
		_, enabled := thinking(b.Thinking)
		return enabled
	case Gemini:
		return strings.HasPrefix(model, "gemini-2.5") || strings.HasPrefix(model, "gemini-3")
	}
	return false
}

// thinking reads Anthropic's thinking object: whether extended thinking
// is enabled, and its budget_tokens (0 when not a whole number).
func thinking(v jval) (budget int, enabled bool) {
	if v.kind() != '{' {
		return 0, false
	}
	var typ, bt jval
	for k, m := range v.members() {
		switch string(k) {
		case "type":
			typ = m
		case "budget_tokens":
			bt = m
		}
	}
	if !typ.isString("enabled") {
		return 0, false
	}
	if n, fault := wholeNumber(bt, 1, math.MaxInt32); fault == "" {
		budget = n
	}
	return budget, true
}

func satMul(a, b int) int {
	if b > 0 && a > math.MaxInt32/b {
		return math.MaxInt32
	}
	return a * b
}

// parseCap reads one output cap. Absent or null, it is not set. A number
// is the cap, rounded up, and 0 when it is zero or below: a cap the
// provider refuses itself (0, -5, 12.5) is still metered, for the provider
// to answer as it does (its answer, not tokengate's). Only what cannot be
// metered is refused: a number above MaxOutputTokens, which no reservation
// can cover, and a value that is no number, which tokengate cannot read as
// the provider would.
func (c *Counter) parseCap(v jval, name string) (n int, set bool, err error) {
	if !v.present() {
		return 0, false, nil
	}
	fault := v.kindName()
	if v.kind() == '0' {
		f, _ := strconv.ParseFloat(string(v.text()), 64) // ±Inf beyond float64's range
		if f <= float64(c.opts.MaxOutputTokens) {
			return int(math.Ceil(max(f, 0))), true, nil
		}
		fault = fmt.Sprintf("a number above %d", c.opts.MaxOutputTokens)
	}
	return 0, false, fmt.Errorf("%w: %s: want a number no larger than %d, got %s at byte %d", ErrInvalidCap, name, c.opts.MaxOutputTokens, fault, v.off)
}

// choices reads a choice count (n, best_of, candidateCount): absent or
// null means 1.
func choices(v jval, name string) (int, error) {
	if !v.present() {
		return 1, nil
	}
	n, fault := wholeNumber(v, 1, 128)
	if fault != "" {
		return 1, fmt.Errorf("%w: %s: want a whole number from 1 to 128, got %s at byte %d", ErrMalformed, name, fault, v.off)
	}
	return n, nil
}

// wholeNumber reads v as an integer in [lo, hi]; fault describes what is
// wrong with it without quoting it.
func wholeNumber(v jval, lo, hi int) (n int, fault string) {
	if v.kind() != '0' {
		return 0, v.kindName()
	}
	text := v.text()
	n64, err := strconv.ParseInt(string(text), 10, 64)
	switch {
	case err != nil && bytes.ContainsAny(text, ".eE"):
		return 0, "a number with a fraction or an exponent"
	case err != nil && text[0] == '-', err == nil && n64 < int64(lo):
		return 0, fmt.Sprintf("a number below %d", lo)
	case err != nil, n64 > int64(hi):
		return 0, fmt.Sprintf("a number above %d", hi)
	}
	return int(n64), ""
}
