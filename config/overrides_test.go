package config

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/tokengate/tokengate/buckets"
)

const overridesYAML = `
policies:
  - name: p
    identities:
      - {name: key, header: authorization, hash: true}
      - {name: team, header: x-team}
    buckets:
      - {name: key, per: key, tokens_per_minute: 6000}
      - {name: team, per: team, tokens_per_minute: 60000, hard: true}
      - {name: model, per: model, tokens_per_minute: 100000}
      - {name: global, tokens_per_minute: 600000}
    concurrency:
      - {name: key, per: key, max: 4}
      - {name: team-slots, per: team, max: 10}
    quotas:
      - {name: team-monthly, per: team, window: month, timezone: UTC, cost: "500"}
      - {name: key-daily, per: key, window: day, timezone: UTC, tokens: 100000}
    tier: {header: x-tier}
    tiers:
      - name: gold
        limits: [{rule: team, tokens_per_minute: 120000}, {rule: team-monthly, cost: 1000}]
    overrides:
      - {rule: team, identity: acme, tokens_per_minute: 2000000, burst: 500000}
      - {rule: team-monthly, identity: acme, cost: "2000"}
`

func TestOverridesParse(t *testing.T) {
	c, err := Parse("o.yaml", []byte(overridesYAML))
	if err != nil {
		t.Fatal(err)
	}
	p, _ := c.Policy("p")
	want := []Override{
		{Rule: "team", Identity: "acme", Limits: Limits{TokensPerMinute: 2000000, Burst: 500000}},
		{Rule: "team-monthly", Identity: "acme", Limits: Limits{Cost: "2000"}},
	}
	if d := cmp.Diff(want, p.Overrides); d != "" {
		t.Errorf("overrides (-want +got):\n%s", d)
	}
	if got := p.Overrides[0].Limit(); got != (buckets.Limit{Capacity: 500000, Rate: 2000000.0 / 60}) {
		t.Errorf("limit %+v", got)
	}
	if tokens, money, err := p.Overrides[1].Budgets(); tokens != 0 || money != 2000e6 || err != nil {
		t.Errorf("budgets %v, %v, %v; want $2000 in micro-units", tokens, money, err)
	}
	// An unquoted amount in YAML is the same amount.
	wantTiers := []Tier{{Name: "gold", Limits: []RuleLimits{
		{Rule: "team", Limits: Limits{TokensPerMinute: 120000}},
		{Rule: "team-monthly", Limits: Limits{Cost: "1000"}},
	}}}
	if d := cmp.Diff(wantTiers, p.Tiers); d != "" {
		t.Errorf("tiers (-want +got):\n%s", d)
	}
}

