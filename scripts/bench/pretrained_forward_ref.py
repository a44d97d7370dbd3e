#!/usr/bin/env python3
"""Reference for `phaselens bench forward --model GGUF --tokens ...` on a pretrained GGUF
model: the same forward in transformers (f32 weights dequantised on load, eager
attention, CPU), at the same lengths and with the same token ids, one length per fresh
subprocess, reporting seconds per forward, tokens/s and the forward's peak resident set
(VmHWM reset after loading).

Pinned: torch 2.9.0, transformers 5.25.0, gguf 0.19.0, accelerate (transformers needs it
to load a GGUF).

    python scripts/bench/pretrained_forward_ref.py --model FILE.gguf --tokens 512,2048 --threads 2 [--last-logits]
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


def one(path: str, t: int, threads: int, last_logits: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager",
    )
    model.eval()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    vocab = model.config.vocab_size
    # The same ids as phaselens' model::bench::forward_sweep (batch 1).
    ids = torch.tensor([[(i * 2654435761) % vocab for i in range(t)]])
    keep = {"logits_to_keep": 1} if last_logits else {}
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, **keep).logits
        _ = out.numpy()
        s = time.perf_counter() - t0
    return {"tokens": t, "seconds": s, "tokens_per_second": t / s, "peak_rss_bytes": peak_rss_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--last-logits", action="store_true")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.model, a.one, a.threads, a.last_logits)))
        return
    for t in [int(x) for x in a.tokens.split(",")]:
        r = subprocess.run(
            [sys.executable, __file__, "--model", a.model, "--one", str(t), "--threads", str(a.threads)]
            + (["--last-logits"] if a.last_logits else []),
            capture_output=True, text=True,
        )
        if r.returncode != 0:
            print(json.dumps({"tokens": t, "error": r.stderr[-1500:]}))
            continue
        print(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
