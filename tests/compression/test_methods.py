"""The one-shot methods through the `Method` interface: registry, outputs, fallbacks, and a real expert."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert, ExpertData
from moesq_core.compression.methods.registry import METHODS, get_method, method_options
from moesq_core.compression.methods.rtn import RTN
from moesq_core.formats import get_format

FORMATS = ["p48-nvfp4", "dense-nvfp4", "s24-fp8"]


def make_expert(index=0, n=512, H=64, inter=64, seed=0) -> ExpertData:
    """An expert with correlated inputs (X = Z·A) and router weights in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(H, H, generator=g) / H**0.5 + 0.3 * torch.eye(H)
    x = torch.randn(n, H, generator=g) @ A
    return ExpertData(index, 0.2 * torch.randn(inter, H, generator=g), 0.2 * torch.randn(inter, H, generator=g),
                      0.2 * torch.randn(H, inter, generator=g), x, torch.rand(n, generator=g))


def output_error(ex: ExpertData, ce: CompressedExpert, x: torch.Tensor | None = None) -> float:
    x = ex.x if x is None else x
    g, u, d = (ce.weights()[p].dequantize() for p in PROJECTIONS)
    y_hat = (F.silu(x @ g.T) * (x @ u.T)) @ d.T
    y = ex.dense_output(x)
    return float((y - y_hat).pow(2).sum() / y.pow(2).sum())


def method_for(name: str, fmt_name: str):
    if name == "gptq" and not get_format(fmt_name).patterns.is_dense:
        return None
    return get_method(name)


def test_registry_names_and_options():
    assert set(METHODS) == {"rtn", "magnitude", "wanda", "jsq", "obr", "sgptq", "gptq"}
    for name in METHODS:
        assert get_method(name).name == name
    assert get_method("sgptq", percdamp=0.1, exact_scales=False).exact_scales is False
    assert "percdamp" in method_options("obr") and "hessian_weighting" in method_options("sgptq")
    with pytest.raises(ValueError, match="unknown method 'sgpt'"):
        get_method("sgpt")
    with pytest.raises(ValueError, match="no option.*percdam"):
        get_method("sgptq", percdam=0.1)
    with pytest.raises(ValueError, match="sparse"):
        get_method("gptq").compress_block([make_expert()], get_format("p48-nvfp4"))
    with pytest.raises(ValueError, match="second_stage"):
        get_method("obr", second_stage="x")


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("name", METHODS)
def test_method_outputs_are_well_formed(name, fmt_name):
    meth = method_for(name, fmt_name)
    if meth is None:
        pytest.skip("gptq is dense-only")
    fmt = get_format(fmt_name)
    experts = [make_expert(i, n=256, seed=i) for i in range(2)]
    calls = []
    out = meth.compress_block(experts, fmt, progress=calls.append)
    assert sum(calls) == 2 and len(out) == 2  # batched methods report a chunk of experts at once
    for ex, ce in zip(experts, out):
        assert torch.equal(ce.gate.global_scale, ce.up.global_scale)  # one global scale for gate and up
        for p, qw in ce.weights().items():
            W = getattr(ex, p)
            assert qw.format == fmt.name and qw.codes.shape == W.shape and qw.codes.dtype == torch.uint8
            assert qw.mask.dtype == torch.bool
            assert bool(fmt.patterns.match(qw.mask)[1].all())  # admissible patterns only
            assert torch.all(qw.codes[~qw.mask] == 0)
            assert ce.latent[p].shape == W.shape and ce.latent[p].dtype == torch.float32
        assert set(ce.info["rel_err"]) == set(PROJECTIONS)
        assert ce.info["method"] == name


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_sgptq_beats_magnitude_rtn_on_correlated_inputs(fmt_name):
    fmt = get_format(fmt_name)
    ex = make_expert(seed=3)
    sg = get_method("sgptq").compress_block([ex], fmt)[0]
    rtn = RTN().compress_block([ex], fmt)[0]
    assert output_error(ex, sg) < 0.9 * output_error(ex, rtn)
    for p in PROJECTIONS:
        assert sg.info["rel_err"][p] < rtn.info["rel_err"][p]
    # the latent is the compensated dense V: masked and quantized it lands near the exported weights
    for p, qw in sg.weights().items():
        assert not torch.equal(sg.latent[p], getattr(ex, p))


def test_export_exact_sgptq_is_a_fixed_point_per_expert():
    for fmt_name in FORMATS:
        fmt = get_format(fmt_name)
        ce = get_method("sgptq").compress_block([make_expert(seed=4)], fmt)[0]
        for p, qw in ce.weights().items():
            again = fmt.quantize(qw.dequantize(), qw.mask, qw.global_scale)
            assert torch.equal(again.codes, qw.codes), (fmt_name, p)


def test_obr_beats_its_own_start_wanda_rtn():
    fmt = get_format("p48-nvfp4")
    ex = make_expert(seed=5)
    obr = get_method("obr").compress_block([ex], fmt)[0]
    obr_rtn = get_method("obr", second_stage="rtn").compress_block([ex], fmt)[0]
    wanda = get_method("wanda").compress_block([ex], fmt)[0]
    for p in PROJECTIONS:  # same support (Wanda's), OBR only moves values
        assert torch.equal(obr.weights()[p].mask, wanda.weights()[p].mask)
    assert output_error(ex, obr) < 0.7 * output_error(ex, wanda)
    assert output_error(ex, obr_rtn) < 0.7 * output_error(ex, wanda)


