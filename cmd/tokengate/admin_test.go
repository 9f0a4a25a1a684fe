package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// The admin token: one read from a secret file keeps its trailing newline
// in the environment, and is trimmed; the scheme is case-insensitive
// (RFC 7235); a wrong token, or one differing only in length, is 401; a
// token with whitespace inside is refused at start.
func TestAdminTokenTrimmedSchemeAnyCase(t *testing.T) {
	bin := tokengateBinary(t)
	file := filepath.Join(t.TempDir(), "tokengate.yaml")
	writeFile(t, file, liveConfig("store: {type: memory}", 1000))
	p := startServe(t, bin, []string{"TG_TEST_ADMIN_TOKEN=" + adminToken + "\n"}, "--config", file)
	for _, tt := range []struct {
		auth   string
		status int
	}{
		{"Bearer " + adminToken, 200},
		{"bearer " + adminToken, 200},
		{"BEARER   " + adminToken + " ", 200},
		{"Bearer " + adminToken + "x", 401},
		{"Bearer " + adminToken[:len(adminToken)-1], 401},
		{"Basic " + adminToken, 401},
		{adminToken, 401},
		{"Bearer", 401},
	} {
		if st, body := adminCall(t, "GET", p.admin+"/v1/limits", tt.auth, ""); st != tt.status {
			t.Errorf("Authorization %q: %d %s, want %d", tt.auth, st, body, tt.status)
		}
	}
	p.stop(t)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a serve that starts is killed
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "serve", "--config", file, "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "TG_TEST_ADMIN_TOKEN=two words")
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "admin_api.token_env: the token in TG_TEST_ADMIN_TOKEN has whitespace inside") ||
		strings.Contains(string(out), "two words") {
		t.Errorf("serve with a token of two words: %v\n%s", err, out)
	}
}

// An admin API on a non-loopback address without TLS is refused by
// validate and by serve, from the file or from --admin, unless
// listeners.insecure says a mesh provides TLS: its token would travel in
// clear.
func TestAdminAPIOffLoopbackRefused(t *testing.T) {
	dir := t.TempDir()
	const policies = "policies: [{name: p, buckets: [{name: g, tokens_per_minute: 60}]}]\n"
	const want = `listeners.admin: "0.0.0.0:0" is not a loopback address and has no TLS, but it serves the admin API`
	open := filepath.Join(dir, "open.yaml")
	writeFile(t, open, "listeners: {admin: \"0.0.0.0:0\"}\nadmin_api: {token_env: TG_TEST_OPEN_TOKEN}\n"+policies)
	var out, errOut bytes.Buffer
	if err := run(context.Background(), []string{"validate", open}, nil, &out, &errOut); exitCode(err) != 1 || !strings.Contains(errOut.String(), want) {
		t.Errorf("validate: exit %d, output:\n%s\nwant %q", exitCode(err), errOut.String(), want)
	}
	t.Setenv("TG_TEST_OPEN_TOKEN", "secret")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := run(ctx, []string{"serve", "--config", open}, nil, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("serve: %v, want %q", err, want)
	}
	loopback := filepath.Join(dir, "loopback.yaml")
	writeFile(t, loopback, "admin_api: {token_env: TG_TEST_OPEN_TOKEN}\n"+policies)
	if err := run(ctx, []string{"serve", "--config", loopback, "--grpc", "127.0.0.1:0", "--admin", "0.0.0.0:0"}, nil, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("serve --admin 0.0.0.0:0: %v, want %q", err, want)
	}
	mesh := filepath.Join(dir, "mesh.yaml")
	writeFile(t, mesh, "listeners: {admin: \"0.0.0.0:0\", insecure: true}\nadmin_api: {token_env: TG_TEST_OPEN_TOKEN}\n"+policies)
	out.Reset()
	errOut.Reset()
	if err := run(context.Background(), []string{"validate", mesh}, nil, &out, &errOut); err != nil {
		t.Errorf("validate with listeners.insecure: %v\n%s", err, errOut.String())
	}
}

// The CLI never puts an identity's value in a URL, where proxies' access
// logs would keep a raw API key: limits and usage send it in the
// X-Tokengate-Identity header, and the server hashes it as it hashes a
// request's.
func TestCLIKeepsRawKeysOutOfURLs(t *testing.T) {
	const key = "sk-live-secret-key"
	var mu sync.Mutex
	var uris []string
	var ids [][]string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		uris = append(uris, r.Method+" "+r.URL.RequestURI())
		ids = append(ids, r.Header.Values("x-tokengate-identity"))
		mu.Unlock()
		w.Header().Set("content-type", "application/json")
		io.WriteString(w, `{"policy":"default","rule":"apikey","identity":"h.0123456789abcdef0123456789abcdef","limits":{"max":1},"identities":{},"rules":[]}`)
	}))
	defer srv.Close()
	t.Setenv("TOKENGATE_ADMIN_TOKEN", adminToken)
	for _, args := range [][]string{
		{"limits", "set", "default", "apikey", key, "max=1"},
		{"limits", "get", "default", "apikey", "Bearer " + key},
		{"limits", "rm", "default", "apikey", key},
		{"usage", "--policy", "default", "apikey=Bearer " + key, "team=acme"},
	} {
		var out bytes.Buffer
		if err := run(context.Background(), append(append([]string{args[0]}, "--url", srv.URL), args[1:]...), nil, &out, &out); err != nil {
			t.Fatalf("%q: %v\n%s", args, err, out.String())
		}
	}
	mu.Lock()
	defer mu.Unlock()
	want := [][]string{{key}, {"Bearer " + key}, {key}, {"apikey=Bearer " + key, "team=acme"}}
	for i, u := range uris {
		if dec, _ := url.QueryUnescape(u); strings.Contains(u, key) || strings.Contains(dec, key) || strings.Contains(dec, "acme") {
			t.Errorf("%s carries an identity's value", u)
		}
		if i >= len(want) || strings.Join(ids[i], "|") != strings.Join(want[i], "|") {
			t.Errorf("%s: X-Tokengate-Identity %q", u, ids[i])
		}
	}
	if len(uris) != len(want) {
		t.Errorf("%d calls, want %d: %q", len(uris), len(want), uris)
	}
}
