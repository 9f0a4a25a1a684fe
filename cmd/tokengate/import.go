package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/rls/rlconfig"
)

// importHelp documents `tokengate import`.
const importHelp = `
Prints the tokengate configuration that does what another rate limiter's
configuration does. The one source is ratelimit: envoyproxy/ratelimit's YAML
files (the domain, descriptors and rate_limit files of its RUNTIME_ROOT), read
as ratelimit reads them; a directory stands for its *.yaml and *.yml files.
Each domain becomes a policy with a bucket per rate_limit (requests_per_unit
tokens, refilling requests_per_unit per unit, one token per hit) and an rls
domain holding the same descriptor tree, for tokengate's rate-limit service
(docs/rls.md). Keys ratelimit accepts but ignores print as warnings on
stderr; a file ratelimit would refuse prints its problems and exits 1.`

// runImport implements `tokengate import ratelimit FILE...`.
func runImport(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("import")
	merge := fs.Bool("merge-domains", false, "merge files of one domain, as ratelimit's MERGE_DOMAIN_CONFIG=true does, instead of refusing the second")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	switch {
	case len(rest) == 0:
		return usageError{"import: want a source (ratelimit) and at least one FILE (see tokengate import --help)"}
	case rest[0] != "ratelimit":
		return usageError{fmt.Sprintf("import: unknown source %q: the one source is ratelimit (envoyproxy/ratelimit)", rest[0])}
	case len(rest) == 1:
		return usageError{"import ratelimit: needs at least one FILE or directory (see tokengate import --help)"}
	}
	paths, err := ratelimitPaths(rest[1:])
	if err != nil {
		return err
	}
	var files []*rlconfig.File
	failed := false
	for _, path := range paths {
		data, err := config.ReadFile(path)
		if err != nil {
			return err // it names the file
		}
		f, err := rlconfig.Parse(path, data)
		if err != nil {
			printProblems(stderr, err)
			failed = true
			continue
		}
		for _, p := range f.Ignored {
			fmt.Fprintln(stderr, warning(p))
		}
		files = append(files, f)
	}
	if failed {
		return errReported
	}
	im, err := config.ImportRatelimit(files, rlconfig.Options{MergeDomains: *merge})
	if err != nil {
		if printProblems(stderr, err) {
			return errReported
		}
		return err
	}
	out, err := im.YAML()
	if err != nil {
		return err
	}
	// What import prints, validate and serve must accept as it is.
	if _, err := config.Parse("imported configuration", out); err != nil {
		return fmt.Errorf("import made a configuration tokengate refuses, which is a bug: %w", err)
	}
	_, err = stdout.Write(out)
	return err
}

// ratelimitPaths expands directories into their YAML files, sorted, as
// ratelimit reads its runtime directory.
func ratelimitPaths(args []string) ([]string, error) {
	var out []string
	for _, a := range args {
		st, err := os.Stat(a)
		if err != nil {
			return nil, err
		}
		if !st.IsDir() {
			out = append(out, a)
			continue
		}
		entries, err := os.ReadDir(a)
		if err != nil {
			return nil, err
		}
		var found []string
		for _, e := range entries {
			if n := e.Name(); !e.IsDir() && !strings.HasPrefix(n, ".") && (strings.HasSuffix(n, ".yaml") || strings.HasSuffix(n, ".yml")) {
				found = append(found, filepath.Join(a, n))
			}
		}
		if len(found) == 0 {
			return nil, fmt.Errorf("%s: no *.yaml or *.yml file in the directory", a)
		}
		slices.Sort(found)
		out = append(out, found...)
	}
	return out, nil
}

// printProblems prints a ratelimit configuration's problems one per line
// and reports whether err was such problems.
func printProblems(w io.Writer, err error) bool {
	var ps rlconfig.Problems
	if !errors.As(err, &ps) {
		return false
	}
	for _, p := range ps {
		fmt.Fprintln(w, p.Error())
	}
	return true
}

// warning prints an ignored key as validate prints warnings.
func warning(p rlconfig.Problem) string {
	p.Msg = "warning: " + p.Msg
	return p.Error()
}
