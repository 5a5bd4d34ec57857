"""Fused routing kernels of the s24-fp8 experts module (Triton, CUDA): three launches per MoE layer around the
two CUTLASS grouped GEMMs instead of ~30 small torch ops.

  route_quant   one program per token: dynamic per-token e4m3 quantization (scale = amax/448, 1 for a zero
                row; x/scale rounded to nearest even, saturated), then for each of its k slots claim a row of
                the expert's capacity slab (atomic cursor, which ends as the expert's token count) and write
                the quantized token and its scale there; row[t, j] = e * capacity + position.
  swiglu_quant  one program per (token, slot): silu(gate) * up from the gate/up GEMM's bf16 output row, the
                same per-row e4m3 quantization, written to the same row of the down GEMM's input slab.
  combine       out[t] = sum_j w[t, j] * y[row[t, j]] in slot order, fp32, cast to the hidden dtype.

The quantization matches moesq_core.serving.kernels.s24_gemm.quantize_activations (IEEE divisions, RNE); a row's
position inside its expert's slab depends on the atomics' order, which does not change any value (GEMM rows
are independent). No host synchronisation: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from moesq_core.triton_support import (  # CPU-only installs: the experts module uses its torch path
    HAS_TRITON,
    tl,
    triton,
)

E4M3_MAX = 448.0

if HAS_TRITON:

    @triton.jit
    def _quant_row(x):
        """fp32 row (masked entries 0) -> (e4m3 values, fp32 scale), as quantize_activations."""
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
        q = tl.div_rn(x, tl.zeros_like(x) + scale)
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale

    @triton.jit
    def _route_quant_kernel(x_ptr, idx_ptr, cursor_ptr, row_ptr, xq_ptr, sx_ptr, H, cap, stride_x,
                            TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_H)
        m = offs < H
        x = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        q, s = _quant_row(x)
        for j in tl.static_range(TOPK):
            e = tl.load(idx_ptr + t * TOPK + j).to(tl.int32)
            pos = tl.atomic_add(cursor_ptr + e, 1)
            row = e.to(tl.int64) * cap + pos
            tl.store(row_ptr + t * TOPK + j, row)
            tl.store(xq_ptr + row * H + offs, q, mask=m)
            tl.store(sx_ptr + row, s)

    @triton.jit
    def _swiglu_quant_kernel(y_ptr, row_ptr, xq_ptr, sx_ptr, inter, BLOCK_I: tl.constexpr):
        p = tl.program_id(0)
        row = tl.load(row_ptr + p)
        offs = tl.arange(0, BLOCK_I)
        m = offs < inter
        g = tl.load(y_ptr + row * (2 * inter) + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(y_ptr + row * (2 * inter) + inter + offs, mask=m, other=0.0).to(tl.float32)
        a = tl.where(m, g * tl.sigmoid(g) * u, 0.0)
        q, s = _quant_row(a)
        tl.store(xq_ptr + row * inter + offs, q, mask=m)
        tl.store(sx_ptr + row, s)

    @triton.jit
    def _combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, H, stride_o, TOPK: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BH + tl.arange(0, BH)
        m = offs < H
        acc = tl.zeros((BH,), tl.float32)
        for j in tl.static_range(TOPK):
            row = tl.load(row_ptr + t * TOPK + j)
            w = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
            acc += tl.load(y_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32) * w
        tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def available(device: torch.device) -> bool:
    return HAS_TRITON and device.type == "cuda"


def route_quant(hidden: torch.Tensor, top_k_index: torch.Tensor, E: int, cap: int):
    """-> (xq float8_e4m3fn [E, cap, H], sx float32 [E, cap], counts int32 [E], row int64 [T*k]).
    Rows past an expert's count are left unwritten."""
    T, k = top_k_index.shape
    H = hidden.shape[1]
    dev = hidden.device
    xq = torch.empty(E, cap, H, dtype=torch.float8_e4m3fn, device=dev)
    sx = torch.empty(E, cap, dtype=torch.float32, device=dev)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    row = torch.empty(T * k, dtype=torch.int64, device=dev)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    _route_quant_kernel[(T,)](hidden, top_k_index.contiguous(), counts, row, xq, sx, H, cap, hidden.stride(0),
                              TOPK=k, BLOCK_H=triton.next_power_of_2(H), num_warps=4 if H <= 4096 else 8)
    return xq, sx, counts, row


def swiglu_quant(y1: torch.Tensor, row: torch.Tensor, inter: int):
    """y1 bf16 [E, cap, 2 * inter] (gate then up) -> (xq float8_e4m3fn [E, cap, inter], sx float32 [E, cap]) on the
    rows used."""
    E, cap = y1.shape[0], y1.shape[1]
    xq = torch.empty(E, cap, inter, dtype=torch.float8_e4m3fn, device=y1.device)
    sx = torch.empty(E, cap, dtype=torch.float32, device=y1.device)
    _swiglu_quant_kernel[(row.numel(),)](y1, row, xq, sx, inter, BLOCK_I=triton.next_power_of_2(inter),
                                         num_warps=4 if inter <= 4096 else 8)
    return xq, sx


def combine(y2: torch.Tensor, row: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y2 bf16 [E, cap, H] -> [T, H] in `dtype`: each token's k rows weighted and summed in slot order."""
    T, k = top_k_weights.shape
    H = y2.shape[2]
    out = torch.empty(T, H, dtype=dtype, device=y2.device)
    BH = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, BH))](y2, row, top_k_weights.contiguous(), out, H, out.stride(0),
                                             TOPK=k, BH=BH, num_warps=4)
    return out
