"""Time the one-shot solvers (SGPTQ, GPTQ, OBR) on one full MoE block on a GPU, batched vs the per-expert path.

A Qwen3-30B-A3B-shaped block: 128 experts, hidden 2048, expert inner 768, random weights and correlated random
tokens (~`--tokens-per-expert` routed rows per expert, a skewed load). In one process:
- the batched path (the default of `compress_block`) on the whole block, timed end to end (Hessians, damping,
  factorisations, the sweeps, export, error report), and on CUDA again with `cuda_graphs=False` (every op of
  the column sweep launched from Python: the baseline of the graph replay) with the two compared code by code;
- the per-expert reference path (`batched=False`) timed on `--baseline-experts` experts spread over the load
  range and EXTRAPOLATED to the block (mean seconds per expert × experts; labelled as such), and its results
  compared with the batched ones for those experts (code agreement, relative errors);
- for the methods with kept-set least squares (sgptq's refit, obr), the default iterative solve (`solve="cg"`)
  against the exact one (`solve="exact"`, a Cholesky per row) on the same experts: relative errors and codes,
  and the CG iterations the block needed;
- optionally (`--kimi`) the same methods on a Kimi-K2-shaped block (384 experts of 7168 × 2048): one memory
  chunk of experts timed and extrapolated to the 384 experts;
- optionally (`--factorisations`, run first) the batched SPD factorisations at this block's sizes, torch's
  cuSOLVER calls vs each `spd` strategy and leaf size; the fastest accurate kept-set solver is used for the
  methods in this process (recorded as `spd_config_used`).
Writes JSON + Markdown to --out (relative paths only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import time
import traceback
from pathlib import Path

import torch

from moesq_core.compression.methods.base import PROJECTIONS, ExpertData
from moesq_core.compression.methods.batching import memory_budget, solver_bytes_per_expert
from moesq_core.compression.methods.registry import get_method
from moesq_core.formats import get_format

METHOD_FORMATS = {"sgptq": "p48-nvfp4", "gptq": "dense-nvfp4", "obr": "p48-nvfp4"}


def routed_counts(experts: int, per_expert: int, seed: int) -> torch.Tensor:
    """Rows per expert: a skewed (log-normal) load with the given mean."""
    g = torch.Generator().manual_seed(seed)
    pref = torch.exp(torch.randn(experts, generator=g) * 0.4)
    counts = (pref / pref.sum() * experts * per_expert).round().long().clamp_min(64)
    return counts


def make_block(experts: int, hidden: int, inter: int, counts: torch.Tensor, dev, seed: int = 0,
               which: list[int] | None = None) -> list[ExpertData]:
    g = torch.Generator(device=dev).manual_seed(seed)
    mix = torch.randn(hidden, hidden, device=dev, generator=g) / hidden**0.5 + 0.5 * torch.eye(hidden, device=dev)
    out = []
    for e in (range(experts) if which is None else which):
        n = int(counts[e])
        x = torch.randn(n, hidden, device=dev, generator=g) @ mix
        out.append(ExpertData(e, torch.randn(inter, hidden, device=dev, generator=g) * 0.02,
                              torch.randn(inter, hidden, device=dev, generator=g) * 0.02,
                              torch.randn(hidden, inter, device=dev, generator=g) * 0.02,
                              x, torch.rand(n, device=dev, generator=g)))
    return out


def timed(fn):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def agreement(ref, bat) -> dict:
    same = total = 0
    ratios = []
    for r, b in zip(ref, bat):
        for p in PROJECTIONS:
            same += int((r.weights()[p].codes.cpu() == b.weights()[p].codes.cpu()).sum())
            total += r.weights()[p].codes.numel()
            ratios.append(b.info["rel_err"][p] / r.info["rel_err"][p])
    return {"code_agreement": same / total, "rel_err_ratio_min": min(ratios), "rel_err_ratio_max": max(ratios),
            "rel_err_ratio_mean": sum(ratios) / len(ratios)}


class SolveLog(logging.Handler):
    """Collects the kept-set CG reports (rows, iterations, exact fallbacks) the solvers log at DEBUG."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.calls = []

    def emit(self, record):
        if record.getMessage().startswith("kept-set CG"):
            self.calls.append(record.args)

    def take(self) -> dict | None:
        calls, self.calls = self.calls, []
        if not calls:
            return None
        return {"solves": len(calls), "max_iterations": max(c[1] for c in calls),
                "iterations": [c[1] for c in calls], "exact_fallback_rows": sum(c[2] for c in calls)}


def solves_kept_sets(name: str) -> bool:
    """The method's default runs kept-set least squares (obr; sgptq with its refit; not gptq)."""
    m = get_method(name)
    return any(f.name == "solve" for f in dataclasses.fields(type(m))) and getattr(m, "refit", True)


