#!/usr/bin/env python3
"""Reference dequantisation of GGUF tensors for phaselens' reader (src/model/gguf/).

Pinned: gguf==0.19.0 (its `gguf.quants.dequantize`, a numpy port of ggml's
`dequantize_row_*`) and numpy. Run from the repository root, after
`bash scripts/fetch-models.sh`:

    pip install gguf==0.19.0 numpy
    python3 scripts/reference/gguf_dequant.py

writes tests/fixtures/pretrained/gguf-dequant.json:
- `models`: for each of the two cached models (tests/it/common/pretrained.rs), every tensor
  in file order: name, ggml type name, shape (row-major, GGUF's dims reversed), the SHA-256
  of its dequantised values as little-endian f32 bytes, and the first 8 values (debugging);
  plus a few metadata values the tests spot-check.
- `blocks`: for each block type the package dequantises and phaselens supports, two blocks
  (32 values for F16 / BF16) of seeded random bytes (their f16 scales forced finite) with the SHA-256 and all values
  of their dequantisation and its first 8 values, so tests/it/gguf.rs checks every block format without the models.

Deterministic: the same files and package versions give the same JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from importlib.metadata import version

assert version("gguf") == "0.19.0", f"gguf {version('gguf')}: the fixture pins 0.19.0"

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "pretrained" / "gguf-dequant.json"
MODELS = {
    "smollm2": "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma3-270m/gemma-3-270m-q4_k_m.gguf",
}
META_KEYS = [
    "general.architecture",
    "{arch}.block_count",
    "{arch}.attention.head_count",
    "{arch}.attention.head_count_kv",
    "{arch}.embedding_length",
    "{arch}.context_length",
    "general.alignment",
]
# The byte offsets of each block type's f16 scales (d, dmin, m), forced finite below so
# that NaN payloads never decide a comparison.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def models_dir() -> Path:
    if "PHASELENS_MODELS" in os.environ:
        return Path(os.environ["PHASELENS_MODELS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "phaselens" / "models"


def values_of(data: np.ndarray, qtype: T) -> np.ndarray:
    v = np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32)
    return v.reshape(-1).astype("<f4", copy=False)


def tensor_entry(t) -> dict:
    v = values_of(t.data, t.tensor_type)
    return {
        "name": t.name,
        "type": t.tensor_type.name,
        "shape": [int(d) for d in reversed(t.shape.tolist())],
        "sha256": hashlib.sha256(v.tobytes()).hexdigest(),
        "first": [float(x) for x in v[:8]],
    }


def meta_value(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    if f is None:
        return None
    v = f.contents()
    return v


def model_entry(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    arch = meta_value(reader, "general.architecture")
    meta = {}
    for k in META_KEYS:
        key = k.format(arch=arch)
        v = meta_value(reader, key)
        if v is not None:
            meta[key] = v
    tensors = []
    for t in reader.tensors:
        tensors.append(tensor_entry(t))
        print(f"  {t.name:40s} {t.tensor_type.name:6s} {tensors[-1]['sha256'][:12]}", file=sys.stderr)
    return {"file": path.name, "n_tensors": len(tensors), "metadata": meta, "tensors": tensors}


def block_entry(qtype: T, rng: np.random.Generator) -> dict:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = 2 if block > 1 else 32
    raw = rng.integers(0, 256, size=n_blocks * size, dtype=np.uint8)
    for b in range(n_blocks):
        for off in F16_FIELDS.get(qtype, []):
            # |scale| < 2, sign random: exponent field at most 15 (bias 15)
            raw[b * size + off + 1] &= 0xBF
    if qtype in (T.F16, T.BF16):
        raw[1::2] &= 0xBF  # every value finite (high byte of each little-endian u16)
    v = values_of(raw.reshape(1, -1).copy(), qtype)
    assert v.size == n_blocks * block
    return {
        "type": qtype.name,
        "bytes": raw.tobytes().hex(),
        "sha256": hashlib.sha256(v.tobytes()).hexdigest(),
        "first": [float(x) for x in v[:8]],
    }


def dump(out: dict) -> str:
    """JSON with one tensor or block per line (small, and diffs read per tensor)."""
    line = lambda x: json.dumps(x, separators=(",", ":"))  # noqa: E731
    models = []
    for key, m in out["models"].items():
        head = {k: v for k, v in m.items() if k != "tensors"}
        rows = ",\n".join("    " + line(t) for t in m["tensors"])
        models.append(f'  {json.dumps(key)}: {line(head)[:-1]},"tensors":[\n{rows}\n  ]}}')
    blocks = ",\n".join("  " + line(b) for b in out["blocks"])
    head = ",\n".join(f" {json.dumps(k)}: {json.dumps(out[k])}" for k in ("generator", "gguf"))
    return f'{{\n{head},\n "models": {{\n' + ",\n".join(models) + f'\n }},\n "blocks": [\n{blocks}\n ]\n}}\n'


def main() -> None:
    out: dict = {
        "generator": "scripts/reference/gguf_dequant.py",
        "gguf": "0.19.0",
        "models": {},
        "blocks": [],
    }
    for key, rel in MODELS.items():
        path = models_dir() / rel
        print(f"{key}: {path}", file=sys.stderr)
        out["models"][key] = model_entry(path)
    rng = np.random.default_rng(20261205)
    for qtype in [T.F16, T.BF16, *F16_FIELDS]:
        out["blocks"].append(block_entry(qtype, rng))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(dump(out))
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
