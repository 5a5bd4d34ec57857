"""`moesq verify DIR --kernel`: run every packed expert of a model directory through its GPU kernel.

Formats covered (KERNEL_FORMATS): s24-fp8 (the CUTLASS 2:4 sparse FP8 grouped GEMM, Hopper) and p48-nvfp4 (the
native 2:4 sparse-tensor-core kernel of moesq_core.serving.kernels.p48_mma on Hopper; the Triton kernel of
p48_triton where the native module cannot run).

For each layer's projection (gate_proj / up_proj / down_proj) the experts are stacked into one grouped call
(capacity-batched, token counts cycling through capacity, 1, 0, capacity/2, ...) on fresh random activations and
compared with the format's CPU reference, reading tensors one projection at a time with safe_open:
  s24-fp8    activations quantized per token to e4m3; `reference_grouped_gemm` (float64) under
             `s24_fp8.error_bound`;
  p48-nvfp4  bf16 activations, W4A16, and where the directory carries input global scales also W4A4 (reported
             as `<tensor> (W4A4)`; the native kernel quantizes the activations itself); p48_reference in float32.
             Kernel and reference sum the same exact products in fp32 in different orders, so every output must
             lie within 2^-20 * sqrt(K) * sum_k |x_k w_k| of the reference (about 16x the random-walk error
             of two fp32 sums; one wrong weight code moves an output by ~1/K of that sum) and each expert's
             relative error must stay below P48_REL_TOL; the output starts as NaN, so rows the kernel skips or
             writes past an expert's count fail.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from moesq_core.naming import EXPERT_RE, weight_files
from moesq_core.serving.kernels import s24_gemm as s24

# the tensor suffix that marks a format's packed expert linear
FORMAT_MARKERS = {"weight_sparse_values": "s24-fp8", "weight_sparse_packed": "p48-nvfp4"}
KERNEL_FORMATS = tuple(FORMAT_MARKERS.values())
P48_REL_TOL = 2e-5  # per expert, relative Frobenius error of fp32 outputs (measured ~1e-7 on an H200)
P48_ORDER_BOUND = 2.0**-20  # per output, times sqrt(K) * sum_k |x_k w_k|: fp32 summation-order noise


def _weight_files(path: Path) -> list[Path]:
    found = [path / f for f in weight_files(path)] or sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{path}: no model.safetensors, index or *.safetensors files")
    return found


def _locate(path: Path) -> dict[tuple[str, str, str], dict[int, tuple[Path, str]]]:
    """(format, layer prefix, proj) -> expert -> (file, tensor name without suffix)."""
    groups: dict[tuple[str, str, str], dict[int, tuple[Path, str]]] = defaultdict(dict)
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                m = EXPERT_RE.match(key)
                if m and m["suffix"] in FORMAT_MARKERS:
                    name = key[: -len(m["suffix"]) - 1]
                    groups[(FORMAT_MARKERS[m["suffix"]], m["prefix"], m["proj"])][int(m["expert"])] = (f, name)
    return groups


def _read(f: Path, name: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    with safe_open(str(f), framework="pt") as sf:
        keys = set(sf.keys())
        out = {}
        for suffix in required + optional:
            full = f"{name}.{suffix}"
            if full in keys:
                out[suffix] = sf.get_tensor(full)
            elif suffix in required:
                raise ValueError(f"{full}: missing (this expert linear needs {', '.join(required)})")
        return out


def _token_counts(E: int, capacity: int) -> torch.Tensor:
    pattern = [capacity, 1, 0, max(capacity // 2, 1)]
    return torch.tensor([pattern[i % len(pattern)] for i in range(E)], dtype=torch.int32)


def kernel_check_packed_dir(path: str | Path, capacity: int = 16, seed: int = 0, ref_device: str = "cpu",
                            fast_accum: bool = False, progress=None, info: dict | None = None
                            ) -> list[tuple[str, float, bool]]:
    """Every packed s24-fp8 / p48-nvfp4 expert linear in `path` through its kernel vs the reference.

    Returns [(tensor name `<prefix>.mlp.experts.<e>.<proj>`, max |kernel - reference| over its valid rows, ok)]
    (p48 W4A4 rows are named `<tensor> (W4A4)`). `progress`: a moesq_core.progress.Progress (one unit per
    projection). `info`, when given, receives {"p48_kernel": "sparse-mma" | "triton", "kernel": a description}
    for p48 directories.
    Raises RuntimeError when the GPU (or native build) the kernel needs is absent, ValueError when the
    directory holds no expert of a covered format. s24 experts the kernel cannot take (M % 8 or K % 32 != 0)
    come back with nan, False.
    """
    from moesq_core.progress import NullProgress

    path = Path(path)
    groups = _locate(path)
    if not groups:
        raise ValueError(f"{path}: no packed expert tensors of a format the kernel check covers "
                         f"({', '.join(KERNEL_FORMATS)}: *.mlp.experts.<e>.<proj>.weight_sparse_values / "
                         "weight_sparse_packed)")
    formats = {fmt for fmt, _, _ in groups}
    p48_kernel = None
    try:
        if "s24-fp8" in formats:
            s24.check_device()
        if "p48-nvfp4" in formats:
            p48_kernel = _p48_kernel()
    except RuntimeError as e:
        raise RuntimeError(f"kernel check of {path} impossible: {e}") from e
    if info is not None and p48_kernel is not None:
        info["p48_kernel"] = p48_kernel[0]
        info["kernel"] = f"p48-nvfp4 on the {p48_kernel[0]} kernel"  # what the CLI prints
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    results: list[tuple[str, float, bool]] = []
    with (progress or NullProgress()).task("kernel check", len(groups)) as task:
        for (fmt, prefix, proj), experts in sorted(groups.items()):
            order = sorted(experts)
            names = [experts[e][1] for e in order]
            if fmt == "s24-fp8":
                packed = [_read(*experts[e], ("weight_sparse_values", "weight_sparse_meta", "weight_scale"))
                          for e in order]
                results += _check_s24(packed, names, capacity, gen, device, ref_device, fast_accum)
            else:
                from moesq_core.serving.kernels.p48_reference import WEIGHT_SUFFIXES

                packed = [_read(*experts[e], WEIGHT_SUFFIXES, ("input_global_scale",)) for e in order]
                results += _check_p48(packed, names, capacity, gen, device, p48_kernel)
            task.advance(1)
    return results


def _check_s24(packed, names, capacity, gen, device, ref_device, fast_accum) -> list[tuple[str, float, bool]]:
    values = torch.stack([p["weight_sparse_values"] for p in packed])
    meta = torch.stack([p["weight_sparse_meta"] for p in packed])
    scale = torch.stack([p["weight_scale"] for p in packed]).float()
    E, M, K = values.shape[0], values.shape[1], values.shape[2] * 2
    try:
        w = s24.prepare_weights(values, meta, scale, device)
    except ValueError:
        return [(n, math.nan, False) for n in names]
    counts = _token_counts(E, capacity)
    x = torch.randn(E, capacity, K, generator=gen)
    xq, sx = s24.quantize_activations(x)
    out = torch.full((E, capacity, M), float("nan"), dtype=torch.bfloat16, device=device)
    s24.grouped_gemm(w, xq.to(device), sx.to(device), counts.to(device), out, fast_accum=fast_accum)
    got = out.cpu()
    ref = s24.reference_grouped_gemm(values.to(ref_device), meta.to(ref_device), scale.to(ref_device),
                                     xq.to(ref_device), sx.to(ref_device), counts).cpu()
    wabs = s24.decompress(values.to(ref_device), meta.to(ref_device)).double().abs()
    results = []
    for i, n in enumerate(names):
        c = int(counts[i])
        if c == 0:
            results.append((n, 0.0, True))
            continue
        g, r = got[i, :c].double(), ref[i, :c].double()
        absdot = ((xq[i, :c].to(ref_device).double().abs() @ wabs[i].T).cpu()
                  * scale[i].reshape(1, M).double() * sx[i, :c, None].double())
        err = (g - r).abs()
        finite = bool(torch.isfinite(g).all())
        ok = finite and bool((err <= s24.error_bound(r, absdot, fast_accum)).all())
        results.append((n, float(err.max()) if finite else math.inf, ok))
    return results


# ------------------------------------------------------------------------------------------------ p48-nvfp4


def _p48_kernel():
    """("sparse-mma", native module) on an sm_90 GPU with the native build, else ("triton", None) on a CUDA
    GPU with triton; RuntimeError without a GPU."""
    from moesq_core.serving.kernels import p48_mma as pm
    from moesq_core.serving.kernels import p48_triton as pt

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is available (the p48-nvfp4 kernels run on Hopper GPUs: H100/H200)")
    native = pm.load_native()
    if native is not None:
        return "sparse-mma", native
    pt.require_triton(torch.device("cuda"))
    return "triton", None


def _check_p48(packed, names, capacity, gen, device, kernel) -> list[tuple[str, float, bool]]:
    from moesq_core.serving.kernels import p48_mma as pm
    from moesq_core.serving.kernels import p48_reference as ref
    from moesq_core.serving.kernels import p48_triton as pt

    which, native = kernel
    E = len(packed)
    M, K = packed[0]["weight_sparse_packed"].shape[0], packed[0]["weight_sparse_packed"].shape[1] * 4
    dec = ref.decode_p48({s: torch.stack([p[s] for p in packed]) for s in ref.WEIGHT_SUFFIXES})
    if which == "sparse-mma":
        w = pm.P48MmaWeights.from_packed(packed, device)
        cfg = pm.pick_config(M, K, E, capacity, device, experts=E)
    else:
        w = pt.P48GemmWeights.from_packed(packed, device)
        cfg = pt.pick_config(M, K, E, capacity, device)
    counts = _token_counts(E, capacity)
    x = (torch.randn(E, capacity, K, generator=gen) * 2).to(torch.bfloat16)
    xr = x.reshape(E * capacity, K).to(device)
    row_start = (torch.arange(E, dtype=torch.int32) * capacity).to(device)
    modes = [False]
    if any("input_global_scale" in p for p in packed):
        modes.append(True)
    results = []
    for act_quant in modes:
        # W4A4: each expert's static input global scale, or the dynamic one of its rows where it is 0
        g_act = torch.ones(E)
        if act_quant:
            for e, p in enumerate(packed):
                g = p.get("input_global_scale", torch.zeros(1)).float().reshape(())
                if int(counts[e]):
                    g = ref.quantize_act_unscaled(x[e, : int(counts[e])], g)[1]
                g_act[e] = g if g > 0 else 1.0
        g_dev = g_act.to(device)
        alpha = 1.0 / (w.global_scale * g_dev) if act_quant else 1.0 / w.global_scale
        if cfg.split == 1:  # poisoned: every valid row must be written, no other
            out = torch.full((E * capacity, M), float("nan"), device=device)
        else:  # K slices accumulate atomically
            out = torch.zeros(E * capacity, M, device=device)
        if which == "sparse-mma":
            pm.p48_mma_gemm_rows(xr, w, row_start, counts.to(device), alpha, out, cfg, native,
                                 act_global=g_dev if act_quant else None)
        else:
            xin = xr
            if act_quant:
                groups = torch.arange(E, dtype=torch.int32, device=device).repeat_interleave(capacity)
                xin = pt.nvfp4_quantize_rows(xr, groups, g_dev)
            pt.p48_gemm_rows(xin, w, row_start, counts.to(device), alpha, out, cfg)
        got = out.reshape(E, capacity, M).cpu()
        for e, n in enumerate(names):
            results.append(_p48_compare(f"{n} (W4A4)" if act_quant else n, got[e], x[e], int(counts[e]), dec, e,
                                        g_act[e], act_quant, cfg.split == 1))
    return results


def _p48_compare(name, got, x, count, dec, e, g_act, act_quant, poisoned) -> tuple[str, float, bool]:
    """One expert's kernel rows against p48_reference: (name, max abs error, ok)."""
    from moesq_core.serving.kernels import p48_reference as ref

    if poisoned and not bool(torch.isnan(got[count:]).all()):
        return name, math.inf, False  # rows past the expert's count were written
    if count == 0:
        return name, 0.0, True
    we = ref.P48Weight(dec.codes[e], dec.scales[e], dec.global_scale[e], g_act.reshape(()))
    xs = x[:count].float()
    xu = ref.quantize_act_unscaled(xs, g_act)[0] if act_quant else xs
    alpha = ref.p48_alpha(we.global_scale, g_act if act_quant else None)
    wu = we.unscaled()
    want = (xu @ wu.T) * alpha
    absdot = (xu.abs() @ wu.abs().T) * alpha
    g = got[:count]
    if not bool(torch.isfinite(g).all()):
        return name, math.inf, False
    err = (g - want).abs()
    bound = math.sqrt(wu.shape[1]) * P48_ORDER_BOUND * absdot + 2.0**-22 * want.abs() + 1e-30
    rel = float((g - want).norm() / want.norm()) if bool(want.any()) else float(g.abs().max())
    return name, float(err.max()), bool((err <= bound).all()) and rel <= P48_REL_TOL
