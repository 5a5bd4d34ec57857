"""Kernel benchmark for p48-nvfp4: the Hopper grouped GEMMs (Triton; native sparse tensor cores) vs torch's bf16
and fp8 grouped GEMMs.

    bench_p48(shapes=[(1536, 2048, 128), (4096, 7168, 48)], G=[128], N=[1, 4, 16, 64, 128, 256],
              out_dir=Path("benchmarks/results"))

Shapes are (M, K) or (M, K, G) (a shape's own G overrides the G list); default: the paper's Table 8 layers.
Tokens per expert follow {N, 3N/4, N/2, N/4} over the G experts (at least 1), as moesq_core.serving.bench.harness does.
Timing is the harness's (moesq_core.serving.bench.harness.graph_time): CUDA-graph replay, median over `repeats` replays,
weight copies rotated so one replay streams at least 256 MiB (no L2 reuse across calls).

Methods timed in one process on the same token counts:
  bf16_grouped_mm / fp8_grouped_mm   the harness's torch._grouped_mm / torch._scaled_grouped_mm baselines
  p48_w4a16        p48_triton GEMM, bf16 activations in the capacity layout [G, C, K], inline-PTX expansion
  p48_w4a4         NVFP4 activation quantization (all G*C capacity rows) + the same GEMM
  p48_w4a16_plain  the GEMM with the plain-Triton expansion (use_asm=False), for the PTX gain (N <= 16 only)
  p48_mma_w4a16    the native sparse-tensor-core kernel (moesq_core.serving.kernels.p48_mma), same activations; skipped
                   (with the reason in the row) where the native module cannot run
  p48_mma_w4a4     the same NVFP4 quantization pre-pass + the native kernel
  p48_mma_w4a4_fused  the native kernel quantizing the bf16 activations to NVFP4 while staging them (no pre-pass;
                   the same operands as p48_mma_w4a4, bit for bit)
p48 weights are random valid packed tensors (every kept byte, pattern and scale drawn uniformly), built on
the GPU; each shape's first copy is checked against p48_reference on two experts before it is timed.
Achieved bandwidth counts the packed weight bytes (2.75 bits/weight) over the median time.

Writes p48_kernel_bench.json / .md / .png into out_dir.
"""
from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path

import torch

from moesq_core.serving.bench.harness import (
    BASELINES,
    PAPER_SHAPES,
    Problem,
    Timing,
    copies_for,
    effective_tflops,
    graph_time,
    new_row,
    run_header,
    time_gemm,
)

P48_METHODS = {
    "p48_w4a16": "moesq p48 Triton grouped GEMM, bf16 activations, inline-PTX weight expansion",
    "p48_w4a4": "NVFP4 activation quantization (32-blocks, static global scale) + the p48 GEMM",
    "p48_w4a16_plain": "the p48 GEMM with the plain-Triton weight expansion (N <= 16 only)",
    "p48_mma_w4a16": "moesq p48 CUDA grouped GEMM on the 2:4 sparse tensor cores (mma.sp bf16), bf16 activations",
    "p48_mma_w4a4": "NVFP4 activation quantization + the p48 sparse-tensor-core GEMM",
    "p48_mma_w4a4_fused": "the p48 sparse-tensor-core GEMM quantizing activations to NVFP4 in its staging",
}
MMA_METHODS = ("p48_mma_w4a16", "p48_mma_w4a4", "p48_mma_w4a4_fused")
# The targets for the p48 kernel (packed bytes at N <= 16, speedups over torch's fp8 grouped GEMM).
TARGET_TBPS, TARGET_SPEEDUP_SMALL, TARGET_SPEEDUP_128 = 2.5, 2.0, 1.0
BASELINE_NAMES = ("bf16_grouped_mm", "fp8_grouped_mm")
VALID_NIBBLES = (3, 5, 6, 9, 10, 12)
COPY_BANDWIDTH_TBPS = 4.3  # device-to-device copy measured on an H200


