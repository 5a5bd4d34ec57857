"""The fused Triton relaxation (refinement's Gumbel-softmax over sparsity patterns) against the torch reference
(moesq_core.compression.methods.refine.relaxation): forward values and both gradients, with and without noise, on sizes
that leave partial programs, on CUDA and under the Triton interpreter on the CPU."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moesq_core.compression.kernels import relax_triton
from moesq_core.compression.methods.refine import relaxation
from moesq_core.formats import get_format

from conftest import run_triton_interpreted


def check_against_reference(device: str, shapes=((3, 5, 48), (1, 7, 8), (2, 3, 136)),
                            forms=("cols", "tile")) -> list[str]:
    """The kernel forms vs the reference on each [E, out, K] shape; returns a line per case (raises on a mismatch)."""
    lines = []
    saved = relax_triton.KERNELS
    try:
        for kernels in forms:
            relax_triton.KERNELS = kernels
            lines += [f"{line} {kernels}" for line in _check_kernels(device, shapes)]
    finally:
        relax_triton.KERNELS = saved
    return lines


@contextlib.contextmanager
def one_config(i: int):
    """The column form's kernels pinned to their i-th autotuning config (the tuner compiles and times every config
    for every size and dtype, minutes over these cases; a config changes only the tiling, so each is checked once)."""
    kernels = (relax_triton._relax_fwd_cols_kernel, relax_triton._relax_bwd_cols_kernel)
    saved = [(k.configs, dict(k.cache)) for k in kernels]
    for k in kernels:
        k.configs, k.cache = k.configs[i:i + 1], {}
    try:
        yield
    finally:
        for k, (configs, cache) in zip(kernels, saved):
            k.configs, k.cache = configs, cache


def _check_kernels(device: str, shapes) -> list[str]:
    fmt = get_format("p48-nvfp4")
    ps = fmt.patterns
    P, group = ps.num_patterns, ps.group
    fi = torch.finfo(torch.float32)
    lines = []
    gen = torch.Generator().manual_seed(0)
    for E, out, K in shapes:
        for noise in (True, False):
            for logits_dtype in (torch.float32, torch.bfloat16):
                for need_da in (True, False):
                    A = (0.05 * torch.randn(E, out, K // group, P, generator=gen)).to(logits_dtype).to(device)
                    V = torch.randn(E, out, K, generator=gen).to(device).requires_grad_()
                    A.requires_grad_(need_da)
                    U = torch.rand(E, out, K // group, P, generator=gen).to(device) if noise else None
                    if U is not None and K == 8:
                        U[..., 0] = 0.0  # the clamp keeps −log(−log U) finite
                    tau, gain = 0.7, 100.0
                    G = None if U is None else -torch.log(-torch.log(U.clamp(fi.tiny, 1 - fi.eps)))
                    # the reference in fp32 (bf16 logits: the kernel reads them and computes in fp32)
                    Af = A.detach().float().requires_grad_(need_da)
                    ref = relaxation.soft_mask(relaxation.pattern_probs(Af, tau, gain, G), ps) * V
                    dout = torch.randn(ref.shape, generator=gen).to(device)
                    want = torch.autograd.grad(ref, [Af, V] if need_da else [V], dout)
                    relaxed = relax_triton.relaxed_weight(A, V, U, ps.pattern_matrix(), tau, gain)
                    assert relaxed.dtype == V.dtype and relaxed.shape == V.shape
                    torch.testing.assert_close(relaxed, ref, rtol=1e-5, atol=1e-6)
                    got = torch.autograd.grad(relaxed, [A, V] if need_da else [V], dout)
                    if need_da:
                        assert got[0].dtype == A.dtype
                        scale = float(want[0].abs().max())
                        tol = 1e-5 if logits_dtype == torch.float32 else 1e-2
                        assert float((got[0].float() - want[0]).abs().max()) <= tol * scale + 1e-6
                    torch.testing.assert_close(got[-1], want[-1], rtol=1e-5, atol=1e-6)
                    lines.append(f"ok {E}x{out}x{K} noise={noise} logits={logits_dtype} dA={need_da}")
    return lines


def test_kernel_matches_reference_under_the_interpreter():
    out = run_triton_interpreted(
        "from test_relax_triton import check_against_reference\n"
        "print('\\n'.join(check_against_reference('cpu')))\n")
    assert out.count("ok ") == 2 * 3 * 2 * 2 * 2


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    # the default (column) form: every case under its first config, then every config on one size; the tile form
    # (kept for the bench's comparison) under the interpreter
    with one_config(0):
        lines = check_against_reference("cuda", shapes=((3, 5, 48), (1, 7, 8), (2, 3, 136), (4, 96, 2048)),
                                        forms=("cols",))
    for i in range(1, len(relax_triton._relax_fwd_cols_kernel.configs)):
        with one_config(i):
            lines += check_against_reference("cuda", shapes=((4, 96, 2048),), forms=("cols",))
    assert len(lines) == 4 * 8 + (len(relax_triton._relax_fwd_cols_kernel.configs) - 1) * 8


def test_refuses_to_run_where_it_cannot():
    if relax_triton.available(torch.device("cpu")):
        pytest.skip("running under the Triton interpreter")
    ps = get_format("p48-nvfp4").patterns
    A = torch.zeros(1, 1, 1, ps.num_patterns)
    with pytest.raises(RuntimeError, match="CUDA with Triton"):
        relax_triton.relaxed_weight(A, torch.zeros(1, 1, 8), None, ps.pattern_matrix(), 1.0, 1.0)


def test_refuses_mismatched_shapes():
    if not relax_triton.available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs CUDA with Triton or the Triton interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ps = get_format("p48-nvfp4").patterns
    A = torch.zeros(1, 1, 2, ps.num_patterns, device=dev)
    with pytest.raises(ValueError, match="do not match"):
        relax_triton.relaxed_weight(A, torch.zeros(1, 1, 8, device=dev), None, ps.pattern_matrix(), 1.0, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        relax_triton.relaxed_weight(A, torch.zeros(1, 1, 16, device=dev), None, ps.pattern_matrix(), 0.0, 1.0)
