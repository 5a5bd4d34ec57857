"""The fused SwiGLU + NVFP4 activation quantizer refinement uses
(moesq_core.compression.kernels.swiglu_quant_triton.swiglu_quant with an NVFP4ActQuantizer) against the torch ops it
replaces (swiglu_quant_reference): under the Triton interpreter on the CPU and on CUDA.

What is exact and what is not: the quantizer is the same fp32 arithmetic, so wherever h = silu(g) ⊙ u is the
same number the output and the range are bitwise the reference's. silu is exact for g >= 17 (exp(−g) vanishes
next to 1) on every platform, so those cases are compared bit for bit; for general g the kernel's exp is numpy's
under the interpreter (torch's CPU exp differs in the last bit of many inputs), so there the reference is fed
h computed with numpy's exp (bitwise again) and torch's own h is checked to an ulp. On CUDA the kernel takes the
CUDA math library's expf, as eager CUDA does."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moesq_core.compression.kernels import swiglu_quant_triton
from moesq_core.compression.kernels.swiglu_quant_triton import swiglu_quant
from moesq_core.formats import get_format
from moesq_core.formats.e2m1 import round_e2m1
from moesq_core.formats.e4m3 import round_ue4m3_scale
from moesq_core.formats.quantizers import NVFP4ActQuantizer, nvfp4_global_scale, swiglu_quant_reference
from moesq_core.triton_support import HAS_TRITON, tl, triton

from conftest import run_triton_interpreted

# (experts, rows, width, scale block): partial row and column tiles, one expert, both NVFP4 formats' blocks,
# a width wider than one program's columns
SHAPES = ((3, 37, 96, 32), (1, 5, 32, 32), (2, 9, 48, 16), (2, 3, 768, 32), (4, 1, 16, 16))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bit pattern, or both NaN (whatever their payloads)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return (a.contiguous().view(view) == b.contiguous().view(view)) | (torch.isnan(a) & torch.isnan(b))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit patterns (NaN equals NaN): -0 is not 0."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(same_bits(a, b).all())


def _up(k, C, inter, gen):
    """Up-projection outputs over 60 binades, with zero rows, a zero scale block and both signs."""
    u = torch.randn(k, C, inter, generator=gen) * torch.logspace(-30, 30, inter)[torch.randperm(inter, generator=gen)]
    u[:, ::4] = 0.0  # zero rows
    if inter >= 32:
        u[:, 1::4, :16] = 0.0  # a zero scale block (and part of one)
    return u


def _scales(k, inter, gen) -> list[torch.Tensor]:
    """Per-expert global scales [k, 1, 1]: from ranges across the dynamic range (blocks saturating at 448 and
    blocks whose scales clamp to 2^-9), and zeros (0/0 = NaN, as the torch ops give)."""
    amax = torch.logspace(-20, 20, k) * (1 + torch.rand(k, generator=gen))
    return [nvfp4_global_scale(amax).reshape(-1, 1, 1), torch.full((k, 1, 1), 1e-12), torch.zeros(k, 1, 1)]


def numpy_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """h as the kernel computes it under the interpreter: g / (1 + exp(−g)) · u in float32 with numpy's exp."""
    g, u = gate.float().numpy(), up.float().numpy()
    return torch.from_numpy(np.divide(g, np.float32(1) + np.exp(-g)) * u)


