package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy"
)

// runValidate checks tokengate configuration files and Envoy YAML (bootstrap
// files and bare listener, route or filter snippets). It prints every problem
// with file, path and rule, and fails if any file has an error.
func runValidate(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("validate")
	files, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return usageError{"validate: needs at least one FILE (see tokengate validate --help)"}
	}
	failed := 0
	for _, path := range files {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", path, err)
			failed++
			continue
		}
		if envoy.LooksLikeEnvoy(data) {
			problems := envoy.Validate(path, data)
			for _, p := range problems {
				fmt.Fprintln(stderr, p.Error())
			}
			if envoy.HasErrors(problems) {
				failed++
				continue
			}
			fmt.Fprintf(stdout, "%s: valid Envoy configuration\n", path)
			continue
		}
		if _, err := config.Parse(path, data); err != nil {
			var ps config.Problems
			if errors.As(err, &ps) {
				for _, p := range ps {
					fmt.Fprintln(stderr, p.Error())
				}
			} else {
				fmt.Fprintf(stderr, "%s: %v\n", path, err)
			}
			failed++
			continue
		}
		fmt.Fprintf(stdout, "%s: valid tokengate configuration\n", path)
	}
	if failed > 0 {
		fmt.Fprintf(stderr, "%d of %d files failed validation\n", failed, len(files))
		return errReported
	}
	return nil
}
