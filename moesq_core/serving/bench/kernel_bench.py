"""Kernel benchmark: our grouped sparse GEMM vs vendor baselines over G experts x N tokens per expert.

    bench_kernel("s24-fp8", shapes=None, G=[8, 32, 128, 384], N=[16, ..., 1024], out_dir=Path("benchmarks/results"))
    python -m moesq_core.serving.bench.kernel_bench --fmt s24-fp8 --G 8 128 --N 16 1024 --out benchmarks/results

Shapes default to the paper's Table 8 layers. Token counts per expert follow {N, 3N/4, N/2, N/4} over the G
experts. Writes `<prefix>_kernel_bench.json` (every timing, the autotuner's per-variant times, date, GPU, commit),
`.md` (tables + the performance targets) and `.png` / `_fast_accum.png` (speedup over the best baseline, heat
map over G x N per shape, like the paper's Figure 5). Other formats plug in by module: `p48-nvfp4` dispatches to
`moesq_core.serving.bench.p48_bench.bench_p48(shapes=..., G=..., N=..., out_dir=..., repeats=...)`.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

import torch

from moesq_core.serving.bench.harness import (
    BASELINES,
    PAPER_SHAPES,
    REPO_ROOT,
    Problem,
    Timing,
    copies_for,
    effective_tflops,
    graph_time,
    new_row,
    pack_logical,
    random_2to4_dense_e4m3,
    random_e4m3,
    run_header,
    time_gemm,
)

DEFAULT_G = [8, 32, 128, 384]
DEFAULT_N = [16, 32, 64, 128, 256, 512, 1024]


def bench_kernel(fmt: str, shapes: list[tuple[int, int]] | None, G: list[int], N: list[int], out_dir: Path,
                 repeats: int = 50) -> dict:
    """Benchmark format `fmt`'s kernel over shapes x G x N; write JSON + Markdown + PNG into out_dir."""
    if fmt == "s24-fp8":
        return bench_s24(shapes, G, N, Path(out_dir), repeats)
    if fmt == "p48-nvfp4":
        try:
            from moesq_core.serving.bench.p48_bench import bench_p48
        except ImportError as e:
            raise ValueError("p48-nvfp4 has no kernel benchmark here yet "
                             "(moesq_core/serving/bench/p48_bench.py)") from e
        return bench_p48(shapes=shapes, G=G, N=N, out_dir=Path(out_dir), repeats=repeats)
    raise ValueError(f"no kernel benchmark for format {fmt!r}; have: s24-fp8, p48-nvfp4")


def _named_shapes(shapes: list[tuple[int, int]] | None) -> list[tuple[str, int, int]]:
    if not shapes:
        return [(name, M, K) for name, (M, K) in PAPER_SHAPES.items()]
    names = {v: k for k, v in PAPER_SHAPES.items()}
    return [(names.get((M, K), f"M={M} K={K}"), M, K) for M, K in shapes]


# ------------------------------------------------------------------------------------------------ s24-fp8


