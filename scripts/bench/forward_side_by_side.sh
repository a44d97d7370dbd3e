#!/usr/bin/env bash
# `phaselens bench forward --model DIR` next to the transformers eager reference
# (scripts/bench/forward_ref.py, DeepSeek-V4 checkpoints only), one length at a time and
# alternating, so that load changes on a shared machine hit both alike. Writes
# OUT/<model>-<length>-{phaselens,transformers}.json and prints a Markdown table.
#
#   scripts/bench/forward_side_by_side.sh MODEL_DIR L1,L2,... [OUT] [REF_MAX_LEN]
#
# The reference runs up to REF_MAX_LEN tokens (default 16384; eager attention builds
# [T, T] scores per layer). Needs the phaselens binary ($PHASELENS_BIN, default
# target/debug/phaselens) and a python with torch 2.9.0 + transformers 5.24.0 ($PYTHON).
# REF_QUERY_CHUNK=N runs the reference's eager attention over N queries at a time
# (forward_ref.py --query-chunk; at real width its [64, T, T] scores do not fit otherwise).
# LAST_LOGITS=1 computes only the last position's logits on both sides (a prefill; at
# 129,280 words every position's logits are 8.5 GB at 16K tokens).
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:?usage: $0 MODEL_DIR L1,L2,... [OUT] [REF_MAX_LEN]}
lengths=${2:?lengths}
out=${3:-runs/bench-forward}
ref_max=${4:-16384}
bin=${PHASELENS_BIN:-${CARGO_TARGET_DIR:-target}/debug/phaselens}
py=${PYTHON:-python3}
name=$(basename "$model")
mkdir -p "$out"
is_v4=$(grep -q '"deepseek_v4"' "$model/config.json" && echo 1 || echo 0)
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for t in ${lengths//,/ }; do
  last=(); [ "${LAST_LOGITS:-0}" = 1 ] && last=(--last-logits)
  "$bin" bench forward --model "$model" --tokens "$t" --reps 1 "${last[@]}" --json "$out/$name-$t-phaselens.json"
  if [ "$is_v4" = 1 ] && [ "$t" -le "$ref_max" ]; then
    "$py" scripts/bench/forward_ref.py --model "$model" --tokens "$t" --threads 2 \
      --query-chunk "${REF_QUERY_CHUNK:-0}" "${last[@]}" \
      --json "$out/$name-$t-transformers.json" || echo "reference failed at $t tokens"
  fi
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
"$py" - "$out" "$name" "$lengths" <<'PY'
import json, os, sys
out, name, lengths = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
def load(t, who):
    p = os.path.join(out, f"{name}-{t}-{who}.json")
    if not os.path.exists(p):
        return None
    d = json.load(open(p))
    return d[0] if isinstance(d, list) else d
print(f"\n| {name} tokens | phaselens s | tokens/s | peak RSS MiB | weights + one layer K/V MiB | matmul GFLOP/s (of GEMM) | transformers s | peak RSS MiB | time ratio |")
print("|---|---|---|---|---|---|---|---|---|")
for t in lengths:
    a, b = load(t, "phaselens"), load(t, "transformers")
    if a is None:
        continue
    row = [str(t), f"{a['seconds']:.2f}", f"{t / a['seconds']:.0f}", f"{a['peak_rss_bytes'] / 2**20:.0f}",
           f"{(a['weights_bytes'] + a['kv_layer_bytes']) / 2**20:.1f}",
           f"{a.get('matmul_gflops', float('nan')):.1f} ({100 * a.get('matmul_gflops', 0) / (a.get('gemm_gflops') or float('nan')):.0f}%)"]
    if b and 'seconds' in b:
        row += [f"{b['seconds']:.2f}", f"{b['peak_rss_bytes'] / 2**20:.0f}", f"{b['seconds'] / a['seconds']:.2f}x"]
    else:
        row += ["-", "-", "-"]
    print("| " + " | ".join(row) + " |")
PY
