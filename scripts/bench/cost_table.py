#!/usr/bin/env python3
"""Forward time and peak memory against length from `phaselens bench forward --json`
files (one model each), with the fitted exponent: the least-squares slope of log(time)
against log(tokens) (2 = quadratic, 1 = linear), over all lengths and over the longest
half. Peak memory above the resident set before the forwards, the same way.

    python3 scripts/bench/cost_table.py OUT/cost-smollm2.json OUT/cost-kvc-w8s8.json
"""

import json
import math
import sys
from pathlib import Path


def slope(xs, ys):
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def table(path):
    points = json.loads(Path(path).read_text())
    name = Path(path).stem.removeprefix("cost-")
    toks = [p["tokens"] for p in points]
    secs = [p["seconds"] for p in points]
    extra = [
        (p["peak_rss_bytes"] or 0) - (p["base_rss_bytes"] or 0) for p in points
    ]
    out = [f"## cost: {name}", ""]
    out.append(
        "| tokens | s / forward | tokens/s | peak RSS MiB | above the RSS before MiB | matmul GFLOP | GFLOP/s |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|")
    for p, e in zip(points, extra):
        peak = p["peak_rss_bytes"]
        out.append(
            f"| {p['tokens']} | {p['seconds']:.3f} | {p['tokens_per_second']:.0f} | "
            f"{peak / 2**20 if peak else float('nan'):.0f} | {e / 2**20:.0f} | "
            f"{p['matmul_flops'] / 1e9:.1f} | {p['matmul_gflops']:.1f} |"
        )
    half = len(toks) // 2
    out.append("")
    out.append(
        f"fitted exponent (time ~ tokens^k): k = {slope(toks, secs):.2f} over all lengths, "
        f"{slope(toks[half:], secs[half:]):.2f} over the longest {len(toks) - half}; "
        f"matmul FLOPs k = {slope(toks, [p['matmul_flops'] for p in points]):.2f}; "
        f"memory above the RSS before k = {slope(toks, extra):.2f}"
    )
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
