#!/usr/bin/env bash
# SystemTap's own example suite against exotap's front end: runs every example .stp of
# Debian's systemtap-doc through pass 1 (parse), pass 2 (elaborate and check) and, with
# --pass3, pass 3 (probe points resolved against the cached guest kernel image's symbols and
# BTF), and prints how many pass and a histogram of the first error of those that fail.
#
#   ci/stap-examples.sh              # arguments and -g/-D from each example's .meta test_check line
#   ci/stap-examples.sh --no-args    # every example bare: `exotap run -p N FILE`
#   ci/stap-examples.sh --list       # also one line per example: pass reached, scope, first error
#   ci/stap-examples.sh --pass3      # also pass 3 for the examples that pass 2 (about 3 s each)
#   ci/stap-examples.sh --table      # also the summary table of the README (markdown)
#   ci/stap-examples.sh --matrix F   # also every example's result, grouped by cause, as the
#                                    # markdown page F (docs/stap-examples.md is made so)
#
# The examples ship in systemtap-doc under /usr/share/systemtap/examples (201, with .meta files
# giving the command line stap's own test suite uses, `test_check: stap -p4 FILE ARGS`) and
# /usr/share/doc/systemtap/examples (11 tutorial scripts): 212 in all. EXAMPLES=DIR... overrides.
# When the package is not installed, the script fetches it with `apt-get download` and unpacks
# it under ~/.cache/exotap/systemtap-doc (never into the repository).
# An example is in scope unless it uses user-space probe points (process.*: out of exotap's
# scope) or embedded C (%{ %}: no module runs C in the guest); the goal is pass 2 for 80% of
# the examples in scope.
# exotap is the debug build without the Unicorn backend; set EXOTAP to use another binary.
# Prints SKIP and exits 0 when the examples are absent and cannot be fetched.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=meta
list=0
pass3=0
table=0
matrix=
while (($#)); do
    a=$1
    shift
    case $a in
    --matrix)
        matrix=${1:?--matrix needs a file}
        shift
        ;;
    --no-args) mode=bare ;;
    --list) list=1 ;;
    --pass3) pass3=1 ;;
    --table) table=1 ;;
    *)
        echo "usage: $0 [--no-args] [--list] [--pass3] [--table] [--matrix FILE]" >&2
        exit 2
        ;;
    esac
done

# fetch_examples: systemtap-doc's examples unpacked under the cache, by `apt-get download`.
fetch_examples() {
    local cache=${XDG_CACHE_HOME:-$HOME/.cache}/exotap/systemtap-doc work
    if [[ ! -d $cache/usr/share/systemtap/examples ]]; then
        work=$(mktemp -d)
        (cd "$work" && apt-get download systemtap-doc >/dev/null 2>&1) || {
            rm -rf "$work"
            return 1
        }
        mkdir -p "$cache"
        dpkg-deb -x "$work"/systemtap-doc_*.deb "$cache" || {
            rm -rf "$work"
            return 1
        }
        rm -rf "$work"
    fi
    echo "$cache/usr/share/systemtap/examples $cache/usr/share/doc/systemtap/examples"
}

default_dirs="/usr/share/systemtap/examples /usr/share/doc/systemtap/examples"
if [[ -z ${EXAMPLES:-} && ! -d /usr/share/systemtap/examples ]]; then
    default_dirs=$(fetch_examples) || default_dirs=
fi
read -r -a dirs <<<"${EXAMPLES:-$default_dirs}"
files=()
for d in "${dirs[@]}"; do
    [[ -d $d ]] || continue
    while IFS= read -r f; do files+=("$f"); done < <(find "$d" -name '*.stp' | sort)
