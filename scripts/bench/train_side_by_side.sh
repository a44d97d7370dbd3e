#!/usr/bin/env bash
# `phaselens bench train` (flex and tch-cpu) next to the PyTorch eager reference
# (scripts/bench/train_ref.py) on the same weights, batches and optimiser steps, in one
# session, alternating (ROUNDS rounds of flex, tch-cpu, PyTorch) so that load changes on
# a shared machine hit all three alike. Prints a Markdown table (median steps/s over the
# rounds, tokens/s, peak RSS, ratio to PyTorch) and writes every measurement to OUT.
#
#   scripts/bench/train_side_by_side.sh [OUT] [STEPS] [WARMUP] [ROUNDS] [RECIPE...]
#
# Defaults: OUT runs/bench-train, 10 timed steps after 2 warm-up, 3 rounds, recipes
# experiments/organisms/kvc-w8s8.toml and full-attn.toml. Threads: $THREADS (default 2)
# for all three (RAYON_NUM_THREADS, OMP_NUM_THREADS, torch.set_num_threads), with
# OMP_WAIT_POLICY=PASSIVE. Needs the phaselens binary built with --features all-backends
# ($PHASELENS_BIN, default target/debug/phaselens) and python3 with torch 2.9.0 ($PYTHON).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/bench-train}
steps=${2:-10}
warmup=${3:-2}
rounds=${4:-3}
shift $(( $# < 4 ? $# : 4 ))
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(experiments/organisms/kvc-w8s8.toml experiments/organisms/full-attn.toml)
bin=${PHASELENS_BIN:-${CARGO_TARGET_DIR:-target}/debug/phaselens}
py=${PYTHON:-python3}
threads=${THREADS:-2}
export RAYON_NUM_THREADS=$threads OMP_NUM_THREADS=$threads OMP_WAIT_POLICY=PASSIVE
mkdir -p "$out"
echo "start: $(date -u +%FT%TZ), uptime: $(uptime)"
for recipe in "${recipes[@]}"; do
  name=$(basename "$recipe" .toml)
  exp="$out/$name-export"
  "$bin" bench train "$recipe" --steps "$steps" --warmup "$warmup" --export "$exp" >/dev/null
  for r in $(seq 1 "$rounds"); do
    "$bin" bench train "$recipe" --steps "$steps" --warmup "$warmup" \
      --json "$out/$name-flex-$r.json" | sed -n 2p | sed "s/^/$name flex r$r:/"
    "$bin" bench train "$recipe" --device tch-cpu --steps "$steps" --warmup "$warmup" \
      --json "$out/$name-tch-$r.json" | sed -n 2p | sed "s/^/$name tch-cpu r$r:/"
    "$py" scripts/bench/train_ref.py "$exp" --threads "$threads" \
      --json "$out/$name-torch-$r.json" | sed -n 3p | sed "s/^/$name torch r$r:/"
  done
done
# Forward tokens/s (the trained organism's model, the training batch shape) and patching
# cells/s on each phaselens backend; PATCHING=none skips the patching bench.
patching=${PATCHING:-experiments/v4pro.toml}
for dev in cpu tch-cpu; do
  for recipe in "${recipes[@]}"; do
    name=$(basename "$recipe" .toml)
    seq_len=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['seq_len'])" "$out/$name-flex-1.json")
    "$bin" bench forward --model "${recipe%.toml}" --tokens "$seq_len" --batch 32 --reps 5 \
      --device "$dev" --json "$out/$name-forward-$dev.json" | tail -1 | sed "s/^/$name forward $dev: /"
  done
  if [ "$patching" != none ]; then
    "$bin" bench patching "$patching" --device "$dev" | tee "$out/patching-$dev.txt" | grep -i "runner"
  fi
done
echo "end: $(date -u +%FT%TZ), uptime: $(uptime)"
"$py" - "$out" "$rounds" "${recipes[@]}" <<'PY'
import json, os, statistics, sys
out, rounds, recipes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(name, who):
    rows = []
    for r in range(1, rounds + 1):
        p = os.path.join(out, f"{name}-{who}-{r}.json")
        if os.path.exists(p):
            rows.append(json.load(open(p)))
    return rows
print("\n| recipe | backend | steps/s (median; range) | tokens/s | ms/step: fwd / bwd / optim | peak RSS MiB | steps/s ratio to PyTorch |")
print("|---|---|---|---|---|---|---|")
for recipe in recipes:
    name = os.path.basename(recipe)[:-5]
    ref = load(name, "torch")
    ref_sps = statistics.median(r["steps_per_second"] for r in ref) if ref else None
    for who, label in [("flex", "phaselens flex"), ("tch", "phaselens tch-cpu"), ("torch", "PyTorch 2.9.0 eager")]:
        rows = load(name, who)
        if not rows:
            continue
        sps = [r["steps_per_second"] for r in rows]
        med = statistics.median(sps)
        mid = sorted(rows, key=lambda r: r["steps_per_second"])[len(rows) // 2]
        ph = mid["phases"]
        rss = mid.get("peak_rss_bytes")
        rss = f"{rss / 2**20:.0f}" if rss else "n/a"
        ratio = f"{med / ref_sps:.2f}x" if ref_sps else "-"
        print(f"| {name} | {label} | {med:.2f} ({min(sps):.2f}-{max(sps):.2f}) | "
              f"{med * mid['batch_size'] * mid['seq_len']:.0f} | "
              f"{1e3 * ph['forward']:.0f} / {1e3 * ph['backward']:.0f} / {1e3 * ph['optimizer']:.0f} | "
              f"{rss} | {ratio} |")
    if ref:
        fwd = statistics.median(r["forward_tokens_per_second"] for r in ref)
        print(f"| {name} | PyTorch inference forward | {fwd:.0f} tokens/s | | | | |")
    for dev in ["cpu", "tch-cpu"]:
        p = os.path.join(out, f"{name}-forward-{dev}.json")
        if os.path.exists(p):
            f = json.load(open(p))[0]
            print(f"| {name} | phaselens {dev} inference forward | {f['tokens_per_second']:.0f} tokens/s | | | | |")
    if ref:
        print(f"| {name} | loss check | PyTorch vs phaselens: max abs diff {max(r['loss_abs_diff_first3'] for r in ref):.1e} "
              f"(steps 0-2), {max(r['loss_abs_diff_max'] for r in ref):.1e} (all); logits {max(r['logits_max_abs_diff'] for r in ref):.1e} | | | | |")
for dev in ["cpu", "tch-cpu"]:
    p = os.path.join(out, f"patching-{dev}.txt")
    if os.path.exists(p):
        line = next((l for l in open(p) if l.startswith("runner")), "").strip()
        print(f"\npatching on {dev}: {line}")
PY
