#!/usr/bin/env python3
"""PyTorch eager reference for `phaselens bench train`: the kvc model family (docs/kvc.md,
src/model/kvc/*, src/model/attention.rs) written plainly in PyTorch, loading what
`phaselens bench train RECIPE --export DIR` wrote (initial weights, config.json, the
batches of every step, the optimiser settings) and running the same optimiser steps.

Pinned: torch==2.9.0 (CPU; scripts/bench/train_requirements.txt). No other package: the
safetensors files are read with the standard library.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench/train_ref.py DIR --threads 2 [--json OUT]

Before timing it checks that its forward logits on the first batch equal the exported
ones (`logits0.safetensors`, phaselens' forward of the same weights) to --tol (default
1e-5, absolute), and afterwards prints how far its losses are from phaselens' losses of
the same steps (`train.json`, `bench.losses`). The same steps run: `warmup` untimed, then
`steps` timed, with phaselens' learning rate of each step.

What "the same" means here:
- model: embedding; pre-norm blocks (RMSNorm), Q/K/V projections (optional one-token key
  shift, tied K/V), per-head Q/K RMSNorm, half-split RoPE (f64 angles, cast to f32), the
  compressor (softmax-gated pooling of each W-token window per KV head, per-offset gate
  bias; scalar, vector or uniform gates; entry i rotated at position i*S), one joint
  softmax over [closed entries ; raw tokens (local tail, or all: full attention) ; sink],
  GQA by contiguous head groups; SwiGLU MLP; final RMSNorm; LM head or tied embedding.
- loss: mean cross-entropy over the answer positions (labels != -100).
- optimiser: AdamW (beta1 0.9, beta2, eps 1e-8, decoupled weight decay on every
  parameter), after clipping each parameter's gradient by its own L2 norm (burn's
  GradientClipping::Norm, which phaselens uses), not the global norm.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"F32": torch.float32, "I64": torch.int64}
F32_MIN_POSITIVE = 1.1754943508222875e-38


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e["dtype"] not in DTYPES:
            raise SystemExit(f"{path}: tensor {name}: dtype {e['dtype']} not supported")
        a, b = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out


def peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Kvc(torch.nn.Module):
    """The kvc model with its parameters named as in phaselens' safetensors."""

    def __init__(self, cfg: dict, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "/"): torch.nn.Parameter(v) for k, v in weights.items()}
        )
        c = cfg
        self.nh, self.kvh, self.L = c["n_heads"], c["n_kv_heads"], c["n_layers"]
        self.dh = c.get("d_head") or c["d_model"] // c["n_heads"]
        self.eps = c.get("norm_eps", 1e-6)
        rope = c.get("rope", "all")
        self.rot = {"all": self.dh, "partial": c.get("rope_dims") or 0, "none": 0}[rope]
        self.theta = c.get("rope_theta", 10000.0)
        self.comp = c.get("compression") if c["attention"] == "compressed" else None
        self._cache: dict = {}

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "/")]

    def has(self, name: str) -> bool:
        return name.replace(".", "/") in self.p

    def tables(self, pos: torch.Tensor):
        half = self.rot // 2
        inv = self.theta ** (-(2.0 * torch.arange(half, dtype=torch.float64)) / self.rot)
        ang = pos.to(torch.float64)[:, None] * inv[None]
        return ang.cos().float()[None, :, None], ang.sin().float()[None, :, None]

    def rope(self, x: torch.Tensor, t) -> torch.Tensor:
        if self.rot == 0:
            return x
        cos, sin = t
        half = self.rot // 2
        x1, x2, rest = x[..., :half], x[..., half : self.rot], x[..., self.rot :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

    def layout(self, T: int):
        """Per prompt length: RoPE tables, window indices, and the visibility mask over
        [entries ; raw ; sink] (built once per length, shared by every layer)."""
        if T in self._cache:
            return self._cache[T]
        pos = torch.arange(T)
        q = pos[:, None]
        n = 0
        idx = ent_tables = None
        parts = []
        if self.comp is not None:
            W, S = self.comp["window"], self.comp["stride"]
            n = (T - W) // S + 1 if T >= W else 0
            if n > 0:
                idx = (torch.arange(n)[:, None] * S + torch.arange(W)[None]).reshape(-1)
                ent_tables = self.tables(torch.arange(n) * S)
                parts.append((torch.arange(n)[None] * S + W - 1) <= q)
            tail = self.comp.get("local_tail", 0)
            window = tail if tail > 0 else None
            raw = tail > 0
        else:
            window, raw = None, True
        if raw:
            m = pos[None] <= q
            if window is not None:
                m = m & (pos[None] + window > q)
            parts.append(m)
        if self.cfg.get("sink"):
            parts.append(torch.ones(T, 1, dtype=torch.bool))
        mask = torch.cat(parts, 1) if parts else torch.zeros(T, 0, dtype=torch.bool)
        seen = mask.any(-1, keepdim=True).float()
        out = dict(tables=self.tables(pos), idx=idx, n=n, ent_tables=ent_tables,
                   raw=raw, mask=mask, seen=seen)
        self._cache[T] = out
        return out

    def pool(self, l: int, which: str, h, x, lay):
        B, T = x.shape[:2]
        W = self.comp["window"]
        n, idx = lay["n"], lay["idx"]
        xw = x[:, idx].reshape(B, n, W, self.kvh, self.dh)
        gate = f"blocks.{l}.attn.compressor.{which}_gate"
        if not self.has(gate + ".weight"):
            return xw.mean(2)
        g = h @ self.w(gate + ".weight").t()
        g = g.reshape(B, T, self.kvh, -1)[:, idx].reshape(B, n, W, self.kvh, -1)
        if self.has(gate + "_bias"):
            g = g + self.w(gate + "_bias").reshape(1, 1, W, self.kvh, 1)
        return (torch.softmax(g, 2) * xw).sum(2)

    def attention(self, l: int, h, lay):
        B, T, _ = h.shape
        nh, kvh, dh = self.nh, self.kvh, self.dh
        a = f"blocks.{l}.attn."
        q = (h @ self.w(a + "w_q.weight").t()).reshape(B, T, nh, dh)
        key_in = h
        if self.has(a + "key_shift"):
            mu = self.w(a + "key_shift")
            prev = F.pad(h, (0, 0, 1, 0))[:, :-1]
            key_in = h * mu + prev * (1 - mu)
        k = (key_in @ self.w(a + "w_k.weight").t()).reshape(B, T, kvh, dh)
        if self.has(a + "w_v.weight"):
            v = (h @ self.w(a + "w_v.weight").t()).reshape(B, T, kvh, dh)
        else:
            v = k
        if self.has(a + "q_norm.weight"):
            q = rms(q, self.w(a + "q_norm.weight"), self.eps)
            k = rms(k, self.w(a + "k_norm.weight"), self.eps)
        keys, vals = [], []
        if lay["n"] > 0:
            ck = self.pool(l, "key", h, k, lay)
            cv = self.pool(l, "value", h, v, lay)
            keys.append(self.rope(ck, lay["ent_tables"]))
            vals.append(cv)
        if lay["raw"]:
            keys.append(self.rope(k, lay["tables"]))
            vals.append(v)
        q = self.rope(q, lay["tables"])
        g = nh // kvh
        qh = q.permute(0, 2, 1, 3).reshape(B, kvh, g * T, dh)
        K = torch.cat(keys, 1).permute(0, 2, 3, 1)  # [B, kvh, dh, keys]
        V = torch.cat(vals, 1).permute(0, 2, 1, 3)  # [B, kvh, keys, dh]
        s = (qh @ K).reshape(B, nh, T, -1) / math.sqrt(dh)
        if self.has(a + "sink"):
            s = torch.cat([s, self.w(a + "sink").reshape(1, nh, 1, 1).expand(B, nh, T, 1)], -1)
        s = s.masked_fill(~lay["mask"], -1.0e30)
        p = torch.softmax(s, -1) * lay["seen"]
        nk = K.shape[-1]
        z = p[..., :nk].reshape(B, kvh, g * T, nk) @ V  # [B, kvh, g*T, dh]
        z = z.reshape(B, nh, T, dh).permute(0, 2, 1, 3).reshape(B, T, nh * dh)
        return z @ self.w(a + "w_o.weight").t()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        lay = self.layout(T)
        x = self.w("embed.weight")[ids]
        for l in range(self.L):
            b = f"blocks.{l}."
            x = x + self.attention(l, rms(x, self.w(b + "attn_norm.weight"), self.eps), lay)
            hm = rms(x, self.w(b + "mlp_norm.weight"), self.eps)
            up = hm @ self.w(b + "mlp.up.weight").t()
            gate = F.silu(hm @ self.w(b + "mlp.gate.weight").t())
            x = x + (gate * up) @ self.w(b + "mlp.down.weight").t()
        x = rms(x, self.w("final_norm.weight"), self.eps)
        head = self.w("lm_head.weight") if self.has("lm_head.weight") else self.w("embed.weight")
        return x @ head.t()


def clip_per_parameter(params, clip: float) -> None:
    grads = [p.grad for p in params]
    norms = torch._foreach_norm(grads)
    coef = [(clip / (n + F32_MIN_POSITIVE)).clamp(max=1.0) for n in norms]
    torch._foreach_mul_(grads, coef)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", help="the directory `phaselens bench train --export` wrote")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = a.export
    with open(os.path.join(d, "model", "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "phaselens-kvc":
        raise SystemExit(f"{d}/model/config.json: model_type {cfg.get('model_type')!r}; "
                         "the reference covers phaselens-kvc models only")
    with open(os.path.join(d, "train.json")) as f:
        tj = json.load(f)
    model = Kvc(cfg, read_safetensors(os.path.join(d, "model", "model.safetensors")))
    batches = read_safetensors(os.path.join(d, "batches.safetensors"))
    ids, labels = batches["input_ids"], batches["labels"]
    want = read_safetensors(os.path.join(d, "logits0.safetensors"))["logits"]
    with torch.no_grad():
        got = model(ids[0])
    diff = (got - want).abs().max().item()
    print(f"forward check: max |logits - phaselens logits| = {diff:.2e} (tol {a.tol:.0e})")
    if not diff <= a.tol:
        raise SystemExit(f"forward logits differ from phaselens' by {diff:.3e} > {a.tol:.0e}")
    # Inference forward speed on the same batch (no autograd), median of 5.
    times = []
    with torch.no_grad():
        for _ in range(5):
            t0 = time.perf_counter()
            model(ids[0])
            times.append(time.perf_counter() - t0)
    fwd_s = sorted(times)[2]
    o = tj["optimizer"]
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=tj["lr"][0], betas=(o["beta1"], o["beta2"]),
                            eps=o["epsilon"], weight_decay=o["weight_decay"])
    warm, steps = tj["warmup"], tj["steps"]
    phases = dict(sample=0.0, forward=0.0, backward=0.0, optimizer=0.0)
    losses = []
    base = rss_bytes()
    reset = False
    for s in range(warm + steps):
        if s == warm:
            base, reset = rss_bytes(), reset_peak_rss()
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        x, y = ids[s], labels[s]
        t1 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                               ignore_index=-100)
        losses.append(loss.item())
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        clip_per_parameter(params, o["grad_clip"])
        for group in opt.param_groups:
            group["lr"] = tj["lr"][s]
        opt.step()
        t4 = time.perf_counter()
        if s >= warm:
            for k, (u, v) in zip(phases, [(t0, t1), (t1, t2), (t2, t3), (t3, t4)]):
                phases[k] += v - u
    seconds = time.perf_counter() - t_start
    B, T = ids.shape[1:]
    ref = tj["bench"]["losses"]
    ldiff = [abs(u - v) for u, v in zip(losses, ref)]
    out = {
        "organism": tj["organism"],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch_size": B,
        "seq_len": T,
        "warmup": warm,
        "steps": steps,
        "seconds": seconds,
        "steps_per_second": steps / seconds,
        "tokens_per_second": steps * B * T / seconds,
        "phases": {k: v / steps for k, v in phases.items()},
        "peak_rss_bytes": peak_rss_bytes() if reset else None,
        "base_rss_bytes": base,
        "losses": losses,
        "logits_max_abs_diff": diff,
        "forward_seconds": fwd_s,
        "forward_tokens_per_second": B * T / fwd_s,
        "loss_abs_diff_first3": max(ldiff[:3]),
        "loss_abs_diff_max": max(ldiff),
    }
    mib = (lambda x: f"{x / 2**20:.0f}" if x else "n/a")
    print(f"{out['organism']}: PyTorch {torch.__version__} eager, {out['threads']} threads, "
          f"batch {B} x {T}, {steps} steps after {warm} warm-up")
    print(f"  {out['steps_per_second']:.3f} steps/s  {out['tokens_per_second']:.0f} tokens/s  "
          f"{1e3 * seconds / steps:.1f} ms/step  peak RSS {mib(out['peak_rss_bytes'])} MiB")
    ph = out["phases"]
    print(f"  per step: forward + loss {1e3 * ph['forward']:.1f} ms, backward "
          f"{1e3 * ph['backward']:.1f} ms, optimiser {1e3 * ph['optimizer']:.1f} ms")
    print(f"  inference forward (no autograd): {B * T / fwd_s:.0f} tokens/s")
    print(f"  losses vs phaselens: max |diff| {out['loss_abs_diff_first3']:.2e} over steps 0-2, "
          f"{out['loss_abs_diff_max']:.2e} over all {len(ldiff)}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
