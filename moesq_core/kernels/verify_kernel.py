"""`moesq verify DIR --kernel`: run every packed s24-fp8 expert of a model directory through the Hopper kernel.

For each layer's projection (gate_proj / up_proj / down_proj) the experts are stacked into one grouped call
(capacity-batched, token counts cycling through capacity, 1, 0, capacity/2, ...), fed fresh random
activations quantized per token to e4m3, and compared with `reference_grouped_gemm` (float64, on the CPU by
default) under `s24_fp8.error_bound`. Tensors are read one projection at a time with safe_open.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from ..naming import EXPERT_RE, weight_files
from . import s24_fp8 as s24


def _weight_files(path: Path) -> list[Path]:
    found = [path / f for f in weight_files(path)] or sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{path}: no model.safetensors, index or *.safetensors files")
    return found


def _locate(path: Path) -> dict[tuple[str, str], dict[int, tuple[Path, str]]]:
    """(layer prefix, proj) -> expert -> (file, tensor name without suffix)."""
    groups: dict[tuple[str, str], dict[int, tuple[Path, str]]] = defaultdict(dict)
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                m = EXPERT_RE.match(key)
                if m and m["suffix"] == "weight_sparse_values":
                    name = key[: -len(".weight_sparse_values")]
                    groups[(m["prefix"], m["proj"])][int(m["expert"])] = (f, name)
    return groups


def _read(f: Path, name: str) -> dict[str, torch.Tensor]:
    with safe_open(str(f), framework="pt") as sf:
        keys = set(sf.keys())
        out = {}
        for suffix in ("weight_sparse_values", "weight_sparse_meta", "weight_scale"):
            full = f"{name}.{suffix}"
            if full not in keys:
                raise ValueError(f"{full}: missing (an s24-fp8 linear needs weight_sparse_values, _meta and weight_scale)")
            out[suffix] = sf.get_tensor(full)
        return out


def kernel_check_packed_dir(path: str | Path, capacity: int = 16, seed: int = 0, ref_device: str = "cpu",
                            fast_accum: bool = False) -> list[tuple[str, float, bool]]:
    """Every packed s24-fp8 expert linear in `path` through the kernel vs the reference.

    Returns [(tensor name `<prefix>.mlp.experts.<e>.<proj>`, max |kernel - reference| over its valid rows, ok)].
    Raises RuntimeError when no suitable GPU (sm_90) or native build is present, ValueError when the directory
    holds no s24-fp8 experts. Experts the kernel cannot take (M % 8 or K % 32 != 0) come back with nan, False.
    """
    path = Path(path)
    try:
        s24.check_device()
    except RuntimeError as e:
        raise RuntimeError(f"kernel check of {path} impossible: {e}") from e
    groups = _locate(path)
    if not groups:
        raise ValueError(f"{path}: no s24-fp8 expert tensors (*.mlp.experts.<e>.<proj>.weight_sparse_values)")
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    results: list[tuple[str, float, bool]] = []
    for (prefix, proj), experts in sorted(groups.items()):
        order = sorted(experts)
        packed = [_read(*experts[e]) for e in order]
        names = [experts[e][1] for e in order]
        values = torch.stack([p["weight_sparse_values"] for p in packed])
        meta = torch.stack([p["weight_sparse_meta"] for p in packed])
        scale = torch.stack([p["weight_scale"] for p in packed]).float()
        E, M, K = values.shape[0], values.shape[1], values.shape[2] * 2
        try:
            w = s24.prepare_weights(values, meta, scale, device)
        except ValueError:
            results += [(n, math.nan, False) for n in names]
            continue
        pattern = [capacity, 1, 0, max(capacity // 2, 1)]
        counts = torch.tensor([pattern[i % len(pattern)] for i in range(E)], dtype=torch.int32)
        x = torch.randn(E, capacity, K, generator=gen)
        xq, sx = s24.quantize_activations(x)
        out = torch.full((E, capacity, M), float("nan"), dtype=torch.bfloat16, device=device)
        s24.grouped_gemm(w, xq.to(device), sx.to(device), counts.to(device), out, fast_accum=fast_accum)
        got = out.cpu()
        ref = s24.reference_grouped_gemm(values.to(ref_device), meta.to(ref_device), scale.to(ref_device),
                                         xq.to(ref_device), sx.to(ref_device), counts).cpu()
        wabs = s24.decompress(values.to(ref_device), meta.to(ref_device)).double().abs()
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
