package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// healthHelp documents `tokengate health`.
const healthHelp = `
Asks a running tokengate whether it is ready: GET --url, exit 0 on 200 and 1
otherwise, with one line saying why. The image has no shell or curl, so this
is what container health checks run. /readyz answers 503 while tokengate
shuts down and while its bucket store is unreachable under
on_failure: closed; the mock LLM answers on /healthz.`

// maxHealthBody bounds what is read from the probed endpoint.
const maxHealthBody = 4 << 10

func runHealth(ctx context.Context, args []string, stdout, _ io.Writer) error {
	fs := newFlagSet("health")
	url := fs.String("url", "http://127.0.0.1:9090/readyz", "the `URL` to probe")
	timeout := fs.Duration("timeout", 2*time.Second, "how long the probe may take (`DURATION`)")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Sprintf("health: takes no arguments, got %q (the address goes after --url)", rest)}
	}
	if *timeout <= 0 {
		return usageError{fmt.Sprintf("health: --timeout must be positive, got %s", *timeout)}
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, *url, nil)
	if err != nil {
		return usageError{fmt.Sprintf("health: --url: %v", err)}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("not healthy: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxHealthBody))
	if err != nil {
		return fmt.Errorf("not healthy: reading %s: %w", *url, err)
	}
	text := strings.TrimSpace(string(body))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("not healthy: %s answered %s: %s", *url, resp.Status, text)
	}
	_, err = fmt.Fprintf(stdout, "%s: %s\n", *url, text)
	return err
}
