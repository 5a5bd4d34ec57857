"""Throughput of refinement on one Qwen3-30B-A3B–shaped MoE block: the batched trainer vs a per-expert loop.

    python benchmarks/bench_refine.py --out benchmarks/results            # defaults: 128 experts, H 2048, I 768, top-8
    python benchmarks/bench_refine.py --device cpu --experts 8 --hidden 256 --inter 128 --tokens 4096 --out /tmp/b

Random expert weights (scaled like a trained model's), random hidden states, a router with realistic load
imbalance (a per-expert popularity bias plus per-token noise, top-k, softmax-normalised weights). The
measured fraction is one optimizer step's worth of routed rows (the paper's batch: 64 sequences × 4,096
tokens × top-8 = 2,097,152 rows by default), stepped `--steps` times after a warm-up step. The per-expert
loop runs the same trainer one expert at a time (what the public release does) on `--loop-experts` experts
spread over the load distribution, extrapolated to the whole block.

GPU-minutes per block at the paper's budget (10 epochs × 8,192 sequences × 4,096 tokens × top-8 routed rows,
batch 64 sequences, 128 validation sequences, 11 validations) are EXTRAPOLATED from the measured step,
validation and setup throughputs; the report says so.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch._dynamo  # noqa: E402,F401  (imported up front: torch.optim pulls it in on first use, ~5 s)

from moesq_core.compression.kernels import gather_quant_triton, relax_triton, rows_add_triton, swiglu_quant_triton  # noqa: E402
from moesq_core.compression.methods.base import ExpertData, TokenRows  # noqa: E402
from moesq_core.compression.methods.refine import BlockRefiner, RefineConfig, trainer  # noqa: E402
from moesq_core.compression.methods.rtn import RTN  # noqa: E402
from moesq_core.formats import get_format  # noqa: E402

# name -> (description, RefineConfig overrides of the base configuration)
VARIANTS = {
    "eager": ("batched trainer, eager (the previous measurement's configuration)", {"compile": False}),
    "compile-unfused": ("as compile, but the relaxation through torch.compile and Lion's torch update (an earlier "
                        "default)", {"compile": True, "fused_kernels": False, "fused_swiglu": False}),
    "compile": ("batched trainer, torch.compile of the weight quantizer and micro-batch forward+loss (SwiGLU and its "
                "activation quantizer included), fused Triton relaxation and Lion kernels (the default before the "
                "fused SwiGLU quantizer)", {"compile": True, "fused_swiglu": False, "strided_rows_add": False}),
    "compile-rows": ("as compile, the transposed weight gradients added in their own layout (no contiguous copies)",
                     {"compile": True, "strided_rows_add": True}),
    "compile-swiglu": ("as compile-rows, with the SwiGLU output, its range and its NVFP4 quantizer in one Triton "
                       "kernel (the default before static-width)", {"compile": True, "fused_swiglu": True,
                                                                    "strided_rows_add": True}),
    "static-width": ("as compile-swiglu, the compiled functions specialised to the model's widths (only the expert "
                     "and row counts symbolic)", {"compile": True, "fused_swiglu": True, "strided_rows_add": True,
                                                  "static_widths": True}),
    "grad-fwd": ("as static-width, the loss's gradient in the expert outputs written by the micro-batch forward, "
                 "which gathers the rows' tokens and computes their dense targets itself, the full micro-batches' "
                 "gradients added by the row-add kernel, and the relaxation's column-form kernels (the default "
                 "before gather-quant)",
                 {"compile": True, "fused_swiglu": True, "strided_rows_add": True, "static_widths": True,
                  "loss_grad_in_forward": True, "all_rows_add": True, "relax_kernels": "cols"}),
    "gather-quant": ("as grad-fwd, the rows' gather and their NVFP4 input quantizer in one Triton kernel that also "
                     "writes the rows for the dense targets (the default)",
                     {"compile": True, "fused_swiglu": True, "strided_rows_add": True, "static_widths": True,
                      "loss_grad_in_forward": True, "all_rows_add": True, "relax_kernels": "cols",
                      "fused_gather": True}),
    "compile-mb2x": ("as compile-swiglu, micro-batches of twice the rows (524,288)",
                     {"compile": True, "fused_swiglu": True, "strided_rows_add": True,
                      "micro_batch_rows": 2 * 8 * 4096 * 8}),
}

# bench-only switches (not RefineConfig fields): kernels turned off for a variant
BENCH_KEYS = ("fused_kernels", "fused_swiglu", "strided_rows_add", "static_widths", "loss_grad_in_forward",
              "all_rows_add", "relax_kernels", "fused_gather")

PAPER = dict(epochs=10, sequences=8192, seq_len=4096, batch_sequences=64, val_sequences=128)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_block(E, H, inter, T, topk, dev, seed, imbalance):
    """Routed rows for T tokens. Returns (experts, load per expert)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    # Low-rank-plus-noise hidden states with a few large channels, like a transformer's residual stream.
    r = 64
    basis = torch.randn(r, H, generator=g, device=dev) / math.sqrt(r)
    x = (torch.randn(T, r, generator=g, device=dev) @ basis + 0.5 * torch.randn(T, H, generator=g, device=dev))
    x[:, :8] *= 6
    bias = imbalance * torch.randn(E, generator=g, device=dev)
    scores = bias[None, :] + torch.randn(T, E, generator=g, device=dev)
    top, idx = scores.topk(topk, dim=1)
    w = torch.softmax(top, dim=1)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).cpu()
    tok = order // topk
    wts = w.reshape(-1)[order]
    x = x.to(torch.bfloat16)
    experts, start = [], 0
    for e in range(E):
        n = int(counts[e])
        sel = tok[start:start + n]
        experts.append(ExpertData(
            e,
            torch.randn(inter, H, generator=g, device=dev) * H ** -0.5,
            torch.randn(inter, H, generator=g, device=dev) * H ** -0.5,
            torch.randn(H, inter, generator=g, device=dev) * inter ** -0.5,
            TokenRows(x, sel), wts[start:start + n].contiguous()))  # the engine's form: tokens held once
        start += n
    experts.sort(key=lambda ex: (-ex.n_rows, ex.index))  # as RefineMethod hands them to the trainer
    return experts, counts


