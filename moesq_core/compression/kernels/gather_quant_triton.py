"""Fused row gather + NVFP4 input fake-quantization for refinement (Triton; forward only).

Each refinement micro-batch reads the routed rows of k experts from the block's token matrix tokens [T, H]
(row r of expert e is token tok[e, r]; padding rows, valid[e, r] false, are exact zeros) and needs them twice:

    x  = tokens[tok] in the compute dtype                         (the dense experts' input: the targets)
    xq = NVFP4 fake-quant of x under the expert's static global scale s_e, in the compute dtype

By torch ops that is an index_select writing x, then torch.compile's two kernels over fp32 copies of it (the
scale-block range and the quantizer) and a cast. Here one program loads a [rows, columns] tile of the gathered
tokens once and writes x (where asked) and xq: HBM traffic is one read and one or two writes of the rows.

Numerics: the quantizer is moesq_core.formats.quantizers.nvfp4_quantize_unscaled op for op (fp32, IEEE
round-to-nearest divisions, the same evaluation order; the rounding helpers are swiglu_quant_triton's), so the
outputs are bitwise the torch reference's (`gather_quant_reference`) wherever the reference's own divisions are
IEEE ones (on the CPU; CUDA's torch divides by a Python scalar through its reciprocal, which can move a scale
by an ulp and, rarely, its rounding).
"""
from __future__ import annotations

import torch

from moesq_core.compression.kernels import swiglu_quant_triton as sq
from moesq_core.triton_support import HAS_TRITON, INTERPRET, tl, triton

COLUMNS = 256  # columns per program (scale blocks of a power-of-two width)

# The compiled trainer takes this kernel when USE is set (the default). False is the torch path, a variant of
# benchmarks/bench_refine.py (gather-quant vs grad-fwd).
USE = True


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for tensors on `device` (CUDA with Triton, or the interpreter)."""
    return sq.available(device)


if HAS_TRITON:
    _CONFIGS = [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((4, 4), (8, 4), (16, 8), (32, 8))]
    if INTERPRET:
        _CONFIGS = _CONFIGS[1:2]

    @triton.autotune(configs=_CONFIGS, key=["H", "QBLOCK", "NB", "WRITE_X"])
    @triton.jit
    def _kernel(tokens_ptr, tok_ptr, valid_ptr, gs_ptr, x_ptr, xq_ptr, C, H, WRITE_X: tl.constexpr,
                QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr):
        e = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < C
        flat = e * C + rows
        tok = tl.load(tok_ptr + flat, mask=rmask, other=0)
        real = rmask & (tl.load(valid_ptr + flat, mask=rmask, other=0) != 0)
        cols = (tl.program_id(1).to(tl.int64) * (NB * QBLOCK) + tl.arange(0, NB)[:, None] * QBLOCK
                + tl.arange(0, QBLOCK)[None, :])
        cmask = (cols < H)[None, :, :]
        # padding rows load as +0: the reference's torch.where(valid, x, 0)
        h = tl.load(tokens_ptr + tok[:, None, None] * H + cols[None, :, :], mask=real[:, None, None] & cmask,
                    other=0.0).to(tl.float32)
        out = flat[:, None, None] * H + cols[None, :, :]
        omask = rmask[:, None, None] & cmask
        if WRITE_X:
            tl.store(x_ptr + out, sq._to_out(h, x_ptr), mask=omask)
        # block ranges as the bits of |h| (integer order is float order for non-negative floats; NaN wins)
        bmax = (tl.max(h.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)).to(tl.float32, bitcast=True)
        gs = tl.load(gs_ptr + e)
        s = sq._round_ue4m3(tl.div_rn(bmax, 6.0) * gs)[:, :, None]
        q = tl.div_rn(sq._round_e2m1(tl.div_rn(h * gs, s)) * s, gs)
        tl.store(xq_ptr + out, sq._to_out(q, xq_ptr), mask=omask)


def _forward(tokens: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor, gs: torch.Tensor, block: int,
             with_x: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k, C = tok.shape
    H = tokens.shape[1]
    tokens, tok = tokens.contiguous(), tok.contiguous()
    valid = valid.contiguous().view(torch.uint8)
    gs = gs.reshape(-1).to(torch.float32).contiguous()
    if gs.numel() != k:
        raise ValueError(f"{gs.numel()} global scales for {k} experts")
    xq = torch.empty((k, C, H), dtype=out_dtype, device=tokens.device)
    x = torch.empty((k, C, H) if with_x else (0, 0, 0), dtype=out_dtype, device=tokens.device)
    if xq.numel():
        nb = max(1, min(triton.next_power_of_2(-(-H // block)), COLUMNS // block))
        grid = lambda meta: (triton.cdiv(C, meta["BLOCK_R"]), triton.cdiv(H, nb * block), k)  # noqa: E731
        # no FMA contraction: the reference rounds h·s_e before dividing by the block scale
        _kernel[grid](tokens, tok, valid, gs, x if with_x else xq, xq, C, H, WRITE_X=with_x, QBLOCK=block, NB=nb,
                      **({} if INTERPRET else {"enable_fp_fusion": False}))
    return x, xq


# A custom op: torch.compile sees one opaque call with a fake implementation for shapes (no gradient flows
# into the calibration tokens).
@torch.library.custom_op("moesq::gather_nvfp4_quant", mutates_args=())
def _gather_nvfp4_quant(tokens: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor, gs: torch.Tensor, block: int,
                        with_x: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(tokens, tok, valid, gs, block, with_x, out_dtype)


@_gather_nvfp4_quant.register_fake
def _(tokens, tok, valid, gs, block, with_x, out_dtype):
    shape = (*tok.shape, tokens.shape[1])
    return tokens.new_empty(shape if with_x else (0, 0, 0), dtype=out_dtype), tokens.new_empty(shape, dtype=out_dtype)


def zero_padding(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Routed rows x [k, c, H] in fp32 with the padding rows (`valid` [k, c] false) exact zeros."""
    return torch.where(valid[..., None], x.float(), torch.zeros((), device=x.device))


