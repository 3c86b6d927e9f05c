#!/usr/bin/env bash
# SystemTap's own example suite against exotap's front end: runs every example .stp of
# Debian's systemtap-doc through pass 1 (parse) and pass 2 (elaborate and check), and prints
# how many pass and a histogram of the first error of those that fail.
#
#   ci/stap-examples.sh              # arguments and -g/-D from each example's .meta test_check line
#   ci/stap-examples.sh --no-args    # every example bare: `exotap run -p N FILE`
#   ci/stap-examples.sh --list       # also one line per example: pass reached and first error
#
# The examples ship in systemtap-doc under /usr/share/systemtap/examples (201, with .meta files
# giving the command line stap's own test suite uses, `test_check: stap -p4 FILE ARGS`) and
# /usr/share/doc/systemtap/examples (11 tutorial scripts): 212 in all. EXAMPLES=DIR... overrides.
# exotap is the debug build without the Unicorn backend; set EXOTAP to use another binary.
# Prints SKIP and exits 0 when the examples are absent (`apt-get install systemtap-doc`).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=meta
list=0
for a in "$@"; do
    case $a in
    --no-args) mode=bare ;;
    --list) list=1 ;;
    *)
        echo "usage: $0 [--no-args] [--list]" >&2
        exit 2
        ;;
    esac
done

read -r -a dirs <<<"${EXAMPLES:-/usr/share/systemtap/examples /usr/share/doc/systemtap/examples}"
files=()
for d in "${dirs[@]}"; do
    [[ -d $d ]] || continue
    while IFS= read -r f; do files+=("$f"); done < <(find "$d" -name '*.stp' | sort)
done
if ((${#files[@]} == 0)); then
    echo "SKIP: no SystemTap examples under ${dirs[*]} (apt-get install systemtap-doc)"
    exit 0
fi
if [[ -z ${EXOTAP:-} ]]; then
    nice -n 10 cargo build --quiet --no-default-features --bin exotap >&2
    EXOTAP=$PWD/target/debug/exotap
fi
# The examples run from their own directories: a relative EXOTAP would not be found there.
EXOTAP=$(realpath "$EXOTAP")

# meta_words FILE: the options (-g, -D X, -x PID) and arguments of the example's
# `test_check: stap ...` line, one per line, options first and the script's name left out.
meta_words() {
    local stp=$1 meta line words opts=() args=()
    meta=${stp%.stp}.meta
    [[ $mode == meta && -f $meta ]] || return 0
    line=$(grep -m1 '^test_check:' "$meta" | sed 's/^test_check:[[:space:]]*//') || return 0
    [[ -n $line ]] || return 0
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
        -[a-zA-Z]*p[0-9]) [[ $1 == *g*p* ]] && opts+=(-g) ;; # -gp4, -wp4
        -D) opts+=(-D "$2") && shift ;;
        -D*) opts+=(-D "${1#-D}") ;;
        -x) opts+=(-x "$2") && shift ;;
        -c | -I | -r | -m | -B | --remote | -S | -d | -G) shift ;;
        -*) ;; # other stap options (--bpf, -w, ...): not exotap's concern here
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
        sed -E "s/'[A-Za-z_][^' ,]{2,}'/'…'/g" || true
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass1=0 pass2=0
for f in "${files[@]}"; do
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
    for p in 1 2; do
        if (cd "$(dirname "$f")" && timeout 20 "${cmd[@]}" -p "$p" "${opts[@]}" "$(basename "$f")" "${args[@]}") \
            >/dev/null 2>"$tmp/err" </dev/null; then
            reached=$p
        else
            err=$(first_error "$(cat "$tmp/err")")
            [[ -n $err ]] || err="exit without an error message: $(head -c 200 "$tmp/err" | tr '\n' ' ')"
            printf 'p%s\t%s\n' "$p" "$err" >>"$tmp/errors"
            break
        fi
    done
    ((reached >= 1)) && pass1=$((pass1 + 1))
    ((reached >= 2)) && pass2=$((pass2 + 1))
    ((list)) && printf '%s\tp%s\t%s\n' "${f#/usr/share/}" "$reached" "$err"
done

total=${#files[@]}
echo
echo "== SystemTap examples ($mode mode, $EXOTAP) =="
echo "examples: $total"
echo "-p 1 (parse):  $pass1 pass, $((total - pass1)) fail"
echo "-p 2 (check):  $pass2 pass, $((total - pass2)) fail"
for p in 1 2; do
    echo
    echo "== first errors of the examples that fail -p $p =="
    if [[ -f $tmp/errors ]]; then
        grep "^p$p"$'\t' "$tmp/errors" | cut -f2- | sort | uniq -c | sort -rn || echo "(none)"
    else
        echo "(none)"
    fi
done