def time_steps(r: BlockRefiner, steps: int, warmup: int, dev) -> list[float]:
    order = r.epoch_order()
    for _ in range(warmup):
        r.train_step(order, 0)
    times = []
    for _ in range(steps):
        sync(dev)
        t = time.perf_counter()
        r.train_step(order, 0)
        sync(dev)
        times.append(time.perf_counter() - t)
    return times


def weight_side_seconds(r: BlockRefiner, dev, reps: int = 2) -> float:
    """Relaxation + fake-quant of all weights and the backward through them (the per-step fixed cost)."""
    ts = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        W = r.soft_weights(1.0, 100.0)
        torch.autograd.backward(list(W.values()), [torch.ones_like(w) for w in W.values()])
        sync(dev)
        ts.append(time.perf_counter() - t)
        r.opt.zero_grad(set_to_none=True)
    return min(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=PAPER["batch_sequences"] * PAPER["seq_len"],
                    help="tokens routed for the measured fraction (default: one paper batch, 64 × 4,096)")
    ap.add_argument("--imbalance", type=float, default=0.2, help="std of the per-expert router bias")
    ap.add_argument("--format", default="p48-nvfp4")
    ap.add_argument("--micro-batch-rows", type=int, default=8 * 4096 * 8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--loop-experts", type=int, default=8, help="experts timed in the per-expert loop (0: skip)")
    ap.add_argument("--loop-steps", type=int, default=2)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--compute-dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="compile=True in the base configuration")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated trainer variants measured in this one process ({', '.join(VARIANTS)})")
    ap.add_argument("--e2e-epochs", type=int, default=0,
                    help="also time BlockRefiner.run() end to end at this many epochs of one step, last variant "
                         "(0: skip)")
    ap.add_argument("--profile", action="store_true", help="write a torch.profiler kernel table of one step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--tag", default=None, help="file name stem (default refine_<device>_<date>)")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    # The variants compile the trainer's functions again under other switches in this one process; dynamo counts
    # all of them against one function's recompilation limit, past which it would silently run a variant eagerly.
    torch._dynamo.config.recompile_limit = 64

    dev = torch.device(a.device)
    fmt = get_format(a.format)
    E, H, inter = a.experts, a.hidden, a.inter
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    experts, counts = make_block(E, H, inter, a.tokens, a.topk, dev, a.seed, a.imbalance)
    rows = int(counts.sum())
    sync(dev)
    t_data = time.perf_counter() - t0
    print(f"block: {E} experts, H {H}, I {inter}, {a.tokens} tokens × top-{a.topk} = {rows} routed rows; "
          f"load min/mean/max {int(counts.min())}/{rows / E:.0f}/{int(counts.max())} ({t_data:.1f}s)", flush=True)

    t0 = time.perf_counter()
    inits = RTN(report_errors=False).compress_block(experts, fmt)
    sync(dev)
    t_init = time.perf_counter() - t0

    base = dict(epochs=PAPER["epochs"], steps_per_epoch=1, micro_batch_rows=a.micro_batch_rows,
                val_fraction=a.val_fraction, compute_dtype=a.compute_dtype, compile=a.compile, seed=a.seed)
    names = a.variants.split(",") if a.variants else ["compile" if a.compile else "eager"]
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {n!r} (known: {', '.join(VARIANTS)})")
    paper_rows_epoch = PAPER["sequences"] * PAPER["seq_len"] * a.topk
    paper_steps = PAPER["epochs"] * PAPER["sequences"] // PAPER["batch_sequences"]
    paper_val_rows = PAPER["val_sequences"] * PAPER["seq_len"] * a.topk
    rows_per_step_paper = PAPER["batch_sequences"] * PAPER["seq_len"] * a.topk
    variants = {}
    for n in names:
        over = VARIANTS[n][1]
        cfg = RefineConfig(**{**base, **config_overrides(over)})
        with fused_kernels(over):
            variants[n] = v = measure(experts, inits, fmt, cfg, a, dev)
        v["description"] = VARIANTS[n][0]
        v["config"] = {k: getattr(cfg, k) for k in ("compile", "micro_batch_rows", "compute_dtype")}
        # Extrapolation to the paper's budget from this variant's measured throughputs.
        step_scale = rows_per_step_paper / v["train_rows_per_step"]  # the measured step had n_train rows
        train_s = paper_steps * v["step_s_median"] * step_scale
        # per validation: the fixed part (hard state, best-epoch bookkeeping) + the per-row forward passes
        val_s = (PAPER["epochs"] + 1) * (v["validation_fixed_s"]
                                         + paper_val_rows * v["validation_rows_s"] / max(v["val_rows"], 1))
        # once per block: per-row work (split, the dense SwiGLU range pass) for every routed row,
        # plus the fixed part (A/V init, optimizer); the epoch-0 validation is counted in val_s
        t = v["setup_phases_s"]
        per_row_setup = sum(t.get(k, 0.0) for k in ("gather_rows", "dense_targets"))
        setup_s = ((paper_rows_epoch + paper_val_rows) * per_row_setup / (v["train_rows_per_step"] + v["val_rows"])
                   + t["init_params"])
        v["paper_budget_extrapolated"] = {"train_min": train_s / 60, "val_min": val_s / 60, "setup_min": setup_s / 60,
                                          "gpu_min_per_block": (train_s + val_s + setup_s) / 60}
        print(f"[{n}] step {v['step_s_median']:.3f}s (steps {[round(x, 3) for x in v['step_s']]}, "
              f"first {v['first_step_s']:.1f}s), "
              f"{v['rows_per_s']:,.0f} rows/s; weight-side {v['weight_side_s_per_step']:.3f}s; "
              f"paper budget ≈ {v['paper_budget_extrapolated']['gpu_min_per_block']:.1f} GPU-min/block "
              "(extrapolated)", flush=True)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "bench_refine_partial.json").write_text(json.dumps(variants, indent=2, default=str))
        if a.e2e_epochs and n == names[-1]:
            with fused_kernels(over):
                v["end_to_end"] = e2e = end_to_end(experts, inits, fmt, RefineConfig(
                    **{**base, **config_overrides(over), "epochs": a.e2e_epochs}), dev)
            # the throughput model's prediction of the same run (each epoch: one step + one validation), to check it
            e2e["run_s_predicted"] = a.e2e_epochs * (v["step_s_median"] + v["validation_s"])
            print(f"[{n}] end to end: {v['end_to_end']}", flush=True)
    n_train, n_val = variants[names[0]]["train_rows_per_step"], variants[names[0]]["val_rows"]

    # Per-expert loop: the same trainer on one expert at a time, on experts spread over the load range.
    loop = None
    if a.loop_experts > 0:
        over = VARIANTS[names[0]][1]
        cfg = RefineConfig(**{**base, **config_overrides(over)})
        order = torch.argsort(counts, descending=True)
        pick = [int(order[round(i * (E - 1) / max(a.loop_experts - 1, 1))]) for i in range(min(a.loop_experts, E))]
        per = []
        for e in pick:
            with fused_kernels(over):
                re_ = BlockRefiner([experts[e]], [inits[e]], fmt, cfg)
                ts = time_steps(re_, a.loop_steps, 1, dev)
            per.append({"expert": e, "rows": int(re_.n_train.sum()), "step_s": statistics.median(ts)})
            del re_
        mean_step = sum(p["step_s"] for p in per) / len(per)
        loop_rows = sum(p["rows"] for p in per)
        loop_t = sum(p["step_s"] for p in per)
        loop = {"variant": names[0], "experts_timed": pick, "per_expert": per, "mean_step_s_per_expert": mean_step,
                "rows_per_s": loop_rows / loop_t, "block_step_s_extrapolated": mean_step * E}
        v0 = variants[names[0]]["paper_budget_extrapolated"]
        loop["paper_budget_gpu_min_per_block"] = (
            v0["gpu_min_per_block"] - v0["train_min"]
            + paper_steps * loop["block_step_s_extrapolated"] * rows_per_step_paper / n_train / 60)
        print(f"per-expert loop: {loop['rows_per_s']:,.0f} rows/s on {len(pick)} experts; block step ≈ "
              f"{loop['block_step_s_extrapolated']:.2f}s (extrapolated ×{E}/{len(pick)})", flush=True)

    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    commit = a.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or None
        except OSError:
            commit = None
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    res = {
        "date": date, "device": gpu, "torch": torch.__version__, "commit": commit, "format": fmt.name,
        "shape": {"experts": E, "hidden": H, "inter": inter, "topk": a.topk},
        "measured": {
            "tokens": a.tokens, "routed_rows": rows, "train_rows_per_step": n_train, "val_rows": n_val,
            "load_min_mean_max": [int(counts.min()), rows / E, int(counts.max())],
            "init_rtn_s": t_init, "data_gen_s": t_data,
        },
        "variants": variants,
        "per_expert_loop": loop,
        "paper_budget": {
            "note": "GPU-min per block EXTRAPOLATED from the measured step/validation/setup throughputs, "
                    "not measured end to end",
            "train_rows": PAPER["epochs"] * paper_rows_epoch, "steps": paper_steps,
            "val_rows_per_epoch": paper_val_rows,
            "target_min": 5,
        },
    }
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.tag or f"refine_{dev.type}_{date}"
    (a.out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (a.out / "bench_refine_partial.json").unlink(missing_ok=True)
    md = [
        f"# Refinement throughput — {fmt.name}, {E} experts × (H {H}, I {inter}), top-{a.topk}",
        "",
        f"{date} · {gpu} · torch {torch.__version__} · commit {commit}",
        "",
        f"Measured: one optimizer step over {n_train:,} routed training rows ({a.tokens:,} tokens × top-{a.topk}, "
        f"load min/mean/max {int(counts.min())}/{rows / E:.0f}/{int(counts.max())} rows per expert), median of "
        f"{a.steps} steps after {a.warmup} warm-up (the first step, compilation included, listed apart). All variants "
        "in one process on the same block.",
        "",
        "| variant | micro-batch rows | s / step | first step s | routed rows / s | weight-side s / step "
        "| peak GPU GiB | paper budget GPU-min / block (extrapolated: train + val + setup) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, v in variants.items():
        pb = v["paper_budget_extrapolated"]
        mem = "" if v["peak_gpu_mem_gib"] is None else f"{v['peak_gpu_mem_gib']:.1f}"
        md.append(f"| {n}: {v['description']} | {v['config']['micro_batch_rows']:,} | {v['step_s_median']:.3f} "
                  f"| {v['first_step_s']:.1f} "
                  f"| {v['rows_per_s']:,.0f} | {v['weight_side_s_per_step']:.3f} | {mem} "
                  f"| **{pb['gpu_min_per_block']:.1f}** "
                  f"({pb['train_min']:.1f} + {pb['val_min']:.1f} + {pb['setup_min']:.1f}) |")
    if loop:
        md.append(f"| per-expert loop ({names[0]}, {len(loop['experts_timed'])} experts timed, ×{E} extrapolated) | | "
                  f"{loop['block_step_s_extrapolated']:.3f} | | {loop['rows_per_s']:,.0f} | | | "
                  f"{loop['paper_budget_gpu_min_per_block']:.1f} |")
    md += ["", f"Paper budget: 10 epochs × 8,192 × 4,096 tokens × top-{a.topk}, {paper_steps} steps of "
           f"{rows_per_step_paper:,} rows, 11 validations over {paper_val_rows:,} rows; GPU-minutes per block are "
           "**EXTRAPOLATED** from the measured throughputs; target ≤ 5.", ""]
    for n, v in variants.items():
        t = v["setup_phases_s"]
        md.append(f"- {n}: setup phases (s) " + ", ".join(f"{k} {x:.2f}" for k, x in t.items())
                  + f"; one validation {v['validation_s']:.2f} s (fixed {v['validation_fixed_s']:.3f} "
                  f"+ rows {v['validation_rows_s']:.3f}).")
        if v.get("end_to_end"):
            e2e = v["end_to_end"]
            md.append(f"  - measured end to end (BlockRefiner construction + run() with export, {e2e['epochs']} epochs "
                      f"× 1 step over this block, compilation included where on): {e2e['total_s']:.1f} s "
                      f"= setup {e2e['setup_s']:.1f} + "
                      f"run {e2e['run_s']:.1f}; the throughput model used for the extrapolation predicts run "
                      f"{e2e['run_s_predicted']:.1f} s (epochs × (step + validation)).")
    md.append("")
    (a.out / f"{stem}.md").write_text("\n".join(md))
    for n, v in variants.items():
        if v.get("profile_top_kernels"):
            (a.out / f"{stem}_profile_{n}.txt").write_text(v["profile_top_kernels"])
    print("\n".join(md))
    return res


def config_overrides(over: dict) -> dict:
    """A variant's RefineConfig fields (its bench-only switches left out)."""
    return {k: x for k, x in over.items() if k not in BENCH_KEYS}


@contextlib.contextmanager
def fused_kernels(over: dict):
    """A variant's kernels: the trainer takes its torch path for the relaxation and Lion where fused_kernels is
    False, the fused SwiGLU quantizer only where fused_swiglu is True (else through torch.compile), and copies the
    transposed weight gradients contiguous before adding them unless strided_rows_add is True; static_widths,
    loss_grad_in_forward, all_rows_add and relax_kernels as the trainer's and kernels' switches of those names,
    fused_gather as gather_quant_triton.USE (absent: their earlier behaviour)."""
    mods = [m for m, key in ((relax_triton, "fused_kernels"), (swiglu_quant_triton, "fused_swiglu"))
            if not over.get(key, True)]
    saved = [m.available for m in mods]
    for m in mods:
        m.available = lambda device: False
    switches = [(swiglu_quant_triton, "USE", bool(over.get("fused_swiglu", False))),
                (rows_add_triton, "STRIDED", bool(over.get("strided_rows_add", False))),
                (trainer, "STATIC_WIDTHS", bool(over.get("static_widths", False))),
                (trainer, "LOSS_GRAD_IN_FORWARD", bool(over.get("loss_grad_in_forward", False))),
                (rows_add_triton, "ALL_ROWS", bool(over.get("all_rows_add", False))),
                (relax_triton, "KERNELS", over.get("relax_kernels", "tile")),
                (gather_quant_triton, "USE", bool(over.get("fused_gather", False)))]
    before = [getattr(m, k) for m, k, _ in switches]
    for m, k, x in switches:
        setattr(m, k, x)
    try:
        yield
    finally:
        for (m, k, _), x in zip(switches, before):
            setattr(m, k, x)
        for m, f in zip(mods, saved):
            m.available = f


def measure(experts, inits, fmt, cfg: RefineConfig, a, dev) -> dict:
    """Setup, validation, step and weight-side times of one trainer configuration on the block."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    r = BlockRefiner(experts, inits, fmt, cfg)  # includes Y, input quantization and the epoch-0 validation
    sync(dev)
    t_setup = time.perf_counter() - t0
    n_train, n_val = int(r.n_train.sum()), int(r.n_val.sum())
    # validation: the hard export state once per validation, then fp32 forward passes over the held-out rows
    t0 = time.perf_counter()
    W, _ = r.hard_state()
    sync(dev)
    t_hard = time.perf_counter() - t0
    r.validate(W)
    sync(dev)
    t_val_rows = time.perf_counter() - t0 - t_hard
    del W
    t0 = time.perf_counter()
    r.end_epoch(0)
    sync(dev)
    t_val = time.perf_counter() - t0
    order = r.epoch_order()
    sync(dev)
    t0 = time.perf_counter()
    r.train_step(order, 0)
    sync(dev)
    first = time.perf_counter() - t0
    step_times = time_steps(r, a.steps, max(a.warmup - 1, 0), dev)
    t_step = statistics.median(step_times)
    t_weight = weight_side_seconds(r, dev)
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    prof_table = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            r.train_step(order, 0)
            sync(dev)
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        # the step's kernels by their own time (the totals list the wrappers around them first)
        prof_table = prof.key_averages().table(sort_by="self_" + key, row_limit=30)
        del r
        with profile(activities=acts) as prof:  # the per-block setup (split, dense targets, input quantization, init)
            r = BlockRefiner(experts, inits, fmt, cfg)
            sync(dev)
        prof_table += "\n\nSetup (BlockRefiner construction):\n" + prof.key_averages().table(sort_by=key, row_limit=25)
    out = {"train_rows_per_step": n_train, "val_rows": n_val, "compute_dtype": compute_dtype_name(cfg, dev),
           "first_step_s": first, "step_s": step_times, "step_s_median": t_step, "rows_per_s": n_train / t_step,
           "weight_side_s_per_step": t_weight, "setup_s": t_setup, "setup_phases_s": dict(r.timings),
           "validation_s": t_val, "validation_fixed_s": max(t_val - t_val_rows, 0.0), "validation_rows_s": t_val_rows,
           "peak_gpu_mem_gib": mem, "profile_top_kernels": prof_table}
    del r
    return out


def end_to_end(experts, inits, fmt, cfg: RefineConfig, dev) -> dict:
    """One block through BlockRefiner construction + run() (train, validate per epoch, export), timed."""
    sync(dev)
    t0 = time.perf_counter()
    r = BlockRefiner(experts, inits, fmt, cfg)
    sync(dev)
    t_setup = time.perf_counter() - t0
    r.run()
    sync(dev)
    total = time.perf_counter() - t0
    run_s = total - t_setup
    steps = r.step_count
    out = {"epochs": cfg.epochs, "steps": steps, "setup_s": t_setup, "run_s": run_s, "total_s": total}
    del r
    return out


def compute_dtype_name(cfg: RefineConfig, dev) -> str:
    if cfg.compute_dtype == "auto":
        return "bfloat16" if dev.type == "cuda" else "float32"
    return cfg.compute_dtype


if __name__ == "__main__":
    main()