// CheckOverride is the rule for the admin API's bodies: the same problems
// as the file's overrides, without a file position.
func TestCheckOverride(t *testing.T) {
	c, err := Parse("o.yaml", []byte(overridesYAML))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		policy, rule string
		l            Limits
		unknown      bool
		want         string // "" for none
	}{
		{"p", "team", Limits{TokensPerMinute: 1000}, false, ""},
		{"p", "key", Limits{TokensPerMinute: 1000, Max: 2}, false, ""},
		{"p", "model", Limits{TokensPerMinute: 1000}, false, ""},
		{"p", "team-slots", Limits{Max: 64}, false, ""},
		{"q", "team", Limits{TokensPerMinute: 1}, true, `policy "q" is not defined`},
		{"p", "nope", Limits{TokensPerMinute: 1}, true, `policy "p" has no bucket, quota or concurrency limit named "nope"`},
		{"p", "global", Limits{TokensPerMinute: 1}, false, `"global" is global`},
		{"p", "team", Limits{}, false, `sets no limit: give tokens_per_minute (and burst) for bucket "team"`},
		{"p", "team", Limits{Burst: 10}, false, "tokens_per_minute: is required with burst"},
		{"p", "team", Limits{Max: 3}, false, `max: "team" is a bucket of policy "p", not a concurrency limit`},
		{"p", "team-slots", Limits{TokensPerMinute: 3}, false, `tokens_per_minute: "team-slots" is a concurrency limit of policy "p", not a bucket: set max`},
		{"p", "team-slots", Limits{Max: -1}, false, "max: must be at least 1, got -1"},
		{"p", "team", Limits{TokensPerMinute: 100, Burst: -1}, false, "burst: must be positive"},
		{"p", "team", Limits{TokensPerMinute: 5e-324}, false, "the limit these values give is unusable"},
		// Quotas: tokens for a quota of tokens, cost for a quota of money.
		{"p", "team-monthly", Limits{Cost: "2000"}, false, ""},
		{"p", "key-daily", Limits{Tokens: 5_000_000}, false, ""},
		{"p", "team-monthly", Limits{Tokens: 5}, false, `tokens: "team-monthly" is a quota of money of policy "p", not a quota of tokens: set cost`},
		{"p", "key-daily", Limits{Cost: "5"}, false, `cost: "key-daily" is a quota of tokens of policy "p", not a quota of money: set tokens`},
		{"p", "key", Limits{Cost: "5"}, false, `cost: "key" is a bucket and a concurrency limit of policy "p", not a quota of money: set tokens_per_minute and burst, or max`},
		{"p", "team-monthly", Limits{Cost: "1e3"}, false, `cost: amount "1e3": not a plain decimal`},
		{"p", "team-monthly", Limits{Cost: "0.000"}, false, `cost: must be more than zero`},
		{"p", "key-daily", Limits{Tokens: -1}, false, `tokens: must be from 1 to`},
		{"p", "team-monthly", Limits{}, false, `sets no limit: give cost for quota "team-monthly"`},
	} {
		err := c.CheckOverride(tt.policy, tt.rule, tt.l)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%s/%s %+v: %v", tt.policy, tt.rule, tt.l, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("%s/%s %+v: %v, want %q", tt.policy, tt.rule, tt.l, err, tt.want)
		case errors.Is(err, ErrUnknownTarget) != tt.unknown:
			t.Errorf("%s/%s: errors.Is(ErrUnknownTarget) = %v", tt.policy, tt.rule, !tt.unknown)
		}
	}
	for rule, want := range map[string]OverrideTarget{"key": {Per: "key", Hash: true}, "team": {Per: "team"}, "model": {Per: "model"}} {
		if got, err := c.OverrideTarget("p", rule); err != nil || got != want {
			t.Errorf("OverrideTarget(%s) = %+v, %v; want %+v", rule, got, err, want)
		}
	}
}

func TestDecodeLimits(t *testing.T) {
	for _, tt := range []struct {
		body string
		want Limits
		err  string
	}{
		{`{"tokens_per_minute": 2000000, "burst": 100}`, Limits{TokensPerMinute: 2000000, Burst: 100}, ""},
		{`{"max": 8}`, Limits{Max: 8}, ""},
		{`{"cost": "2000.50"}`, Limits{Cost: "2000.50"}, ""},
		{`{"cost": 2000.50}`, Limits{Cost: "2000.50"}, ""}, // a number, as written
		{`{"tokens": 2000000}`, Limits{Tokens: 2000000}, ""},
		{`{"cost": true}`, Limits{}, `request body: cost: want an amount such as "2000.50", got a JSON bool`},
		{`{"cost": {}}`, Limits{}, `request body: cost: want an amount such as "2000.50", got a JSON object`},
		{`{"tpm": 8}`, Limits{}, `request body: tpm: unknown key "tpm" (known: burst, cost, max, tokens, tokens_per_minute)`},
		{`{"max": 1.5}`, Limits{}, "request body: max: want a whole number, got a JSON number"},
		{`{"tokens_per_minute": "lots"}`, Limits{}, "request body: tokens_per_minute: want a number, got a JSON string"},
		{`{"max": 8} {"max": 9}`, Limits{}, "request body: holds more than one JSON object"},
		{`{"max": 8`, Limits{}, "request body: is not a JSON object"},
		{``, Limits{}, "request body: is not a JSON object"},
		{`[1]`, Limits{}, "request body: is not a JSON object: got a JSON array"},
		{strings.Repeat(" ", 5000), Limits{}, "request body: is 5000 bytes; limits take at most 4096"},
	} {
		got, err := DecodeLimits([]byte(tt.body))
		if tt.err == "" {
			if err != nil || got != tt.want {
				t.Errorf("%s: %+v, %v; want %+v", tt.body, got, err, tt.want)
			}
			continue
		}
		var ps Problems
		if !errors.As(err, &ps) || !strings.Contains(err.Error(), tt.err) {
			t.Errorf("%.40s: error %v, want Problems containing %q", tt.body, err, tt.err)
		}
	}
}