class S24Bench:
    """Our kernel on one problem: weight copies in the kernel layout, capacity-batched activations."""

    def __init__(self, prob: Problem, gen: torch.Generator, device):
        from moesq_core.serving.kernels import s24_gemm as s24

        self.s24, self.prob, self.gen, self.device = s24, prob, gen, device
        G, K, cap = prob.G, prob.K, prob.capacity
        self.counts = torch.tensor(prob.counts, dtype=torch.int32, device=device)
        self.xq = random_e4m3((G, cap, K), gen, device)
        self.sx = torch.rand(G, cap, generator=gen, device=device) * 1e-2 + 1e-3
        self.out = torch.empty(G, cap, prob.M, dtype=torch.bfloat16, device=device)
        self.copies: list = []
        self.weight_bytes = 0

    def add_copy(self, keep_dense: bool = False):
        p = self.prob
        dense, scale = random_2to4_dense_e4m3(p.G, p.M, p.K, self.gen, self.device)
        values, meta = pack_logical(dense)
        w = self.s24.prepare_weights(values, meta, scale, self.device)
        self.copies.append(w)
        self.weight_bytes = w.nbytes()
        return (w, dense, scale) if keep_dense else (w, None, None)

    def verify(self, w, dense, scale, variant: int) -> float:
        """Relative Frobenius error of `variant` vs an fp32 GPU reference over up to 4 experts (largest error)."""
        s24 = self.s24
        self.out.fill_(float("nan"))
        s24.launch_variant(w, self.xq, self.sx, self.counts, self.out, variant)
        torch.cuda.synchronize()
        worst = 0.0
        G = self.prob.G
        for e in sorted({0, 1 % G, G // 2, G - 1}):
            c = self.prob.counts[e]
            acc = self.xq[e, :c].float() @ dense[e].float().T
            ref = (acc * scale[e]) * self.sx[e, :c, None]
            got = self.out[e, :c].float()
            if not bool(torch.isfinite(got).all()):
                return math.inf
            worst = max(worst, float((got - ref).norm() / ref.norm().clamp_min(1e-30)))
        return worst

    def call(self, w, variant: int):
        s24, xq, sx, counts, out = self.s24, self.xq, self.sx, self.counts, self.out
        return lambda: s24.launch_variant(w, xq, sx, counts, out, variant)


def _record(t: Timing, prob: Problem, weight_bytes: int) -> dict:
    sec = t.median_us * 1e-6
    return {
        "us": round(t.median_us, 3), "p10_us": round(t.p10_us, 3), "p90_us": round(t.p90_us, 3),
        "tflops": round(effective_tflops(prob.M, prob.K, prob.counts, sec), 2),
        "weight_bytes": int(weight_bytes), "weight_TBps": round(weight_bytes / sec / 1e12, 3),
        "copies": t.copies, "replays": t.replays,
    }


def bench_one(name: str, M: int, K: int, G: int, N: int, repeats: int, device, seed: int = 0,
              baselines: tuple[str, ...] = tuple(BASELINES)) -> dict:
    from moesq_core.serving.kernels import s24_gemm as s24

    prob, gen, row = new_row(name, M, K, G, N, seed, device)

    for bname in baselines:
        try:
            m = BASELINES[bname](prob, gen, device)
            row["methods"][bname] = _record(time_gemm(m, repeats), prob, m.weight_bytes)
            if m.note:
                row["methods"][bname]["note"] = m.note
        except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
            row["methods"][bname] = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            m = None
            gc.collect()
            torch.cuda.empty_cache()

    ours = S24Bench(prob, gen, device)
    w0, dense, scale = ours.add_copy(keep_dense=True)
    cands = s24.variants()
    tune = s24.AUTOTUNER.time_variants(cands, w0, ours.xq, ours.sx, ours.counts, ours.out)
    row["autotune_us"] = {k: round(v, 3) for k, v in tune.items()}
    for label, fast in (("s24_fp8", False), ("s24_fp8_fast_accum", True)):
        pool = [v for v in cands if fast or not v.fast_accum]  # fast accumulation allowed, not required
        if not pool:
            continue
        best = min(pool, key=lambda v: tune[v.name])
        if label != "s24_fp8" and row["methods"].get("s24_fp8", {}).get("variant") == best.name:
            row["methods"][label] = dict(row["methods"]["s24_fp8"])  # same kernel: no second timing
            continue
        err = ours.verify(w0, dense, scale, best.index)
        rec = {"variant": best.name, "verify_rel_err": err}
        if err > 2e-2:
            rec["error"] = f"verification failed: relative error {err:.3g}"
        else:
            while len(ours.copies) < copies_for(ours.weight_bytes):
                ours.add_copy()
            t = graph_time([ours.call(w, best.index) for w in ours.copies], repeats)
            rec.update(_record(t, prob, ours.weight_bytes))
        row["methods"][label] = rec
    del ours, dense, scale, w0
    gc.collect()
    torch.cuda.empty_cache()

    base_us = [m["us"] for k, m in row["methods"].items() if k in BASELINES and "us" in m]
    row["best_baseline_us"] = min(base_us) if base_us else None
    row["best_baseline"] = (min(((m["us"], k) for k, m in row["methods"].items() if k in BASELINES and "us" in m))[1]
                            if base_us else None)
    for label in ("s24_fp8", "s24_fp8_fast_accum"):
        m = row["methods"].get(label, {})
        if "us" in m and base_us:
            m["speedup"] = round(min(base_us) / m["us"], 3)
    return row


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def targets(rows: list[dict], label: str = "s24_fp8") -> dict:
    """Performance targets: decode N <= 64 >= 2.0x; N >= 256 >= 1.3x geomean; Kimi gate/up N=1024 >= 1600 TFLOP/s."""
    sp = lambda r: r["methods"].get(label, {}).get("speedup")  # noqa: E731
    decode = [sp(r) for r in rows if r["N"] <= 64 and sp(r)]
    large = [sp(r) for r in rows if r["N"] >= 256 and sp(r)]
    kimi = [r["methods"][label]["tflops"] for r in rows
            if (r["M"], r["K"]) == PAPER_SHAPES["Kimi-K2.5 gate/up"] and r["N"] == 1024
            and "tflops" in r["methods"].get(label, {})]
    return {
        "decode_N_le_64": {"min": min(decode) if decode else None, "geomean": _geomean(decode), "target": 2.0,
                           "met": bool(decode) and min(decode) >= 2.0},
        "N_ge_256": {"geomean": _geomean(large), "min": min(large) if large else None, "target": 1.3,
                     "met": bool(large) and _geomean(large) >= 1.3},
        "kimi_gate_up_N1024_tflops": {"values": kimi, "target": 1600.0, "met": bool(kimi) and max(kimi) >= 1600.0},
    }


def bench_s24(shapes, G, N, out_dir: Path, repeats: int = 50, baselines: tuple[str, ...] = tuple(BASELINES),
              prefix: str = "s24_fp8", log=print) -> dict:
    from moesq_core.serving.kernels import s24_gemm as s24

    if not torch.cuda.is_available():
        raise RuntimeError("bench-kernel needs a CUDA GPU (the s24-fp8 kernel needs an H100/H200)")
    device = torch.device("cuda", torch.cuda.current_device())
    s24.check_device(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        **run_header("s24-fp8", device, repeats),
        "token_pattern": "{N, 3N/4, N/2, N/4} repeated over G experts",
        "timing": "CUDA-graph replay, median over replays; weight copies rotated so a replay streams >= 256 MiB",
        "methods": {k: BASELINES[k].description for k in baselines} | {
            "s24_fp8": "moesq CUTLASS grouped 2:4 e4m3 GEMM, fp32-promoted accumulation, autotuned variant",
            "s24_fp8_fast_accum": "the same with fast (unpromoted) fp8 accumulation allowed: best of all variants",
        },
        "variants": [v.__dict__ for v in s24.variants()],
        "rows": [],
    }
    for name, M, K in _named_shapes(shapes):
        for g in G:
            for n in N:
                row = bench_one(name, M, K, g, n, repeats, device, baselines=baselines)
                result["rows"].append(row)
                ours = row["methods"].get("s24_fp8", {})
                log(f"{name:24s} G={g:4d} N={n:5d}  best baseline {row['best_baseline']} "
                    f"{row['best_baseline_us'] or float('nan'):9.1f} us | s24 {ours.get('us', float('nan')):9.1f} us "
                    f"{ours.get('variant', '')} x{ours.get('speedup', float('nan')):.2f}")
                (out_dir / f"{prefix}_kernel_bench.json").write_text(json.dumps(result, indent=1))
    result["targets"] = targets(result["rows"])
    result["targets_fast_accum"] = targets(result["rows"], "s24_fp8_fast_accum")
    (out_dir / f"{prefix}_kernel_bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{prefix}_kernel_bench.md").write_text(markdown(result))
    heatmap(result, out_dir / f"{prefix}_kernel_bench.png")
    heatmap(result, out_dir / f"{prefix}_kernel_bench_fast_accum.png", "s24_fp8_fast_accum")
    return result


# ------------------------------------------------------------------------------------------------ reports


def markdown(result: dict) -> str:
    lines = [
        f"# {result['format']} grouped GEMM vs vendor baselines",
        "",
        f"{result['date']} · {result['gpu']} ({result['sm_count']} SMs) · torch {result['torch']}"
        f" (CUDA {result['cuda']})"
        f" · commit `{result['commit']}` · {result['repeats']} CUDA-graph replays (median)",
        "",
        f"Tokens per expert: {result['token_pattern']}. {result['timing']}. Effective TFLOP/s = 2·M·K·ΣN/t.",
        "",
    ]
    for k, d in result["methods"].items():
        lines.append(f"- `{k}`: {d}")
    lines.append("")
    f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    for key, title in (("targets", "fp32-promoted accumulation (default)"),
                       ("targets_fast_accum", "fast accumulation allowed (`fast_accum=True`)")):
        t = result.get(key)
        if not t:
            continue
        decode, large, kimi = t["decode_N_le_64"], t["N_ge_256"], t["kimi_gate_up_N1024_tflops"]
        lines += [
            f"## Targets, {title}",
            "",
            "| target | measured | met |",
            "| --- | --- | --- |",
            f"| decode N ≤ 64: ≥ 2.0× best baseline | min {f(decode['min'])}×, geomean {f(decode['geomean'])}× "
            f"| {'yes' if decode['met'] else 'no'} |",
            f"| N ≥ 256: ≥ 1.3× geomean | geomean {f(large['geomean'])}×, min {f(large['min'])}× "
            f"| {'yes' if large['met'] else 'no'} |",
            f"| Kimi gate/up N = 1024: ≥ 1,600 TFLOP/s | {', '.join(f'{v:.0f}' for v in kimi['values']) or 'n/a'} "
            f"| {'yes' if kimi['met'] else 'no'} |",
            "",
        ]
    if result.get("note"):
        lines += [f"Note: {result['note']}", ""]
    shapes = []
    for r in result["rows"]:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    base_names = [k for k in result["methods"] if not k.startswith("s24")]
    for s in shapes:
        rows = [r for r in result["rows"] if r["shape"] == s]
        lines += [f"## {s} (M={rows[0]['M']}, K={rows[0]['K']})", "",
                  "| G | N | " + " | ".join(f"{b} µs" for b in base_names)
                  + " | s24 µs | TFLOP/s | weights TB/s | speedup | variant | fast-acc allowed µs (×) | its variant |",
                  "| --- | --- | " + " | ".join("---" for _ in base_names)
                  + " | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            cells = []
            for b in base_names:
                m = r["methods"].get(b, {})
                cells.append(f"{m['us']:.1f}" if "us" in m else "err")
            o = r["methods"].get("s24_fp8", {})
            fa = r["methods"].get("s24_fp8_fast_accum", {})
            if "us" in o:
                ours = (f"{o['us']:.1f} | {o['tflops']:.0f} | {o['weight_TBps']:.2f} "
                        f"| {o.get('speedup', float('nan')):.2f}×")
            else:
                ours = f"{o.get('error', 'err')} | | | "
            fac = f"{fa['us']:.1f} ({fa.get('speedup', float('nan')):.2f}×)" if "us" in fa else "err"
            lines.append(f"| {r['G']} | {r['N']} | " + " | ".join(cells)
                         + f" | {ours} | {o.get('variant', '')} | {fac} | {fa.get('variant', '')} |")
        lines.append("")
    return "\n".join(lines)


def heatmap(result: dict, path: Path, label: str = "s24_fp8") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    shapes = []
    for r in result["rows"]:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    ncol = min(2, len(shapes))
    nrow = math.ceil(len(shapes) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 4.0 * nrow), squeeze=False, constrained_layout=True)
    norm = LogNorm(vmin=0.25, vmax=4.0)
    im = None
    for ax, s in zip(axes.flat, shapes):
        rows = [r for r in result["rows"] if r["shape"] == s]
        Gs = sorted({r["G"] for r in rows})
        Ns = sorted({r["N"] for r in rows})
        grid = [[float("nan")] * len(Ns) for _ in Gs]
        for r in rows:
            sp = r["methods"].get(label, {}).get("speedup")
            if sp:
                grid[Gs.index(r["G"])][Ns.index(r["N"])] = sp
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
        for i in range(len(Gs)):
            for j in range(len(Ns)):
                v = grid[i][j]
                ax.text(j, i, "–" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(Ns)), [str(n) for n in Ns])
        ax.set_yticks(range(len(Gs)), [str(g) for g in Gs])
        ax.set_xlabel("N (tokens of the busiest expert)")
        ax.set_ylabel("G (experts)")
        ax.set_title(f"{s} (M={rows[0]['M']}, K={rows[0]['K']})", fontsize=10)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    mode = "fast accumulation allowed" if label.endswith("fast_accum") else "fp32-promoted accumulation"
    fig.suptitle(f"s24-fp8 ({mode}) speedup over the best baseline · {result['gpu']} · {result['date'][:10]} · "
                 f"{result['commit'][:12]}", fontsize=10)
    if im is not None:
        ticks = [0.25, 0.5, 1.0, 2.0, 4.0]
        cb = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="speedup (×)", ticks=ticks)
        cb.ax.minorticks_off()
        cb.ax.set_yticklabels([f"{t:g}×" for t in ticks])
    fig.savefig(path, dpi=130)
    plt.close(fig)


