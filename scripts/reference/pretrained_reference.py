#!/usr/bin/env python3
"""transformers' reference outputs for the two pretrained GGUF models, and tiny Hugging Face
checkpoints, for phaselens' pretrained-model tests (tests/fixtures/pretrained/).

Pinned: torch==2.9.0 transformers==5.25.0 gguf==0.19.0 (plus accelerate, which
transformers requires to load a GGUF file; 1.16.0 was used, it does not touch the numbers),
safetensors (0.8.0 used), numpy, CPython 3.11 (the input text is made from its standard
library's docstrings, see `corpus()`; the token ids are stored in the fixtures, so a Rust test
never re-derives them). Run from the repository root, after `bash scripts/fetch-models.sh`:

    pip install torch==2.9.0 transformers==5.25.0 gguf==0.19.0 accelerate safetensors
    nice -n 10 python3 scripts/reference/pretrained_reference.py            # everything
    python3 scripts/reference/pretrained_reference.py --only tiny           # tiny checkpoints only

Models are read from $PHASELENS_MODELS (default ${XDG_CACHE_HOME:-~/.cache}/phaselens/models)
and never copied into the repository. transformers loads each GGUF dequantised to f32
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32,
attn_implementation="eager")`), on the CPU, one thread.

Writes, under tests/fixtures/pretrained/ (tests/fixtures/pretrained/README.md describes every
tensor, shape and dtype):
- `<m>-config.json` (m in smollm2, gemma3): `model.config.to_dict()` as transformers resolved
  it, plus `_phaselens_notes`: how transformers' GGUF loader transformed the tensors;
- `logits-<m>.safetensors`: ids, logits at 256 fixed vocabulary columns, full-vocabulary
  argmax / top-1-minus-top-2 gap / max |logit| for inputs of 16, 512 and 2048 tokens;
- `hooks-<m>.safetensors`: activations at 16 tokens under TransformerLens hook names;
- `interventions-<m>.safetensors`: a head ablation and a head-output patch at 16 tokens;
- `generate-<m>.json`: greedy `model.generate` continuations (64 new tokens) of 5 prompts;
- `tiny-{llama,qwen3,qwen2,gemma3}/`: `save_pretrained` checkpoints of seeded random models
  (`config.json`, `model.safetensors`) and `reference.safetensors` (ids, logits, patterns).

Deterministic: seeded generators only, one CPU thread, `torch.use_deterministic_algorithms`;
the same files and versions give the same numbers (the safetensors/JSON are byte-identical
on the same machine; another CPU's BLAS may differ in the last bits of the float outputs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

from safetensors.torch import save_file  # noqa: E402

PINNED = {"torch": "2.9.0", "transformers": "5.25.0", "gguf": "0.19.0"}
for _pkg, _want in PINNED.items():
    _got = version(_pkg)
    assert _got.split("+")[0] == _want, f"{_pkg} {_got}: pinned {_want}"

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "pretrained"
MODELS = Path(
    os.environ.get("PHASELENS_MODELS")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "phaselens" / "models"
)
GGUF = {
    "smollm2": ("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
}
LENGTHS = (16, 512, 2048)
NCOLS = 256
COLS_SEED = 1234
# Intervention sites (item 4 of the brief); positions are 0-based token positions.
ABLATE_LAYER, ABLATE_HEAD = 2, 1
PATCH_LAYER, PATCH_HEAD, PATCH_POS = 3, 2, 10
SWAP_POSITIONS = (4, 5, 6, 7)  # ids_b = ids_16 with these positions replaced
GEN_NEW = 64

VERSIONS = {
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "gguf": version("gguf"),
    "safetensors": version("safetensors"),
    "accelerate": version("accelerate"),
    "numpy": np.__version__,
}


def meta(model: str) -> dict[str, str]:
    """safetensors metadata: ONE key (the writer serialises a hash map, so several keys come
    out in a random order and the file would not be byte-identical run to run)."""
    return {"phaselens": json.dumps({"model": model, **VERSIONS}, sort_keys=True)}


# ---------------------------------------------------------------------------------------
# _phaselens_notes: read off transformers 5.25.0's GGUF loader
# (transformers/modeling_gguf_pytorch_utils.py, transformers/integrations/ggml.py) and
# checked numerically against the raw GGUF tensors by `check_loader_notes()` below.
# ---------------------------------------------------------------------------------------
COMMON_NOTES = [
    "Loader path: PreTrainedModel.from_pretrained(gguf_file=...) calls "
    "modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=True, "
    "model_to_load=model, torch_dtype=float32). For every tensor of the GGUF it does "
    "weights = gguf.dequantize(tensor.data, tensor.tensor_type) (gguf-py 0.19.0's numpy "
    "dequantisers, float32, shape = the GGUF shape reversed, i.e. [out, in] row-major as "
    "in PyTorch), then TENSOR_PROCESSORS.get(general.architecture, TensorProcessor)"
    "(config).process(weights, name), then renames blk.N.* -> model.layers.N.* with "
    "get_gguf_hf_weights_map() (gguf-py's get_tensor_name_map, inverted over the HF "
    "state_dict), then torch.from_numpy(np.copy(weights)).to(float32). No transpose, no "
    "scaling, no re-quantisation for these two architectures beyond what is listed below.",
    "tie_word_embeddings is set by load_gguf_checkpoint to True iff the file has no "
    "'output.weight' tensor (both files: no output.weight, so lm_head.weight IS "
    "model.embed_tokens.weight = dequantised token_embd.weight, Q8_0 in both files).",
    "Config: integrations/ggml.py GGUF_CONFIG_MAPPING renames the GGUF keys listed there; "
    "everything else (see the rest of this file) is the transformers config class's own "
    "default. GGUF_CONFIG_DEFAULTS_MAPPING has no entry for llama or gemma3.",
]
SMOLLM2_NOTES = COMMON_NOTES + [
    "(a) YES, Llama q/k weights are un-permuted. general.architecture='llama' selects "
    "LlamaTensorProcessor; its process() applies, only to names containing '.attn_q.' or "
    "'.attn_k.', LlamaTensorProcessor._reverse_permute_weights(weights, n_head, n_kv): "
    "attn_q with (num_attention_heads=9, 9), attn_k with (9, num_key_value_heads=3) -> "
    "n = 9 for q, n = 3 for k; dim = rows // n // 2 (= head_dim/2 = 32); "
    "w.reshape(n, dim, 2, cols).swapaxes(2, 1).reshape(rows, cols). Elementwise, with "
    "hd = head_dim = 64, h = head, s in {0,1}, i in [0, hd/2): "
    "W_hf[h*hd + s*hd/2 + i, :] = W_gguf[h*hd + 2*i + s, :]. This is the exact inverse of "
    "llama.cpp convert_hf_to_gguf.py LlamaModel.permute (reshape(n, 2, rows//n//2, ...)"
    ".swapaxes(1, 2)), so the HF model's q_proj/k_proj are in HF's rotate_half "
    "(first-half/second-half) RoPE layout, and HF applies RoPE as "
    "q*cos + rotate_half(q)*sin with rotate_half(x) = cat(-x[hd/2:], x[:hd/2]) "
    "(NEOX-style pairs (i, i+hd/2)). A Rust loader that reads the GGUF directly and applies "
    "GGML's normal (adjacent-pair (2i, 2i+1)) RoPE is equivalent; one that applies NEOX "
    "RoPE must apply this un-permutation first. The processor is skipped (weights returned "
    "unchanged) only if num_attention_heads or num_key_value_heads is missing from the "
    "config, which is not the case here.",
    "(b) No norm weight is changed for llama: attn_norm / ffn_norm / output_norm (F32 in "
    "the file) load as-is into LlamaRMSNorm.weight, applied as weight * x.to(input dtype) "
    "after x * rsqrt(mean(x^2) + eps) in f32.",
    "(c) Nothing else: attn_v, attn_output, ffn_gate/up/down, token_embd load unchanged "
    "(after dequantisation). head_dim comes from llama.rope.dimension_count (64); "
    "rope_theta from llama.rope.freq_base (100000.0); rms_norm_eps from "
    "llama.attention.layer_norm_rms_epsilon (stored as f32 9.999999747378752e-06, used "
    "as that double); no rope scaling (rope_type 'default').",
    "Tokenizer: tokenizer.ggml.add_bos_token is False in this file, so "
    "add_special_tokens=True adds NO BOS for SmolLM2 (ids start with the text's first "
    "token); the chat template comes from tokenizer.chat_template.",
]
GEMMA3_NOTES = COMMON_NOTES + [
    "(a) Not applicable: general.architecture='gemma3' selects Gemma2TensorProcessor "
    "(TENSOR_PROCESSORS['gemma3'] = Gemma2TensorProcessor), which does NOT un-permute "
    "q/k (llama.cpp's gemma3 converter does not permute them either); attn_q / attn_k load "
    "as-is and HF applies NEOX-style rotate_half RoPE (pairs (i, i+head_dim/2)).",
    "(b) YES, Gemma norm weights get 1 subtracted: Gemma2TensorProcessor.process() does "
    "`if \"norm.weight\" in name: weights = weights - 1` (substring match), which for this "
    "file hits every norm: blk.N.attn_norm, blk.N.post_attention_norm, blk.N.ffn_norm, "
    "blk.N.post_ffw_norm, blk.N.attn_q_norm, blk.N.attn_k_norm and output_norm (all F32 "
    "in the file). llama.cpp's converter stored (1 + w_hf); transformers recovers w_hf and "
    "Gemma3RMSNorm applies x_f32 * rsqrt(mean(x_f32^2) + eps) * (1.0 + weight_f32), "
    "cast back to the input dtype. So the GGUF value IS the effective multiplier; "
    "the f32 round trip (g - 1) + 1 may differ from g in the last bit.",
    "(c) Nothing else per tensor (no transposes, no scaling). Config: head_dim from "
    "gemma3.attention.key_length (256), rope_theta (-> rope_parameters['full_attention'] "
    "['rope_theta'] = 1e6) from gemma3.rope.freq_base, sliding_window from "
    "gemma3.attention.sliding_window (512). Everything else is Gemma3TextConfig's default: "
    "rope_parameters['sliding_attention']['rope_theta'] = 10000.0 (the old "
    "rope_local_base_freq), rope_type 'default' (no scaling) for both, "
    "query_pre_attn_scalar = 256 (attention scale = 256**-0.5), layer_types = "
    "sliding x5 then full, repeating (_sliding_window_pattern 6: layers 5, 11, 17 full), "
    "final_logit_softcapping = None, attn_logit_softcapping = None, "
    "hidden_activation gelu_pytorch_tanh. model_type is rewritten 'gemma3' -> "
    "'gemma3_text' (Gemma3ForCausalLM, text only).",
    "Gemma3 forward details (modeling_gemma3.py): embeddings are "
    "Gemma3TextScaledWordEmbedding: embed(ids) * tensor(hidden_size**0.5).to(weight dtype) "
    "(sqrt(640) rounded to f32); q_norm/k_norm (per head, over head_dim) are applied before "
    "RoPE; sliding layers use create_sliding_window_causal_mask with "
    "masking_utils.sliding_window_overlay: key kv allowed for query q iff "
    "q - sliding_window < kv <= q (the query sees itself and the previous "
    "sliding_window - 1 tokens, i.e. 512 keys in all); sliding layers use the "
    "'sliding_attention' RoPE (theta 10000), full layers the 'full_attention' one "
    "(theta 1e6). The lm_head is the tied embedding WITHOUT the sqrt(hidden) scale.",
    "Tokenizer: tokenizer.ggml.add_bos_token is True, so add_special_tokens=True prepends "
    "BOS (id 2).",
]


def check_loader_notes(key: str, model) -> None:
    """Asserts the notes above against the raw GGUF tensors (fails loudly if a future
    transformers changes the loader)."""
    from gguf import GGUFReader, dequantize

    d, f = GGUF[key]
    r = GGUFReader(str(MODELS / d / f))
    raw = {t.name: t for t in r.tensors}

    def deq(name):
        t = raw[name]
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))

    sd = dict(model.named_parameters())
    cfg = model.config
    if key == "smollm2":
        hd = cfg.head_dim
        for gname, hname, n in (
            ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", cfg.num_attention_heads),
            ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", cfg.num_key_value_heads),
        ):
            g = deq(gname)
            h = sd[hname].detach()
            want = torch.empty_like(g)
            for hh in range(n):
                for s in range(2):
                    for i in range(hd // 2):
                        want[hh * hd + s * hd // 2 + i] = g[hh * hd + 2 * i + s]
            assert torch.equal(h, want), f"{hname}: un-permutation formula does not hold"
            assert not torch.equal(h, g)
        assert torch.equal(sd["model.layers.0.self_attn.v_proj.weight"].detach(), deq("blk.0.attn_v.weight"))
        assert torch.equal(sd["model.layers.0.input_layernorm.weight"].detach(), deq("blk.0.attn_norm.weight"))
        assert torch.equal(sd["model.norm.weight"].detach(), deq("output_norm.weight"))
    else:
        for gname, hname in (
            ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
            ("blk.0.post_attention_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
            ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
            ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
            ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
            ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
            ("output_norm.weight", "model.norm.weight"),
        ):
            assert torch.equal(sd[hname].detach(), deq(gname) - 1), f"{hname}: not gguf - 1"
        assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"].detach(), deq("blk.0.attn_q.weight"))
        assert torch.equal(sd["model.layers.0.self_attn.k_proj.weight"].detach(), deq("blk.0.attn_k.weight"))
    assert "output.weight" not in raw and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight.detach(), deq("token_embd.weight"))


# ---------------------------------------------------------------------------------------
# Input text
# ---------------------------------------------------------------------------------------
CORPUS_MODULES = [
    "unittest", "doctest", "collections", "inspect", "subprocess", "shelve", "sqlite3",
    "argparse", "statistics", "csv", "sys", "json", "re",
]


def corpus() -> str:
    """English prose available offline: the Zen of Python, heapq's essay `heapq.__about__`,
    then the module docstrings of CORPUS_MODULES in that order, joined by blank lines."""
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    zen = "".join(this.d.get(c, c) for c in this.s)
    parts = [zen, importlib.import_module("heapq").__about__]
    for m in CORPUS_MODULES:
        parts.append(importlib.import_module(m).__doc__)
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------
def load(key: str):
    d, f = GGUF[key]
    path = MODELS / d
    assert (path / f).is_file(), f"{path / f} missing: run scripts/fetch-models.sh"
    tok = AutoTokenizer.from_pretrained(str(path), gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), gguf_file=f, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return tok, model


def layers(model):
    return model.model.layers


@torch.no_grad()
def full_logits_stats(model, ids: torch.Tensor, cols: torch.Tensor | None, chunk: int = 256):
    """Runs the decoder once, then the lm_head in chunks of positions (the full [L, vocab]
    logits of Gemma at 2048 tokens would be 2 GiB). Returns (logits at cols or None,
    argmax, gap, maxabs, top-1 logit value)."""
    hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
    soft = model.config.final_logit_softcapping if hasattr(model.config, "final_logit_softcapping") else None
    outs = {"cols": [], "argmax": [], "gap": [], "maxabs": [], "top1": []}
    for s in range(0, hidden.shape[0], chunk):
        lg = model.lm_head(hidden[s : s + chunk])
        if soft is not None:
            lg = torch.tanh(lg / soft) * soft
        top = torch.topk(lg, 2, dim=-1)
        outs["argmax"].append(lg.argmax(-1))
        outs["gap"].append(top.values[:, 0] - top.values[:, 1])
        outs["maxabs"].append(lg.abs().amax(-1))
        outs["top1"].append(top.values[:, 0])
        if cols is not None:
            outs["cols"].append(lg[:, cols])
        assert torch.isfinite(lg).all(), "non-finite logits"
    res = {k: torch.cat(v) for k, v in outs.items() if v}
    return res.get("cols"), res["argmax"], res["gap"], res["maxabs"], res["top1"]


def choose_cols(argmax_2048: torch.Tensor, vocab: int) -> tuple[torch.Tensor, dict]:
    """The union of every position's top-1 id at L=2048, then seeded random ids, sorted.
    If the union has more than NCOLS - 32 ids, keep the NCOLS - 32 most frequent (ties:
    smaller id first) and fill the last 32 with random ids."""
    ids, counts = torch.unique(argmax_2048, return_counts=True)
    n_union = int(ids.numel())
    cap = NCOLS - 32
    if n_union > cap:
        order = sorted(range(n_union), key=lambda i: (-int(counts[i]), int(ids[i])))
        keep = [int(ids[i]) for i in order[:cap]]
    else:
        keep = [int(i) for i in ids]
    chosen = set(keep)
    g = torch.Generator().manual_seed(COLS_SEED)
    while len(chosen) < NCOLS:
        chosen.add(int(torch.randint(0, vocab, (1,), generator=g)))
    cols = torch.tensor(sorted(chosen), dtype=torch.int64)
    return cols, {"top1_union": n_union, "top1_kept": len(keep)}


def ids_for(tok, text: str, n: int) -> torch.Tensor:
    ids = tok(text, add_special_tokens=True).input_ids
    assert len(ids) >= n, f"corpus has only {len(ids)} tokens, need {n}"
    return torch.tensor(ids[:n], dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# 1-5: the GGUF models
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def run_gguf(key: str, log: dict) -> None:
    t0 = time.time()
    tok, model = load(key)
    cfg = model.config
    check_loader_notes(key, model)
    log[key] = {"load_s": round(time.time() - t0, 1)}

    # 1. config
    c = cfg.to_dict()
    # not the machine's path: where scripts/fetch-models.sh puts the model
    c["_name_or_path"] = f"$PHASELENS_MODELS/{GGUF[key][0]}"
    c["_phaselens_notes"] = SMOLLM2_NOTES if key == "smollm2" else GEMMA3_NOTES
    c["_phaselens_versions"] = VERSIONS
    (OUT / f"{key}-config.json").write_text(json.dumps(c, indent=1, sort_keys=True, default=str) + "\n")

    # 2. logits
    text = corpus()
    ids = {L: ids_for(tok, text, L) for L in LENGTHS}
    for L in LENGTHS:
        assert torch.equal(ids[L], ids[2048][:L])
    t1 = time.time()
    _, am2048, _, _, _ = full_logits_stats(model, ids[2048], None)
    cols, colinfo = choose_cols(am2048, cfg.vocab_size)
    tensors = {"cols": cols}
    for L in LENGTHS:
        lg, am, gap, mx, top1 = full_logits_stats(model, ids[L], cols)
        tensors[f"ids_{L}"] = ids[L]
        tensors[f"logits_{L}"] = lg.float().contiguous()
        tensors[f"argmax_{L}"] = am.to(torch.int64)
        tensors[f"gap_{L}"] = gap.float()
        tensors[f"maxabs_{L}"] = mx.float()
        tensors[f"top1_{L}"] = top1.float()
    # Sanity: the chunked lm_head equals transformers' own full forward at L=16.
    ref16 = model(input_ids=ids[16][None]).logits[0]
    torch.testing.assert_close(ref16[:, cols], tensors["logits_16"], rtol=0, atol=1e-5)
    assert torch.equal(ref16.argmax(-1), tensors["argmax_16"])
    # The shorter inputs are prefixes of the 2048 one: causal, so the same logits.
    prefix_diff = {
        L: float((tensors[f"logits_{L}"] - tensors["logits_2048"][:L]).abs().max()) for L in (16, 512)
    }
    prefix_argmax_diff = {
        L: int((tensors[f"argmax_{L}"] != tensors["argmax_2048"][:L]).sum()) for L in (16, 512)
    }
    save_file(tensors, str(OUT / f"logits-{key}.safetensors"), metadata=meta(key))
    log[key].update(
        logits_s=round(time.time() - t1, 1),
        cols=colinfo,
        gap_min={L: float(tensors[f"gap_{L}"].min()) for L in LENGTHS},
        near_ties_lt_1e3={L: int((tensors[f"gap_{L}"] < 1e-3).sum()) for L in LENGTHS},
        near_ties_lt_1e2={L: int((tensors[f"gap_{L}"] < 1e-2).sum()) for L in LENGTHS},
        maxabs_max={L: float(tensors[f"maxabs_{L}"].max()) for L in LENGTHS},
        prefix_logit_maxdiff_vs_2048=prefix_diff,
        prefix_argmax_mismatch_vs_2048=prefix_argmax_diff,
    )

    # 3. hooks at L = 16
    ids16 = ids[16]
    L = 16
    nl, nh, dh = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    last = nl - 1
    cap: dict[str, torch.Tensor] = {}
    handles = []

    def first_arg(args, kwargs):
        return args[0] if args else kwargs["hidden_states"]

    def out_tensor(out):
        return out[0] if isinstance(out, tuple) else out

    handles.append(
        layers(model)[0].register_forward_pre_hook(
            lambda m, a, k: cap.__setitem__("blocks.0.hook_resid_pre", first_arg(a, k)[0].clone()),
            with_kwargs=True,
        )
    )
    for l in (0, last):
        handles.append(
            layers(model)[l].register_forward_hook(
                lambda m, a, o, l=l: cap.__setitem__(f"blocks.{l}.hook_resid_post", out_tensor(o)[0].clone())
            )
        )
        handles.append(
            layers(model)[l].self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, l=l: cap.__setitem__(f"blocks.{l}.attn.hook_z", a[0][0].reshape(L, nh, dh).clone())
            )
        )
    handles.append(
        model.model.norm.register_forward_hook(
            lambda m, a, o: cap.__setitem__("ln_final.hook_normalized", o[0].clone())
        )
    )
    out = model(input_ids=ids16[None], output_attentions=True, output_hidden_states=True)
    for h in handles:
        h.remove()
    cap["blocks.0.attn.hook_pattern"] = out.attentions[0][0].clone()
    # Cross-checks against output_hidden_states: [0] is the (scaled) embedding, [l+1] the
    # output of layer l (the last entry is replaced by the final norm's output).
    assert torch.equal(out.hidden_states[0][0], cap["blocks.0.hook_resid_pre"])
    assert torch.equal(out.hidden_states[1][0], cap["blocks.0.hook_resid_post"])
    assert torch.equal(out.hidden_states[-1][0], cap["ln_final.hook_normalized"])
    torch.testing.assert_close(out.logits[0][:, cols], tensors["logits_16"], rtol=0, atol=1e-5)
    if key == "gemma3":
        emb = model.model.embed_tokens.weight[ids16] * torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32)
        assert torch.equal(emb, cap["blocks.0.hook_resid_pre"])
    assert cap["blocks.0.attn.hook_pattern"].shape == (nh, L, L)
    hooks = {k: v.float().contiguous() for k, v in sorted(cap.items())}
    hooks["ids_16"] = ids16
    save_file(hooks, str(OUT / f"hooks-{key}.safetensors"), metadata=meta(key))

    # 4. interventions at L = 16
    def z_hook(layer, fn):
        return layers(model)[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, a: (fn(a[0].clone()),))

    def ablate(z):
        z[:, :, ABLATE_HEAD * dh : (ABLATE_HEAD + 1) * dh] = 0
        return z

    h = z_hook(ABLATE_LAYER, ablate)
    ablate_logits = model(input_ids=ids16[None]).logits[0][:, cols]
    h.remove()

    # ids_b: positions SWAP_POSITIONS replaced by the tokens 100.. of the 2048-token input,
    # skipping any that equal the original token.
    ids_b = ids16.clone()
    pool = [int(t) for t in ids[2048][100:]]
    for p in SWAP_POSITIONS:
        while pool[0] == int(ids16[p]):
            pool.pop(0)
        ids_b[p] = pool.pop(0)
    saved = {}

    def grab(z):
        saved["z"] = z[0, PATCH_POS, PATCH_HEAD * dh : (PATCH_HEAD + 1) * dh].clone()
        return z

    h = z_hook(PATCH_LAYER, grab)
    model(input_ids=ids_b[None])
    h.remove()

    def patch(z):
        z[0, PATCH_POS, PATCH_HEAD * dh : (PATCH_HEAD + 1) * dh] = saved["z"]
        return z

    h = z_hook(PATCH_LAYER, patch)
    patch_logits = model(input_ids=ids16[None]).logits[0][:, cols]
    h.remove()
    # the hooks are gone: the clean run is back
    torch.testing.assert_close(model(input_ids=ids16[None]).logits[0][:, cols], tensors["logits_16"], rtol=0, atol=1e-5)
    iv = {
        "ids_16": ids16,
        "cols": cols,
        "ids_b": ids_b,
        "ablate_logits": ablate_logits.float().contiguous(),
        "patch_logits": patch_logits.float().contiguous(),
        "patch_z": saved["z"].float(),
        "ablate_layer": torch.tensor([ABLATE_LAYER]),
        "ablate_head": torch.tensor([ABLATE_HEAD]),
        "patch_layer": torch.tensor([PATCH_LAYER]),
        "patch_head": torch.tensor([PATCH_HEAD]),
        "patch_pos": torch.tensor([PATCH_POS]),
    }
    save_file(iv, str(OUT / f"interventions-{key}.safetensors"), metadata=meta(key))
    clean = tensors["logits_16"]
    log[key].update(
        ablate_maxdiff=float((ablate_logits - clean).abs().max()),
        patch_maxdiff=float((patch_logits - clean).abs().max()),
        patch_maxdiff_before_pos=float((patch_logits - clean)[:PATCH_POS].abs().max()),
    )

    # 5. generation
    t2 = time.time()
    log[key]["generate"] = generate(key, tok, model)
    log[key]["generate_s"] = round(time.time() - t2, 1)
    log[key]["total_s"] = round(time.time() - t0, 1)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Water boils at 100 degrees Celsius. At high altitude, water boils at",
    "1, 2, 3, 5, 8, 13, 21,",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
]


@torch.no_grad()
def generate(key: str, tok, model) -> dict:
    """Greedy, 64 new tokens, EOS does NOT stop generation (so every case has exactly 64
    new tokens; `first_eos` says where the first end-of-sequence token came, if any)."""
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))
    cases = []
    inputs = [("plain", p, tok(p, add_special_tokens=True).input_ids) for p in PROMPTS]
    if key == "smollm2":
        for c in CHAT:
            msgs = [{"role": "user", "content": c}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
            cases_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(cases_ids, dict) or hasattr(cases_ids, "keys"):
                cases_ids = cases_ids["input_ids"]
            assert list(cases_ids) == ids, "chat template: tokenize=True differs from encode(text)"
            inputs.append(("chat", c, ids, text))
    for inp in inputs:
        kind, prompt, ids = inp[0], inp[1], inp[2]
        x = torch.tensor([ids], dtype=torch.int64)
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=GEN_NEW,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=model.generation_config.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new = out.sequences[0, len(ids) :].tolist()
        assert len(new) == GEN_NEW, f"{len(new)} new tokens"
        steps = torch.stack([lg[0] for lg in out.logits])
        top = torch.topk(steps, 2, dim=-1)
        assert torch.equal(top.indices[:, 0], torch.tensor(new)), "generate is not greedy"
        gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
        first_eos = next((i for i, t in enumerate(new) if t in eos_ids), None)
        case = {
            "kind": kind,
            "prompt": prompt,
            "input_ids": ids,
            "new_ids": new,
            "text": tok.decode(new, skip_special_tokens=False),
            "first_eos": first_eos,
            "step_gap": [round(g, 6) for g in gaps],
            "min_gap": round(min(gaps), 6),
            "min_gap_before_eos": round(min(gaps[: first_eos + 1] if first_eos is not None else gaps), 6),
        }
        if kind == "chat":
            case["rendered"] = inp[3]
        cases.append(case)
    doc = {
        "model": key,
        "versions": VERSIONS,
        "how": "model.generate(input_ids, attention_mask=ones, max_new_tokens=64, do_sample=False, "
        "eos_token_id=None, output_logits=True): greedy with the KV cache, EOS does not stop it; "
        "plain prompts encoded with add_special_tokens=True; chat prompts rendered with "
        "apply_chat_template([{'role':'user','content':c}], add_generation_prompt=True) and "
        "encoded without special tokens (the template writes them). step_gap[i]: top-1 minus "
        "top-2 raw logit at new token i (near-ties: a different but correct engine may pick "
        "the other token there).",
        "eos_ids": eos_ids,
        "cases": cases,
    }
    (OUT / f"generate-{key}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return {
        "min_gap": min(c["min_gap"] for c in cases),
        "first_eos": [c["first_eos"] for c in cases],
        "min_gap_before_eos": [c["min_gap_before_eos"] for c in cases],
    }


# ---------------------------------------------------------------------------------------
# 6. Tiny Hugging Face checkpoints
# ---------------------------------------------------------------------------------------
TINY_SEED = 20240607
NOISE_STD = 0.1


def tiny_specs():
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=64)
    return [
        (
            "tiny-llama",
            LlamaForCausalLM,
            LlamaConfig(
                **common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=False, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            torch.bfloat16,
        ),
        (
            "tiny-qwen3",
            Qwen3ForCausalLM,
            Qwen3Config(
                **common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            torch.float32,
        ),
        (
            "tiny-qwen2",
            Qwen2ForCausalLM,
            Qwen2Config(
                **common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            torch.float32,
        ),
        (
            "tiny-gemma3",
            Gemma3ForCausalLM,
            Gemma3TextConfig(
                **common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
                layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                },
                rms_norm_eps=1e-6, tie_word_embeddings=True,
            ),
            torch.float32,
        ),
    ]


@torch.no_grad()
def run_tiny(log: dict) -> None:
    g_ids = torch.Generator().manual_seed(TINY_SEED + 1)
    ids = torch.randint(0, 128, (2, 12), generator=g_ids, dtype=torch.int64)
    for i, (name, cls, cfg, dtype) in enumerate(tiny_specs()):
        torch.manual_seed(TINY_SEED + 10 * i)
        cfg.dtype = dtype
        model = cls(cfg).eval()
        g = torch.Generator().manual_seed(TINY_SEED + 10 * i + 1)
        for pname, p in model.named_parameters():
            p.add_(NOISE_STD * torch.randn(p.shape, generator=g, dtype=torch.float32))
            # no weight exactly 0 or 1 in the dtype on disk (bf16 rounds 1 + 0.003 to 1):
            # redraw those entries' noise until none is left
            while bool((bad := (p.to(dtype) == 0) | (p.to(dtype) == 1)).any()):
                p[bad] += NOISE_STD * torch.randn(int(bad.sum()), generator=g, dtype=torch.float32)
        model = model.to(dtype)
        for pname, p in model.named_parameters():
            assert not (p == 0).any() and not (p == 1).any(), f"{name}.{pname} has an exact 0 or 1"
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            f.unlink()
        model.save_pretrained(str(folder))
        # The reference comes from the checkpoint as written: reloaded in f32 (bf16 -> f32 for
        # tiny-llama), eager attention.
        ref = cls.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
        for (pn, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.float(), q), f"{name}.{pn}: reload differs"
        out = ref(input_ids=ids, output_attentions=True, output_hidden_states=True)
        rt = {"ids": ids, "logits": out.logits.float().contiguous()}
        for l, a in enumerate(out.attentions):
            rt[f"pattern_{l}"] = a.float().contiguous()
        rt["embed"] = out.hidden_states[0].float().contiguous()
        if name == "tiny-gemma3":
            # the window matters: sliding layers see exactly the last 4 positions
            for l, t in enumerate(cfg.layer_types):
                a = out.attentions[l][0, 0]
                q, k = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
                allowed = (k <= q) & ((k > q - cfg.sliding_window) if t == "sliding_attention" else True)
                assert bool((a[~allowed] == 0).all()) and bool((a[allowed] > 0).all()), f"layer {l} mask"
        assert torch.isfinite(rt["logits"]).all()
        save_file(rt, str(folder / "reference.safetensors"), metadata=meta(name))
        size = sum(f.stat().st_size for f in folder.iterdir())
        assert size < 1 << 20, f"{name}: {size} bytes"
        log[name] = {
            "bytes": size,
            "params": sum(p.numel() for p in model.parameters()),
            "files": sorted(f.name for f in folder.iterdir()),
            "logit_std": float(rt["logits"].std()),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["smollm2", "gemma3", "tiny"], action="append")
    args = ap.parse_args()
    todo = args.only or ["tiny", "smollm2", "gemma3"]
    OUT.mkdir(parents=True, exist_ok=True)
    log: dict = {"versions": VERSIONS}
    t0 = time.time()
    if "tiny" in todo:
        run_tiny(log)
    for key in ("smollm2", "gemma3"):
        if key in todo:
            run_gguf(key, log)
    log["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(log, indent=1, default=str))


if __name__ == "__main__":
    main()
