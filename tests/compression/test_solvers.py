"""The Hessian machinery and the column-sweep / closed-form solvers on small problems with direct answers."""
from __future__ import annotations

import logging

import pytest
import torch

from moesq_core.compression.methods.hessian import (
    damped_factor,
    fix_dead,
    hessian,
    input_sq_norms,
    masked_optimum,
    relative_error,
)
from moesq_core.compression.methods.jsq import clip_activations, range_saliency
from moesq_core.compression.methods.sparsegpt_gptq import SGPTQSolver, provisional_mask
from moesq_core.formats import get_format

FORMATS = ["p48-nvfp4", "dense-nvfp4", "s24-fp8"]


def correlated(n=1024, C=128, R=64, seed=0, device="cpu"):
    """X = Z·A with a random mixing A (strongly correlated columns), W random; returns X, W, H, factor."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(C, C, generator=g) / C**0.5 + 0.3 * torch.eye(C)
    X = (torch.randn(n, C, generator=g) @ A).to(device)
    W = (0.05 * torch.randn(R, C, generator=g)).to(device)
    H = hessian(X)
    Hf, Wf = fix_dead(H, W)
    return X, Wf, H, damped_factor(Hf, 0.01)


def out_err(W, W_hat, X):
    return float(((W - W_hat) @ X.T).pow(2).sum() / (W @ X.T).pow(2).sum())


# ---------------------------------------------------------------- Hessian


def test_hessian_is_2_over_n_xtx_and_router_weighted():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 16, generator=g)
    w = torch.rand(300, generator=g)
    torch.testing.assert_close(hessian(X), 2 / 300 * X.T @ X, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hessian(X, w, "w"), 2 / w.sum() * (X * w[:, None]).T @ X, rtol=1e-5, atol=1e-6)
    w2 = w * w
    torch.testing.assert_close(hessian(X, w, "w2"), 2 / w2.sum() * (X * w2[:, None]).T @ X, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(input_sq_norms(X), (X * X).sum(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weighting"):
        hessian(X, w, "w3")
    with pytest.raises(ValueError, match="router weight"):
        hessian(X, None, "w")
    assert torch.equal(hessian(X[:0]), torch.zeros(16, 16))


def test_relative_error_equals_output_error():
    X, W, H, _ = correlated(C=64, R=16)
    W_hat = W + 0.01 * torch.randn_like(W)
    assert relative_error(W, W_hat, H) == pytest.approx(out_err(W, W_hat, X), rel=1e-4)


def test_dead_columns_are_zeroed_and_factorisable():
    X, W, _, _ = correlated(C=64, R=16)
    X[:, [3, 40]] = 0
    H = hessian(X)
    Hf, Wf = fix_dead(H, W)
    assert Hf[3, 3] == 1 and Hf[40, 40] == 1 and H[3, 3] == 0  # the input is not modified
    assert torch.all(Wf[:, [3, 40]] == 0) and torch.equal(Wf[:, 0], W[:, 0])
    fac = damped_factor(Hf)
    res = SGPTQSolver(get_format("p48-nvfp4")).solve(Wf, fac.hinv_chol)
    assert torch.all(res.values[:, [3, 40]] == 0)


def test_not_positive_definite_is_retried_with_more_damping(caplog):
    H = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.2]))  # mean diag 0.7: needs percdamp 1.0
    with caplog.at_level(logging.WARNING, logger="moesq_core.compression.methods.hessian"):
        fac = damped_factor(H, 0.01)
    assert fac.percdamp == pytest.approx(1.0)
    assert fac.damp == pytest.approx(0.7)
    assert sum("not positive definite" in r.getMessage() for r in caplog.records) == 2
    Hd = H.double() + 0.7 * torch.eye(4, dtype=torch.float64)
    torch.testing.assert_close((fac.hinv_chol.T @ fac.hinv_chol).double(), torch.linalg.inv(Hd), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not positive definite"):
        damped_factor(-torch.eye(4), 0.01)
    with pytest.raises(ValueError, match="non-finite"):
        damped_factor(torch.full((4, 4), float("nan")))


def test_factor_is_fp32_on_the_input_device_even_when_computed_in_fp64():
    _, _, H, fac = correlated(C=32, R=8)
    assert fac.hinv_chol.dtype == torch.float32 and fac.H.dtype == torch.float32
    assert torch.allclose(torch.triu(fac.hinv_chol), fac.hinv_chol)


# ---------------------------------------------------------------- the sweep


def test_gptq_without_quantization_or_sparsity_reproduces_the_input():
    _, W, _, fac = correlated()
    res = SGPTQSolver(get_format("dense-nvfp4"), quantize=False).solve(W, fac.hinv_chol)
    assert torch.equal(res.values, W) and torch.equal(res.latent, W) and bool(res.mask.all())
    with pytest.raises(ValueError, match="without quantization"):
        res.quantized_weight(get_format("dense-nvfp4"))


def test_gptq_with_a_fine_grid_is_near_lossless_and_compensates():
    """Dense GPTQ in NVFP4 beats RTN with the same scales/global scale (the classic GPTQ result)."""
    X, W, H, fac = correlated()
    fmt = get_format("dense-nvfp4")
    g = fmt.global_scale(W)
    gptq = SGPTQSolver(fmt).solve(W, fac.hinv_chol, g)
    rtn = fmt.quantize(W, None, g).dequantize()
    assert relative_error(W, gptq.values, H) < 0.7 * relative_error(W, rtn, H)


@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "s24-fp8"])
def test_sparsegpt_compensation_beats_plain_masking(fmt_name):
    X, W, H, fac = correlated(seed=2)
    fmt = get_format(fmt_name)
    sg = SGPTQSolver(fmt, quantize=False).solve(W, fac.hinv_chol)
    fmt.patterns.index_from_mask(sg.mask)
    plain = W * sg.mask
    e_sg, e_plain = out_err(W, sg.values, X), out_err(W, plain, X)
    e_mag = out_err(W, W * fmt.magnitude_mask(W), X)
    assert e_sg < 0.8 * e_plain, (e_sg, e_plain)
    assert e_sg < 0.8 * e_mag
    # kept weights moved (compensation), pruned ones are exactly zero
    assert not torch.equal(sg.values[sg.mask], W[sg.mask])
    assert torch.all(sg.values[~sg.mask] == 0)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_export_exact_output_is_a_fixed_point_of_the_format(fmt_name):
    X, W, H, fac = correlated(seed=3)
    fmt = get_format(fmt_name)
    res = SGPTQSolver(fmt).solve(W, fac.hinv_chol)
    qw = res.quantized_weight(fmt)
    assert torch.equal(qw.dequantize(), res.values)  # what GPTQ's errors were computed against is exported
    if not fmt.patterns.is_dense:
        assert bool(fmt.patterns.match(qw.mask)[1].all())
    again = fmt.quantize(qw.dequantize(), qw.mask, qw.global_scale)
    assert torch.equal(again.codes, qw.codes)
    torch.testing.assert_close(again.scales, qw.scales, rtol=1e-6, atol=0)
    assert torch.all(qw.codes[~qw.mask] == 0)


@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "s24-fp8"])
def test_non_exact_variant_is_not_a_fixed_point(fmt_name):
    """fp32 scales during GPTQ (the release): the block maxima drift, so re-quantizing the exported weights
    recomputes other scales and moves codes."""
    X, W, H, fac = correlated(seed=3)
    fmt = get_format(fmt_name)
    res = SGPTQSolver(fmt, exact_scales=False).solve(W, fac.hinv_chol)
    qw = res.quantized_weight(fmt)
    assert torch.equal(qw.dequantize(), res.values)
    if fmt.weight.block:  # stored scales are UE4M3 values
        assert torch.equal(qw.scales.to(torch.float8_e4m3fn).float(), qw.scales)
    again = fmt.quantize(qw.dequantize(), qw.mask, qw.global_scale)
    assert not torch.equal(again.codes, qw.codes)


@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "dense-nvfp4"])
def test_sgptq_beats_sparsegpt_then_rtn(fmt_name):
    for seed in range(2):
        X, W, H, fac = correlated(seed=10 + seed)
        fmt = get_format(fmt_name)
        g = fmt.global_scale(W * provisional_mask(fmt, W, fac.hinv_chol))
        joint = SGPTQSolver(fmt).solve(W, fac.hinv_chol, g)
        sg = SGPTQSolver(fmt, quantize=False).solve(W, fac.hinv_chol, g)
        then_rtn = fmt.quantize(sg.values, sg.mask, g).dequantize()
        assert relative_error(W, joint.values, H) < relative_error(W, then_rtn, H)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_sgptq_beats_rtn_and_masks_are_admissible(fmt_name):
    X, W, H, fac = correlated(seed=4)
    fmt = get_format(fmt_name)
    qw = SGPTQSolver(fmt).solve(W, fac.hinv_chol).quantized_weight(fmt)
    idx, ok = fmt.patterns.match(qw.mask)
    assert bool(ok.all())
    rtn = fmt.quantize(W)
    assert relative_error(W, qw.dequantize(), H) < 0.8 * relative_error(W, rtn.dequantize(), H)


def test_fixed_support_is_respected_and_mask_block_options():
    X, W, H, fac = correlated(seed=5)
    fmt = get_format("p48-nvfp4")
    mask = fmt.magnitude_mask(W)
    res = SGPTQSolver(fmt).solve(W, fac.hinv_chol, mask=mask)
    assert torch.equal(res.mask, mask)
    errs = {mb: relative_error(W, SGPTQSolver(fmt, mask_block=mb).solve(W, fac.hinv_chol).values, H) for mb in (8, 128)}
    assert errs[8] < errs[128]  # choosing each group's pattern when the sweep reaches it sees more compensation
    with pytest.raises(ValueError, match="multiple of the pattern group"):
        SGPTQSolver(fmt, mask_block=4)
    with pytest.raises(ValueError, match="must divide blocksize"):
        SGPTQSolver(fmt, mask_block=48)


def test_nan_weights_are_refused():
    _, W, _, fac = correlated(C=64, R=8)
    W[2, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        SGPTQSolver(get_format("p48-nvfp4")).solve(W, fac.hinv_chol)


# ---------------------------------------------------------------- closed forms


def test_masked_optimum_is_the_least_squares_solution_on_the_support():
    X, W, H, _ = correlated(n=512, C=64, R=6, seed=6)
    fmt = get_format("p48-nvfp4")
    mask = fmt.magnitude_mask(W)
    Wo = masked_optimum(W, H, mask)  # undamped: the plain least-squares problem (X has full column rank)
    assert torch.all(Wo[~mask] == 0)
    for r in range(W.shape[0]):
        K = mask[r].nonzero().squeeze(1)
        direct = torch.linalg.lstsq(X[:, K].double(), (X @ W[r]).double()[:, None]).solution[:, 0]
        torch.testing.assert_close(Wo[r, K].double(), direct, rtol=1e-3, atol=1e-5)


def test_jsq_range_saliency_matches_its_definition():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(50, 12, generator=g)
    W = torch.randn(5, 12, generator=g)
    ss = range_saliency(x, W, budget=100)  # tiny budget: several column chunks
    for j in range(12):
        Wj = W.clone()
        Wj[:, j] = 0
        y = x @ Wj.T
        torch.testing.assert_close(ss[:, j], y.amax(0) - y.amin(0), rtol=1e-5, atol=1e-5)
    xc = clip_activations(x, 0.02)
    assert float(xc.abs().max()) < float(x.abs().max())
    assert int((xc.abs() == xc.abs().max()).sum()) >= int(0.02 * x.numel())


@pytest.mark.gpu
def test_sweep_runs_on_cuda_and_matches_cpu():
    X, W, H, fac = correlated(seed=8)
    fmt = get_format("p48-nvfp4")
    cpu = SGPTQSolver(fmt).solve(W, fac.hinv_chol)
    gpu = SGPTQSolver(fmt).solve(W.cuda(), fac.hinv_chol.cuda())
    assert gpu.values.is_cuda
    e_cpu, e_gpu = relative_error(W, cpu.values, H), relative_error(W, gpu.values.cpu(), H)
    assert e_gpu == pytest.approx(e_cpu, rel=0.05)
    assert float((gpu.mask.cpu() == cpu.mask).float().mean()) > 0.95