def check_against_reference(device: str, shapes=SHAPES) -> list[str]:
    """Kernel vs torch ops on each shape; returns a line per case (raises on a mismatch)."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    for k, C, inter, block in shapes:
        act = NVFP4ActQuantizer(block)
        for exact_silu in (True, False):
            if exact_silu:
                gate = 17 + 3 * torch.rand(k, C, inter, generator=gen)
            else:
                gate = 6 * torch.randn(k, C, inter, generator=gen)
            up = _up(k, C, inter, gen)
            for in_dtype, out_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                        (torch.bfloat16, torch.float32)):
                gt, ut = gate.to(in_dtype), up.to(in_dtype)
                for gs in _scales(k, inter, gen):
                    for ste in (True, False):
                        got, amax = swiglu_quant(act, gt.to(device), ut.to(device), gs.to(device), ste=ste,
                                                 out_dtype=out_dtype)
                        got, amax = got.cpu(), amax.cpu()
                        want, want_amax = swiglu_quant_reference(act, gt.to(device), ut.to(device), gs.to(device),
                                                                 ste, out_dtype)
                        want, want_amax = want.cpu(), want_amax.cpu()
                        if exact_silu:
                            assert bits_equal(got, want), (k, C, inter, in_dtype, out_dtype, ste, gs.flatten()[0])
                            assert bits_equal(amax, want_amax)
                        else:
                            # h to an ulp: the range within 4 ulp, the output bitwise wherever the quantizer
                            # saw the same h (almost everywhere)
                            torch.testing.assert_close(amax, want_amax, rtol=2**-21, atol=0)
                            same = same_bits(got, want)
                            assert float(same.float().mean()) > 0.99, float(same.float().mean())
                            if device == "cpu":  # the interpreter: with numpy's exp in the reference, bitwise
                                h = numpy_silu_mul(gt, ut)
                                ref = act.batched(h, gs, ste=ste).to(out_dtype)
                                assert bits_equal(got, ref), (k, C, inter, in_dtype, out_dtype, ste)
                                assert bits_equal(amax, h.abs().amax(dim=(1, 2)))
                            else:
                                lines.append(f"differ {int((~same).sum())}/{same.numel()}")
                        lines.append(f"ok {k}x{C}x{inter}/{block} exact={exact_silu} {in_dtype}->{out_dtype} "
                                     f"g={float(gs.flatten()[0]):.3g} ste={ste}")
    return lines


def check_gradients(device: str, shapes=SHAPES[:3]) -> list[str]:
    """Straight-through gradients of the kernel vs autograd through the torch ops: fp32 inputs within fp32
    rounding, bf16 inputs within a bf16 ulp; no gradient without STE."""
    gen = torch.Generator().manual_seed(1)
    lines = []
    for k, C, inter, block in shapes:
        act = NVFP4ActQuantizer(block)
        gs = nvfp4_global_scale(torch.rand(k, generator=gen) * 10 + 0.1).reshape(-1, 1, 1).to(device)
        for dtype, rtol, atol in ((torch.float32, 1e-5, 1e-6), (torch.bfloat16, 1.6e-2, 1e-5)):
            gate = (4 * torch.randn(k, C, inter, generator=gen)).to(dtype).to(device)
            up = torch.randn(k, C, inter, generator=gen).to(dtype).to(device)
            dout = torch.randn(k, C, inter, generator=gen).to(dtype).to(device)
            grads = []
            for fn in (lambda *a, **kw: swiglu_quant(act, *a, **kw),
                       lambda *a, **kw: swiglu_quant_reference(act, *a, **kw)):
                gl, ul = gate.clone().requires_grad_(), up.clone().requires_grad_()
                hq, amax = fn(gl, ul, gs, ste=True, out_dtype=dtype)
                assert hq.requires_grad and not amax.requires_grad
                grads.append(torch.autograd.grad(hq, [gl, ul], dout))
            for got, want in zip(*grads):
                assert got.dtype == dtype
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
            hq, _ = swiglu_quant(act, gate.clone().requires_grad_(), up.clone().requires_grad_(), gs, ste=False,
                                 out_dtype=dtype)
            assert not hq.requires_grad
            lines.append(f"ok grad {k}x{C}x{inter} {dtype}")
    return lines


if HAS_TRITON:

    @triton.jit
    def _rounding_kernel(x_ptr, s_ptr, e_ptr, n, BLOCK: tl.constexpr):
        off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        x = tl.load(x_ptr + off, mask=m)
        tl.store(s_ptr + off, swiglu_quant_triton._round_ue4m3(x), mask=m)
        tl.store(e_ptr + off, swiglu_quant_triton._round_e2m1(x), mask=m)


def check_rounding(device: str) -> str:
    """The kernel's UE4M3 scale and E2M1 value rounding vs the formats' torch ops on every e4m3 / e2m1 value,
    the midpoints between neighbours (ties), their fp32 neighbours, random values over the range, ±0, ±inf, NaN."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e2m1 = torch.cat([e2m1, -e2m1]).unique()
    pts = []
    for grid in (e4m3, e2m1):
        mid = (grid[1:] + grid[:-1]) / 2
        for v in (grid, mid):
            pts += [v, torch.nextafter(v, torch.tensor(np.inf)), torch.nextafter(v, torch.tensor(-np.inf))]
    gen = torch.Generator().manual_seed(2)
    pts += [torch.exp2(torch.empty(20000).uniform_(-14, 12, generator=gen)) * torch.randn(20000, generator=gen).sign(),
            torch.tensor([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, 3e38])]
    x = torch.cat(pts).float().to(device)
    s, e = torch.empty_like(x), torch.empty_like(x)
    _rounding_kernel[(triton.cdiv(x.numel(), 1024),)](x, s, e, x.numel(), BLOCK=1024)
    pos = x > 0  # scales are positive (the ranges' |h| / 6 · g); NaN scales stay NaN
    assert bits_equal(s[pos].cpu(), round_ue4m3_scale(x[pos]).cpu())
    assert torch.isnan(s[torch.isnan(x)]).all()
    assert bits_equal(e.cpu(), round_e2m1(x).cpu())
    return f"ok rounding {x.numel()}"