def mean_rel_err(results) -> dict:
    return {p: sum(r.info["rel_err"][p] for r in results) / len(results) for p in PROJECTIONS}


FACTORISATION_SHAPES = (("kept_set_solve_256x1024", 256, 1024), ("hessian_factor_16x2048", 16, 2048))


def bench_factorisations(dev, bases=(32, 64, 128), shapes=FACTORISATION_SHAPES) -> dict:
    """Batched SPD factorisations at this block's sizes: torch's batched cuSOLVER calls vs the recursive
    versions (`spd`, each strategy and leaf size), with their largest relative deviation from torch's."""
    from moesq_core.compression.methods import spd
    out = {}
    saved = spd.BASE, spd.STRATEGY
    for name, B, n in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        X = torch.randn(B, n, n, device=dev, dtype=torch.float64, generator=g) / n**0.5
        A = X @ X.mT + 0.01 * torch.eye(n, device=dev, dtype=torch.float64)
        del X
        rhs = A[..., :1].clone()
        solve = name.startswith("kept")

        def run(blocked):
            return spd.spd_solve(A, rhs, blocked)[0] if solve else spd.inverse_cholesky_upper(A, blocked)[0]
        ref = run(False)
        _, t_ref, _ = timed(lambda: run(False))
        row = {"torch_cusolver_batched": {"seconds": t_ref}}
        for strategy in spd.STRATEGIES:
            for base in bases:
                spd.STRATEGY, spd.BASE = strategy, base
                got = run(True)
                _, t, _ = timed(lambda: run(True))
                dev_rel = float((got - ref).abs().max() / ref.abs().max())
                row[f"{strategy}_base{base}"] = {"seconds": t, "max_rel_dev_vs_torch": dev_rel}
                del got
        out[name] = row
        A = ref = rhs = None  # free the device memory before the next shape
    spd.BASE, spd.STRATEGY = saved
    return out


