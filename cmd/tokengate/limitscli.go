package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tokengate/tokengate/admin"
)

// limitsHelp documents `tokengate limits`.
const limitsHelp = `
Reads and writes per-identity limit overrides through a running tokengate's
admin API (listeners.admin). Every gateway sharing the store (Redis) applies
a change within a second, without a restart.

  set POLICY RULE IDENTITY FIELD=VALUE...   give IDENTITY its own limits under RULE
  get [POLICY [RULE IDENTITY]]              list stored overrides, or show one
  rm POLICY RULE IDENTITY                   remove an override: the rule's limits apply again

RULE names a bucket, a quota or a concurrency limit of POLICY (a
concurrency limit may share its name with a bucket or a quota). FIELDs:
tokens_per_minute and burst for a bucket (they replace its whole limit),
tokens for a quota of tokens and cost for a quota of money (its budget per
window, in the pricing currency: cost=2000), max for a concurrency limit.
set replaces the identity's override of RULE whole.

IDENTITY is the value requests carry (for the Authorization header, the
API key with or without "Bearer "); tokengate hashes a hashed identity
(hash: true) before storing it, and never stores or logs the raw value.
Listings show hashed identities in their hashed form (h. and 32 hex
digits); pass that form with --hashed. IDENTITY travels in the
X-Tokengate-Identity header, never in the URL, which proxies log.

The admin API's bearer token is read from the environment variable named by
--token-env.`

// usageHelp documents `tokengate usage`.
const usageHelp = `
Prints what one identity has used and has left, per rule of its policy's
chain: the limit in force (and where it comes from: the rule, a tier or an
override) and what remains; for a bucket when it is full again, for a
quota what its current window has spent and when the window ends, for a
concurrency limit the requests in flight.

IDENTITY is NAME=VALUE (team=acme), or the value alone when the policy has
one identity; it travels in an X-Tokengate-Identity header, never in the
URL. Rules keyed by an identity not given are left out; per-model rules
need --model.`

// adminFlags are the flags every admin API command takes.
type adminFlags struct {
	url, tokenEnv string
	timeout       time.Duration
	json, hashed  bool
}

func addAdminFlags(fs *flag.FlagSet) *adminFlags {
	f := &adminFlags{}
	fs.StringVar(&f.url, "url", "http://127.0.0.1:9090", "the admin listener's base `URL`")
	fs.StringVar(&f.tokenEnv, "token-env", "TOKENGATE_ADMIN_TOKEN", "the environment variable holding the admin API's bearer token (`NAME`)")
	fs.DurationVar(&f.timeout, "timeout", 5*time.Second, "how long a call may take (`DURATION`)")
	fs.BoolVar(&f.json, "json", false, "print the API's JSON answer")
	fs.BoolVar(&f.hashed, "hashed", false, "IDENTITY is already in its hashed form (h. and 32 hex digits)")
	return f
}

// call sends one admin API request and decodes a 2xx answer into out; any
// other answer is an error quoting the API's message and problems. ids
// travel in identity headers, never in the URL: a raw API key there would
// reach the access logs of every proxy on the way.
func (f *adminFlags) call(ctx context.Context, cmd, method, path string, query url.Values, ids []string, body []byte, out any) ([]byte, error) {
	tok := strings.TrimSpace(os.Getenv(f.tokenEnv)) // as the server reads its own
	if tok == "" {
		return nil, usageError{fmt.Sprintf("%s: environment variable %s is not set: it holds the admin API's bearer token (admin_api.token_env on the server)", cmd, f.tokenEnv)}
	}
	if f.timeout <= 0 {
		return nil, usageError{fmt.Sprintf("%s: --timeout must be positive, got %s", cmd, f.timeout)}
	}
	if f.hashed {
		if query == nil {
			query = url.Values{}
		}
		query.Set("hashed", "true")
	}
	u := strings.TrimSuffix(f.url, "/") + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	ctx, cancel := context.WithTimeout(ctx, f.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, u, bytes.NewReader(body))
	if err != nil {
		return nil, usageError{fmt.Sprintf("%s: --url: %v", cmd, err)}
	}
	req.Header.Set("authorization", "Bearer "+tok)
	for _, id := range ids {
		req.Header.Add(admin.IdentityHeader, id)
	}
	if body != nil {
		req.Header.Set("content-type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cmd, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("%s: reading the answer: %w", cmd, err)
	}
	if resp.StatusCode/100 != 2 {
		var e admin.APIError
		if json.Unmarshal(data, &e) != nil || e.Error.Message == "" {
			return nil, fmt.Errorf("%s: %s answered %s: %.200s", cmd, f.url, resp.Status, data)
		}
		msg := e.Error.Message
		for _, p := range e.Error.Problems {
			msg += "\n  " + strings.TrimPrefix(p.Field+": ", ": ") + p.Message
		}
		return nil, fmt.Errorf("%s: %s (%s)", cmd, msg, resp.Status)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return nil, fmt.Errorf("%s: the answer is not what this version of tokengate expects: %w", cmd, err)
		}
	}
	return data, nil
}