def check_opaque_to_compile(device: str) -> str:
    """The fused op through torch.compile's tracing (fake tensors, AOT autograd, dynamic shapes): the same loss
    and gradients as eager; and torch.library's own checks of the custom op."""
    fmt = get_format("p48-nvfp4")
    from moesq_core.compression.methods.refine.trainer import BlockRefiner

    gen = torch.Generator().manual_seed(3)
    k, C, H, inter = 3, 11, 64, 64
    dense = [torch.randn(k, inter, H, generator=gen) * H ** -0.5, torch.randn(k, inter, H, generator=gen) * H ** -0.5,
             torch.randn(k, H, inter, generator=gen) * inter ** -0.5]
    valid = torch.ones(k, C, dtype=torch.bool)
    valid[0, -3:] = False  # padding rows
    # (tokens, tok, valid, g_in, Dg, Du, Dd): the rows' tokens and their dense targets; then the quantized
    # weights (the leaves), then (tw, scale, g_h)
    head = [torch.randn(2 * C, H, generator=gen), torch.randint(2 * C, (k, C), generator=gen), valid,
            nvfp4_global_scale(torch.rand(k, generator=gen) + 1.0).reshape(-1, 1, 1), *dense]
    weights = [d + 0.05 * torch.randn(d.shape, generator=gen) * d.std() for d in dense]
    tail = [torch.rand(k, C, generator=gen), torch.rand(k, generator=gen),
            nvfp4_global_scale(torch.rand(k, generator=gen) + 0.5).reshape(-1, 1, 1)]
    head, weights, tail = ([a.to(device) for a in group] for group in (head, weights, tail))
    outs = []
    # the loss's gradient written in the forward (the trainer's) or from its own backward: the same numbers
    for fused, compiled, grad_in_forward in ((False, False, False), (False, False, True), (True, False, True),
                                             (True, True, True)):
        fn = BlockRefiner.micro_loss_fn(fmt, torch.float32, fused, grad_in_forward, fused_gather=fused)
        if compiled:
            fn = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
        leaves = [a.clone().requires_grad_() for a in weights]
        out, grad_out, num, amax = fn(*head, *leaves, *tail)
        assert (grad_out is None) != grad_in_forward and not num.requires_grad
        outs.append(((num * tail[1]).sum(), num, amax, *torch.autograd.grad(out, leaves, grad_out)))
    assert all(bits_equal(a, b) for a, b in zip(outs.pop(0), outs[0]))
    # fused vs torch ops: h to an ulp can flip a quantized value, which moves the gradients a little
    for a, b in zip(outs[1], outs[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(outs[2], outs[1]):  # the compiled graph calls the very same kernel
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert bits_equal(outs[1][2], outs[2][2])
    gate = torch.randn(2, 3, 32, generator=gen).to(device).requires_grad_()
    up = torch.randn(2, 3, 32, generator=gen).to(device).requires_grad_()
    torch.library.opcheck(swiglu_quant_triton._swiglu_nvfp4_quant,
                          (gate, up, torch.ones(2, device=device), 16, True, torch.float32))
    return "ok compile"


def test_kernel_matches_reference_under_the_interpreter():
    out = run_triton_interpreted(
        "import torch\n"
        "from moesq_core.compression.kernels import swiglu_quant_triton\n"
        "assert swiglu_quant_triton.available(torch.device('cpu'))\n"
        "from test_swiglu_quant_triton import *\n"
        "print(check_rounding('cpu'))\n"
        "print('\\n'.join(check_against_reference('cpu')))\n"
        "print('\\n'.join(check_gradients('cpu')))\n"
        "print(check_opaque_to_compile('cpu'))\n")
    assert "ok rounding" in out and "ok compile" in out
    assert out.count("ok grad") == 3 * 2
    assert out.count("ok ") - out.count("ok grad") == 2 + len(SHAPES) * 2 * 3 * 3 * 2


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert swiglu_quant_triton.available(torch.device("cuda"))
    print(check_rounding("cuda"))
    lines = check_against_reference("cuda", SHAPES + ((8, 3000, 768, 32),))
    print("\n".join(line for line in lines if line.startswith("differ")))  # how often expf's h differed
    assert sum(line.startswith("ok ") for line in lines) == (len(SHAPES) + 1) * 2 * 3 * 3 * 2
    assert len(check_gradients("cuda", SHAPES[:3] + ((8, 3000, 768, 32),))) == 4 * 2
    print(check_opaque_to_compile("cuda"))


def test_falls_back_to_the_torch_ops():
    """Without static scales (dynamic), without `fused`, for a block the kernel does not tile, off the kernel's
    devices, and for FP8 activations, swiglu_quant is the torch ops bit for bit."""
    gen = torch.Generator().manual_seed(4)
    gate, up = torch.randn(2, 5, 48, generator=gen), torch.randn(2, 5, 48, generator=gen)
    gs = torch.full((2, 1, 1), 3.0)
    cases = [(NVFP4ActQuantizer(16), None, True), (NVFP4ActQuantizer(16), gs, False), (NVFP4ActQuantizer(24), gs, True),
             (get_format("s24-fp8").act, None, True)]
    if not swiglu_quant_triton.available(torch.device("cpu")):
        cases.append((NVFP4ActQuantizer(16), gs, True))
    for act, g, fused in cases:
        got = swiglu_quant(act, gate, up, g, ste=True, out_dtype=torch.float32, fused=fused)
        h = F.silu(gate) * up
        assert bits_equal(got[0], act.batched(h, g, ste=True)) and bits_equal(got[1], h.abs().amax(dim=(1, 2)))


def test_refuses_what_it_cannot_run():
    if not swiglu_quant_triton.available(torch.device("cpu")):
        with pytest.raises(RuntimeError, match="CUDA with Triton"):
            swiglu_quant_triton.swiglu_nvfp4_quant(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), torch.ones(1), 16,
                                                   True, torch.float32)
        return
    with pytest.raises(ValueError, match="multiple of the scale block"):
        swiglu_quant_triton.swiglu_nvfp4_quant(torch.zeros(1, 2, 24), torch.zeros(1, 2, 24), torch.ones(1), 16,
                                               True, torch.float32)
    with pytest.raises(ValueError, match="equal-shaped"):
        swiglu_quant_triton.swiglu_nvfp4_quant(torch.zeros(1, 2, 16), torch.zeros(1, 3, 16), torch.ones(1), 16,
                                               True, torch.float32)


def check_compiled_trainer() -> str:
    """The compiled trainer (inductor, with the fused SwiGLU quantizer and relaxation kernels) computes the eager
    trainer's steps: losses, latent values and validation (the CPU trainer under the interpreter)."""
    from moesq_core.compression.kernels import rows_add_triton
    from moesq_core.compression.methods.base import PROJECTIONS
    from moesq_core.compression.methods.refine import BlockRefiner, RefineConfig
    from moesq_core.compression.methods.rtn import RTN

    from test_refine import make_block

    assert swiglu_quant_triton.USE and rows_add_triton.STRIDED  # the defaults
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, H=64, inter=64, n=160, n_val=20, seed=23)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    rs = [BlockRefiner(ex, inits, fmt, RefineConfig(epochs=1, steps_per_epoch=2, micro_batch_rows=96, compile=c))
          for c in (False, True)]
    assert [r.fused_swiglu for r in rs] == [False, True]
    losses = [torch.stack([r.train_step(r.epoch_order(), s) for s in range(2)]) for r in rs]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for p in PROJECTIONS:
        assert float((rs[0].proj[p].V - rs[1].proj[p].V).abs().gt(1e-7).float().mean()) < 1e-3
    v = [r.validate(r.hard_state()[0]) for r in rs]
    torch.testing.assert_close(v[1], v[0], rtol=1e-5, atol=0)
    return "ok trainer"


@pytest.mark.slow
def test_compiled_trainer_with_the_fused_kernel_matches_eager():
    out = run_triton_interpreted("from test_swiglu_quant_triton import check_compiled_trainer\n"
                                 "print(check_compiled_trainer())\n")
    assert "ok trainer" in out
