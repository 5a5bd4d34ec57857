"""Running a Hessian-based method on all experts of a block at once, in chunks that fit a memory budget.

The batched solvers stack the experts of a block ([E, out, in] weights, [E, in, in] Hessians) and run every
step as one tensor op over experts × rows. A block's stacked state can be larger than the device (Kimi-K2:
384 experts of 7168 × 2048), so the experts are cut into chunks of at most `budget // bytes_per_expert`.
Results do not depend on the chunking: each expert's numbers only ever involve its own tensors.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert, ExpertData, ProgressFn
from moesq_core.compression.methods.rtn import check_expert, fallback_no_tokens
from moesq_core.formats import Format
from moesq_core.memory import release_device_cache

log = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 4 << 30
DEFAULT_GPU_FRACTION = 0.5  # of the device memory free when the block starts


def memory_budget(device: torch.device, chunk_gb: float | None) -> int:
    """Bytes one chunk of experts may use: `chunk_gb` when given, else half the free memory of a CUDA device
    (4 GiB elsewhere)."""
    if chunk_gb is not None:
        if not chunk_gb > 0:
            raise ValueError(f"chunk_gb must be > 0, got {chunk_gb}")
        return int(chunk_gb * (1 << 30))
    if device.type == "cuda":
        from moesq_core.memory import device_available_bytes

        return int(device_available_bytes(device) * DEFAULT_GPU_FRACTION)
    return DEFAULT_CPU_BUDGET


def solver_bytes_per_expert(inter: int, H: int) -> int:
    """Peak bytes of one expert in a batched sweep (the larger of the gate/up and the down phase): ~28 bytes per
    weight (stacked fp32 weights, the sweep's values, latent and working copy, codes, mask, transients) and
    ~48 bytes per Hessian entry (fp32 Hessian and factor, the fp64 factorisation's temporaries)."""
    gate_up = 28 * (2 * inter) * H + 48 * H * H
    down = 28 * H * inter + 48 * inter * inter
    return max(gate_up, down)


def compress_batched(experts: list[ExpertData], fmt: Format, method_name: str,
                     solve_chunk: Callable[[list[ExpertData], int], list[CompressedExpert]],
                     progress: ProgressFn | None = None, chunk_gb: float | None = None,
                     experts_per_chunk: int | None = None) -> list[CompressedExpert]:
    """Checks every expert, gives experts without routed tokens the RTN fallback, and runs `solve_chunk(chunk,
    budget)` on the others in chunks; results in the order of `experts`. progress(n) after each chunk."""
    for ex in experts:
        check_expert(ex, fmt)
    out: list[CompressedExpert | None] = [None] * len(experts)
    active = []
    for i, ex in enumerate(experts):
        if ex.n_rows == 0:
            out[i] = fallback_no_tokens(ex, fmt, method_name)
            if progress is not None:
                progress(1)
        else:
            active.append(i)
    if not active:
        return out
    first = experts[active[0]]
    shapes = {tuple(experts[i].gate.shape) for i in active}
    if len(shapes) > 1:
        raise ValueError(f"the experts of one block must share their shapes, got gate/up shapes {sorted(shapes)}")
    devices = {experts[i].gate.device for i in active}
    if len(devices) > 1:
        raise ValueError(f"the experts of one block must be on one device, got {sorted(map(str, devices))}")
    inter, H = first.gate.shape
    s = 0
    cap = None  # experts per chunk after an out-of-memory retry
    while s < len(active):
        # sized before every chunk: the finished chunks' results hold device memory the next one cannot use
        budget = memory_budget(first.gate.device, chunk_gb)
        per_chunk = experts_per_chunk or max(1, budget // solver_bytes_per_expert(inter, H))
        idx = active[s:s + (per_chunk if cap is None else min(per_chunk, cap))]
        chunk_out = None
        try:
            chunk_out = solve_chunk([experts[i] for i in idx], budget)
        except torch.OutOfMemoryError as exc:
            if len(idx) == 1:
                raise torch.OutOfMemoryError(
                    f"{method_name}: out of memory solving one expert with a {budget / 2**30:.1f} GiB budget; lower "
                    f"the method option chunk_gb (e.g. chunk_gb={max(budget / 2**31, 0.01):.2f})") from exc
        if chunk_out is None:  # out of memory: the same experts in smaller chunks (the same results)
            cap = max(1, len(idx) // 2)
            release_device_cache()
            log.warning("%s: out of device memory solving %d experts together; retrying %d at a time",
                        method_name, len(idx), cap)
            continue
        s += len(idx)
        for i, r in zip(idx, chunk_out):
            out[i] = r
        if progress is not None:
            progress(len(idx))
    return out


def assemble_results(experts: list[ExpertData], results: list[dict], method: str,
                     extra: Callable[[dict], dict] = lambda r: {}) -> list[CompressedExpert]:
    """The block's CompressedExperts from the per-expert dicts a batched solver fills (`q`, `latent`, `rel_err`,
    `percdamp`, `damp` per projection or phase); `extra(r)` adds the method's own info keys."""
    out = []
    for ex, r in zip(experts, results):
        info = {"method": method, "tokens": ex.n_rows, "percdamp": r["percdamp"], "damp": r["damp"],
                **extra(r), "rel_err": {p: r["rel_err"][p] for p in PROJECTIONS}}
        q = r["q"]
        out.append(CompressedExpert(q["gate"], q["up"], q["down"], latent=r["latent"], info=info))
    return out
