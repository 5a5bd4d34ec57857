"""The fused row gather + NVFP4 input quantizer refinement uses (gather_quant_triton.gather_quant with an
NVFP4ActQuantizer) against the torch ops it replaces (gather_quant_reference), computed on the CPU, where torch's
divisions are IEEE ones like the kernel's: bit for bit, under the Triton interpreter and on CUDA."""
from __future__ import annotations

import pytest
import torch

from moesq_core.compression.kernels import gather_quant_triton
from moesq_core.compression.kernels.gather_quant_triton import gather_quant, gather_quant_reference
from moesq_core.formats import get_format
from moesq_core.formats.quantizers import NVFP4ActQuantizer, nvfp4_global_scale

from conftest import run_triton_interpreted
from test_swiglu_quant_triton import bits_equal

# (experts, rows, width, scale block, tokens): partial row and column tiles, one expert, both NVFP4 blocks, a
# width wider than one program's columns
SHAPES = ((3, 37, 96, 32, 50), (1, 5, 32, 32, 3), (2, 9, 48, 16, 40), (2, 3, 768, 32, 7), (4, 1, 16, 16, 2))


def _case(k, C, H, T, gen):
    """Tokens over 60 binades with a zero row and a zero scale block, random rows (repeats included) with padding."""
    tokens = torch.randn(T, H, generator=gen) * torch.logspace(-30, 30, H)[torch.randperm(H, generator=gen)]
    tokens[0] = 0.0
    if H >= 32:
        tokens[1 % T, :16] = 0.0
    tok = torch.randint(T, (k, C), generator=gen)
    valid = torch.rand(k, C, generator=gen) > 0.2
    return tokens, tok, valid


def _scales(k, gen) -> list[torch.Tensor]:
    amax = torch.logspace(-20, 20, k) * (1 + torch.rand(k, generator=gen))
    return [nvfp4_global_scale(amax).reshape(-1, 1, 1), torch.full((k, 1, 1), 1e-12)]


def check_against_reference(device: str, shapes=SHAPES) -> list[str]:
    """Kernel on `device` vs the torch ops on the CPU, bit for bit; a line per case."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    for k, C, H, block, T in shapes:
        act = NVFP4ActQuantizer(block)
        tokens, tok, valid = _case(k, C, H, T, gen)
        for in_dtype, out_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.float32, torch.bfloat16)):
            t = tokens.to(in_dtype)
            for gs in _scales(k, gen):
                want_x, want_q = gather_quant_reference(act, t, tok, valid, gs, out_dtype)
                for with_x in (True, False):
                    x, xq = gather_quant(act, t.to(device), tok.to(device), valid.to(device), gs.to(device),
                                         out_dtype, with_x=with_x)
                    assert bits_equal(xq.cpu(), want_q), (k, C, H, block, in_dtype, out_dtype, with_x)
                    if with_x:
                        assert bits_equal(x.cpu(), want_x), (k, C, H, block, in_dtype, out_dtype)
                    else:
                        assert x is None
                    lines.append(f"ok {k}x{C}x{H}/{block} {in_dtype}->{out_dtype} x={with_x}")
    return lines


def check_opcheck(device: str) -> str:
    gen = torch.Generator().manual_seed(1)
    tokens, tok, valid = _case(2, 3, 32, 5, gen)
    for with_x in (True, False):
        torch.library.opcheck(gather_quant_triton._gather_nvfp4_quant,
                              (tokens.to(device), tok.to(device), valid.to(device), torch.ones(2, device=device), 16,
                               with_x, torch.float32))
    return "ok opcheck"


def test_kernel_matches_reference_under_the_interpreter():
    out = run_triton_interpreted(
        "import torch\n"
        "from moesq_core.compression.kernels import gather_quant_triton\n"
        "assert gather_quant_triton.available(torch.device('cpu'))\n"
        "from test_gather_quant_triton import *\n"
        "print('\\n'.join(check_against_reference('cpu')))\n"
        "print(check_opcheck('cpu'))\n")
    assert out.count("ok ") == len(SHAPES) * 3 * 2 * 2 + 1


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert gather_quant_triton.available(torch.device("cuda"))
    lines = check_against_reference("cuda", SHAPES + ((8, 3000, 2048, 32, 5000),))
    assert len(lines) == (len(SHAPES) + 1) * 3 * 2 * 2
    print(check_opcheck("cuda"))


def test_falls_back_to_the_torch_ops():
    """Without static scales, without `fused`, for a block the kernel does not tile, off the kernel's devices and
    for FP8 activations, gather_quant is the torch ops bit for bit."""
    gen = torch.Generator().manual_seed(4)
    tokens, tok, valid = _case(2, 5, 48, 9, gen)
    gs = torch.full((2, 1, 1), 3.0)
    cases = [(NVFP4ActQuantizer(16), None, True), (NVFP4ActQuantizer(16), gs, False),
             (NVFP4ActQuantizer(24), gs, True), (get_format("s24-fp8").act, None, True)]
    if not gather_quant_triton.available(torch.device("cpu")):
        cases.append((NVFP4ActQuantizer(16), gs, True))
    for act, g, fused in cases:
        x, xq = gather_quant(act, tokens, tok, valid, g, torch.float32, fused=fused)
        want = torch.where(valid[..., None], tokens[tok], 0.0)
        assert bits_equal(x, want)
        assert bits_equal(xq, act.batched(want, g, ste=False))
        assert bool((xq[~valid] == 0).all())
