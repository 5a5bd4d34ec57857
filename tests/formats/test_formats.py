"""Format numerics: E2M1 rounding (ties to the even code, saturation), UE4M3 scales, NVFP4 and FP8
quantizers, pattern sets. Property-based where the property is general."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import (
    E2M1_GRID,
    FORMATS,
    P48,
    S24,
    e2m1_decode,
    e2m1_encode,
    get_format,
    round_e2m1,
    round_e4m3,
)
from moesq_core.formats.e2m1 import e2m1_magnitude_index
from moesq_core.formats.e4m3 import round_ue4m3_scale
from moesq_core.formats.quantizers import NVFP4Quantizer, nvfp4_global_scale, nvfp4_quantize_unscaled

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


def test_e2m1_ties_go_to_even_code():
    # 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4, saturate above 6
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -0.25, -0.75, -5.0, -7.0])
    want = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, 6, -0, -1, -4, -6], dtype=torch.float32)
    assert torch.equal(round_e2m1(x), want)


@given(st.lists(finite, min_size=1, max_size=64))
def test_e2m1_is_nearest_grid_value(vals):
    x = torch.tensor(vals, dtype=torch.float32)
    r = round_e2m1(x)
    grid = torch.tensor(E2M1_GRID)
    full = torch.cat([-grid, grid])
    assert bool(torch.isin(r, full).all())
    # nearest: no grid point is strictly closer (after saturation)
    xs = x.clamp(-6, 6)
    best = (xs[:, None] - full[None]).abs().min(1).values
    assert torch.allclose((xs - r).abs(), best)


@given(st.lists(finite, min_size=1, max_size=64))
def test_e2m1_codes_round_trip(vals):
    x = torch.tensor(vals, dtype=torch.float32)
    codes = e2m1_encode(x)
    assert int(codes.max()) <= 15
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)
    assert not bool(((codes == 8)).any()), "negative zero must be encoded as code 0"


def _comparison_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes by the definition: one comparison per midpoint (e2m1_magnitude_index)."""
    mag = e2m1_magnitude_index(x.abs())
    return (((x < 0) & (mag > 0)).to(torch.uint8) << 3) | mag


def _float32_sample() -> torch.Tensor:
    """Every 97th float32 bit pattern of either sign (no NaN), the grid's midpoints and their neighbours."""
    f = torch.arange(0, 2**31 - 1, 97, dtype=torch.int64).to(torch.int32).view(torch.float32)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0, 0.0, float("inf"), 2.0**25, 3e38])
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    x = torch.cat([f[~f.isnan()], near])
    return torch.cat([x, -x])


