package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/tokengate/tokengate/config"
	"github.com/tokengate/tokengate/envoy"
)

// runValidate checks tokengate configuration files and Envoy YAML. It
// prints every problem with file, position, field and rule, and fails if
// any file has an error (or, with --strict, a warning).
func runValidate(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("validate")
	strict := fs.Bool("strict", false, "treat warnings as errors")
	files, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return usageError{"validate: needs at least one FILE (see tokengate validate --help)"}
	}

	// tokengate configurations first: the Envoy files are checked against
	// the policies they define.
	type input struct {
		path  string
		data  []byte
		envoy bool
	}
	var inputs []input
	var policies []envoy.PolicySet
	failed := 0
	for _, path := range files {
		data, err := config.ReadFile(path)
		if err != nil {
			fmt.Fprintln(stderr, err) // it names the file
			failed++
			continue
		}
		in := input{path: path, data: data, envoy: envoy.LooksLikeEnvoy(data)}
		inputs = append(inputs, in)
		if in.envoy {
			continue
		}
		cfg, err := config.Parse(path, data)
		if err != nil {
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
		set := envoy.PolicySet{File: path, Key: cfg.PolicyMetadataKey}
		for _, p := range cfg.Policies {
			set.Names = append(set.Names, p.Name)
		}
		if cfg.RLS != nil {
			set.Domains = []string{}
			for _, d := range cfg.RLS.Domains {
				set.Domains = append(set.Domains, d.Domain)
			}
		}
		policies = append(policies, set)
		fmt.Fprintf(stdout, "%s: valid tokengate configuration\n", path)
	}
	for _, in := range inputs {
		if in.envoy && !reportEnvoy(in.path, in.data, envoy.Options{Policies: policies}, *strict, stdout, stderr) {
			failed++
		}
	}
	if failed > 0 {
		how := ""
		if *strict {
			how = " (--strict: warnings count as errors)"
		}
		fmt.Fprintf(stderr, "%d of %d files failed validation%s\n", failed, len(files), how)
		return errReported
	}
	return nil
}

// reportEnvoy checks one Envoy file and prints what it found; it reports
// whether the file passes.
func reportEnvoy(path string, data []byte, opts envoy.Options, strict bool, stdout, stderr io.Writer) bool {
	r := envoy.Check(path, data, opts)
	warnings := 0
	for _, p := range r.Problems {
		fmt.Fprintln(stderr, p.Error())
		if p.Severity == envoy.Warning {
			warnings++
		}
	}
	if envoy.HasErrors(r.Problems) || strict && warnings > 0 {
		return false
	}
	for _, m := range r.Modes {
		if !m.Supported {
			continue
		}
		needs := ""
		if m.Mode.MinEnvoy != "" {
			needs = " (Envoy ≥ " + m.Mode.MinEnvoy + ")"
		}
		fmt.Fprintf(stdout, "%s:%d:%d: body modes request %v, response %v%s: %s\n",
			path, m.Line, m.Column, m.Request, m.Response, needs, m.Mode.Recommended)
	}
	var what string
	switch {
	case len(r.Checked) == 0:
		verb := " carry"
		if len(r.Skipped) == 1 {
			verb = " carries"
		}
		what = "nothing to check: " + strings.Join(r.Skipped, ", ") + verb + " no Envoy configuration"
	case len(r.Skipped) == 0:
		what = "valid Envoy configuration (" + strings.Join(r.Checked, ", ") + ")"
	default:
		what = "valid Envoy configuration (" + strings.Join(r.Checked, ", ") + "; " +
			strings.Join(r.Skipped, ", ") + " not checked: no Envoy configuration)"
	}
	if warnings > 0 {
		what += fmt.Sprintf(", %d warning%s", warnings, plural(warnings))
	}
	fmt.Fprintf(stdout, "%s: %s\n", path, what)
	return true
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}
