"""acc[idx[i]] += src[i] over the leading dimension, for distinct indices (Triton, with the torch fallback).

Refinement adds each micro-batch's weight gradients ([k, out, in], compute dtype) into the block's fp32
accumulator ([E, out, in]) for the k experts the micro-batch holds. torch's `index_add_` runs a generic
kernel at ~0.6 TB/s on an H200 (benchmarks/results/refine_h200_2026-12-01_75a3a44_profile_compile.txt) after
a separate cast of the gradient to fp32; this kernel reads the gradient in its own dtype and adds it in one
coalesced pass.
With distinct indices every element gets exactly one fp32 addition, so it equals `index_add_` bitwise.

The gradients of weights used transposed in the matmuls (x Wᵀ) come back as transposed views ([k, out, in]
with the `out` axis contiguous); those are read tile by tile in their own layout rather than copied
contiguous first (STRIDED).
"""
from __future__ import annotations

import torch

from moesq_core.triton_support import HAS_TRITON, INTERPRET, tl, triton

BLOCK = 4096


def available(device: torch.device) -> bool:
    return HAS_TRITON and (device.type == "cuda" or INTERPRET)


if HAS_TRITON:

    @triton.jit
    def _rows_add(acc_ptr, src_ptr, idx_ptr, row_len, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        off = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < row_len
        dst = tl.load(idx_ptr + i).to(tl.int64)
        s = tl.load(src_ptr + i * row_len + off, mask=m, other=0.0).to(tl.float32)
        a = tl.load(acc_ptr + dst * row_len + off, mask=m, other=0.0)
        tl.store(acc_ptr + dst * row_len + off, a + s, mask=m)


    @triton.jit
    def _rows_add_transposed(acc_ptr, src_ptr, idx_ptr, n_out, K, BO: tl.constexpr, BK: tl.constexpr):
        """acc[idx[i], o, k] += src[i, o, k] for a src stored as [n, K, n_out] (its last two axes transposed)."""
        i = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1).to(tl.int64) * BO + tl.arange(0, BO)
        k = tl.program_id(2).to(tl.int64) * BK + tl.arange(0, BK)
        m = (o < n_out)[:, None] & (k < K)[None, :]
        dst = tl.load(idx_ptr + i).to(tl.int64)
        s = tl.load(src_ptr + i * n_out * K + k[None, :] * n_out + o[:, None], mask=m, other=0.0).to(tl.float32)
        off = dst * n_out * K + o[:, None] * K + k[None, :]
        a = tl.load(acc_ptr + off, mask=m, other=0.0)
        tl.store(acc_ptr + off, a + s, mask=m)


TILE = 64  # the transposed kernel's [TILE, TILE] tiles
# add_rows_ reads transposed sources in place when STRIDED is set (the default), saving the contiguous copies
# (refine bench on an H200: step 0.237 -> 0.222 s). False is benchmarks/bench_refine.py's compile variant.
STRIDED = True
# Refinement adds the gradients of micro-batches that hold every expert with this kernel too (the identity as
# idx) rather than torch's add_, which reads a transposed bf16 source into an fp32 accumulator off its layout
# (a Qwen3-30B-A3B block's gate/up gradient on an H200: 1.32 ms with add_, ~0.5 ms here). False (add_) is a
# variant of benchmarks/bench_refine.py.
ALL_ROWS = True


def add_rows_(acc: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """acc[idx[i]] += src[i] in place (acc fp32 [E, ...], src [len(idx), ...] any float dtype, idx distinct)."""
    if acc.dtype != torch.float32 or src.shape[1:] != acc.shape[1:] or idx.shape != src.shape[:1]:
        raise ValueError(f"add_rows_: acc {tuple(acc.shape)} {acc.dtype}, idx {tuple(idx.shape)}, "
                         f"src {tuple(src.shape)}")
    if not (available(acc.device) and acc.is_contiguous()):
        return acc.index_add_(0, idx, src.to(acc.dtype))
    if STRIDED and src.dim() == 3 and not src.is_contiguous() and src.transpose(1, 2).is_contiguous():
        n, n_out, K = src.shape
        if n and n_out and K:
            grid = (n, triton.cdiv(n_out, TILE), triton.cdiv(K, TILE))
            _rows_add_transposed[grid](acc, src, idx, n_out, K, BO=TILE, BK=TILE)
        return acc
    src = src.contiguous()
    row_len = acc[0].numel() if acc.shape[0] else 0
    if idx.numel() and row_len:
        _rows_add[(idx.numel(), triton.cdiv(row_len, BLOCK))](acc, src, idx, row_len, BLOCK=BLOCK)
    return acc
