#!/usr/bin/env bash
# `phaselens bench forward` on a pretrained GGUF model next to transformers' eager f32
# forward of the same file (scripts/bench/pretrained_forward_ref.py), one length at a
# time and alternating in one session, both at the same thread count, only the last
# position's logits on both sides (a prefill). Prints one JSON line per side and length.
#
#   scripts/bench/pretrained_side_by_side.sh FILE.gguf L1,L2,... [THREADS]
#
# Needs the phaselens binary ($PHASELENS_BIN, default target/debug/phaselens) and a
# python with torch 2.9.0 + transformers 5.25.0 + gguf 0.19.0 + accelerate ($PYTHON).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:?usage: $0 FILE.gguf L1,L2,... [THREADS]}
lengths=${2:?lengths}
threads=${3:-$(nproc)}
bin=${PHASELENS_BIN:-${CARGO_TARGET_DIR:-target}/debug/phaselens}
py=${PYTHON:-python3}
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg); $threads threads"
for t in ${lengths//,/ }; do
  RAYON_NUM_THREADS=$threads "$bin" bench forward --model "$model" --tokens "$t" --reps 1 \
    --weights f32 --last-logits 2>&1 | tail -4 | sed "s/^/phaselens $t: /"
  "$py" scripts/bench/pretrained_forward_ref.py --model "$model" --tokens "$t" \
    --threads "$threads" --last-logits | sed "s/^/transformers $t: /"
done
