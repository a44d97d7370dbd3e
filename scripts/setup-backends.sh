#!/usr/bin/env bash
# Idempotent: what the `tch` and `wgpu` backends need on a fresh Debian machine.
# - wgpu: Mesa's Vulkan drivers (lavapipe, a software Vulkan on the CPU) + the loader.
# - tch: PyTorch 2.9.0 (tch 0.22's LibTorch) for the python3 on PATH; torch-sys links
#   against its lib/ folder (LIBTORCH_USE_PYTORCH=1, set by the justfile) and build.rs
#   puts that folder on the binaries' rpath. The CPU-only wheel (download.pytorch.org)
#   is tried first; where that index cannot be reached, PyPI's default (CUDA) wheel,
#   which runs on the CPU as well.
set -euo pipefail
need_apt=()
[ -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] || [ -e /usr/share/vulkan/icd.d/lvp_icd.json ] \
  || ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || need_apt+=(mesa-vulkan-drivers)
ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1' || need_apt+=(libvulkan1)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "setup-backends: not root: install ${need_apt[*]} yourself (wgpu needs a Vulkan driver)" >&2
  fi
fi
have_torch() {
  python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.9.0") else 1)' 2>/dev/null
}
if ! have_torch; then
  python3 -m pip install -q --timeout 20 --retries 0 torch==2.9.0 --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
    || python3 -m pip install -q torch==2.9.0
fi
have_torch || { echo "setup-backends: torch 2.9.0 is not importable by python3 after installing it" >&2; exit 1; }
echo "setup-backends: ok (torch $(python3 -c 'import torch; print(torch.__version__)'), vulkan: $(ls /usr/share/vulkan/icd.d/ 2>/dev/null | tr '\n' ' '))"