def test_jsq_and_wanda_masks_use_activations():
    fmt = get_format("p48-nvfp4")
    ex = make_expert(seed=6)
    loud = torch.arange(ex.x.shape[1]) % 8 < 2  # the first pair of every 8-group: loud input channels
    ex.x[:, loud] *= 20
    mag = RTN().compress_block([ex], fmt)[0]
    assert float(mag.gate.mask[:, loud].float().mean()) < 0.7  # magnitude does not care
    for name in ("wanda", "jsq"):
        ce = get_method(name).compress_block([ex], fmt)[0]
        assert float(ce.gate.mask[:, loud].float().mean()) > 0.95, name


@pytest.mark.parametrize("name", METHODS)
def test_expert_without_tokens_falls_back_to_rtn(name):
    fmt_name = "dense-nvfp4" if name == "gptq" else "p48-nvfp4"
    fmt = get_format(fmt_name)
    ex = make_expert(seed=7)
    empty = ExpertData(ex.index, ex.gate, ex.up, ex.down, ex.x[:0], ex.w[:0])
    ce = get_method(name).compress_block([empty], fmt)[0]
    ref = RTN().compress_block([empty], fmt)[0]
    if name not in ("rtn", "magnitude"):
        assert "fallback" in ce.info
    for p in PROJECTIONS:
        assert torch.equal(ce.weights()[p].codes, ref.weights()[p].codes)
        assert torch.equal(ce.weights()[p].scales, ref.weights()[p].scales)


@pytest.mark.parametrize("name", METHODS)
def test_nan_weights_give_a_clear_error(name):
    fmt = get_format("dense-nvfp4" if name == "gptq" else "p48-nvfp4")
    ex = make_expert(seed=8)
    ex.up[3, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        get_method(name).compress_block([ex], fmt)


def test_hessian_weighting_option():
    fmt = get_format("p48-nvfp4")
    ex = make_expert(seed=9)
    half = ex.w.numel() // 2
    ex.w[:half] = 1e-3  # half the tokens barely matter to the router, the other half fully
    ex.w[half:] = 1.0
    plain = get_method("sgptq").compress_block([ex], fmt)[0]
    w2 = get_method("sgptq", hessian_weighting="w2").compress_block([ex], fmt)[0]
    assert not torch.equal(plain.gate.codes, w2.gate.codes)
    # each solve wins on its own objective: the router-weighted one on the tokens that matter
    heavy = ex.x[half:]
    assert output_error(ex, w2, heavy) < output_error(ex, plain, heavy)
    assert output_error(ex, w2) > output_error(ex, plain)
    assert w2.info["rel_err"]["gate"] > plain.info["rel_err"]["gate"]  # reported errors are unweighted
    with pytest.raises(ValueError, match="weighting"):
        get_method("sgptq", hessian_weighting="w3").compress_block([ex], fmt)


def test_not_positive_definite_hessian_is_retried_inside_a_method(caplog):
    """Rank-deficient inputs whose damped Hessian still fails in the first try: percdamp=0 gives no damping;
    the retry must add some and the run must finish."""
    fmt = get_format("dense-nvfp4")
    ex = make_expert(seed=10, n=16)  # 16 tokens, 64 features: H has rank 16
    with caplog.at_level("WARNING"):
        ce = get_method("sgptq", percdamp=0.0).compress_block([ex], fmt)[0]
    assert ce.info["percdamp"]["gate_up"] > 0
    assert any("not positive definite" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- a real expert


@pytest.fixture(scope="module")
def micro_expert(micro_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import moe_block_inputs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(micro_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(micro_path)
    x = moe_block_inputs(model, tok, 0, 16, 128, chars=120_000)
    mlp = model.model.layers[0].mlp
    cal, val = x[: x.shape[0] // 2], x[x.shape[0] // 2:]
    with torch.no_grad():
        _, weights, idx = mlp.gate(cal)
        _, _, idx_val = mlp.gate(val)
    counts = torch.bincount(idx.flatten(), minlength=mlp.experts.down_proj.shape[0])
    e = int(counts.argmax())
    sel = (idx == e).any(-1)
    inter = mlp.experts.down_proj.shape[-1]
    gu = mlp.experts.gate_up_proj[e].detach()
    ex = ExpertData(e, gu[:inter].clone(), gu[inter:].clone(), mlp.experts.down_proj[e].detach().clone(),
                    cal[sel], (weights * (idx == e)).sum(-1)[sel])
    # the expert as rebuilt here (gate rows first) computes what the model's expert e computes
    with torch.no_grad():
        n = ex.x.shape[0]
        ref = mlp.experts(ex.x, torch.full((n, 1), e), torch.ones(n, 1))
    torch.testing.assert_close(ex.dense_output(), ref, rtol=1e-4, atol=1e-5)
    return ex, val[(idx_val == e).any(-1)]


def test_sgptq_beats_magnitude_on_a_real_expert(micro_expert):
    ex, x_val = micro_expert
    fmt = get_format("p48-nvfp4")
    assert ex.x.shape[0] > 100
    sg = get_method("sgptq").compress_block([ex], fmt)[0]
    mag = get_method("magnitude").compress_block([ex], fmt)[0]
    e_sg, e_mag = output_error(ex, sg), output_error(ex, mag)
    v_sg, v_mag = output_error(ex, sg, x_val), output_error(ex, mag, x_val)
    print(f"\nreal expert {ex.index} ({ex.x.shape[0]} tokens): sgptq {e_sg:.4f} (held-out {v_sg:.4f}) "
          f"vs magnitude {e_mag:.4f} (held-out {v_mag:.4f})")
    assert e_sg < 0.6 * e_mag
    assert v_sg < 0.8 * v_mag
