#!/usr/bin/env bash
# Full-size real-width parity (issue 22; docs/models.md, "Parity" / full size): writes the
# random V4-Flash-width release checkpoint (scripts/realwidth/write_checkpoint.py) unless
# DIR already holds one, the transformers reference at each length
# (scripts/realwidth/reference.py; skipped when DIR/reference-T.safetensors exists), then
# runs the opt-in test deepseek_v4_realwidth::realwidth_full_* on each, which prints and
# writes DIR/reference-T.phaselens.json. One heavy process at a time.
#
#   scripts/realwidth/parity.sh DIR 4096[,8192] [LOGIT_STRIDE]
#
# Memory: the reference holds the weights as f32 (7.8 GiB) and peaks at ~12 GiB while
# loading; phaselens keeps them as stored (2.7 GiB). Needs python with torch 2.9.0 +
# transformers 5.24.0 ($PYTHON; tests/fixtures/deepseek_v4/requirements.txt) and cargo.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:?usage: $0 DIR LENGTHS [LOGIT_STRIDE]}
lengths=${2:?lengths, e.g. 4096,8192}
stride=${3:-1}
py=${PYTHON:-python3}
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -f "$dir/model.safetensors.index.json" ]; then
  "$py" scripts/realwidth/write_checkpoint.py "$dir"
fi
for t in ${lengths//,/ }; do
  if [ ! -f "$dir/reference-$t.safetensors" ]; then
    "$py" scripts/realwidth/reference.py --model "$dir" --tokens "$t" --logit-stride "$stride"
  fi
  PHASELENS_REALWIDTH_REF="$dir/reference-$t.safetensors" \
    cargo nextest run --features all-backends --run-ignored only --no-capture \
    -E 'test(realwidth_full_matches_transformers_under_the_same_indexer_selection)'
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