// limitPath is the path of a rule's overrides; the identity goes in a
// header (see call).
func limitPath(policy, rule string) string {
	return "/v1/limits/" + url.PathEscape(policy) + "/" + url.PathEscape(rule)
}

func runLimits(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("limits")
	f := addAdminFlags(fs)
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) == 0 {
		return usageError{"limits: want set, get or rm (see tokengate limits --help)"}
	}
	verb, rest := rest[0], rest[1:]
	cmd := "limits " + verb
	switch verb {
	case "set":
		if len(rest) < 4 {
			return usageError{"limits set: want POLICY RULE IDENTITY FIELD=VALUE... (e.g. default team acme tokens_per_minute=2000000)"}
		}
		body, err := limitFields(rest[3:])
		if err != nil {
			return err
		}
		var b admin.LimitBody
		data, err := f.call(ctx, cmd, http.MethodPut, limitPath(rest[0], rest[1]), nil, rest[2:3], body, &b)
		if err != nil {
			return err
		}
		if f.json {
			_, err = stdout.Write(data)
			return err
		}
		_, err = fmt.Fprintf(stdout, "%s/%s/%s: %s (version %s)\n", b.Policy, b.Rule, b.Identity, compact(b.Limits), b.Version)
		return err
	case "get":
		switch len(rest) {
		case 0, 1:
			path := "/v1/limits"
			if len(rest) == 1 {
				path += "/" + url.PathEscape(rest[0])
			}
			var l admin.LimitList
			data, err := f.call(ctx, cmd, http.MethodGet, path, nil, nil, nil, &l)
			if err != nil || f.json {
				return writeRaw(stdout, data, err)
			}
			tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "POLICY\tRULE\tIDENTITY\tLIMITS\t")
			for _, o := range l.Overrides {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", o.Policy, o.Rule, o.Identity, compact(o.Limits), o.Problem)
			}
			return tw.Flush()
		case 3:
			var b admin.LimitBody
			data, err := f.call(ctx, cmd, http.MethodGet, limitPath(rest[0], rest[1]), nil, rest[2:3], nil, &b)
			if err != nil || f.json {
				return writeRaw(stdout, data, err)
			}
			_, err = fmt.Fprintf(stdout, "%s/%s/%s: %s\n", b.Policy, b.Rule, b.Identity, compact(b.Limits))
			return err
		}
		return usageError{"limits get: want no arguments, POLICY, or POLICY RULE IDENTITY"}
	case "rm":
		if len(rest) != 3 {
			return usageError{"limits rm: want POLICY RULE IDENTITY"}
		}
		var b admin.LimitBody
		data, err := f.call(ctx, cmd, http.MethodDelete, limitPath(rest[0], rest[1]), nil, rest[2:3], nil, &b)
		if err != nil || f.json {
			return writeRaw(stdout, data, err)
		}
		_, err = fmt.Fprintf(stdout, "%s/%s/%s: removed (version %s)\n", b.Policy, b.Rule, b.Identity, b.Version)
		return err
	}
	return usageError{fmt.Sprintf("limits: unknown action %q: want set, get or rm", verb)}
}

// compact prints limits on one line.
func compact(raw json.RawMessage) string {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return string(raw)
	}
	return b.String()
}

