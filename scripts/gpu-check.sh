#!/usr/bin/env bash
# One GPU run (issue 45 §5), <= 8 minutes on an H100: builds phaselens with LibTorch
# (`--features tch`), then on tch-cuda:0
#   1. the backend matrix (`phaselens backends --devices tch-cuda:0 --json`),
#   2. the real-width-like parity under the reference's forced indexer selection
#      (tests/it deepseek_v4_realwidth::realwidth_ci_*, PHASELENS_TEST_DEVICE=tch-cuda:0),
#   3. `bench forward` at 4K..64K tokens on the real-width DeepSeek-V4 checkpoint
#      (target/realwidth/v4flash-width-3l; written by scripts/realwidth/write_checkpoint.py
#      when absent and python has torch) and on Gemma 3 270M (models:gemma3-270m, when the
#      model cache has it), only the last position's logits from 16K on,
#   4. the same forwards with the bf16 compute dtype (4K and 16K),
# and writes OUT/gpu-check.json (every step: command, status, seconds, its numbers) and
# OUT/gpu-check.md (one table). Each step has a time limit; a step that fails or runs out
# of time is recorded as such and the script goes on. Lengths stop growing once one
# forward takes more than a quarter of the time left.
#
#   scripts/gpu-check.sh [--backend tch-cuda|flex] [--quick] [OUT]
#
# --backend flex: the CPU dry path (default features, device cpu); --quick: short lengths
# (256 / 512 tokens) and the CI-sized real-width fixture instead of the full checkpoint,
# with the backend matrix's kvc-contract check only. The dry path is what CI-less
# machines run to test this script: `scripts/gpu-check.sh --backend flex --quick`.
# OUT: $OUT when set, else target/gpu-check. PROFILE=debug|release (default debug: the
# dev profile compiles the dependencies, whose kernels do the work, at opt-level 3).
# The 8 minutes (GPU_CHECK_SECONDS, default 470) count from the end of the build; the
# build's own time is recorded as its step (a cold build of the tch feature takes longer).
set -uo pipefail
cd "$(dirname "$0")/.."
BACKEND=tch-cuda
QUICK=0
DEST=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --backend) BACKEND=${2:?--backend tch-cuda|flex}; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n 2,23p "$0"; exit 0 ;;
    *) DEST=$1; shift ;;
  esac
done
OUT=${DEST:-${OUT:-target/gpu-check}}
mkdir -p "$OUT"
START=$(date +%s)
BUDGET=${GPU_CHECK_SECONDS:-470}
PROFILE=${PROFILE:-debug}
case "$BACKEND" in
  tch-cuda) DEVICE=tch-cuda:0; FEATURES=(--features tch); export LIBTORCH_USE_PYTORCH=1 ;;
  flex) DEVICE=cpu; FEATURES=() ;;
  *) echo "gpu-check: --backend is tch-cuda or flex, not '$BACKEND'" >&2; exit 2 ;;
esac
PROFILE_FLAG=(); [[ $PROFILE == release ]] && PROFILE_FLAG=(--release)
BIN=target/$PROFILE/phaselens
STEPS="$OUT/steps.jsonl"
: > "$STEPS"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD...: run CMD with a time limit, log to OUT/NAME.log, record it.
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  (( limit > l )) && limit=$l
  if (( limit < 5 )); then
    printf '{"step":"%s","status":"skipped (time)","seconds":0}\n' "$name" >> "$STEPS"
    echo "gpu-check: $name skipped: out of time" >&2
    return 1
  fi
  echo "== $name (limit ${limit}s): $*" >&2
  local t0 rc; t0=$(date +%s.%N)
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local secs; secs=$(echo "$(date +%s.%N) - $t0" | bc)
  local status=ok
  (( rc == 124 || rc == 130 )) && status="timed out"
  (( rc != 0 && rc != 124 && rc != 130 )) && status="failed (exit $rc)"
  python3 - "$name" "$status" "$secs" "$*" >> "$STEPS" <<'EOF'
