#!/usr/bin/env python3
"""Write a random DeepSeek-V4 release checkpoint at V4-Flash's width for the full-size
real-width parity and speed runs (issue 22; docs/models.md, "Real width, full size").

The configuration is the one of `deepseek_v4_memory::REALWIDTH` (hidden 4096, 64 heads x
512 with 64 rope dims, q_lora 1024, o_groups 8 x 1024, indexer 64 x 128 with index_topk
512, window 128, CSA rate 4 / HCA rate 128, hc_mult 4, the real vocabulary 129280, 3
layers sliding / CSA / HCA, the first hash-routed, 8 FP4 routed experts of width 2048,
top 2, swiglu_limit 10). Unlike the Rust writer there (random bytes, for measuring memory
only), the values here have the scales of the parity fixtures' `randomise`
(tests/fixtures/deepseek_v4/generate.py: linear weights N(0, 1/in), norms N(1, 0.25^2),
...), so a forward computes something sensible, and they are quantised the same way:
FP8 e4m3 + ue8m0 128 x 128 block scales (with the fixtures' x1/x4 checkerboard) for the
attention and shared-expert matrices, FP4 e2m1 + ue8m0 per 32 columns (x1/x4/x16 between
neighbouring groups) for the routed experts, BF16 for the embedding, head, router and
compressors, F32 for norms / mHC / biases, I32 for the hash table. DeepSeek's release
naming, one shard for the embedding / head / final norms and one per layer.

Deterministic: one torch.Generator seeded with --seed, one thread; the same seed gives
identical files with torch 2.9.0 (tests/fixtures/deepseek_v4/requirements.txt).

    python scripts/realwidth/write_checkpoint.py DIR [--experts 8] [--seed 22022] [--width real|mid]

`--width mid` writes the same design at d_model 1024 (MIDWIDTH: 16 heads x 256, q_lora
512, 4 output groups of rank 256, indexer 16 x 128 keeping 128, experts of width 512) for
the cost table's middle column.

About 2.7 GiB on disk; peak memory about 4 GiB (the f32 embedding while it is made).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/fixtures/deepseek_v4"))
import generate as g  # noqa: E402  (the fixtures' naming, storage classes and FP4 quantiser)

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

REALWIDTH = dict(
    g.ORIGINAL_CONFIG,
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=3,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    n_routed_experts=8,
    num_experts_per_tok=2,
    swiglu_limit=10.0,
    num_hash_layers=1,
    compress_ratios=[0, 4, 128, 0],
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    expert_dtype="fp4",
)

# A mid width for the cost table (docs/performance.md, "Cost as the length grows"): a
# quarter of V4-Flash's d_model, the same layer pattern, rates, window, hc_mult, vocabulary
# and quantisation (every FP8 matrix side still a multiple of 128).
MIDWIDTH = dict(
    REALWIDTH,
    hidden_size=1024,
    moe_intermediate_size=512,
    num_attention_heads=16,
    head_dim=256,
    q_lora_rank=512,
    o_groups=4,
    o_lora_rank=256,
    index_n_heads=16,
    index_topk=128,
)

WIDTHS = {"real": REALWIDTH, "mid": MIDWIDTH}


def quantize_fp8_blocks(w: torch.Tensor):
    """generate.quantize_fp8_ue8m0 (the same rule: scale 2^ceil(log2(amax / 448)) per 128 x
    128 block, values / scale clamped to +-448, round to e4m3), vectorised for matrices whose
    sides are multiples of 128 (every FP8 matrix at this width)."""
    rows, cols = w.shape
    br, bc = g.BLOCK
    assert rows % br == 0 and cols % bc == 0, (rows, cols)
    blk = w.float().reshape(rows // br, br, cols // bc, bc)
    amax = blk.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    s = torch.pow(2.0, torch.ceil(torch.log2(amax / g.FP8_MAX)))
    q = (blk / s[:, None, :, None]).clamp(-g.FP8_MAX, g.FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols).contiguous(), s.to(torch.float8_e8m0fnu)


def value(name: str, shape, gen: torch.Generator, cfg) -> torch.Tensor:
    """A random tensor for the transformers parameter / buffer `name`, with the scales of
    generate.randomise (drawn in float32 directly: the embedding alone is 0.5G values)."""
    leaf = name.rsplit(".", 1)[-1]

    def normal(std=1.0, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std).add_(mean)

    if name.endswith("tid2eid"):
        vocab, k = shape
        order = torch.rand((vocab, cfg.n_routed_experts), generator=gen).argsort(-1)
        return order[:, :k].to(torch.int32).contiguous()
    if name.endswith("e_score_correction_bias"):
        return normal(0.2)
    if name.endswith("norm.weight") or "layernorm" in name:
        return normal(0.25, 1.0)
    if leaf in ("sinks", "position_bias"):
        return normal(1.0)
    if leaf in ("fn", "hc_fn"):
        return normal(1.0 / math.sqrt(shape[1]))
    if leaf in ("base", "hc_base"):
        return normal(0.5)
    if leaf in ("scale", "hc_scale"):
        return torch.rand(shape, generator=gen, dtype=torch.float32).add_(0.5)
    if leaf in ("gate_up_proj", "down_proj"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if len(shape) == 2:
        return normal(1.0 / math.sqrt(shape[1]))
    raise RuntimeError(f"no randomisation rule for {name} {tuple(shape)}")


def store(release: str, v: torch.Tensor, out: dict, counts: dict) -> None:
    """Quantise one release tensor into `out` (weight and, when quantised, its .scale)."""
    c = g.storage_class(release, v)
    if c == "fp8" and ".ffn.experts." in release:
        c = "fp4"
    counts[c] = counts.get(c, 0) + 1
    base = release[: -len(".weight")]
    if c == "fp4":
        grp = 4.0 ** (torch.arange(v.shape[1]) // g.FP4_GROUP % 3).float()
        out[release], out[base + ".scale"] = g.quantize_fp4_ue8m0(v * grp)
    elif c == "fp8":
        out[release], out[base + ".scale"] = quantize_fp8_blocks(v * g.checkerboard(v.shape))
    elif c == "bf16":
        out[release] = v.to(torch.bfloat16).contiguous()
    else:
        out[release] = v.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per layer (default 8)")
    ap.add_argument("--seed", type=int, default=22022)
    ap.add_argument(
        "--width", choices=sorted(WIDTHS), default="real",
        help="real: V4-Flash's width (default); mid: d_model 1024 (see MIDWIDTH)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    config = dict(WIDTHS[a.width], n_routed_experts=a.experts)
    drop = ("quantization_config", "architectures", "model_type", "expert_dtype")
    cfg = DeepseekV4Config(**{k: v for k, v in config.items() if k not in drop})
    with torch.device("meta"):
        meta = DeepseekV4ForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items() if "rotary_emb" not in k}
    del meta
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(a.seed)
    n_shards = cfg.num_hidden_layers + 1

    def shard_of(name: str) -> int:
        return int(name.split(".")[2]) + 1 if name.startswith("model.layers.") else 0

    weight_map, counts, total = {}, {}, 0
    t0 = time.time()
    for shard in range(n_shards):
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if shard_of(name) != shard:
                continue
            v = value(name, shape, gen, cfg)
            for release, rv in g.to_release_names({name: v}, cfg).items():
                store(release, rv, tensors, counts)
            del v
        file = f"model-{shard + 1:05}-of-{n_shards:05}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({k: file for k in tensors})
        print(f"[{time.time() - t0:6.1f} s] {file}: {len(tensors)} tensors", flush=True)
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n"
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "WRITER.json").write_text(
        json.dumps(
            {
                "writer": "scripts/realwidth/write_checkpoint.py",
                "seed": a.seed,
                "experts": a.experts,
                "width": a.width,
                "torch": torch.__version__,
                "tensors_by_storage": counts,
                "stored_bytes": total,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}: {total / 2**30:.2f} GiB stored, tensors by storage {counts}")


if __name__ == "__main__":
    main()