done
if ((${#files[@]} == 0)); then
    echo "SKIP: no SystemTap examples under ${dirs[*]:-/usr/share/systemtap/examples} (apt-get install systemtap-doc, or apt-get download failed)"
    exit 0
fi

# scope FILE: "user-space" (process.* probe points), "embedded-C" (%{ %}) or "in".
scope() {
    if grep -vE '^[[:space:]]*(#|//|\*)' "$1" |
        grep -qE '(^|[^a-zA-Z_.])process(\(|\.(begin|end|function|statement|mark|syscall|plt|thread|library|provider))'; then
        echo user-space
    elif grep -q '%{' "$1"; then
        echo embedded-C
    else
        echo in
    fi
}
# suite FILE: "suite" when SystemTap's own test suite runs the example (it has a .meta file
# with a test_check line: testsuite/systemtap.examples runs exactly those), "extra" otherwise
# (the tutorial's scripts and tapset fragments, a template).
suite() {
    if [[ -f ${1%.stp}.meta ]] && grep -q '^test_check:' "${1%.stp}.meta"; then
        echo suite
    else
        echo extra
    fi
}
# modules FILE: "modules" when the example's probe points are in kernel modules (module("M")
# points, or the nfs/nfsd tapsets, which SystemTap writes as module probes), "-" otherwise.
modules() {
    if grep -vE '^[[:space:]]*(#|//|\*)' "$1" |
        grep -qE '(^|[^A-Za-z_.])module\("|(probe|,)[[:space:]]+nfsd?\.'; then
        echo modules
    else
        echo -
    fi
}
if [[ -z ${EXOTAP:-} ]]; then
    nice -n 10 cargo build --quiet --no-default-features --bin exotap >&2
    EXOTAP=$PWD/target/debug/exotap
fi
# The examples run from their own directories: a relative EXOTAP would not be found there.
EXOTAP=$(realpath "$EXOTAP")

# meta_words FILE: the options (-g, -w, -D X, -G X, -x PID, ...) and arguments of the example's
# `test_check: stap ...` line, one per line, options first and the script's name left out.
meta_words() {
    local stp=$1 meta line words opts=() args=()
    meta=${stp%.stp}.meta
    [[ $mode == meta ]] || return 0
    if [[ ! -f $meta ]]; then
        # The tutorial's scripts have no .meta. Its tapset/ directory is the tapset of its
        # section on the tapset search path (timer_begin, used by tapset-time-user.stp):
        # the scripts beside it run with it on the path, `-I tapset`.
        [[ -d $(dirname "$stp")/tapset ]] && printf '%s\n' -I tapset --
        return 0
    fi
    line=$(grep -m1 '^test_check:' "$meta" | sed 's/^test_check:[[:space:]]*//') || return 0
    [[ -n $line ]] || return 0
    # One command substitution is answered, without running it: `grep "SYM" /proc/kallsyms |
    # awk '{print $1}'` (hw_watch_addr's address argument), which stap's test suite runs on the
    # kernel it probes, from the guest kernel's own kallsyms (`exotap symbols`, link-time).
    local kallsyms='`grep "([A-Za-z0-9_]+)" /proc/kallsyms \| awk .\{print \$1\}.`'
    if [[ $line =~ $kallsyms ]]; then
        local sym=${BASH_REMATCH[1]} addr
        addr=$("$EXOTAP" symbols "$sym" 2>/dev/null | awk -v s="$sym" '$3 == s { print $1; exit }')
        [[ -n $addr ]] && line=${line/"${BASH_REMATCH[0]}"/$addr}
    fi
    # Split as the shell would, without running anything in it (xargs knows quotes; a
    # command substitution in a .meta line stays text).
    mapfile -t words < <(printf '%s' "$line" | xargs -r printf '%s\n' 2>/dev/null)
    ((${#words[@]})) || return 0
    local k
    for k in "${!words[@]}"; do # `-x $$`: the shell's pid, as the .meta line means
        [[ ${words[k]} == '$$' ]] && words[k]=$$
    done
    set -- "${words[@]}"
    shift # stap
    while (($#)); do
        case $1 in
        -p*) [[ $1 == -p ]] && shift ;;
        -g) opts+=(-g) ;;
        -[a-zA-Z]*p[0-9]) # -gp4, -wp4
            [[ $1 == *g*p* ]] && opts+=(-g)
            [[ $1 == *w*p* ]] && opts+=(-w)
            ;;
        -D) opts+=(-D "$2") && shift ;;
        -D*) opts+=(-D "${1#-D}") ;;
        -x) opts+=(-x "$2") && shift ;;
        -I) opts+=(-I "$2") && shift ;;
        -I*) opts+=(-I "${1#-I}") ;;
        -w | -k | --all-modules | --bpf) opts+=("$1") ;;
        -s | -T | -G) opts+=("$1" "$2") && shift ;;
        -G*) opts+=(-G "${1#-G}") ;;
        -c | -r | -m | -B | --remote | -S | -d) shift ;;
        -*) ;; # other stap options (--ldd, -V, ...): not exotap's concern here
        *.stp) [[ $1 == "$(basename "$stp")" ]] || args+=("$1") ;;
        *) args+=("$1") ;;
        esac
        shift
    done
    printf '%s\n' "${opts[@]}" "--" "${args[@]}"
}

