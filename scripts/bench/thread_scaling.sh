#!/usr/bin/env bash
# Thread scaling of the flex forward (issue 45 §1): `phaselens bench forward` with 1 and
# then N rayon threads, alternating in one session, on a pretrained GGUF model (only the
# last position's logits: a prefill) and on the synthetic kvc model. Prints the load
# average, one line per run, and the speed-up of N threads over 1 per length.
#
#   scripts/bench/thread_scaling.sh FILE.gguf L1,L2,... [N]
#   WEIGHTS=stored scripts/bench/thread_scaling.sh target/realwidth/v4flash-width-3l 2048 2
#
# FILE may be any model directory too. $WEIGHTS: `f32` (default: dequantised on load) or
# `stored` (resident as stored, dequantised as multiplied: the real-width checkpoint's
# figures in docs/performance.md). Needs the phaselens binary ($PHASELENS_BIN, default
# target/debug/phaselens). Results are bit-identical at every thread count
# (tests/it/threads.rs); only time changes.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:?usage: $0 FILE.gguf L1,L2,... [N]}
lengths=${2:?lengths}
n=${3:-$(nproc)}
weights=${WEIGHTS:-f32}
bin=${PHASELENS_BIN:-${CARGO_TARGET_DIR:-target}/debug/phaselens}
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); 1 vs $n threads"
secs() { # seconds per forward in bench forward's length table for length $1 (last row)
  awk -F'|' -v t="$1" '{ gsub(/ /, "", $2); gsub(/ /, "", $3) }
    $2 == t && $3 ~ /^[0-9.]+$/ { s = $3 } END { print s }'
}
for t in ${lengths//,/ }; do
  for what in model synthetic; do
    declare -A s=()
    for th in 1 "$n"; do
      if [ "$what" = model ]; then
        out=$(RAYON_NUM_THREADS=$th "$bin" bench forward --model "$model" --tokens "$t" \
          --reps 2 --weights "$weights" --last-logits 2>&1)
      else
        out=$(RAYON_NUM_THREADS=$th "$bin" bench forward --tokens "$t,$t" --reps 2 --d-model 512 --layers 6 2>&1)
      fi
      s[$th]=$(echo "$out" | secs "$t")
      echo "$what $t tokens, $th thread(s): ${s[$th]} s per forward"
    done
    awk -v a="${s[1]}" -v b="${s[$n]}" -v w="$what" -v t="$t" -v n="$n" \
      'BEGIN { if (a > 0 && b > 0) printf "%s %s tokens: %d threads %.2fx as fast as 1\n", w, t, n, a / b }'
  done
done
