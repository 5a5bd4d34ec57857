"""Time SGPTQ on one Qwen3-30B-A3B–shaped MoE block on a GPU (issue 3): 128 experts, hidden 2048, expert inner
768, top-8 routing of 512 x 4096 calibration tokens with an imbalanced load; random weights and correlated
random tokens. Times `--experts` experts end to end (Hessians, damping, the sweeps, export) and extrapolates
linearly to the whole block (experts are independent; labelled as extrapolated). Writes JSON + Markdown."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from moesq_core.formats import get_format
from moesq_core.methods.base import ExpertData
from moesq_core.methods.registry import get_method


def routed_counts(n_tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """Rows per expert: top-k of skewed (log-normal) router preferences, summing to n_tokens * top_k."""
    g = torch.Generator().manual_seed(seed)
    pref = torch.exp(torch.randn(experts, generator=g) * 0.6)
    counts = (pref / pref.sum() * n_tokens * top_k).round().long()
    counts[0] += n_tokens * top_k - counts.sum()
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=16, help="experts actually timed (of 128)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=512 * 4096)
    ap.add_argument("--format", default="p48-nvfp4")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    fmt = get_format(args.format)
    counts = routed_counts(args.tokens, 8, 128, 0)
    timed = torch.linspace(0, 127, args.experts).round().long().tolist()  # spread over the load range
    method = get_method("sgptq")
    g = torch.Generator(device=dev).manual_seed(0)
    mix = torch.randn(args.hidden, args.hidden, device=dev, generator=g) / args.hidden**0.5
    per_expert, rows = [], 0
    torch.cuda.synchronize()
    for e in timed:
        n = int(counts[e])
        x = (torch.randn(n, args.hidden, device=dev, generator=g) @ mix).float()
        w = torch.rand(n, device=dev, generator=g)
        ex = ExpertData(e, torch.randn(args.inter, args.hidden, device=dev, generator=g) * 0.02,
                        torch.randn(args.inter, args.hidden, device=dev, generator=g) * 0.02,
                        torch.randn(args.hidden, args.inter, device=dev, generator=g) * 0.02, x, w)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = method.compress_block([ex], fmt)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        per_expert.append({"expert": e, "rows": n, "seconds": dt, "rel_err": res[0].info.get("rel_err")})
        rows += n
        del x, ex, res
    measured = sum(p["seconds"] for p in per_expert)
    # time = a + b * rows fitted over the timed experts, applied to all 128 experts' loads
    r = torch.tensor([p["rows"] for p in per_expert], dtype=torch.float64)
    t = torch.tensor([p["seconds"] for p in per_expert], dtype=torch.float64)
    A = torch.stack([torch.ones_like(r), r], 1)
    a, b = torch.linalg.lstsq(A, t[:, None]).solution[:, 0].tolist()
    block_s = float(a * 128 + b * counts.sum().item())
    commit = os.environ.get("MOESQ_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    out = {"benchmark": "sgptq_block", "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
           "commit": commit, "torch": torch.__version__, "format": args.format,
           "shape": {"experts": 128, "hidden": args.hidden, "inter": args.inter, "top_k": 8, "tokens": args.tokens},
           "timed_experts": per_expert, "measured_seconds": measured,
           "fit_seconds": {"per_expert": a, "per_row": b},
           "block_seconds_extrapolated": block_s, "note": f"{len(timed)} of 128 experts timed; block time extrapolated"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sgptq_h200_block.json").write_text(json.dumps(out, indent=2))
    md = [f"# SGPTQ, one Qwen3-30B-A3B–shaped block ({args.format})", "",
          f"{out['date']}, {out['gpu']}, commit {commit}, torch {torch.__version__}", "",
          f"128 experts, hidden {args.hidden}, inter {args.inter}, top-8 of {args.tokens:,} tokens "
          f"({int(counts.sum()):,} routed rows, {int(counts.min()):,}–{int(counts.max()):,} per expert).", "",
          "| expert | rows | seconds |", "|---|---|---|"]
    md += [f"| {p['expert']} | {p['rows']:,} | {p['seconds']:.2f} |" for p in per_expert]
    md += ["", f"Measured: {measured:.1f} s for {len(timed)} experts. **Extrapolated to the block: "
               f"{block_s:.0f} s ({block_s / 60:.1f} GPU-minutes)** (fit: {a:.2f} s per expert + {b * 1e6:.3f} s per million rows)."]
    (args.out / "sgptq_h200_block.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
