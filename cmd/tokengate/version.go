package main

import (
	"context"
	"fmt"
	"io"
	"runtime/debug"
)

// versionHelp documents `tokengate version`.
const versionHelp = `
Prints the module version, the commit the binary was built from (with
"modified" when the working tree had changes) and the Go version. A binary
built by go install from a tagged module shows the tag; one built from a
checkout shows the commit.`

func runVersion(_ context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("version")
	rest, err := parseArgs(fs, args, stdout)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return usageError{fmt.Sprintf("version: takes no arguments, got %q", rest)}
	}
	_, err = fmt.Fprintln(stdout, versionLine())
	return err
}

// versionLine describes this binary from the build information Go embeds:
// "tokengate v1.2.3 (commit 0123abcd…, 2025-01-02T03:04:05Z) go1.26.8".
func versionLine() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "tokengate (no build information)"
	}
	version := bi.Main.Version
	if version == "" {
		version = "(devel)"
	}
	var rev, at, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			at = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				modified = ", modified"
			}
		}
	}
	commit := "commit unknown"
	if rev != "" {
		commit = "commit " + rev
		if at != "" {
			commit += ", " + at
		}
		commit += modified
	}
	return fmt.Sprintf("tokengate %s (%s) %s", version, commit, bi.GoVersion)
}
