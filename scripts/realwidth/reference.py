#!/usr/bin/env python3
"""transformers reference for the full-size real-width parity (issue 22; docs/models.md,
"Real width, full size"): loads a release checkpoint (scripts/realwidth/write_checkpoint.py)
with transformers' OWN FP8 / FP4 dequantisation (`FineGrainedFP8Config(dequantize=True)`),
runs one f32 eager forward of --tokens random token ids on the CPU and writes
DIR/reference-T.safetensors + DIR/reference-T.json: the input ids, the logits (of every
--logit-stride-th position and the last one), the final norm at every position, per CSA
layer the indexer scores [1, T, T/4] and its top-k, per MoE layer the chosen experts, and
how many deciding queries have their top-k boundary within float32 rounding.

The forward is transformers 5.24's, with two changes that only split work, not change it:
the eager attention runs over --query-chunk queries at a time (it would otherwise build
[64, T, T + T/4] float32 scores, their masked copy and their softmax at once: 3 x 5.4 GB at
4096 tokens), and so does the indexer's scorer ([T, 64, T/4] per call). Every query row
is the same arithmetic as in the unchunked call. As in the parity fixtures, torch.topk
keeps the lower index among equal scores (generate.tie_stable_topk).

    python scripts/realwidth/reference.py --model DIR --tokens 4096 [--logit-stride 1]
        [--query-chunk 256] [--threads 2] [--seed 4096]

Then `PHASELENS_REALWIDTH_REF=DIR/reference-4096.safetensors cargo nextest run
--run-ignored only -E 'test(realwidth_full)'` compares phaselens with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/fixtures/deepseek_v4"))
import generate as g  # noqa: E402
import spec_oracle  # noqa: E402

import transformers  # noqa: E402
from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod  # noqa: E402


def peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return -1.0


def chunk_queries(chunk: int) -> None:
    """Make the eager attention and the indexer scorer run `chunk` queries at a time."""
    eager = mod.eager_attention_forward

    def eager_chunked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        outs = []
        for a in range(0, query.shape[-2], chunk):
            b = min(a + chunk, query.shape[-2])
            m = attention_mask[:, :, a:b] if attention_mask is not None else None
            o, _ = eager(module, query[:, :, a:b], key, value, m, scaling, dropout, **kw)
            outs.append(o)
        return torch.cat(outs, dim=1), None

    # DeepseekV4Attention looks the function up at call time (the "eager" default of
    # ALL_ATTENTION_FUNCTIONS.get_interface is this module global).
    mod.eager_attention_forward = eager_chunked
    scorer = mod.DeepseekV4IndexerScorer.forward

    def scorer_chunked(self, q, compressed_kv, hidden_states):
        return torch.cat(
            [
                scorer(self, q[:, a : a + chunk], compressed_kv, hidden_states[:, a : a + chunk])
                for a in range(0, q.shape[1], chunk)
            ],
            dim=1,
        )

    mod.DeepseekV4IndexerScorer.forward = scorer_chunked


def check_dequantisation(model_dir: Path, model) -> dict:
    """transformers' dequantised parameters against the documented rules
    (generate.dequantize_fp8 / dequantize_fp4) for every FP8 and FP4 tensor of the files."""
    sd = model.state_dict()
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = model.config
    rel_to_tf = {}
    for tf_name in sd:
        if "rotary_emb" in tf_name:
            continue
        for rel in g.to_release_names({tf_name: sd[tf_name]}, cfg):
            rel_to_tf[rel] = tf_name
    inter = cfg.moe_intermediate_size
    checked, bad = 0, []
    for file in sorted(set(index.values())):
        with safe_open(str(model_dir / file), framework="pt") as f:
            for k in f.keys():
                if not k.endswith(".scale"):
                    continue
                w = k[: -len(".scale")] + ".weight"
                q, s = f.get_tensor(w), f.get_tensor(k)
                want = g.dequantize_fp4(q, s) if q.dtype == torch.int8 else g.dequantize_fp8(q, s)
                tf = sd[rel_to_tf[w]]
                if ".ffn.experts." in w:
                    e, leaf = int(w.split(".")[4]), w.split(".")[5]
                    tf = {"w1": tf[e, :inter], "w3": tf[e, inter:], "w2": tf[e]}[leaf]
                checked += 1
                if not torch.equal(tf.float(), want):
                    bad.append(w)
    return {"checked": checked, "differ": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--logit-stride", type=int, default=1)
    ap.add_argument("--query-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=4096)
    a = ap.parse_args()
    model_dir = Path(a.model)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    chunk_queries(a.query_chunk)
    t0 = time.time()
    model = DeepseekV4ForCausalLM.from_pretrained(
        model_dir,
        attn_implementation="eager",
        experts_implementation="eager",
        quantization_config=FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0"),
        dtype=torch.float32,
    ).eval()
    t_load = time.time() - t0
    cfg = model.config
    deq = check_dequantisation(model_dir, model)
    print(f"loaded in {t_load:.0f} s; dequantisation vs the documented rules: {deq['checked']} tensors, "
          f"{len(deq['differ'])} differ; peak RSS {peak_rss_gib():.2f} GiB", flush=True)
    gen = torch.Generator().manual_seed(a.seed)
    ids = g.draw_inputs(gen, 1, a.tokens, cfg.vocab_size)
    T = a.tokens
    rows = sorted(set(range(0, T, a.logit_stride)) | {T - 1})
    cap: dict[str, torch.Tensor] = {}
    hooks = []

    def put(name):
        def f(m, inp, o):
            cap[name] = o.detach().clone().contiguous()

        return f

    csa = [i for i, t in enumerate(cfg.layer_types) if t == g.CSA]
    for i, layer in enumerate(model.model.layers):
        idx = layer.self_attn.compressor.indexer if i in csa else None
        if idx is not None:
            hooks.append(idx.scorer.register_forward_hook(put(f"layers.{i}.indexer.scores")))
            hooks.append(idx.register_forward_hook(put(f"layers.{i}.indexer.topk_indices")))

        def gate_hook(m, inp, o, i=i):
            logits, _, chosen = o
            cap[f"layers.{i}.router.logits"] = logits.detach().clone()
            cap[f"layers.{i}.router.indices"] = chosen.sort(-1).values.contiguous()

        hooks.append(layer.mlp.gate.register_forward_hook(gate_hook))
    hooks.append(model.model.norm.register_forward_hook(put("final.norm")))
    t0 = time.time()
    with torch.no_grad(), g.tie_stable_topk():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=torch.tensor(rows)).logits
    t_fwd = time.time() - t0
    for h in hooks:
        h.remove()
    nb = g.near_boundary(cap, cfg)
    worst_router = math.inf
    for i in range(cfg.num_hidden_layers):
        if cfg.mlp_layer_types[i] != "moe":
            continue
        scores = spec_oracle.score_fn(cfg.scoring_func, cap[f"layers.{i}.router.logits"].double())
        biased = scores + model.model.layers[i].mlp.gate.e_score_correction_bias.double()
        srt = biased.sort(-1, descending=True).values
        k = cfg.num_experts_per_tok
        gap = (srt[:, k - 1] - srt[:, k]) / srt.abs().max(-1).values.clamp_min(1e-6)
        worst_router = min(worst_router, gap.min().item())
    keep = {
        "input_ids": ids,
        "logits": logits.contiguous(),
        "logit_rows": torch.tensor(rows, dtype=torch.int64),
        "final.norm": cap["final.norm"],
    }
    for k, v in cap.items():
        if k.endswith(("indexer.scores", "indexer.topk_indices", "router.indices")):
            keep[k] = v
    out = model_dir / f"reference-{T}.safetensors"
    save_file(keep, str(out), metadata={"format": "pt"})
    meta = {
        "what": "full-size real-width parity reference (issue 22): compare phaselens' logits with these under "
        "this reference's indexer selection (layers.N.indexer.topk_indices forced through hook_selected)",
        "generator": "scripts/realwidth/reference.py",
        "reference": f"transformers {transformers.__version__} DeepseekV4ForCausalLM.from_pretrained(dequantize=True), "
        f"torch {torch.__version__}, CPU, float32, eager; attention and indexer scorer over {a.query_chunk} "
        "queries at a time; tie-stable top-k",
        "seq_len": T,
        "seed": a.seed,
        "threads": a.threads,
        "logit_stride": a.logit_stride,
        "layer_types": cfg.layer_types,
        "mlp_layer_types": cfg.mlp_layer_types,
        "near_boundary": nb,
        "near_boundary_rule": "a deciding query (more closed entries than index_topk) is within rounding when its "
        "k-th and (k+1)-th largest closed index scores differ by <= 1e-6 * max|score of the row|",
        "smallest_relative_router_gap": worst_router,
        "dequantisation_check": deq,
        "load_s": round(t_load, 1),
        "forward_s": round(t_fwd, 1),
        "peak_rss_gib": round(peak_rss_gib(), 2),
        "loadavg_at_end": os.getloadavg(),
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps({k: meta[k] for k in ("near_boundary", "smallest_relative_router_gap", "forward_s", "peak_rss_gib")}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