def gather_quant_reference(act, tokens: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor, g: torch.Tensor | None,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of `gather_quant`: the rows x = tokens[tok] in fp32 with the padding rows zero, then (x,
    act.batched(x, g)) in out_dtype."""
    x = zero_padding(tokens.index_select(0, tok.reshape(-1)).view(*tok.shape, tokens.shape[1]), valid)
    return x.to(out_dtype), act.batched(x, g, ste=False).to(out_dtype)


def gather_quant(act, tokens: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor, g: torch.Tensor | None,
                 out_dtype: torch.dtype, with_x: bool = True, fused: bool = True
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x, xq) of the routed rows tok [k, C] (token indices into tokens [T, H]; `valid` [k, C] false on padding,
    whose rows are exact zeros): the rows and their input fake-quantization act.batched(x, g) under the
    per-expert global scales g [k, 1, 1], both [k, C, H] in out_dtype; x is None unless with_x. In one fused pass
    where the kernel computes that quantizer's arithmetic (an NVFP4 activation quantizer), g is static, `fused`
    is set and the kernel runs (CUDA, or the interpreter); else by the torch ops (gather_quant_reference)."""
    block = getattr(act, "fused_swiglu_block", None)
    H = tokens.shape[-1]
    if (fused and USE and block and g is not None and tokens.dim() == 2 and available(tokens.device)
            and sq.supports_block(block) and H % block == 0):
        x, xq = _gather_nvfp4_quant(tokens, tok, valid, g, int(block), bool(with_x), out_dtype)
        return (x if with_x else None), xq
    x, xq = gather_quant_reference(act, tokens, tok, valid, g, out_dtype)
    return (x if with_x else None), xq
