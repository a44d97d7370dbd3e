#!/usr/bin/env python3
"""The report of scripts/gpu-check.sh: OUT/gpu-check.json (the machine, every step's
status and seconds, the backend matrix's cells, the parity line, every forward's numbers)
and OUT/gpu-check.md (the same as tables).

    python3 scripts/bench/gpu_check_report.py OUT BACKEND DEVICE SECONDS
"""

import json
import re
import sys
from pathlib import Path


def lines_json(path):
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def main(out, backend, device, seconds):
    out = Path(out)
    steps = lines_json(out / "steps.jsonl")
    backends = lines_json(out / "backends.log")
    parity = []
    log = out / "parity.log"
    if log.exists():
        parity = [l for l in log.read_text().splitlines() if "realwidth_ci" in l and "|diff|" in l]
    forwards = []
    for f in sorted(out.glob("*-*.json")):
        if f.name in ("gpu-check.json",):
            continue
        try:
            pts = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        for p in pts if isinstance(pts, list) else []:
            forwards.append({"run": f.stem.rsplit("-", 1)[0], **p})
    machine = (out / "machine.txt").read_text() if (out / "machine.txt").exists() else ""
    report = {
        "schema": "phaselens.gpu_check/v1",
        "backend": backend,
        "device": device,
        "seconds": seconds,
        "machine": machine.splitlines(),
        "steps": steps,
        "backend_matrix": backends,
        "parity": parity,
        "forwards": forwards,
    }
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    md = [f"# gpu-check: {backend} on {device} ({seconds} s)", "", "```", machine.strip(), "```", ""]
    md += ["| step | status | s |", "|---|---|---:|"]
    md += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
    if backends:
        md += ["", "| device | check | status | detail |", "|---|---|---|---|"]
        for c in backends:
            detail = c.get("error") or c.get("detail") or (
                f"max err {c['max_err']:.3g} (tol {c['tol']:.3g}), {c.get('seconds', 0):.1f} s"
                if "max_err" in c else "")
            detail = str(detail)[:160].replace("|", "/")
            md.append(f"| {c.get('device', '')} | {c.get('check', '')} | {c.get('status', '')} | {detail} |")
    if parity:
        md += ["", "parity (forced selection):", ""] + [f"    {l.strip()}" for l in parity]
    if forwards:
        md += ["", "| run | dtype | tokens | s / forward | tokens/s | peak RSS MiB | GFLOP/s | last logits only |",
               "|---|---|---:|---:|---:|---:|---:|---|"]
        for p in forwards:
            peak = p.get("peak_rss_bytes")
            md.append(
                f"| {p['run']} | {p.get('dtype', '')} | {p['tokens']} | {p['seconds']:.3f} | "
                f"{p['tokens_per_second']:.0f} | {peak / 2**20 if peak else float('nan'):.0f} | "
                f"{p.get('matmul_gflops', 0):.1f} | {p.get('last_logits')} |"
            )
    (out / "gpu-check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    failed = [s for s in steps if s["status"] not in ("ok",) and not s["status"].startswith("skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) != 4:
        sys.exit("usage: gpu_check_report.py OUT BACKEND DEVICE SECONDS")
    sys.exit(main(*a))
