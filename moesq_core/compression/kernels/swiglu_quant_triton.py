"""Fused SwiGLU + NVFP4 activation fake-quantization for refinement (Triton; forward and backward).

Refinement's expert forward quantizes the SwiGLU output h = silu(g) ⊙ u (g, u: the gate and up matmul outputs
[k, C, I] of k experts) with the NVFP4 activation quantizer under a static per-expert global scale s_e:

    amax_e = max |h[e]|                                    (the range the next step's static scale comes from)
    S      = ue4m3(max over a block of `block` columns of |h| / 6 · s_e)
    hq     = h + (e2m1(h · s_e / S) · S / s_e − h)         (straight-through: the value is the quantized one)

torch.compile maps this to two kernels that read and write fp32 [k, C, I] tensors (the range reduction and the
quantizer, ~10× what the bytes need at HBM speed on an H200). Here one program loads a [rows, columns] tile of
the compute-dtype g and u, computes h in fp32, adds its range to amax_e (one atomic per program) and writes hq
in the compute dtype; the backward (straight through the quantizer: dh = dhq) recomputes silu from g and writes
dg and du. Nothing fp32 and [k, C, I]-sized is written or saved.

Numerics: the quantizer is moesq_core.formats.quantizers.nvfp4_quantize_unscaled and `_ste` op for op (fp32,
IEEE round-to-nearest divisions, the same evaluation order), so for a given h the output is bitwise the torch
reference's. silu is eager torch's x / (1 + exp(−x)); exp is the CUDA math library's expf on the GPU (as eager
CUDA) and numpy's under the interpreter, which differ from torch's CPU exp in the last bit of ~40 % of inputs,
so under the interpreter h (and, where that flips a rounding, hq) match the CPU reference to an ulp of h only.
"""
from __future__ import annotations

import torch

from moesq_core.triton_support import HAS_TRITON, INTERPRET, tl, triton

COLUMNS = 256  # columns per program (scale blocks of a power-of-two width; one block when wider)


