#!/usr/bin/env bash
# The layers of exotap (docs/architecture.md), lowest first: a crate may depend on crates of
# its own layer and below, never on one above. Two checks, exit 1 with each offence:
# 1. The crates: every dependency between workspace crates (normal, build and dev alike: a
#    dev-dependency on a crate above is a cycle in disguise) from `cargo metadata`, against the
#    table below. A crate missing from the table fails too, so a new crate gets a place.
# 2. Inside the engine crate (probes/src), whose modules are layers of their own: every
#    `crate::MODULE::` or `exotap_probes::MODULE::` path in code (comments left out) of a
#    module's files, against the module table.
#
#   ci/layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

cargo metadata --format-version 1 --no-deps --locked | python3 -c '
import json, sys

# crate -> its layer
layer = {
    "exotap-vmm": 0,            # the backends: gdbstub client, QEMU, own KVM VMM, Unicorn
    "exotap-introspect": 0,     # reading a kernel: ELF, kallsyms, BTF, DWARF, ORC, x86 decoding
    "exotap-guest-images": 0,   # the guest images cache and its fetching
    "exotap-probes-base": 1,    # the kernel image on the host, the ring format, procfs files
    "exotap-lang": 2,           # the front end: SystemTap language -> one checked program
    "exotap-compile": 3,        # that program -> x86-64 code run in the guest
    "exotap-probes": 4,         # the engine: splicing, JIT, the live session, recovery
    "exotap-regress": 5,        # the splicing-safety regression, over the engine
    "exotap": 6,                # the CLI: parses arguments and prints
}
meta = json.load(sys.stdin)
ours = {p["name"] for p in meta["packages"]}
bad = 0
for p in meta["packages"]:
    name = p["name"]
    if name not in layer:
        print(f"ci/layers.sh: crate {name} has no layer in the table")
        bad = 1
        continue
    for d in p["dependencies"]:
        dep = d["name"]
        if dep not in ours:
            continue
        if dep not in layer:
            continue  # reported above as a crate of its own
        if layer[dep] > layer[name] or (dep != name and layer[dep] == layer[name] and layer[name] > 0):
            kind = d["kind"] or "normal"
            print(f"ci/layers.sh: {name} (layer {layer[name]}) depends on {dep} (layer {layer[dep]}, {kind} dependency)")
            bad = 1
sys.exit(bad)
'

cd probes/src
# engine module -> its layer (the re-exported crates below it are layers 0-2 here)
declare -A layer=(
    [kernel_image]=0 [rings]=0 [procfs]=0 # exotap-probes-base, re-exported
    [lang]=1                   # exotap-lang, re-exported
    [compile]=2                # exotap-compile, re-exported
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
