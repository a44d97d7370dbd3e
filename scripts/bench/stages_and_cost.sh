#!/usr/bin/env bash
# Per-stage forward profile and cost-against-length table (issue 45 §2, §4;
# docs/performance.md "Forward: where the time goes" and "Cost as the length grows").
#
#   scripts/bench/stages_and_cost.sh [OUT] [--quick]
#
# Runs `phaselens bench forward --stages` on SmolLM2-135M and Gemma 3 270M (GGUF, the
# model cache: models:NAME) at 1K and 4K tokens and on the real-width DeepSeek-V4
# checkpoint (target/realwidth/v4flash-width-3l, scripts/realwidth/write_checkpoint.py;
# skipped when absent) at 1K and 4K, then `bench forward --last-logits` at 1K..16K tokens on
# SmolLM2 (to its 8K context) and on the kvc-w8s8 organism, and writes OUT/*.json and OUT/tables.md (the
# fitted exponents by scripts/bench/cost_table.py). --quick: 256 / 512 tokens only (a dry
# run of the script). PHASELENS_BIN picks the binary (default target/debug/phaselens).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/bench-stages}
QUICK=0
[[ "${2:-}" == "--quick" || "${1:-}" == "--quick" ]] && QUICK=1
[[ "${1:-}" == "--quick" ]] && OUT=target/bench-stages
BIN=${PHASELENS_BIN:-target/debug/phaselens}
mkdir -p "$OUT"
if [[ $QUICK == 1 ]]; then
  STAGE_LENS=256,512; COST_LENS=256,512; SMOL_LENS=256,512
else
  # SmolLM2's context is 8,192 positions (longer prompts are refused).
  STAGE_LENS=1024,4096; COST_LENS=1024,2048,4096,8192,16384; SMOL_LENS=1024,2048,4096,8192
fi
RW=target/realwidth/v4flash-width-3l
{
  echo "# bench forward: stages and cost ($(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
  echo
} > "$OUT/tables.md"
stage() { # NAME MODEL LENGTHS
  echo "== stages: $1 ($3 tokens)" >&2
  "$BIN" bench forward --model "$2" --tokens "$3" --reps 1 --stages --json "$OUT/stages-$1.json" \
    | tee "$OUT/stages-$1.txt"
  { echo "## stages: $1"; echo; grep '^|' "$OUT/stages-$1.txt"; echo; } >> "$OUT/tables.md"
}
cost() { # NAME MODEL LENGTHS
  echo "== cost: $1 ($3 tokens)" >&2
  "$BIN" bench forward --model "$2" --tokens "$3" --reps 1 --last-logits --json "$OUT/cost-$1.json" \
    | tee "$OUT/cost-$1.txt"
}
stage smollm2 models:smollm2-135m-instruct "$STAGE_LENS"
stage gemma3 models:gemma3-270m "$STAGE_LENS"
if [[ -d $RW ]]; then
  stage realwidth "$RW" "$( [[ $QUICK == 1 ]] && echo 256 || echo 1024,4096 )"
else
  echo "note: $RW absent (scripts/realwidth/write_checkpoint.py $RW): no real-width stages" >&2
fi
cost smollm2 models:smollm2-135m-instruct "$SMOL_LENS"
cost kvc-w8s8 experiments/organisms/kvc-w8s8 "$COST_LENS"
python3 scripts/bench/cost_table.py "$OUT"/cost-*.json >> "$OUT/tables.md"
cat "$OUT/tables.md"