# The compiled trainer takes this kernel when USE is set (the default: one pass instead of torch.compile's two
# fp32 ones; refine bench on an H200, step 0.222 -> 0.199 s). False is benchmarks/bench_refine.py's compile-rows.
USE = True


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for tensors on `device` (CUDA with Triton, or the interpreter)."""
    return HAS_TRITON and (device.type == "cuda" or INTERPRET)


def supports_block(block: int) -> bool:
    """Scale blocks the kernel tiles: powers of two."""
    return block >= 1 and block & (block - 1) == 0


if HAS_TRITON:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x, ACCURATE_EXP: tl.constexpr):
        """expf: the CUDA math library's (libdevice, what eager CUDA calls) on the GPU; tl.exp (fp32 through the
        approximate exp2) is several ulp off, and the interpreter has no libdevice (numpy's exp there)."""
        if ACCURATE_EXP:
            y = libdevice.exp(x)
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def _round_ue4m3(s):
        """A positive fp32 scale clamped to [2^-9, 448] and rounded to the nearest e4m3 value, ties to even
        (round_ue4m3_scale); NaN stays NaN."""
        s = tl.minimum(tl.maximum(s, 0.001953125, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
        # normal e4m3 (>= 2^-6): keep 3 mantissa bits of the fp32 pattern, round half to even on the rest
        b = s.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000
        normal = b.to(tl.float32, bitcast=True)
        # subnormal e4m3 (< 2^-6): multiples of 2^-9; s·512 < 8 is exact, adding 2^23 rounds it to an integer
        sub = ((s * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
        r = tl.where(s < 0.015625, sub, normal)
        return tl.where(s != s, s, r)

    @triton.jit
    def _round_e2m1(y):
        """The nearest E2M1 value of y (ties to the even code, saturating at ±6, NaN -> 0, never −0), as
        e2m1_decode(e2m1_encode(y)): the same strict / non-strict comparisons at the midpoints."""
        a = tl.abs(y)
        v = tl.where(a > 5.0, 6.0, tl.where(a >= 3.5, 4.0, tl.where(a > 2.5, 3.0, tl.where(
            a >= 1.75, 2.0, tl.where(a > 1.25, 1.5, tl.where(a >= 0.75, 1.0, tl.where(a > 0.25, 0.5, 0.0)))))))
        return tl.where((y < 0) & (v > 0), -v, v)

    @triton.jit
    def _to_out(x, out_ptr):
        """x in the output's dtype; bf16 rounded to nearest even from the bits (the interpreter truncates in
        its own cast; on the GPU this is what cvt.rn does)."""
        if out_ptr.dtype.element_ty == tl.bfloat16:
            b = x.to(tl.int32, bitcast=True)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
            y = tl.where(x != x, 0x7FC0, r).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(out_ptr.dtype.element_ty)
        return y

    @triton.jit
    def _tile(C, inter, BLOCK_R: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr):
        """This program's expert and its [BLOCK_R, NB, QBLOCK] tile: NB scale blocks of QBLOCK columns per row
        (a scale block never straddles the edge: `inter` is a multiple of QBLOCK)."""
        e = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (tl.program_id(1).to(tl.int64) * (NB * QBLOCK) + tl.arange(0, NB)[:, None] * QBLOCK
                + tl.arange(0, QBLOCK)[None, :])
        off = e * C * inter + rows[:, None, None] * inter + cols[None, :, :]
        mask = (rows < C)[:, None, None] & (cols < inter)[None, :, :]
        return e, off, mask

    @triton.jit
    def _silu(g, ACCURATE_EXP: tl.constexpr):
        """Eager torch's silu: x / (1 + exp(−x)), IEEE division."""
        return tl.div_rn(g, 1.0 + _exp(-g, ACCURATE_EXP))

    # rows per program x warps, tuned once per width (the forward's range is a max, so re-running it while
    # tuning leaves the same result; the outputs are only written)
    _CONFIGS = [triton.Config({"BLOCK_R": r}, num_warps=w) for r, w in ((4, 4), (8, 4), (16, 8), (32, 8))]
    if INTERPRET:
        _CONFIGS = _CONFIGS[1:2]

    @triton.autotune(configs=_CONFIGS, key=["inter", "QBLOCK", "NB", "STE"])
    @triton.jit
    def _fwd_kernel(gate_ptr, up_ptr, gs_ptr, out_ptr, amax_ptr, C, inter, STE: tl.constexpr,
                    ACCURATE_EXP: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr):
        e, off, mask = _tile(C, inter, BLOCK_R, NB, QBLOCK)
        g = tl.load(gate_ptr + off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + off, mask=mask, other=0.0).to(tl.float32)
        h = _silu(g, ACCURATE_EXP) * u
        # ranges as the bits of |h|: for non-negative floats integer order is float order, and NaN (above inf)
        # wins as in torch's amax; masked elements are +0
        hbits = h.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.atomic_max(amax_ptr + e, tl.max(tl.max(tl.max(hbits, axis=2), axis=1), axis=0))
        bmax = tl.max(hbits, axis=2).to(tl.float32, bitcast=True)  # [BLOCK_R, NB]
        gs = tl.load(gs_ptr + e)
        s = _round_ue4m3(tl.div_rn(bmax, 6.0) * gs)[:, :, None]
        q = tl.div_rn(_round_e2m1(tl.div_rn(h * gs, s)) * s, gs)
        if STE:
            q = h + (q - h)
        tl.store(out_ptr + off, _to_out(q, out_ptr), mask=mask)

    @triton.autotune(configs=_CONFIGS, key=["inter", "NB"])
    @triton.jit
    def _bwd_kernel(gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, C, inter, ACCURATE_EXP: tl.constexpr,
                    QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr, NB: tl.constexpr):
        e, off, mask = _tile(C, inter, BLOCK_R, NB, QBLOCK)
        g = tl.load(gate_ptr + off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dout_ptr + off, mask=mask, other=0.0).to(tl.float32)
        ex = _exp(-g, ACCURATE_EXP)
        sig = tl.div_rn(1.0, 1.0 + ex)
        silu = tl.div_rn(g, 1.0 + ex)
        # d(silu(g)·u): du = dh·silu(g); dg = dh·u·silu'(g), silu' = σ(1 + g(1 − σ)) (torch's silu_backward)
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(dup_ptr + off, _to_out(dh * silu, dup_ptr), mask=mask)
        tl.store(dgate_ptr + off, _to_out(dg, dgate_ptr), mask=mask)


def _grid(k: int, C: int, inter: int, block: int):
    """(NB, grid): NB scale blocks of `block` columns per program (up to COLUMNS columns, fewer for a narrow
    `inter`); programs over rows, column tiles and experts."""
    nb = max(1, min(triton.next_power_of_2(-(-inter // block)), COLUMNS // block))
    return nb, lambda meta: (triton.cdiv(C, meta["BLOCK_R"]), triton.cdiv(inter, nb * block), k)


def _check(gate: torch.Tensor, up: torch.Tensor, block: int) -> None:
    if not available(gate.device):
        raise RuntimeError("the fused SwiGLU quantizer runs on CUDA with Triton (or under TRITON_INTERPRET=1), "
                           f"got {gate.device}")
    if gate.dim() != 3 or up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must be equal-shaped [k, C, I]")
    if not supports_block(block) or gate.shape[-1] % block:
        raise ValueError(f"the SwiGLU width {gate.shape[-1]} is not a multiple of the scale block {block} "
                         "(a power of two)")


def _forward(gate, up, gs, block: int, ste: bool, out_dtype: torch.dtype):
    k, C, inter = gate.shape
    gate, up = gate.contiguous(), up.contiguous()
    gs = gs.reshape(-1).to(torch.float32).contiguous()
    if gs.numel() != k:
        raise ValueError(f"{gs.numel()} global scales for {k} experts")
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    amax = torch.zeros(k, dtype=torch.float32, device=gate.device)
    if gate.numel():
        nb, grid = _grid(k, C, inter, block)
        # No FMA contraction: eager torch rounds h = silu(g)·u in its own kernel before the straight-through
        # h + (q − h); fused into fma(−silu, u, q) it differs in the last bit (seen on the H200)
        _fwd_kernel[grid](gate, up, gs, out, amax.view(torch.int32), C, inter, STE=ste, ACCURATE_EXP=not INTERPRET,
                          QBLOCK=block, NB=nb, **({} if INTERPRET else {"enable_fp_fusion": False}))
    return out, amax


def _backward(gate, up, dout):
    k, C, inter = gate.shape
    gate, up, dout = gate.contiguous(), up.contiguous(), dout.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        nb, grid = _grid(k, C, inter, 32)  # elementwise: any tiling of the columns
        _bwd_kernel[grid](gate, up, dout, dgate, dup, C, inter, ACCURATE_EXP=not INTERPRET, QBLOCK=32, NB=nb)
    return dgate, dup


# Custom ops: torch.compile sees one opaque call (its own graph's fusions stop at its edges) with a fake
# implementation for shapes, and autograd the straight-through backward below.
@torch.library.custom_op("moesq::swiglu_nvfp4_quant", mutates_args=())
def _swiglu_nvfp4_quant(gate: torch.Tensor, up: torch.Tensor, gs: torch.Tensor, block: int, ste: bool,
                        out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(gate, up, gs, block, ste, out_dtype)


@_swiglu_nvfp4_quant.register_fake
def _(gate, up, gs, block, ste, out_dtype):
    return gate.new_empty(gate.shape, dtype=out_dtype), gate.new_empty(gate.shape[:1], dtype=torch.float32)


@torch.library.custom_op("moesq::swiglu_backward", mutates_args=())
def _swiglu_backward(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(gate, up, dout)


@_swiglu_backward.register_fake
def _(gate, up, dout):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output):
    gate, up, _, _, ste, _ = inputs
    ctx.ste = ste
    ctx.save_for_backward(gate, up)


def _autograd_backward(ctx, dout, damax):
    gate, up = ctx.saved_tensors
    if not ctx.ste or dout is None:  # without STE the quantized value carries no gradient (as the torch path)
        return None, None, None, None, None, None
    dgate, dup = _swiglu_backward(gate, up, dout)
    return dgate, dup, None, None, None, None


_swiglu_nvfp4_quant.register_autograd(_autograd_backward, setup_context=_setup_context)


def swiglu_nvfp4_quant(gate: torch.Tensor, up: torch.Tensor, gs: torch.Tensor, block: int, ste: bool,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hq [k, C, I] in out_dtype, amax of h per expert [k] fp32) for h = silu(gate) ⊙ up computed in fp32 from
    the [k, C, I] matmul outputs and hq its NVFP4 fake-quantization (scale blocks of `block` columns) under the
    per-expert global scales gs (k values); ste: straight-through gradients to gate and up. Needs
    `available(gate.device)`."""
    _check(gate, up, block)
    if not ste:  # the quantized value carries no gradient (the torch path's output does not require one)
        gate, up = gate.detach(), up.detach()
    hq, amax = _swiglu_nvfp4_quant(gate, up, gs, int(block), bool(ste), out_dtype)
    return hq, amax.detach()  # a range, as the torch path's (taken from h.detach())


def swiglu_quant(act, gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor | None = None, ste: bool = False,
                 out_dtype: torch.dtype = torch.float32, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """act.swiglu_quant(gate, up, g, ste, out_dtype), in one fused pass where this kernel computes that
    quantizer's arithmetic (an NVFP4 activation quantizer: `act.fused_swiglu_block`), the scales g are static,
    `fused` is set and the kernel runs (CUDA, or the interpreter); else by the quantizer's torch ops."""
    block = getattr(act, "fused_swiglu_block", None)
    if (fused and block and g is not None and available(gate.device) and supports_block(block)
            and gate.shape[-1] % block == 0):
        return swiglu_nvfp4_quant(gate, up, g, block, ste, out_dtype)
    return act.swiglu_quant(gate, up, g, ste, out_dtype)
