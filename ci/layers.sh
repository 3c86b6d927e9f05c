#!/usr/bin/env bash
# The layers of probes/ (docs/architecture.md), lowest first: a module may use its own layer
# and those below, never one above. Until probes/ is cut into crates along these lines (where
# `cargo tree` shows the arrows), this check keeps an upward reference from creeping in:
# every `crate::MODULE::` or `exotap_probes::MODULE::` path in code (comments left out) of a
# module's files is checked against the table. Exit 1 with each offending line.
#
#   ci/layers.sh
set -euo pipefail
cd "$(dirname "$0")/../probes/src"

# module -> its layer
declare -A layer=(
    [kernel_image]=0 [rings]=0 [procfs]=0 # the kernel image on the host; the trace-record format; files served
    [lang]=1                   # the front end: SystemTap's language to one checked program
    [compile]=2                # that program to x86-64 machine code
    [splice]=3 [jit]=3         # planning splices, translating functions into the code cache
    [live]=4                   # the session with a live guest: installs, reads, removes
)
bad=0
for module in "${!layer[@]}"; do
    files=$(find "$module" "$module.rs" -name '*.rs' 2>/dev/null || true)
    [ -n "$files" ] || continue
    for other in "${!layer[@]}"; do
        [ "${layer[$other]}" -gt "${layer[$module]}" ] || continue
        # Code lines only: `//` comments and doc comments are not references.
        hits=$(grep -nE "(crate|exotap_probes)::$other\b" $files | grep -vE '^[^:]+:[0-9]+:\s*//' || true)
        if [ -n "$hits" ]; then
            echo "ci/layers.sh: $module (layer ${layer[$module]}) reaches up into $other (layer ${layer[$other]}):"
            echo "$hits"
            bad=1
        fi
    done
done
exit "$bad"