// The JSON keys of Limits are its YAML keys: the admin API and the file
// speak the same words.
func TestLimitsKeysAgree(t *testing.T) {
	typ := reflect.TypeOf(Limits{})
	for i := range typ.NumField() {
		f := typ.Field(i)
		y, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		j, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if y != j {
			t.Errorf("Limits.%s: yaml %q, json %q", f.Name, y, j)
		}
	}
}

func TestNeedsRestart(t *testing.T) {
	old, err := Parse("a.yaml", []byte(overridesYAML))
	if err != nil {
		t.Fatal(err)
	}
	same, err := Parse("b.yaml", []byte(strings.Replace(overridesYAML, "tokens_per_minute: 6000}", "tokens_per_minute: 7000}", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if got := old.NeedsRestart(same); len(got) != 0 {
		t.Errorf("a policy change needs a restart of %v", got)
	}
	moved, err := Parse("c.yaml", []byte("listeners: {admin: 127.0.0.1:9999}\nstore: {type: memory, on_failure: closed}\nadmin_api: {token_env: T}\n"+overridesYAML))
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([]string{"listeners", "admin_api"}, old.NeedsRestart(moved)); d != "" {
		t.Errorf("NeedsRestart (-want +got):\n%s", d)
	}
}

// DecodeLimits never panics, answers either limits or problems, and what
// it accepts survives a round trip through its JSON form.
func FuzzDecodeLimits(f *testing.F) {
	for _, s := range []string{`{"tokens_per_minute":2000000,"burst":100}`, `{"max":8}`, `{}`, `{"max":1.5}`, `[1]`, `{"tpm":1}`, `{"max":8} {"max":9}`, `{"burst":1e400}`,
		`{"cost":"2000.50"}`, `{"cost":2000.5}`, `{"cost":null}`, `{"cost":"<>&"}`, `{"tokens":5,"cost":1e3}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		l, err := DecodeLimits(data)
		if err != nil {
			var ps Problems
			if !errors.As(err, &ps) || len(ps) == 0 || ps.Error() == "" {
				t.Fatalf("error %v is not Problems", err)
			}
			return
		}
		round, err := json.Marshal(l)
		if err != nil {
			t.Fatal(err)
		}
		if len(round) > maxLimitsBytes {
			// JSON escapes some bytes of a string (a cost that is no
			// amount, which CheckOverride refuses) in six.
			return
		}
		again, err := DecodeLimits(round)
		if err != nil || again != l {
			t.Fatalf("%s → %+v → %s → %+v, %v", data, l, round, again, err)
		}
	})
}

// Two overrides of one rule for the same identity are refused
// ("overrides %q for the same identity as overrides[%d]",
// testdata/invalid/overrides.yaml). docs/operations.md: "An override of a
// per-model rule names the model as requests do: any spelling of it
// (GPT-4o, openai/gpt-4o-2024-08-06) is the same model", and an identity is
// read as requests carry it, "with or without Bearer " (tokengate limits
// --help): spelled differently, the same identity's two overrides are
// refused as when spelled alike, not the later one silently in force.
func TestOverridesOfOneIdentitySpelledTwiceRefused(t *testing.T) {
	for name, y := range map[string]string{
		"model spelled twice": `
policies:
  - name: default
    buckets: [{name: per-model, per: model, tokens_per_minute: 600000}]
    overrides:
      - {rule: per-model, identity: GPT-4o, tokens_per_minute: 60}
      - {rule: per-model, identity: gpt-4o, tokens_per_minute: 6000000}
`,
		"api key with and without bearer": `
policies:
  - name: default
    identities: [{name: apikey, header: authorization, hash: true}]
    buckets: [{name: apikey, per: apikey, tokens_per_minute: 6000}]
    overrides:
      - {rule: apikey, identity: "Bearer sk-acme", tokens_per_minute: 60}
      - {rule: apikey, identity: "sk-acme", tokens_per_minute: 6000000}
`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := Parse("dup.yaml", []byte(y))
			if err == nil || !strings.Contains(err.Error(), "for the same identity") {
				t.Errorf("Parse = %v; want overrides[1] refused as the same identity as overrides[0]", err)
			}
		})
	}
}

// A setting that does not apply is refused, as store.replay_file,
// store.fleet and a bucket's lease are without the redis store
// (validateStore, validateLeases; README: decoding is strict), so are Redis
// settings under the default memory store: a fleet whose operator forgot
// `type: redis` would run every gateway on its own memory buckets, each
// admitting the whole limit (S20).
func TestRedisSettingsWithTheMemoryStoreRefused(t *testing.T) {
	_, err := Parse("mem.yaml", []byte(`
store:
  redis: {addrs: ["redis.internal:6379"], password_env: REDIS_PASSWORD}
policies:
  - name: default
    buckets: [{name: global, tokens_per_minute: 600}]
`))
	if err == nil {
		t.Fatal("Parse accepted store.redis with the memory store (store.type left at its default); want a problem naming store.redis")
	}
	if !strings.Contains(err.Error(), "store.redis") {
		t.Errorf("Parse = %v; want a problem naming store.redis", err)
	}
}

// "tokengate hashes a hashed identity before storing it and never stores
// or logs the raw value" (docs/operations.md, The admin API; STYLE: never
// keys above debug). A raw API key pasted into identity_key instead of
// identity is not repeated in the problem, which tokengate validate prints
// and a reload logs at error level, as the admin API's answer to the same
// mistake (hashed=true with a raw value) does not repeat it.
func TestIdentityKeyProblemDoesNotRepeatTheValue(t *testing.T) {
	const secret = "sk-live-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"
	_, err := Parse("keys.yaml", []byte(`
policies:
  - name: default
    identities: [{name: apikey, header: authorization, hash: true}]
    buckets: [{name: apikey, per: apikey, tokens_per_minute: 6000}]
    overrides:
      - {rule: apikey, identity_key: "`+secret+`", tokens_per_minute: 60000}
`))
	if err == nil {
		t.Fatal("Parse accepted a raw key as identity_key")
	}
	if strings.Contains(err.Error(), secret) {
		t.Errorf("the problem repeats the raw API key:\n%v", err)
	}
}

// listeners.max_recv_msg_bytes is bounded above too: the gRPC receive
// limit is twice it (README), and an "unlimited" value would wrap it
// around to a negative limit that refuses every message.
func TestHugeBodyLimitRefused(t *testing.T) {
	for _, n := range []string{"1073741825", "4611686018427387905"} {
		_, err := Parse("big.yaml", []byte("listeners: {max_recv_msg_bytes: "+n+"}\npolicies:\n  - name: default\n    buckets: [{name: global, tokens_per_minute: 600}]\n"))
		if err == nil || !strings.Contains(err.Error(), "listeners.max_recv_msg_bytes") || !strings.Contains(err.Error(), "at most") {
			t.Errorf("max_recv_msg_bytes %s: %v, want it refused as above the most", n, err)
		}
	}
	if _, err := Parse("big.yaml", []byte("listeners: {max_recv_msg_bytes: 1073741824}\npolicies:\n  - name: default\n    buckets: [{name: global, tokens_per_minute: 600}]\n")); err != nil {
		t.Errorf("max_recv_msg_bytes of 1 GiB: %v, want it accepted", err)
	}
}