def random_p48_tensors(G: int, M: int, K: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Random valid release-layout tensors [G, M, ...]: any kept byte, any of the 6 pair patterns, scales
    2^-3..2^3 (e4m3), global scales around 1e3."""
    kept = torch.randint(0, 256, (G, M, K // 4), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    nib = torch.tensor(VALID_NIBBLES, device=device, dtype=torch.uint8)[
        torch.randint(0, 6, (G, M, K // 8), generator=gen, device=device)]
    mask = nib[..., 0::2] | (nib[..., 1::2] << 4)
    exp = torch.randint(4, 11, (G, M, K // 32), generator=gen, device=device, dtype=torch.int32)
    man = torch.randint(0, 8, (G, M, K // 32), generator=gen, device=device, dtype=torch.int32)
    scale = ((exp << 3) | man).to(torch.uint8).view(torch.float8_e4m3fn)
    g = torch.rand(G, 1, generator=gen, device=device) * 1000 + 500
    return {"weight_sparse_packed": kept, "weight_sparse_mask": mask.contiguous(), "weight_scale": scale,
            "weight_global_scale": g.float()}


class P48Bench:
    """The p48 GEMM on one problem: capacity-batched activations [G, C, K], counts on the device. `native`:
    the sparse-tensor-core module (moesq_core.serving.kernels.p48_mma) instead of the Triton kernel."""

    def __init__(self, prob: Problem, gen: torch.Generator, device, native=None):
        from moesq_core.serving.kernels import p48_mma as pm
        from moesq_core.serving.kernels import p48_triton as pt

        self.pt, self.pm, self.native, self.prob, self.gen, self.device = pt, pm, native, prob, gen, device
        G, K, C = prob.G, prob.K, prob.capacity
        self.x = (torch.randn(G, C, prob.K, generator=gen, device=device) * 2).to(torch.bfloat16)
        self.xr = self.x.reshape(G * C, K)
        self.counts = torch.tensor(prob.counts, dtype=torch.int32, device=device)
        self.row_start = torch.arange(G, dtype=torch.int32, device=device) * C
        self.row_group = torch.arange(G, dtype=torch.int32, device=device).repeat_interleave(C)
        self.g_act = torch.rand(G, generator=gen, device=device) * 100 + 100
        self.xq = torch.empty_like(self.xr)
        if native is None:
            self.config = pt.pick_config(prob.M, K, G, C, device)
        else:
            self.config = pm.pick_config(prob.M, K, G, C, device, experts=G)
        out_dtype = torch.float32 if self.config.split > 1 else torch.bfloat16
        self.out = torch.zeros(G * C, prob.M, dtype=out_dtype, device=device)
        self.copies: list = []
        self.x_permuted = False  # native: x handed over in the kernel's K order (use_permuted_activations)
        self.raw0: dict | None = None
        self.dec = None  # p48_reference decode of copy 0's first two experts, made once

    def add_copy(self):
        t = random_p48_tensors(self.prob.G, self.prob.M, self.prob.K, self.gen, self.device)
        if self.raw0 is None:
            self.raw0 = {k: v[:2].cpu() for k, v in t.items()}
        if self.native is None:
            w = self.pt.P48GemmWeights.from_packed(t)
        else:
            w = self.pm.P48MmaWeights.from_packed(t)
        del t
        self.copies.append(w)
        return w

    def use_permuted_activations(self) -> None:
        """Hand the kernel x in its K order, as the runtime's GEMMs receive it (the scatter writes the hidden
        states so; the gate/up weight rows are stored so, which puts the SwiGLU output in it); self.x stays natural
        for the reference."""
        self.xr = self.xr[:, self.pm.k_order(self.prob.K, self.device)].contiguous()
        self.x_permuted = True

    @property
    def weight_bytes(self) -> int:
        return self.copies[0].nbytes

    def gemm(self, x, w, alpha, use_asm: bool, act_global=None):
        if self.native is None:
            self.pt.p48_gemm_rows(x, w, self.row_start, self.counts, alpha, self.out, self.config, use_asm)
        else:
            self.pm.p48_mma_gemm_rows(x, w, self.row_start, self.counts, alpha, self.out, self.config, self.native,
                                      act_global, self.x_permuted)

    def call(self, w, act_quant: bool, use_asm: bool, fused: bool = False):
        """The timed closure; fused (native only): W4A4 with the quantization inside the kernel."""
        pt, cfg, out = self.pt, self.config, self.out
        if fused:
            alpha = (1.0 / (w.global_scale * self.g_act)).contiguous()

            def run():
                if cfg.split > 1:
                    out.zero_()
                self.gemm(self.xr, w, alpha, use_asm, self.g_act)
        elif act_quant:
            alpha = (1.0 / (w.global_scale * self.g_act)).contiguous()

            def run():
                if cfg.split > 1:
                    out.zero_()
                pt.nvfp4_quantize_rows(self.xr, self.row_group, self.g_act, self.xq)
                self.gemm(self.xq, w, alpha, use_asm)
        else:
            alpha = (1.0 / w.global_scale).contiguous()

            def run():
                if cfg.split > 1:
                    out.zero_()
                self.gemm(self.xr, w, alpha, use_asm)
        return run

    def verify(self, act_quant: bool, use_asm: bool, fused: bool = False) -> float:
        """Relative error of copy 0 on experts 0 and 1 against p48_reference (CPU)."""
        from moesq_core.serving.kernels import p48_reference as ref

        self.call(self.copies[0], act_quant, use_asm, fused)()
        if self.out.is_cuda:
            torch.cuda.synchronize()
        if self.dec is None:
            self.dec = ref.decode_p48(self.raw0)
        dec = self.dec
        cnt = self.counts[:2].cpu()
        dec.input_global_scale = self.g_act[:2].cpu()  # used only when act_quant
        want = ref.p48_grouped_ref(self.x[:2].cpu(), cnt, dec, act_quant)
        C = self.prob.capacity
        got = self.out[: 2 * C].float().cpu().reshape(2, C, -1)
        num = sum(((got[e, : int(cnt[e])] - want[e, : int(cnt[e])]) ** 2).sum() for e in range(2))
        den = sum((want[e, : int(cnt[e])] ** 2).sum() for e in range(2))
        return float((num / den).sqrt())


def _record(t: Timing, prob: Problem, weight_bytes: int) -> dict:
    sec = t.median_us * 1e-6
    return {"us": round(t.median_us, 3), "p10_us": round(t.p10_us, 3), "p90_us": round(t.p90_us, 3),
            "tflops": round(effective_tflops(prob.M, prob.K, prob.counts, sec), 2),
            "weight_bytes": int(weight_bytes), "weight_TBps": round(weight_bytes / sec / 1e12, 3),
            "copies": t.copies, "replays": t.replays}


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _bench_kernel(row: dict, ours: P48Bench, methods: tuple[str, ...], N: int, repeats: int, config_key: str):
    prob = ours.prob
    ours.add_copy()
    row[config_key] = ours.config.__dict__
    for label in methods:
        fused = label == "p48_mma_w4a4_fused"
        act_quant = label.endswith("w4a4") or fused
        use_asm = label != "p48_w4a16_plain"
        if label == "p48_w4a16_plain" and N > 16:
            continue
        rec: dict = {}
        try:
            err = ours.verify(act_quant, use_asm, fused)
            rec["verify_rel_err"] = err
            if not err < 1e-2:  # the timed GEMM stores bf16 (rounding ~3e-3); exactness is tested in fp32
                rec["error"] = f"verification against p48_reference failed: relative error {err:.3g}"
            else:
                while len(ours.copies) < copies_for(ours.weight_bytes):
                    ours.add_copy()
                t = graph_time([ours.call(w, act_quant, use_asm, fused) for w in ours.copies], repeats)
                rec.update(_record(t, prob, ours.weight_bytes))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        row["methods"][label] = rec
    row.setdefault("p48_bits_per_weight", round(8.0 * ours.weight_bytes / (prob.G * prob.M * prob.K), 4))
    del ours
    _free()


def bench_one(name: str, M: int, K: int, G: int, N: int, repeats: int, device, seed: int = 0,
              methods: tuple[str, ...] = tuple(P48_METHODS)) -> dict:
    prob, gen, row = new_row(name, M, K, G, N, seed, device)
    for bname in BASELINE_NAMES:
        m = None
        try:
            m = BASELINES[bname](prob, gen, device)
            row["methods"][bname] = _record(time_gemm(m, repeats), prob, m.weight_bytes)
        except Exception as e:  # a baseline that cannot run a shape is reported, not fatal
            row["methods"][bname] = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            del m
            _free()
    triton_methods = tuple(m for m in methods if m not in MMA_METHODS)
    mma_methods = tuple(m for m in methods if m in MMA_METHODS)
    if triton_methods:
        _bench_kernel(row, P48Bench(prob, gen, device), triton_methods, N, repeats, "p48_config")
    if mma_methods:
        from moesq_core.serving.kernels import p48_mma

        native = p48_mma.load_native()
        if native is None:
            for label in mma_methods:
                row["methods"][label] = {"error": "the native module cannot run here (needs sm_90 and nvcc)"}
        else:
            ours = P48Bench(prob, gen, device, native)
            if p48_mma.takes_permuted_activations(native):
                ours.use_permuted_activations()  # as the runtime hands them over (scatter, SwiGLU)
            row["p48_mma_x_permuted"] = ours.x_permuted
            _bench_kernel(row, ours, mma_methods, N, repeats, "p48_mma_config")
    base = {k: row["methods"][k]["us"] for k in BASELINE_NAMES if "us" in row["methods"].get(k, {})}
    for label in P48_METHODS:
        rec = row["methods"].get(label, {})
        if "us" in rec:
            for k, us in base.items():
                rec[f"speedup_vs_{k.split('_')[0]}"] = round(us / rec["us"], 3)
    return row


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def targets(rows: list[dict], label: str = "p48_w4a16") -> dict:
    """Performance targets: N <= 16: >= TARGET_TBPS of packed bytes and >= TARGET_SPEEDUP_SMALL x fp8;
    N = 128: >= TARGET_SPEEDUP_128 x fp8."""
    get = lambda r, k: r["methods"].get(label, {}).get(k)  # noqa: E731
    small = [r for r in rows if r["N"] <= 16 and get(r, "us")]
    mid = [r for r in rows if r["N"] == 128 and get(r, "us")]
    bw = [get(r, "weight_TBps") for r in small]
    sp_small = [get(r, "speedup_vs_fp8") for r in small if get(r, "speedup_vs_fp8")]
    sp_mid = [get(r, "speedup_vs_fp8") for r in mid if get(r, "speedup_vs_fp8")]
    return {
        "N_le_16_TBps": {"min": min(bw) if bw else None, "max": max(bw) if bw else None, "target": TARGET_TBPS,
                         "met": bool(bw) and min(bw) >= TARGET_TBPS},
        "N_le_16_speedup_vs_fp8": {"min": min(sp_small) if sp_small else None, "geomean": _geomean(sp_small),
                                   "target": TARGET_SPEEDUP_SMALL,
                                   "met": bool(sp_small) and min(sp_small) >= TARGET_SPEEDUP_SMALL},
        "N_128_speedup_vs_fp8": {"min": min(sp_mid) if sp_mid else None, "geomean": _geomean(sp_mid),
                                 "target": TARGET_SPEEDUP_128,
                                 "met": bool(sp_mid) and min(sp_mid) >= TARGET_SPEEDUP_128},
    }


def _shapes(shapes, G) -> list[tuple[str, int, int, int]]:
    Gs = [G] if isinstance(G, int) else list(G)
    names = {v: k for k, v in PAPER_SHAPES.items()}
    if not shapes:
        shapes = list(PAPER_SHAPES.values())
    out = []
    for s in shapes:
        M, K = s[0], s[1]
        for g in ([s[2]] if len(s) > 2 else Gs):
            out.append((names.get((M, K), f"M={M} K={K}"), M, K, g))
    return out


def bench_p48(shapes, G, N, out_dir: Path, repeats: int = 50, log=print,
              methods: tuple[str, ...] = tuple(P48_METHODS)) -> dict:
    """Benchmark the p48 kernel over shapes x G x N against the bf16/fp8 baselines; write
    p48_kernel_bench.{json,md,png} into out_dir and return the result dict."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_p48 needs a CUDA GPU (the p48 kernel targets H100/H200)")
    device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    Ns = [N] if isinstance(N, int) else list(N)
    result = {
        **run_header("p48-nvfp4", device, repeats), "triton": __import__("triton").__version__,
        "token_pattern": "{N, 3N/4, N/2, N/4} repeated over G experts (each >= 1)",
        "timing": "moesq_core.serving.bench.harness.graph_time: CUDA-graph replay, median; weight copies rotated "
                  "so a replay streams >= 256 MiB",
        "p48_mma_activations": "in the kernel's K order where the module takes it (p48_mma.k_order), as "
                               "moesq's runtime hands them over: its scatter writes the hidden states so and its "
                               "gate/up rows are stored so, which puts the SwiGLU output in that order",
        # the native launcher's default (MOESQ_P48_PDL=0 launches plainly)
        "p48_mma_programmatic_launch": any(m in MMA_METHODS for m in methods)
                                       and os.environ.get("MOESQ_P48_PDL", "1") != "0",
        "methods": {k: BASELINES[k].description for k in BASELINE_NAMES} | {k: P48_METHODS[k] for k in methods},
        "copy_bandwidth_TBps": COPY_BANDWIDTH_TBPS,
        "rows": [],
    }
    for name, M, K, g in _shapes(shapes, G):
        for n in Ns:
            row = bench_one(name, M, K, g, n, repeats, device, methods=methods)
            result["rows"].append(row)
            f = row["methods"].get("fp8_grouped_mm", {})
            parts = []
            for label in ("p48_w4a16", "p48_mma_w4a16", "p48_mma_w4a4_fused"):
                p = row["methods"].get(label)
                if p is not None:
                    parts.append(f"{label} {p.get('us', float('nan')):8.1f} us "
                                 f"{p.get('weight_TBps', float('nan')):5.2f} TB/s "
                                 f"x{p.get('speedup_vs_fp8', float('nan')):.2f} vs fp8 {p.get('error', '')}")
            log(f"{name:24s} G={g:4d} N={n:4d} | fp8 {f.get('us', float('nan')):8.1f} us | " + " | ".join(parts))
            (out_dir / "p48_kernel_bench.json").write_text(json.dumps(result, indent=1))
    for label in ("p48_w4a16", "p48_w4a4", *MMA_METHODS):
        if label in methods:
            result[f"targets_{label}"] = targets(result["rows"], label)
    (out_dir / "p48_kernel_bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / "p48_kernel_bench.md").write_text(markdown(result))
    try:
        plot(result, out_dir / "p48_kernel_bench.png")
    except Exception as e:  # a missing matplotlib must not lose the numbers
        log(f"plot skipped: {e}")
    return result


def markdown(result: dict) -> str:
    cols = list(BASELINE_NAMES) + [m for m in P48_METHODS if m in result["methods"]]
    ratio_cols = [m for m in ("p48_w4a16", "p48_w4a4", *MMA_METHODS) if m in result["methods"]]
    lines = [
        "# p48-nvfp4 grouped GEMM on Hopper vs torch bf16 / fp8 grouped GEMMs",
        "",
        f"{result['date']} · {result['gpu']} ({result['sm_count']} SMs) · torch {result['torch']} (CUDA "
        f"{result['cuda']}) · triton {result['triton']} · commit `{result['commit']}` · {result['repeats']} "
        "CUDA-graph replays (median)",
        "",
        f"Tokens per expert: {result['token_pattern']}. µs per grouped GEMM; TB/s = the method's weight bytes / "
        "time (p48: packed bytes, 2.75 bits/weight)."
        + (" p48_mma: activations in the kernel's K order, as moesq's runtime hands them over."
           if any(r.get("p48_mma_x_permuted") for r in result["rows"]) else "")
        + (" p48_mma launches use programmatic dependent launch (each call waits for the previous grid before it "
           "reads its inputs; back-to-back calls overlap one's launch and first weight loads with the other's tail)."
           if result.get("p48_mma_programmatic_launch") else ""),
        "",
        "| shape | G | N | " + " | ".join(cols) + " | "
        + " | ".join(f"{m} TB/s | {m} vs fp8" for m in ratio_cols) + " |",
        "|---|---|---|" + "---|" * len(cols) + "---|---|" * len(ratio_cols),
    ]
    for r in result["rows"]:
        ms = r["methods"]
        cells = []
        for c in cols:
            m = ms.get(c, {})
            cells.append(f"{m['us']:.1f}" if "us" in m else ("err" if "error" in m else "–"))
        ratios = [f"{ms.get(m, {}).get('weight_TBps', '–')} | {ms.get(m, {}).get('speedup_vs_fp8', '–')}"
                  for m in ratio_cols]
        lines.append(f"| {r['shape']} | {r['G']} | {r['N']} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    errs = [(r["shape"], r["N"], k, m["error"])
            for r in result["rows"] for k, m in r["methods"].items() if "error" in m]
    if errs:
        lines += ["", "Errors:", ""] + [f"- {s} N={n} {k}: {e}" for s, n, k, e in errs]
    lines += ["", "## Targets", ""]
    for label in ratio_cols:
        for tname, t in result.get(f"targets_{label}", {}).items():
            lines.append(f"- {label} {tname}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in t.items()))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = []
    for r in result["rows"]:
        key = (r["shape"], r["G"])
        if key not in shapes:
            shapes.append(key)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, (shape, g) in zip(axes[0], shapes):
        rows = [r for r in result["rows"] if (r["shape"], r["G"]) == (shape, g)]
        for m in list(BASELINE_NAMES) + ["p48_w4a16", "p48_w4a4", *MMA_METHODS]:
            pts = [(r["N"], r["methods"][m]["us"]) for r in rows if "us" in r["methods"].get(m, {})]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} (G={g})", fontsize=9)
        ax.set_xlabel("tokens per expert N")
        ax.set_ylabel("µs per grouped GEMM")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"p48-nvfp4 kernels vs torch grouped GEMMs · {result['gpu']} · {result['date'][:10]} · "
                 f"{result['commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
