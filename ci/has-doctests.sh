#!/usr/bin/env bash
# Whether the workspace has a documentation example that `cargo test --doc` would compile: a
# code block in a `///` or `//!` comment whose fence names no language, or rust, or one of
# rustdoc's test attributes (no_run, should_panic, compile_fail, editionN). Prints each and
# exits 0 when there is one, 1 when there is none. ci/test.sh runs the doctests only then:
# `cargo test --doc` type-checks every library again through rustdoc (2.5 minutes on a
# 2-core machine) even when it finds no example to run.
set -euo pipefail
cd "$(dirname "$0")/.."
found=$(git ls-files -z '*.rs' | xargs -0 awk '
    FNR == 1 { inside = 0 }
    {
        line = $0
        if (line !~ /^[ \t]*\/\/[\/!]/) { inside = 0; next }
        sub(/^[ \t]*\/\/[\/!] ?/, "", line)
        if (line !~ /^[ \t]*```/) next
        if (inside) { inside = 0; next }
        inside = 1
        lang = line
        sub(/^[ \t]*```+/, "", lang)
        gsub(/[ \t]/, "", lang)
        if (lang == "" || lang ~ /(^|,)(rust|no_run|should_panic|compile_fail|edition[0-9]+)(,|$)/)
            print FILENAME ":" FNR ": " $0
    }
')
[ -n "$found" ] || exit 1
echo "$found"