# first_error TEXT: the first error line, normalized so that like failures group: quoted
# names (a letter or '_' first, no spaces, three characters or more) become '…'.
first_error() {
    grep -m1 -iE '^(exotap: )?error' <<<"$1" |
        sed -E 's/^(exotap: )?[Ee]rror: //' |
        sed -E "s/^unknown probe point '([A-Za-z_]+)[^']*'/unknown probe point family \1/" |
        sed -E "s/^probe point '([A-Za-z_]+)[^']*' is not supported: ([^:;]*).*/probe point family \1 is not supported: \2/" |
        sed -E "s/'[A-Za-z_][^' ,]{2,}'/'…'/g" || true
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass1=0 pass2=0 pass3n=0
declare -A in_scope=([n]=0 [p1]=0 [p2]=0 [p3]=0)
declare -A out_scope=([user-space]=0 [embedded-C]=0)
for f in "${files[@]}"; do
    where=$(scope "$f")
    mapfile -t words < <(meta_words "$f")
    opts=() args=()
    seen_sep=0
    for w in "${words[@]}"; do
        if [[ $w == -- && $seen_sep == 0 ]]; then
            seen_sep=1
        elif ((seen_sep)); then
            args+=("$w")
        else
            opts+=("$w")
        fi
    done
    if [[ $mode == bare ]]; then
        cmd=("$EXOTAP" run)
    else
        cmd=("$EXOTAP")
    fi
    reached=0 err=
    last=2
    ((pass3)) && last=3
    for p in $(seq 1 $last); do
        if (cd "$(dirname "$f")" && timeout 60 "${cmd[@]}" -p "$p" "${opts[@]}" "$(basename "$f")" "${args[@]}") \
            >/dev/null 2>"$tmp/err" </dev/null; then
            reached=$p
        else
            err=$(first_error "$(cat "$tmp/err")")
            [[ -n $err ]] || err="exit without an error message: $(head -c 200 "$tmp/err" | tr '\n' ' ')"
            printf 'p%s\t%s\n' "$p" "$err" >>"$tmp/errors"
            [[ $where == in ]] && printf 'p%s\t%s\n' "$p" "$err" >>"$tmp/errors_in"
            break
        fi
    done
    # exotap's own verdict catches user-space families that the grep does not (glib.*, stap.*).
    if [[ $where == in && $err == *"user-space"* ]]; then
        where=user-space
        sed -i '$d' "$tmp/errors_in"
    fi
    ((reached >= 1)) && pass1=$((pass1 + 1))
    ((reached >= 2)) && pass2=$((pass2 + 1))
    ((reached >= 3)) && pass3n=$((pass3n + 1))
    if [[ $where == in ]]; then
        in_scope[n]=$((in_scope[n] + 1))
        for p in 1 2 3; do
            ((reached >= p)) && in_scope[p$p]=$((in_scope[p$p] + 1))
        done
    else
        out_scope[$where]=$((out_scope[$where] + 1))
    fi
    ((list)) && printf '%s\tp%s\t%s\t%s\n' "${f#*/share/}" "$reached" "$where" "$err"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "${f#*/share/}" "$reached" "$where" "$err" "$(suite "$f")" "$(modules "$f")" >>"$tmp/rows"
done

total=${#files[@]}
echo
echo "== SystemTap examples ($mode mode, $EXOTAP) =="
echo "examples: $total"
echo "-p 1 (parse):  $pass1 pass, $((total - pass1)) fail"
echo "-p 2 (check):  $pass2 pass, $((total - pass2)) fail"
if ((pass3)); then
    echo "-p 3 (resolve): $pass3n pass, $((total - pass3n)) fail"
    in3=", -p 3 ${in_scope[p3]}"
else
    in3=
fi
echo "in scope (no process.* probe points, no embedded C): ${in_scope[n]}; -p 1 ${in_scope[p1]}, -p 2 ${in_scope[p2]}$in3"
# SystemTap's test suite's own population (the examples with a .meta test_check line), in
# scope; and of those, the ones whose probe points are not in kernel modules.
suite_line() {
    awk -F'\t' -v mods="$1" '$3 == "in" && $5 == "suite" && (mods == "all" || $6 == "-") {
        n++; if ($2 >= 2) p++ }
        END { printf "%d of %d (%.1f%%)", p, n, n ? 100 * p / n : 0 }' "$tmp/rows"
}
echo "SystemTap's test suite's examples in scope (a .meta test_check line), pass -p 2: $(suite_line all); without module probes: $(suite_line none)"
for p in 1 2 3; do
    ((p == 3 && !pass3)) && continue
    echo
    echo "== first errors of the examples that fail -p $p =="
    if [[ -f $tmp/errors ]]; then
        grep "^p$p"$'\t' "$tmp/errors" | cut -f2- | sort | uniq -c | sort -rn || echo "(none)"
    else
        echo "(none)"
    fi
done

if ((table)); then
    pct() { echo "$(((100 * $1 + $2 / 2) / $2))%"; }
    n=${in_scope[n]}
    p3all="not run" p3in="not run"
    if ((pass3)); then
        p3all=$pass3n
        p3in="${in_scope[p3]} ($(pct "${in_scope[p3]}" "$n"))"
    fi
    echo
    echo "== summary table (markdown) =="
    echo "| examples | count | -p 1 parse | -p 2 check | -p 3 resolve |"
    echo "|---|---|---|---|---|"
    echo "| all | $total | $pass1 | $pass2 | $p3all |"
    echo "| in scope (no \`process.*\`, no embedded C) | $n | ${in_scope[p1]} ($(pct "${in_scope[p1]}" "$n")) | ${in_scope[p2]} ($(pct "${in_scope[p2]}" "$n")) | $p3in |"
    echo "| user-space probe points (out of scope) | ${out_scope[user-space]} | | | |"
    echo "| embedded C (out of scope) | ${out_scope[embedded-C]} | | | |"
    echo
    echo "In-scope examples that fail, by the pass that fails and its first error:"
    echo
    echo "| pass | first error | examples |"
    echo "|---|---|---|"
    if [[ -f $tmp/errors_in ]]; then
        sort "$tmp/errors_in" | uniq -c | sort -rn |
            sed -E 's/^ *([0-9]+) p([0-9])\t(.*)$/| \2 | \3 | \1 |/'
    fi
fi

if [[ -n $matrix ]]; then
    # Every example by its result: those in scope that pass -p 2, those that fail grouped by
    # their first error, and those out of scope. Generated, never edited by hand.
    names() {
        awk -F'\t' '{ n = $1; sub(/^(systemtap\/examples|doc\/systemtap\/examples)\//, "", n)
            printf "%s`%s`%s", (NR > 1 ? ", " : ""), n, ($5 == "extra" ? " *(no .meta)*" : "") }
            END { print "" }'
    }
    {
        echo "# SystemTap's examples: what exotap makes of each"
        echo
        echo "Generated by \`ci/stap-examples.sh --matrix docs/stap-examples.md\` (CI runs it and"
        echo "says when this page is stale); do not edit by hand. The $total examples of Debian's"
        echo "systemtap-doc, each run as SystemTap's test suite runs it (the options and arguments of"
        echo "its \`.meta\` file's \`test_check:\` line), through pass 2 (parse, elaborate and check)."
        echo "In scope: no user-space probe points (\`process.*\`) and no embedded C."
        echo
        echo "In scope: ${in_scope[n]}; pass \`-p 2\`: ${in_scope[p2]} ($(((100 * ${in_scope[p2]} + ${in_scope[n]} / 2) / ${in_scope[n]}))%)."
        echo
        echo "SystemTap's own test suite runs the examples that have a \`.meta\` file with a"
        echo "\`test_check:\` line; of those in scope, $(suite_line all) pass \`-p 2\`; without the"
        echo "ones whose probe points are in kernel modules (\`module(\"M\")\`, the nfs and nfsd"
        echo "tapsets), $(suite_line none). The others in scope (the tutorial's scripts, tapset"
        echo "fragments, a template) are below with the rest, marked *(no .meta)*."
        echo
        echo "## In scope, pass -p 2 (${in_scope[p2]})"
        echo
        awk -F'\t' '$3 == "in" && $2 >= 2' "$tmp/rows" | names
        echo
        # What the soak measured running live (tests/stap_examples_live/soak.rs), from its
        # committed results: docs/stap-examples-live.tsv, or LIVE=FILE.
        live=${LIVE:-docs/stap-examples-live.tsv}
        if [[ -s $live ]]; then
            live_all=$(wc -l <"$live")
            live_runs=$(awk -F'\t' '$2 == "runs"' "$live" | wc -l)
            echo "## Run live: $live_runs of $live_all"
            echo
            echo "The examples in \`/usr/share/systemtap/examples\` that pass \`-p 2\`, each run against"
            echo "a booted guest under the mixed workload (tests/stap_examples_live, the soak), compiled"
            echo "and host-evaluated, ended by SIGINT some seconds after its install. It *runs* when"
            echo "both runs end with exit 0 and no error and print on standard output what its \`.meta\`"
            echo "file's \`output:\` line promises (nothing for \`proc\`, \`file\`, \`none\`). From"
            echo "\`$live\`, which the soak writes:"
            echo "\`EXOTAP_SOAK=all EXOTAP_SOAK_WINDOW=6 EXOTAP_SOAK_EVENTS=none EXOTAP_SOAK_RESULTS=\$PWD/$live"
            echo "cargo test --test stap_examples_live every_example -- --nocapture\` (every tracepoint of"
            echo "the guest left off: exotap arms those the examples use)."
            echo
            echo "### Run ($live_runs)"
            echo
            awk -F'\t' '$2 == "runs"' "$live" | names
            echo
            echo "### Do not run, with the first run that failed ($((live_all - live_runs)))"
            echo
            echo "| example | mode: why |"
            echo "|---|---|"
            awk -F'\t' '$2 != "runs" { r = $2; gsub(/\|/, "\\|", r); printf "| `%s` | %s |\n", $1, r }' "$live"
            echo
        fi
        echo "## In scope, fail"
        awk -F'\t' '$3 == "in" && $2 < 2 {print $4}' "$tmp/rows" | sort | uniq -c | sort -rn |
            while read -r n cause; do
                echo
                echo "### $cause ($n)"
                echo
                awk -F'\t' -v c="$cause" '$3 == "in" && $2 < 2 && $4 == c' "$tmp/rows" | names
            done
        for where in user-space embedded-C; do
            echo
            echo "## Out of scope: $where ($(awk -F'\t' -v w="$where" '$3 == w' "$tmp/rows" | wc -l))"
            echo
            awk -F'\t' -v w="$where" '$3 == w' "$tmp/rows" | names
        done
    } >"$matrix"
fi