import json, sys
print(json.dumps({"step": sys.argv[1], "status": sys.argv[2],
                  "seconds": round(float(sys.argv[3]), 1), "command": sys.argv[4]}))
EOF
  tail -3 "$OUT/$name.log" >&2
  return $rc
}

{
  echo "date: $(date -u +%FT%TZ)"; echo "host: $(hostname), $(nproc) cores"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
} > "$OUT/machine.txt"
cat "$OUT/machine.txt" >&2

# 0. Build (the binary and the test binary, with the backend's features).
BUDGET=$(( BUDGET + 1200 ))
NEXTEST_PROFILE=(); [[ $PROFILE == release ]] && NEXTEST_PROFILE=(--cargo-profile release)
step build 1200 bash -c 'cargo build "$@" && cargo nextest run --no-run --test it "$@"' _ \
  "${PROFILE_FLAG[@]}" "${FEATURES[@]}" || {
  echo "gpu-check: the build failed; see $OUT/build.log" >&2
}
START=$(date +%s); BUDGET=${GPU_CHECK_SECONDS:-470}

# 1. The backend matrix on the device.
CHECKS=(); [[ $QUICK == 1 ]] && CHECKS=(--checks kvc-contract)
step backends 120 "$BIN" backends --devices "$DEVICE" "${CHECKS[@]}" --json

# 2. Real-width-like parity under the reference's forced indexer selection.
step parity 150 env PHASELENS_TEST_DEVICE="$DEVICE" cargo nextest run "${FEATURES[@]}" \
  "${NEXTEST_PROFILE[@]}" --test it --no-capture deepseek_v4_realwidth::realwidth_ci_matches

# 3-4. Forward sweeps. The real-width checkpoint (or the CI fixture with --quick).
RW=target/realwidth/v4flash-width-3l
if [[ $QUICK == 1 ]]; then
  RW=tests/fixtures/deepseek_v4/realwidth_ci; LENS=(256 512); BF16_LENS=(256)
else
  LENS=(4096 8192 16384 32768 65536); BF16_LENS=(4096 16384)
  if [[ ! -d $RW ]]; then
    step write-checkpoint 200 python3 scripts/realwidth/write_checkpoint.py "$RW"
  fi
fi
GEMMA=models:gemma3-270m
[[ -d ${PHASELENS_MODELS:-$HOME/.cache/phaselens/models}/gemma3-270m ]] || GEMMA=""

# sweep NAME MODEL DTYPE LENGTHS...: one `bench forward` per length, growing while time allows.
sweep() {
  local name=$1 model=$2 dtype=$3; shift 3
  [[ -z $model || ( ! -d $model && $model != models:* ) ]] && {
    printf '{"step":"%s","status":"skipped (no model %s)","seconds":0}\n' "$name" "$model" >> "$STEPS"
    return 0
  }
  local t
  for t in "$@"; do
    local last=(); (( t >= 16384 )) && last=(--last-logits)
    local t0; t0=$(date +%s)
    step "$name-$t" 240 "$BIN" bench forward --model "$model" --device "$DEVICE" --dtype "$dtype" \
      --tokens "$t" --reps 1 "${last[@]}" --json "$OUT/$name-$t.json" || return 0
    (( 4 * ($(date +%s) - t0) > $(left) )) && { echo "gpu-check: $name stops at $t tokens (time)" >&2; return 0; }
  done
}
sweep forward-realwidth "$RW" f32 "${LENS[@]}"
sweep forward-gemma3 "$GEMMA" f32 "${LENS[@]}"
sweep bf16-realwidth "$RW" bf16 "${BF16_LENS[@]}"
sweep bf16-gemma3 "$GEMMA" bf16 "${BF16_LENS[@]}"

# The report: one JSON and one markdown table.
python3 scripts/bench/gpu_check_report.py "$OUT" "$BACKEND" "$DEVICE" "$(( $(date +%s) - START ))"
