"""Does short refinement beat its SGPTQ init at a real model's width? An experiment on one MoE block.

    python benchmarks/refine_lr_scale.py --out benchmarks/results            # hidden 2048, 8 experts of 768, top-2
    python benchmarks/refine_lr_scale.py --hidden 256 --inter 128 --tokens 2048 --out /tmp/r   # a quick look
    python benchmarks/refine_lr_scale.py --experts 128 --topk 8 --tokens 98304 --val-tokens 8192 --device cuda \
        --steps 8 128 --variant 'absolute={"lr_budget_values_rms": null}' --variant 'default={}' --out DIR   # a GPU

One block of Qwen3-30B-A3B's widths (hidden 2048, experts of 768) with few experts, so that one refinement
takes CPU-minutes: random expert weights of std `--std` (0.02 is the Qwen3 initializer range the real-size
GPU run's random model used; the shared micro/tiny models' experts have an RMS of 0.03–0.08), RMS-normalised
Gaussian inputs (a random model's post-attention norm output), a random router (top-k, softmax-normalised).
The init is moesq's default (SGPTQ with refit) on the training rows; every variant refines from the very same
init and data (one epoch of `steps` Lion steps, as the GPU run) and is validated on held-out rows. Reported
per variant: how many experts validate better than their init and the mean over experts of (val loss after
the epoch) / (init's val loss) — above 1 means refinement made the expert worse (the engine then ships the init).

Variants are RefineConfig overrides (JSON) given on the command line, `--variant NAME='{"lr_values": 1e-4}'`;
the defaults are today's rule and rates relative to the weights' scale.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesq_core.compression.methods.base import ExpertData  # noqa: E402
from moesq_core.compression.methods.refine import BlockRefiner, RefineConfig, relaxation  # noqa: E402
from moesq_core.compression.methods.registry import get_method  # noqa: E402
from moesq_core.formats import get_format  # noqa: E402


def make_block(E: int, H: int, inter: int, tokens: int, val_tokens: int, topk: int, std: float, seed: int):
    """Experts with train rows (x, w) and held-out rows (x_val, w_val) from one random router."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) / math.sqrt(H)

    def route(n):
        x = torch.randn(n, H, generator=g)
        x = x * x.pow(2).mean(-1, keepdim=True).rsqrt()
        top, idx = (x @ router.T).topk(topk, dim=1)
        w = torch.softmax(top, dim=1)
        rows = [(idx == e).any(1) for e in range(E)]
        wts = [(w * (idx == e)).sum(1)[r] for e, r in enumerate(rows)]
        return [x[r] for r in rows], wts

    xs, ws = route(tokens)
    xv, wv = route(val_tokens)
    experts = []
    for e in range(E):
        experts.append(ExpertData(e, torch.randn(inter, H, generator=g) * std, torch.randn(inter, H, generator=g) * std,
                                  torch.randn(H, inter, generator=g) * std, xs[e], ws[e], xv[e], wv[e]))
    return experts


def run_variant(experts, inits, fmt, over: dict, steps: int) -> dict:
    cfg = RefineConfig(epochs=1, steps_per_epoch=steps, **over)
    t0 = time.perf_counter()
    r = BlockRefiner(experts, inits, fmt, cfg)
    r.run()
    v0, v1 = r.history_val[0], r.history_val[-1]
    ratio = (v1 / v0).tolist()
    changed = groups = 0
    for pr in r.proj.values():
        if pr.A is not None:
            m = relaxation.hard_mask(pr.A.detach(), r.ps)
            d = (m != pr.init_mask).reshape(-1, r.ps.group).any(-1)
            changed, groups = changed + int(d.sum()), groups + d.numel()
    return {"steps": steps, "config": over, "plan": str(r.plan),
            "lr_logits": r.plan.lr_logits, "lr_values": r.plan.lr_values,
            "improved": int((v1 < v0).sum()), "experts": len(experts),
            "val_ratio_mean": sum(ratio) / len(ratio), "val_ratio": ratio,
            "patterns_changed": changed / groups if groups else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def weight_rms(experts) -> dict:
    return {p: sum(float(getattr(ex, p).pow(2).mean().sqrt()) for ex in experts) / len(experts)
            for p in ("gate", "up", "down")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="training tokens (rows per expert ≈ tokens·topk/experts)")
    ap.add_argument("--val-tokens", type=int, default=1024)
    ap.add_argument("--std", type=float, nargs="+", default=[0.02])
    ap.add_argument("--steps", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--format", default="p48-nvfp4")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="a RefineConfig override set (repeatable); default: today's rule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the init and refinement run (the block is drawn on the CPU)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tag", default="real_width")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = dict(v.split("=", 1) for v in args.variant) or {"today": "{}"}
    variants = {k: json.loads(v) for k, v in variants.items()}
    fmt = get_format(args.format)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    doc = {"date": _dt.date.today().isoformat(), "commit": commit, "args": {k: v for k, v in vars(args).items()
                                                                            if k != "out"},  # no machine paths
           "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"refine_lr_scale_{args.tag}.json"
    for std in args.std:
        experts = make_block(args.experts, args.hidden, args.inter, args.tokens, args.val_tokens, args.topk, std,
                             args.seed)
        experts = [ExpertData(ex.index, *(t.to(args.device)
                                          for t in (ex.gate, ex.up, ex.down, ex.x, ex.w, ex.x_val, ex.w_val)))
                   for ex in experts]
        t0 = time.perf_counter()
        inits = get_method("sgptq").compress_block(experts, fmt)
        t_init = time.perf_counter() - t0
        rows = [ex.x.shape[0] for ex in experts]
        print(f"std {std}: rows per expert {min(rows)}–{max(rows)}, weight RMS {weight_rms(experts)}, "
              f"init {t_init:.1f} s", flush=True)
        for steps in args.steps:
            for name, over in variants.items():
                res = run_variant(experts, inits, fmt, over, steps)
                res.update(variant=name, std=std, weight_rms=weight_rms(experts))
                doc["runs"].append(res)
                print(f"  std {std} steps {steps:4d} {name:24s} lr(A) {res['lr_logits']:.3g} "
                      f"lr(V) {res['lr_values']:.3g}: "
                      f"{res['improved']}/{res['experts']} improved, val/init {res['val_ratio_mean']:.4f}, "
                      f"patterns changed {res['patterns_changed']}, {res['seconds']} s", flush=True)
                path.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
