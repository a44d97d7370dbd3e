#!/usr/bin/env bash
# Screenshots of the shipped experiments' viewers (docs/img/view-*.png, linked from the
# README and docs/view.md): `phaselens view` each (capturing its exemplar table from the
# model when missing), then headless Chromium on index.html#demo (worst phase -> its
# strongest head -> its prompt and compressed entry). Usage: bash scripts/view-screenshots.sh [BIN]
set -euo pipefail
bin=${1:-${CARGO_TARGET_DIR:-target}/debug/phaselens}
shots=docs/img
for name in v4pro w8s8-ablate w8s8-knockout w8s8-patch w8s8-retrieval v4pro-retrieval v4pro-indexer; do
  [ -d "notebooks-data/$name" ] || continue
  "$bin" view "$name"
  chromium --headless --disable-gpu --no-sandbox --hide-scrollbars --virtual-time-budget=5000 \
    --window-size=1400,2400 --screenshot="$shots/view-$name.png" \
    "file://$PWD/reports/$name/view/index.html#demo" 2>/dev/null
done
"$bin" view --grid paper
chromium --headless --disable-gpu --no-sandbox --hide-scrollbars --virtual-time-budget=5000 \
  --window-size=1400,1400 --screenshot="$shots/view-grid-paper.png" \
  "file://$PWD/reports/grids/paper/view/index.html" 2>/dev/null
ls -la "$shots"/view-*.png