def merge_results(paths: list[Path], out_dir: Path, prefix: str = "s24_fp8") -> dict:
    """Join sweeps made in several device calls (same kernel build) into one result; later rows replace earlier
    rows of the same (shape, G, N). Writes the JSON, Markdown and PNG like bench_s24."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(parts[0])
    rows: dict[tuple, dict] = {}
    for part in parts:
        for r in part["rows"]:
            rows[(r["shape"], r["G"], r["N"])] = r
    order = {name: i for i, name in enumerate(PAPER_SHAPES)}
    merged["rows"] = sorted(rows.values(), key=lambda r: (order.get(r["shape"], 99), r["shape"], r["G"], r["N"]))
    merged["runs"] = [{"date": p["date"], "commit": p["commit"], "gpu": p["gpu"], "rows": len(p["rows"])}
                      for p in parts]
    merged["targets"] = targets(merged["rows"])
    merged["targets_fast_accum"] = targets(merged["rows"], "s24_fp8_fast_accum")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{prefix}_kernel_bench.json").write_text(json.dumps(merged, indent=1))
    (out_dir / f"{prefix}_kernel_bench.md").write_text(markdown(merged))
    heatmap(merged, out_dir / f"{prefix}_kernel_bench.png")
    heatmap(merged, out_dir / f"{prefix}_kernel_bench_fast_accum.png", "s24_fp8_fast_accum")
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moesq_core.serving.bench.kernel_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--fmt", default="s24-fp8")
    ap.add_argument("--G", type=int, nargs="+", default=DEFAULT_G)
    ap.add_argument("--N", type=int, nargs="+", default=DEFAULT_N)
    ap.add_argument("--shape", type=str, nargs="*", default=None, help="custom shapes as MxK (default: paper Table 8)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="instead of measuring, merge these result JSONs (several device calls) into --out")
    args = ap.parse_args(argv)
    if args.merge:
        res = merge_results(args.merge, args.out)
        print(json.dumps(res["targets"], indent=1))
        return 0
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape] if args.shape else None
    res = bench_kernel(args.fmt, shapes, args.G, args.N, args.out, args.repeats)
    print(json.dumps(res.get("targets", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
