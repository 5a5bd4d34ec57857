"""The Triton row accumulation refinement uses for micro-batch gradients (acc[idx[i]] += src[i]) against torch's
index_add_: bitwise, on row lengths that leave partial programs, bf16 and fp32 sources, contiguous and transposed
ones, empty index sets, on CUDA and under the Triton interpreter on the CPU; the CPU fallback and the argument
checks."""
from __future__ import annotations

import pytest
import torch

from moesq_core.compression.kernels import rows_add_triton

from conftest import run_triton_interpreted


def check_against_index_add(device: str, shapes=((5, 3, 7), (4, 2, 4096), (6, 1, 4097), (3, 0, 9))) -> list[str]:
    """add_rows_ vs index_add_ on each [E, out, in] shape; returns a line per case (raises on a mismatch)."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    for E, out, K in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            for k in (0, 1, E - 1):
                idx = torch.randperm(E, generator=gen)[:k].to(device)
                acc = torch.randn(E, out, K, generator=gen).to(device)
                src = torch.randn(k, out, K, generator=gen).to(dtype).to(device)
                # a weight gradient of x Wᵀ: [k, out, in] with out contiguous, copied first or read in place
                for transposed, strided in ((False, False), (True, False), (True, True)):
                    s = src.transpose(1, 2).contiguous().transpose(1, 2) if transposed else src
                    a = acc.clone()
                    want = a.clone().index_add_(0, idx, s.float())
                    default, rows_add_triton.STRIDED = rows_add_triton.STRIDED, strided
                    try:
                        got = rows_add_triton.add_rows_(a, idx, s)
                    finally:
                        rows_add_triton.STRIDED = default
                    assert got is a and torch.equal(got, want), (E, out, K, dtype, k, transposed, strided)
                    lines.append(f"ok {E}x{out}x{K} {dtype} k={k} transposed={transposed} strided={strided}")
    return lines


def test_kernel_matches_index_add_under_the_interpreter():
    out = run_triton_interpreted(
        "from test_rows_add_triton import check_against_index_add\n"
        "print('\\n'.join(check_against_index_add('cpu')))\n")
    assert out.count("ok ") == 4 * 2 * 3 * 3


@pytest.mark.gpu
def test_kernel_matches_index_add_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert rows_add_triton.available(torch.device("cuda"))
    shapes = ((5, 3, 7), (6, 1, 4097), (3, 0, 9), (40, 768, 2048))
    assert len(check_against_index_add("cuda", shapes=shapes)) == 4 * 6 * 3


def test_fallback_and_argument_checks():
    """Without Triton (or off CUDA) it is index_add_; mismatched shapes or a non-fp32 accumulator are refused."""
    if not rows_add_triton.available(torch.device("cpu")):
        assert len(check_against_index_add("cpu")) == 4 * 2 * 3 * 3
    acc = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="add_rows_"):
        rows_add_triton.add_rows_(acc, torch.tensor([0]), torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="add_rows_"):
        rows_add_triton.add_rows_(acc, torch.tensor([0, 1]), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="add_rows_"):
        rows_add_triton.add_rows_(acc.half(), torch.tensor([0]), torch.zeros(1, 2, 4))
