#!/usr/bin/env python3
"""Reference for `phaselens bench forward --model DIR --tokens ...`: the same forward in
transformers (eager attention, f32, CPU), for DeepSeek-V4 checkpoints, at the same
lengths and with the same token ids, reporting seconds per forward, tokens/s and the
process's peak resident set. Each length runs in a fresh subprocess so that its peak is
its own.

Pinned: torch 2.9.0, transformers 5.24.0 (tests/fixtures/deepseek_v4/requirements.txt).

    python scripts/bench/forward_ref.py --model experiments/organisms/v4pro-mini \
        --tokens 1024,4096,16384 --threads 2 [--reps 1] [--max-gib 16] [--last-logits]

A length whose forward would need more memory than --max-gib (eager attention builds
[T, T] masks and scores per layer) is reported as skipped, not run. --query-chunk N runs
the eager attention over N queries at a time (the same arithmetic per query; needed at
real width, where [64 heads, T, T] f32 scores are 4 GiB per copy at 4096 tokens). A
release checkpoint (FP8 / FP4) is dequantised to f32 by transformers on load. The peak
resident set is the forward's (reset after loading, weights included); the loading peak
is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def chunk_queries(chunk: int) -> None:
    """Run transformers' eager attention over `chunk` queries at a time (the same
    arithmetic per query row; [heads, chunk, keys] scores instead of [heads, T, keys])."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    eager = mod.eager_attention_forward

    def eager_chunked(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        outs = []
        for a in range(0, query.shape[-2], chunk):
            m = attention_mask[:, :, a : a + chunk] if attention_mask is not None else None
            outs.append(eager(module, query[:, :, a : a + chunk], key, value, m, scaling, dropout, **kw)[0])
        return torch.cat(outs, dim=1), None

    # DeepseekV4Attention looks its "eager" function up at call time.
    mod.eager_attention_forward = eager_chunked


def one(model_dir: str, t: int, batch: int, reps: int, threads: int, query_chunk: int, last_logits: bool) -> dict:
    import torch
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    torch.set_num_threads(threads)
    if query_chunk:
        chunk_queries(query_chunk)
    with open(os.path.join(model_dir, "config.json")) as f:
        quantized = "quantization_config" in json.load(f)
    # A release checkpoint (FP8 / FP4): transformers' own dequantisation to f32 on load.
    extra = {"quantization_config": FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0")} if quantized else {}
    model = DeepseekV4ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", **extra
    )
    model.eval()
    load_peak = peak_rss_bytes()
    # The peak of the forward alone (weights included), as `phaselens bench forward`
    # measures it: reset VmHWM after loading (Linux clear_refs 5).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    vocab = model.config.vocab_size
    # The same ids as phaselens' model::bench::forward_sweep.
    ids = torch.tensor(
        [[((r * t + i) * 2654435761) % vocab for i in range(t)] for r in range(batch)]
    )
    times = []
    # --last-logits: only the last position through the LM head (a prefill), as
    # `phaselens bench forward --last-logits`.
    keep = {"logits_to_keep": 1} if last_logits else {}
    with torch.no_grad():
        if reps > 1:
            model(ids, **keep)
        for _ in range(reps):
            t0 = time.perf_counter()
            out = model(ids, **keep).logits
            _ = out.numpy()
            times.append(time.perf_counter() - t0)
    times.sort()
    s = times[len(times) // 2]
    return {
        "tokens": t,
        "batch": batch,
        "seconds": s,
        "tokens_per_second": batch * t / s,
        "peak_rss_bytes": peak_rss_bytes(),
        "load_peak_rss_bytes": load_peak,
        "query_chunk": query_chunk,
        "last_logits": last_logits,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-gib", type=float, default=16.0)
    ap.add_argument("--query-chunk", type=int, default=0,
                    help="eager attention over this many queries at a time (0: all at once, as transformers)")
    ap.add_argument("--last-logits", action="store_true",
                    help="only the last position's logits (logits_to_keep=1), as phaselens' --last-logits")
    ap.add_argument("--json")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.model, a.one, a.batch, a.reps, a.threads, a.query_chunk, a.last_logits)))
        return
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    print(f"transformers eager reference: {a.model}, batch {a.batch}, {a.threads} threads")
    print("| tokens | s / forward | tokens/s | peak RSS MiB |")
    print("|---:|---:|---:|---:|")
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        # Eager attention holds [batch, heads, T, T + entries] scores + mask (f32) at once.
        q_rows = min(a.query_chunk, t) if a.query_chunk else t
        need = 3 * a.batch * heads * q_rows * t * 4 / 2**30
        if need > a.max_gib:
            print(f"| {t} | skipped: eager attention needs ~{need:.0f} GiB | | |")
            rows.append({"tokens": t, "skipped_gib": need})
            continue
        r = subprocess.run(
            [sys.executable, __file__, "--model", a.model, "--one", str(t), "--batch",
             str(a.batch), "--reps", str(a.reps), "--threads", str(a.threads), "--query-chunk", str(a.query_chunk)]
            + (["--last-logits"] if a.last_logits else []),
            capture_output=True, text=True,
        )
        if r.returncode != 0:
            print(f"| {t} | failed: {r.stderr.strip().splitlines()[-1:]} | | |")
            rows.append({"tokens": t, "error": r.stderr[-2000:]})
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"| {t} | {row['seconds']:.3f} | {row['tokens_per_second']:.0f} | "
              f"{row['peak_rss_bytes'] / 2**20:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
