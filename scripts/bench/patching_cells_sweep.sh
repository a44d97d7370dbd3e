#!/usr/bin/env bash
# Patching cells/s against the number of cells (docs/performance.md, "Length and width"):
# runs one patch-heads experiment with its `[patch]` keys narrowed, so the same base runs
# feed fewer or more cells, and prints one markdown row per run: the keys, cells, the
# run's own split into base runs and cells (`time: base runs ...`), cells/s.
#
#   scripts/bench/patching_cells_sweep.sh EXP.toml OUT [BIN] [VARIANT ...]
#
# A VARIANT is `;`-separated `[patch]` lines, e.g. 'heads = [0];head_kinds = ["query"]'
# (default: the four below: every layer, 1/10 .. all of exp/v4pro.toml's cells). A key
# set by a variant replaces the experiment's line for it or joins the section.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,11p' "$0"
    exit 2
fi
exp=$1
out=$2
bin=${3:-target/debug/phaselens}
shift $(( $# < 3 ? $# : 3 ))
variants=("$@")
if [ ${#variants[@]} -eq 0 ]; then
    variants=(
        'heads = [0];head_kinds = ["query"];directions = ["denoise"]'
        'heads = [0];head_kinds = ["query"]'
        'heads = [0, 1];head_kinds = ["query"]'
        'heads = "all";head_kinds = ["query", "kv"]'
    )
fi
mkdir -p "$out"
echo "| [patch] | cells | base runs s | cells s | cells/s |"
echo "|---|---:|---:|---:|---:|"
i=0
for v in "${variants[@]}"; do
    i=$((i + 1))
    dir=$out/v$i
    rm -rf "$dir"
    mkdir -p "$dir"
    # The experiment with the variant's [patch] lines in place of its own.
    awk -v V="$v" '
        BEGIN { n = split(V, lines, ";"); for (j = 1; j <= n; j++) { k = lines[j]; sub(/ *=.*/, "", k); key[k] = lines[j] } }
        /^\[/ { if (inpatch) for (k in key) if (!done[k]) print key[k]; inpatch = ($0 == "[patch]") }
        inpatch && /^[a-z_]+ *=/ { k = $0; sub(/ *=.*/, "", k); if (k in key) { print key[k]; done[k] = 1; next } }
        { print }
        END { if (inpatch) for (k in key) if (!done[k]) print key[k] }' "$exp" > "$dir/exp.toml"
    # Relative paths in the experiment (organisms/...) resolve from its own folder.
    tmp="$(dirname "$exp")/cells-sweep-$i.toml"
    cp "$dir/exp.toml" "$tmp"
    if ! "$bin" run "$tmp" --data-dir "$dir/d" --reports-dir "$dir/r" --no-figures --plain 2> "$dir/log"; then
        rm -f "$tmp"
        cat "$dir/log"
        exit 1
    fi
    rm -f "$tmp"
    line=$(grep -E 'time: base runs' "$dir/log" | tail -1)
    base=$(echo "$line" | sed -E 's/.*base runs ([0-9.]+) s.*/\1/')
    cells_s=$(echo "$line" | sed -E 's/.*cells ([0-9.]+) s.*/\1/')
    cells=$(grep -E ' cells computed, ' "$dir/log" | tail -1 | sed -E 's/.*: ([0-9]+) cells computed.*/\1/')
    rate=$(echo "$cells / $cells_s" | bc -l | xargs printf '%.1f')
    echo "| \`${v//;/; }\` | $cells | $base | $cells_s | $rate |"
done