def pick_factorisation(fac: dict) -> tuple[str, int] | None:
    """The fastest accurate recursive variant for the kept-set solves (what bounds OBR)."""
    best = None
    for key, r in next(iter(fac.values())).items():  # the first shape: the kept-set solves
        if key == "torch_cusolver_batched" or r["max_rel_dev_vs_torch"] > 1e-8:
            continue
        if best is None or r["seconds"] < best[1]:
            best = (key, r["seconds"])
    if best is None:
        return None
    strategy, base = best[0].rsplit("_base", 1)
    return strategy, int(base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="sgptq,gptq,obr")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens-per-expert", type=int, default=2200)
    ap.add_argument("--baseline-experts", type=int, default=2, help="experts timed through the per-expert path")
    ap.add_argument("--kimi", action="store_true", help="also SGPTQ on one chunk of a Kimi-K2-shaped block")
    ap.add_argument("--factorisations", action="store_true", help="also time the batched SPD factorisations")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default=None, help="output file stem (default solvers_h200_<date>_<commit>)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script on small shapes")
    args = ap.parse_args()
    dev = torch.device(args.device)
    solve_log = SolveLog()
    hlog = logging.getLogger("moesq_core.compression.methods.hessian")
    hlog.setLevel(logging.DEBUG)
    hlog.addHandler(solve_log)
    commit = os.environ.get("MOESQ_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    date = time.strftime("%Y-%m-%d")
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    stem = args.name or f"solvers_h200_{date}_{commit}"
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "one-shot solvers, one MoE block", "date": date, "gpu": gpu, "commit": commit,
           "torch": torch.__version__, "results": {}, "errors": {}}

    def save():  # after every stage, so a run cut short still leaves its numbers
        (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2))
        write_markdown(res, args.out / f"{stem}.md")

    counts = routed_counts(args.experts, args.tokens_per_expert, 0)
    res["shape"] = {"model": "Qwen3-30B-A3B", "experts": args.experts, "hidden": args.hidden, "inter": args.inter,
                    "routed_rows": int(counts.sum()), "rows_per_expert_min": int(counts.min()),
                    "rows_per_expert_max": int(counts.max())}
    block = make_block(args.experts, args.hidden, args.inter, counts, dev)
    order = counts.argsort().tolist()
    picks = [order[round(i * (len(order) - 1) / max(1, args.baseline_experts - 1))]
             for i in range(args.baseline_experts)]
    budget = memory_budget(dev, None)
    res["shape"]["default_chunk_experts"] = int(max(1, budget // solver_bytes_per_expert(args.inter, args.hidden)))
    save()
    if args.factorisations:
        from moesq_core.compression.methods import spd
        try:
            shapes = (FACTORISATION_SHAPES if dev.type == "cuda"
                      else (("kept_set_solve_4x128", 4, 128), ("hessian_factor_2x256", 2, 256)))
            res["factorisations"] = bench_factorisations(dev, shapes=shapes)
            pick = pick_factorisation(res["factorisations"])
            if pick:
                spd.STRATEGY, spd.BASE = pick
            print("factorisations", json.dumps(res["factorisations"]), flush=True)
        except Exception:
            res["errors"]["factorisations"] = traceback.format_exc()
        res["spd_config_used"] = {"strategy": spd.STRATEGY, "base": spd.BASE}
        empty_cache()
        save()
    for name in args.methods.split(","):
        fmt = get_format(METHOD_FORMATS[name])
        try:
            get_method(name).compress_block(block[:2], fmt)  # warm-up (cuBLAS/cuSOLVER handles, allocator)
            solve_log.take()
            out, sec, peak = timed(lambda: get_method(name).compress_block(block, fmt))
            row = {"format": fmt.name, "batched_block_s": sec, "batched_peak_gib": peak,
                   "mean_rel_err": mean_rel_err(out), "kept_set_cg": solve_log.take()}
            bat_picks = [out[e] for e in picks]
            if dev.type == "cuda":  # the same batched path launching every op of the sweep (no CUDA graphs)
                launched, row["batched_launched_s"], _ = timed(
                    lambda: get_method(name, cuda_graphs=False).compress_block(block, fmt))
                row["graphed_vs_launched"] = agreement(launched, out)
                del launched
            del out
            if solves_kept_sets(name):  # the iterative kept-set solve against the exact one, on the same experts
                exact = get_method(name, solve="exact").compress_block([block[e] for e in picks], fmt)
                row["cg_vs_exact_on_timed_experts"] = agreement(exact, bat_picks)
                del exact
            per = []
            ref = []
            for e in picks:
                r, s, _ = timed(lambda: get_method(name, batched=False).compress_block([block[e]], fmt))
                per.append({"expert": e, "rows": int(counts[e]), "seconds": s})
                ref.extend(r)
            mean = sum(p["seconds"] for p in per) / len(per)
            row.update({"per_expert_timed": per, "per_expert_block_s_extrapolated": mean * args.experts,
                        "speedup_vs_extrapolated_per_expert": mean * args.experts / sec,
                        "batched_vs_per_expert_on_timed_experts": agreement(ref, bat_picks)})
            res["results"][name] = row
            print(name, json.dumps(row), flush=True)
        except Exception as exc:  # record and go on: one failing method must not lose the others' numbers
            res["errors"][name] = traceback.format_exc()
            print(name, "FAILED", exc, flush=True)
        empty_cache()
        save()
    block = None  # free the device memory
    empty_cache()
    if args.kimi:
        E, H, inter = 384, 7168, 2048
        per_chunk = int(max(1, memory_budget(dev, None) // solver_bytes_per_expert(inter, H)))
        kc = routed_counts(E, args.tokens_per_expert, 1)
        which = list(range(min(per_chunk, E)))
        kb = make_block(E, H, inter, kc, dev, seed=1, which=which)
        for name in args.methods.split(","):
            key = f"{name}_kimi_k2"
            try:
                fmt = get_format(METHOD_FORMATS[name])
                get_method(name).compress_block(kb[:1], fmt)
                solve_log.take()
                out, sec, peak = timed(lambda: get_method(name).compress_block(kb, fmt))
                rows_timed = int(kc[which].sum())
                res["results"][key] = {
                    "shape": {"model": "Kimi-K2", "experts": E, "hidden": H, "inter": inter,
                              "routed_rows": int(kc.sum())},
                    "format": fmt.name, "experts_timed": len(which), "rows_timed": rows_timed, "seconds_timed": sec,
                    "peak_gib": peak, "block_s_extrapolated": sec * E / len(which), "mean_rel_err": mean_rel_err(out),
                    "kept_set_cg": solve_log.take(),
                    "note": f"one chunk of {len(which)} experts timed, x{E / len(which):.1f} extrapolated to the block"}
                print("kimi", name, json.dumps(res["results"][key]), flush=True)
                del out
            except Exception:
                res["errors"][key] = traceback.format_exc()
            empty_cache()
            save()
        del kb
    print((args.out / f"{stem}.md").read_text())


def write_markdown(res: dict, path: Path):
    sh = res["shape"]
    md = ["# One-shot solvers on one MoE block — batched vs per-expert", "",
          f"{res['date']} · {res['gpu']} · torch {res['torch']} · commit {res['commit']}", "",
          f"Qwen3-30B-A3B-shaped block: {sh['experts']} experts, hidden {sh['hidden']}, inter {sh['inter']}, random "
          f"weights, {sh['routed_rows']:,} routed rows "
          f"({sh['rows_per_expert_min']:,}–{sh['rows_per_expert_max']:,} per "
          f"expert). Batched: the whole block through `compress_block` (default path), measured. Per-expert: "
          f"`batched=False` on a few experts, **extrapolated** ×{sh['experts']}.", "",
          "| method | format | batched, s per block (measured) | batched without CUDA graphs, s (codes equal) | "
          "per-expert, s per block (extrapolated) | speed-up | peak GiB | codes equal on timed experts |",
          "|---|---|---|---|---|---|---|---|"]
    for name, r in res["results"].items():
        if name.endswith("_kimi_k2"):
            continue
        a = r["batched_vs_per_expert_on_timed_experts"]
        gl = r.get("graphed_vs_launched")
        launched = f"{r['batched_launched_s']:.2f} ({100 * gl['code_agreement']:.3f} %)" if gl else "—"
        md.append(f"| {name} | {r['format']} | **{r['batched_block_s']:.2f}** | {launched} "
                  f"| {r['per_expert_block_s_extrapolated']:,.1f} "
                  f"(from {len(r['per_expert_timed'])} experts) | {r['speedup_vs_extrapolated_per_expert']:,.1f}× | "
                  f"{r['batched_peak_gib']:.1f} | {100 * a['code_agreement']:.3f} % (rel. err ratio "
                  f"{a['rel_err_ratio_min']:.4f}–{a['rel_err_ratio_max']:.4f}) |")
    solves = {n: r for n, r in res["results"].items() if r.get("kept_set_cg") or r.get("cg_vs_exact_on_timed_experts")}
    if solves:
        md += ["", "Kept-set least squares (sgptq's refit, obr) by conjugate gradients (the default, "
                   "`solve=\"cg\"`) vs "
                   "the exact Cholesky per row (`solve=\"exact\"`) on the timed experts: relative output error of CG "
                   "over exact, and the CG iterations the block needed (per solve; rows not converged by then are "
                   "solved exactly).", "",
               "| run | rel. err CG / exact (min–max) | codes equal | CG iterations per solve | rows solved exactly |",
               "|---|---|---|---|---|"]
        for n, r in solves.items():
            c, cg = r.get("cg_vs_exact_on_timed_experts"), r.get("kept_set_cg") or {}
            ratio = (f"{c['rel_err_ratio_min']:.4f}–{c['rel_err_ratio_max']:.4f} (mean {c['rel_err_ratio_mean']:.5f})"
                     if c else "—")
            codes = f"{100 * c['code_agreement']:.2f} %" if c else "—"
            md.append(f"| {n} | {ratio} | {codes} | {', '.join(map(str, cg.get('iterations', []))) or '—'} | "
                      f"{cg.get('exact_fallback_rows', '—')} |")
    kimi = {n: r for n, r in res["results"].items() if n.endswith("_kimi_k2")}
    if kimi:
        md += ["", "Kimi-K2-shaped block (384 experts, hidden 7168, inter 2048): one memory chunk of experts timed, "
                   "**extrapolated** to the block.", "",
               "| method | format | chunk | s for the chunk | peak GiB | s per block (extrapolated) |",
               "|---|---|---|---|---|---|"]
        for n, k in kimi.items():
            md.append(f"| {n.removesuffix('_kimi_k2')} | {k['format']} | {k['experts_timed']} experts, "
                      f"{k['rows_timed']:,} rows "
                      f"| {k['seconds_timed']:.1f} | {k['peak_gib']:.1f} | **{k['block_s_extrapolated']:.0f}** |")
    if res.get("factorisations"):
        md += ["", "Batched SPD factorisations, seconds (fp64; `spd` strategy and leaf size vs torch's batched "
                   "cuSOLVER calls). The solvers above ran with "
                   + f"strategy {res['spd_config_used']['strategy']!r}, leaf "
                   f"{res['spd_config_used']['base']} (the fastest accurate kept-set solve, picked in this process):",
                   "",
               "| variant | " + " | ".join(res["factorisations"]) + " |",
               "|---" * (1 + len(res["factorisations"])) + "|"]
        keys = list(next(iter(res["factorisations"].values())))
        for k in keys:
            md.append(f"| {k} | " + " | ".join(f"{row[k]['seconds']:.4f}" for row in res["factorisations"].values())
                      + " |")
    if res["errors"]:
        md += ["", "Failed: " + ", ".join(res["errors"])]
    md += ["", "Code agreement < 100 % on the GPU is rounding: cuBLAS/cuSOLVER vs the recursive factorisations and "
               "batched products change the last bits, which moves codes that sit on a rounding boundary; on the CPU "
               "the two paths are bitwise equal (tests/compression/test_batched_solvers.py)."]
    path.write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
