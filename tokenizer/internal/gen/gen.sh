#!/bin/sh
# gen.sh regenerates the tokenizer's Unicode tables or its tiktoken fixture
# from the npm packages pinned in package-lock.json (integrity-checked by
# npm ci), installed in a temporary directory, never in the repository.
#
#	sh tokenizer/internal/gen/gen.sh classes   # tokenizer/unicode_tables.go (also: go generate ./tokenizer)
#	sh tokenizer/internal/gen/gen.sh fixture   # tokenizer/testdata/tiktoken_unicode.txt.gz
#
# Needs node (20 or later), npm, gofmt and gzip.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
pkg=$(cd "$here/../.." && pwd)
what=${1:-}
case "$what" in
classes | fixture) ;;
*)
	echo "usage: gen.sh classes|fixture" >&2
	exit 2
	;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$here/classes.mjs" "$here/fixture.mjs" "$tmp/"
(cd "$tmp" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
case "$what" in
classes)
	node "$tmp/classes.mjs" >"$tmp/unicode_tables.go"
	gofmt "$tmp/unicode_tables.go" >"$pkg/unicode_tables.go"
	;;
fixture)
	node "$tmp/fixture.mjs" | gzip -n -9 >"$pkg/testdata/tiktoken_unicode.txt.gz"
	;;
esac