def test_e2m1_fast_rounding_equals_the_comparisons_bit_for_bit():
    x = _float32_sample()
    want = _comparison_codes(x)
    assert torch.equal(e2m1_encode(x), want)
    assert torch.equal(round_e2m1(x).view(torch.int32), e2m1_decode(want).view(torch.int32))  # +0 for code 0
    assert int(e2m1_encode(torch.tensor([float("nan")]))) == 0
    # NaN rounds to what is stored for it (code 0: +0), so fake quantization computes what is packed
    nan = torch.tensor([float("nan"), -float("nan")])
    assert torch.equal(round_e2m1(nan).view(torch.int32), torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("shape,block,g_shape", [((512, 192), 16, ()), ((8, 64, 192), 16, (8, 1, 1)),
                                                  ((300, 128), 32, ()), ((64, 128), 1, ()), ((5, 7, 32), 32, (1,))])
def test_nvfp4_quantization_equals_the_expanded_scales_reference(shape, block, g_shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 3
    x[..., :16] *= 1e-4  # scales in UE4M3's subnormal range
    g = (torch.rand(g_shape, generator=gen) + 0.5) * 448 * 6 / x.abs().max()
    s = round_ue4m3_scale(x.reshape(*shape[:-1], -1, block).abs().amax(-1) / 6.0 * g).repeat_interleave(block, -1)
    want = e2m1_decode(_comparison_codes(x * g / s)) * s
    assert torch.equal(nvfp4_quantize_unscaled(x, block, g).view(torch.int32), want.view(torch.int32))


def test_e4m3_saturates_instead_of_nan():
    x = torch.tensor([500.0, -1000.0, 448.0, 1e-12])
    r = round_e4m3(x)
    assert torch.equal(r[:3], torch.tensor([448.0, -448.0, 448.0]))
    assert bool(torch.isfinite(r).all())


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 6), st.integers(1, 4), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_nvfp4_quantize_is_exact_and_on_grid(rows, nblocks, scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, nblocks * 32, generator=g) * scale
    fmt = get_format("p48-nvfp4")
    qw = fmt.quantize(w)
    # stored block scales are e4m3 values within [2^-9, 448]
    assert torch.equal(round_e4m3(qw.scales), qw.scales)
    assert float(qw.scales.min()) >= 2**-9 and float(qw.scales.max()) <= 448
    # global scale g = 448*6/amax of the masked weight
    assert math.isclose(float(qw.global_scale), 448 * 6 / float((w * qw.mask).abs().max()), rel_tol=1e-6)
    # re-quantizing the dequantized weight is a fixed point (what pack writes is what we computed)
    again = fmt.quantize(qw.dequantize(), qw.mask, qw.global_scale)
    assert torch.equal(again.codes, qw.codes) and torch.equal(again.scales, qw.scales)
    # fake-quant equals encode/decode
    assert torch.equal(fmt.fake_quant_weight(w, qw.mask), qw.dequantize())
    # error bounded by half a step of the coarsest grid spacing (2 units of E2M1 at the top) per block
    err = (qw.dequantize() - w * qw.mask).abs()
    step = NVFP4Quantizer(32).expand(qw.scales) / qw.global_scale
    assert bool((err <= step + 1e-6 * w.abs().max()).all())


def test_nvfp4_global_scale_of_zero_tensor_is_one():
    assert float(nvfp4_global_scale(torch.tensor(0.0))) == 1.0
    qw = get_format("dense-nvfp4").quantize(torch.zeros(4, 32))
    assert bool((qw.dequantize() == 0).all())


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_pattern_masks_are_admissible(rows, groups, seed):
    g = torch.Generator().manual_seed(seed)
    for ps in (P48, S24):
        w = torch.randn(rows, groups * 8, generator=g)
        idx = ps.best_index(w.abs())
        mask = ps.mask_from_index(idx)
        assert torch.equal(ps.index_from_mask(mask), idx)
        assert int(mask.sum()) == rows * groups * 8 * ps.kept_per_group // ps.group
        # best pattern keeps at least as much magnitude as any other admissible pattern
        sums = w.abs().reshape(rows, -1, ps.group) @ ps.pattern_matrix().T
        assert torch.allclose(sums.max(-1).values, (w.abs() * mask).reshape(rows, -1, ps.group).sum(-1))


def test_p48_pattern_order_matches_release():
    assert P48.rows == ("11110000", "11001100", "11000011", "00111100", "00110011", "00001111")
    c = P48.overlap_init(P48.mask_from_index(torch.tensor([[2]])))
    assert c.squeeze().tolist() == [0.0, 0.0, 2.0, -2.0, 0.0, 0.0]


def test_format_rejects_what_it_cannot_hold():
    fmt = get_format("p48-nvfp4")
    with pytest.raises(ValueError, match="multiple of 32"):
        fmt.check_weight(torch.randn(4, 48))
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite value at \[1, 3\]"):
        fmt.check_weight(w)
    with pytest.raises(ValueError, match="unknown format"):
        get_format("p48-int4")


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_fp8_channel_quant(rows, groups, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * 4, generator=g) * 10
    fmt = get_format("s24-fp8")
    qw = fmt.quantize(w)
    d = qw.dequantize()
    assert bool(((d != 0) <= qw.mask).all())
    # per row, the largest kept magnitude maps to 448 exactly
    amax = (w * qw.mask).abs().amax(1)
    assert torch.allclose(d.abs().amax(1), amax)
    assert torch.allclose(d, w * qw.mask, rtol=2**-3)


def test_bits_per_weight_declared():
    assert FORMATS["p48-nvfp4"].bits_per_weight == 2.75
    assert FORMATS["dense-nvfp4"].bits_per_weight == 4.5


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("name", list(FORMATS))
def test_config_layout_is_the_layout_pack_writes(name, sparse):
    """A serving engine picks the experts' layout from the config before reading a tensor (the vLLM plugin)."""
    fmt = get_format(name)
    qc = fmt.quantization_config([], True, sparse, {})
    assert fmt.config_layout(qc) == fmt.export_layout(sparse)
