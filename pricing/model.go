package pricing

import "strings"

// CanonicalModel is the name a table looks a model up by: lower case,
// without surrounding space, without a router or resource prefix
// ("openai/gpt-4o" and "models/gemini-2.5-pro" become "gpt-4o" and
// "gemini-2.5-pro"). The tokenizer strips the same prefixes.
//
// Unlike the tokenizer, pricing keeps a fine-tune's "ft:" wrapper: a
// fine-tuned model shares its base model's vocabulary but not its price,
// so "ft:gpt-4o-mini:org::id" is a model of its own, priced by an entry or
// by the fallback. Azure OpenAI deployment names, Bedrock model IDs and
// other operator-chosen names cannot be resolved from the name alone; a
// table entry lists them as aliases.
func CanonicalModel(model string) string {
	m := strings.ToLower(strings.TrimSpace(model))
	if i := strings.LastIndexByte(m, '/'); i >= 0 {
		m = m[i+1:]
	}
	return m
}

// snapshotFamily returns the model a dated snapshot belongs to, and whether
// m is one: "gpt-4o-2024-08-06" is "gpt-4o", "claude-opus-4-5-20251101" and
// "claude-opus-4-5@20251101" (Vertex AI) are "claude-opus-4-5". m is
// canonical. Only a date suffix is removed: "gpt-6.2-sol-fast" is not
// "gpt-6.2-sol", because it is billed at twice the rate.
func snapshotFamily(m string) (string, bool) {
	if n := len(m); n > 11 && m[n-11] == '-' && m[n-6] == '-' && m[n-3] == '-' &&
		digits(m[n-10:n-6]) && digits(m[n-5:n-3]) && digits(m[n-2:]) {
		return m[:n-11], true // -YYYY-MM-DD
	}
	if n := len(m); n > 9 && (m[n-9] == '-' || m[n-9] == '@') && digits(m[n-8:]) && m[n-8] == '2' {
		return m[:n-9], true // -YYYYMMDD or @YYYYMMDD
	}
	return "", false
}
