#!/usr/bin/env bash
# Time one patching experiment with several phaselens binaries (or settings), one run
# after the other in one session, each from scratch (a fresh data folder, no figures):
#
#   scripts/bench/patching_side_by_side.sh EXP.toml OUT LABEL=CMD [LABEL=CMD ...]
#
# CMD is a phaselens binary, optionally preceded by environment settings, e.g.
#   scripts/bench/patching_side_by_side.sh exp/realwidth-patch.toml /tmp/pb \
#       before=/tmp/phaselens-before after=target/debug/phaselens \
#       one-chunk="PHASELENS_CHUNKS_AT_ONCE=1 target/debug/phaselens"
#
# Per run it keeps OUT/LABEL/{log,time} (the progress lines with the seconds since the
# start, `/usr/bin/time -v`) and prints one markdown row: wall seconds, CPU seconds
# (user + system) and cores busy on average, peak RSS, the seconds at which the first
# and the last chunk were saved (progress lines), and the run's own split into base
# runs and cells where the binary prints it (`time: base runs ...`). The tables of the
# runs are compared with `cmp` against the first run's.
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,16p' "$0"
    exit 2
fi
exp=$1
out=$2
shift 2
mkdir -p "$out"
first=""
echo "| run | wall s | CPU s | cores busy | peak RSS GiB | first chunk saved at s | last chunk saved at s | base runs s | cells s | per cell s | table as the first run's |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
for spec in "$@"; do
    label=${spec%%=*}
    cmd=${spec#*=}
    dir=$out/$label
    rm -rf "$dir"
    mkdir -p "$dir"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    /usr/bin/time -o "$dir/time" -f '%e %U %S %M' env $cmd run "$exp" \
        --data-dir "$dir/d" --reports-dir "$dir/r" --no-figures --plain \
        2> >(stdbuf -oL tr '\r' '\n' | while IFS= read -r line; do
            printf '%.1f %s\n' "$(echo "$(date +%s.%N) - $start" | bc)" "$line"
        done > "$dir/log")
    sleep 1 # the log's reader finishes
    read -r wall user sys rss < "$dir/time"
    cpu=$(echo "$user + $sys" | bc)
    cores=$(echo "scale=2; $cpu / $wall" | bc)
    first_chunk=$( (grep -E 'cells \(' "$dir/log" || true) | head -1 | cut -d' ' -f1)
    last_chunk=$( (grep -E 'cells \(' "$dir/log" || true) | tail -1 | cut -d' ' -f1)
    split=$( (grep -E 'time: base runs' "$dir/log" || true) | tail -1 |
        sed -E 's/.*base runs ([0-9.]+) s, cells ([0-9.]+) s \(([0-9.]+) s per cell\).*/\1 | \2 | \3/')
    [ -z "$split" ] && split="- | - | -"
    table=$(find "$dir/d" -name '*.arrow' | sort | head -1)
    if [ -z "$first" ]; then
        first=$table
        same="(reference)"
    elif cmp -s "$first" "$table"; then
        same="identical"
    else
        same="differs"
    fi
    echo "| $label | $wall | $cpu | $cores | $(echo "scale=2; $rss / 1048576" | bc) | ${first_chunk:--} | ${last_chunk:--} | $split | $same |"
done