func writeRaw(w io.Writer, data []byte, err error) error {
	if err != nil {
		return err
	}
	_, err = w.Write(data)
	return err
}

// limitFields turns FIELD=VALUE arguments into the JSON body of a PUT: a
// number stays a number, anything else is a string, for the server to
// judge (one set of rules, package config's).
func limitFields(args []string) ([]byte, error) {
	m := map[string]json.RawMessage{}
	for _, a := range args {
		k, v, ok := strings.Cut(a, "=")
		if !ok || k == "" {
			return nil, usageError{fmt.Sprintf("limits set: %q is not FIELD=VALUE (e.g. tokens_per_minute=2000000)", a)}
		}
		if _, dup := m[k]; dup {
			return nil, usageError{fmt.Sprintf("limits set: %s is given twice", k)}
		}
		if _, err := strconv.ParseFloat(v, 64); err == nil && json.Valid([]byte(v)) {
			m[k] = json.RawMessage(v)
		} else {
			s, err := json.Marshal(v)
			if err != nil {
				return nil, err
			}
			m[k] = s
		}
	}
	return json.Marshal(m)
}

func runUsage(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("usage")
	f := addAdminFlags(fs)
	policy := fs.String("policy", "", "the `NAME` of the policy (default: the default policy)")
	model := fs.String("model", "", "the `MODEL` whose per-model rules to include")
	tier := fs.String("tier", "", "the `TIER` the identity's requests carry")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) == 0 {
		return usageError{"usage: want at least one IDENTITY (NAME=VALUE, or the value when the policy has one identity)"}
	}
	q := url.Values{}
	for k, v := range map[string]string{"policy": *policy, "model": *model, "tier": *tier} {
		if v != "" {
			q.Set(k, v)
		}
	}
	var rep admin.UsageReport
	data, err := f.call(ctx, "usage", http.MethodGet, "/v1/usage", q, rest, nil, &rep)
	if err != nil || f.json {
		return writeRaw(stdout, data, err)
	}
	ids := make([]string, 0, len(rep.Identities))
	for k, v := range rep.Identities {
		ids = append(ids, k+"="+v)
	}
	slices.Sort(ids)
	fmt.Fprintf(stdout, "policy %s, %s\n", rep.Policy, strings.Join(ids, ", "))
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RULE\tKIND\tSOURCE\tLIMIT\tREMAINING\tRESET\t")
	for _, u := range rep.Rules {
		reset := ""
		if u.ResetSeconds != nil && u.Reset != nil {
			reset = fmt.Sprintf("in %s (%s)", (time.Duration(*u.ResetSeconds * float64(time.Second))).Round(100*time.Millisecond), u.Reset.Format(time.RFC3339))
		}
		switch u.Kind {
		case "bucket":
			if u.ResetSeconds == nil || *u.ResetSeconds <= 0 {
				reset = "full"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s/min, burst %s\t%s\t%s\t\n", u.Rule, u.Kind, u.Source,
				number(u.Limit.TokensPerMinute), number(u.Limit.Burst), number(u.Remaining), reset)
		case "quota":
			limit, amount := strconv.Itoa(u.Limit.Tokens)+" tokens", func(f float64) string { return number(f) + " tokens" }
			if u.Limit.Cost != "" {
				limit, amount = string(u.Limit.Cost)+" "+u.Unit, func(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) + " " + u.Unit }
			}
			spent := 0.0
			if u.Spent != nil {
				spent = *u.Spent
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s in %s\t%s (%s spent)\t%s\t\n", u.Rule, u.Kind, u.Source,
				limit, u.Window, amount(u.Remaining), amount(spent), reset)
		default:
			inUse := 0
			if u.InUse != nil {
				inUse = *u.InUse
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\tmax %d\t%s free (%d in use)\t\t\n", u.Rule, u.Kind, u.Source, u.Limit.Max, number(u.Remaining), inUse)
		}
	}
	return tw.Flush()
}

// number prints a token amount: whole, or with one decimal when it has a
// fraction.
func number(f float64) string {
	if f == float64(int64(f)) {
		return strconv.FormatInt(int64(f), 10)
	}
	return strconv.FormatFloat(f, 'f', 1, 64)
}
