"""The factored weights and activations the experts module's GPU path multiplies in bf16: every format's quantized
values are exact in bf16 (codes times block scales; the global or channel scale a per-row factor), and the batched
path on them equals the per-expert fp32 loop up to the matmuls' summation order, in chunks of experts grouped by
row count."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moesq_core.formats import FORMATS, get_format
from moesq_core.naming import PROJECTIONS
from moesq_core.serving.experts import MoesqExperts

FORMAT_NAMES = sorted(FORMATS)


def _exact_in_bf16(t: torch.Tensor) -> bool:
    return torch.equal(t.bfloat16().float(), t)


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(FORMAT_NAMES), st.integers(1, 5), st.floats(1e-4, 1e4), st.integers(0, 2**31 - 1))
def test_factored_weights_are_exact_in_bf16_and_multiply_back_to_the_weights(name, rows, scale, seed):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 64, generator=g) * scale
    w[0, :8] *= 1e-3  # small blocks: subnormal block scales
    qw = fmt.quantize(w)
    values, row = qw.factored()
    assert values.shape == w.shape and row.shape == (rows,)
    assert _exact_in_bf16(values)
    torch.testing.assert_close(values * row[:, None], qw.dequantize(), rtol=2e-7, atol=0)


@settings(deadline=None, max_examples=30)
@given(st.sampled_from(FORMAT_NAMES), st.floats(1e-3, 1e3), st.booleans(), st.integers(0, 2**31 - 1))
def test_factored_activations_are_exact_in_bf16_and_multiply_back(name, scale, static, seed):
    act = get_format(name).act
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 64, generator=g) * scale
    x[1] = 0  # an expert without rows (all padding)
    gs = act.global_from_amax(torch.full((3,), 4.0 * scale)).reshape(-1, 1, 1) if static and \
        act.uses_global_scale else None
    values, factor = act.batched_factored(x, gs)
    assert _exact_in_bf16(values) and bool((values[1] == 0).all())
    torch.testing.assert_close(values * factor, act.batched(x, gs), rtol=2e-7, atol=0)


def test_expert_chunks_group_similar_row_counts_within_the_budget():
    counts = [0, 100, 7, 90, 100, 3, 60, 0, 59]
    chunks = MoesqExperts.expert_chunks(counts, width=4, budget=3 * 100 * 4 * 4, fill=0.75)
    assert sorted(e for c in chunks for e in c) == [e for e, n in enumerate(counts) if n]
    assert chunks[0] == [1, 4, 3]  # decreasing counts, ties by index; the budget stops at 3 x 100 rows
    for c in chunks:
        assert all(counts[e] <= counts[c[0]] and counts[e] >= 0.75 * counts[c[0]] for e in c)
        assert len(c) == 1 or len(c) * counts[c[0]] * 4 * 4 <= 3 * 100 * 4 * 4
    assert MoesqExperts.expert_chunks(counts, 4, 1, 0.75) == [[e] for e in (1, 4, 3, 6, 8, 2, 5)]
    # weights counted per expert: a budget of two experts' weights and rows holds two
    assert len(MoesqExperts.expert_chunks([10, 10, 10], 4, 2 * (10 * 16 + 1000), 0.5, 1000)[0]) == 2


AMAX_IN = torch.tensor([4.0, 0.0, 6.0, 0.0, 3.0, 5.0, 2.0])  # 0: no range, dynamic
AMAX_MID = torch.tensor([0.0, 0.5, 0.4, 0.0, 0.7, 0.0, 0.3])


def _module(name: str, act_quant: bool, E=7, H=64, inter=32, seed=3):
    fmt = get_format(name)
    torch.manual_seed(seed)
    weights = [{p: fmt.quantize(torch.randn(*((inter, H) if p != "down" else (H, inter))) * 0.1 * (1 + e))
                for p in PROJECTIONS} for e in range(E)]
    module = MoesqExperts.from_quantized(fmt, weights, act_quant, AMAX_IN[:E], AMAX_MID[:E])
    return module, weights


def _routing(T=90, E=7, k=2, seed=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, E - 1, (T, k), generator=g)  # expert E-1 gets no row
    idx[:30, 0] = 0  # uneven: expert 0 hot
    idx[:30, 1] = torch.where(idx[:30, 1] == 0, 1, idx[:30, 1])
    return idx, torch.rand(T, k, generator=g)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("act_quant", [True, False])
def test_factored_batched_path_equals_the_per_expert_loop(name, act_quant, monkeypatch):
    module, weights = _module(name, act_quant)
    assert getattr(module, "gate_up_values", None) is None  # only when asked (the engine's install on a GPU)
    module.set_factored(weights)
    assert module.gate_up_values.dtype == torch.bfloat16 and module._factored()
    assert "gate_up_values" not in module.state_dict()  # not part of what is saved
    idx, w = _routing()
    for x in (torch.randn(90, 64).bfloat16().float(), torch.randn(90, 64)):  # bf16 states, and any fp32
        want = module(x, idx, w)  # the CPU loop, the reference
        module.batched = True
        got = module(x, idx, w)
        module.batched = None
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 3e-5, rel  # summation order only (a code on a rounding boundary may move: not here)
        monkeypatch.setattr(MoesqExperts, "BATCH_BYTES", 1)  # one expert per chunk: the same numbers
        module.batched = True
        assert torch.equal(module(x, idx, w), got)
        module.batched = None
        monkeypatch.undo()


def test_straight_through_modules_do_not_take_the_factored_path():
    module, weights = _module("p48-nvfp4", True)
    module.set_factored(weights)
    module.ste = True
    assert not module._factored()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_factored_path_on_cuda_matches_the_loop(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module, weights = _module(name, True, E=7, H=256, inter=128)
    idx, w = _routing(T=700)
    x = torch.randn(700, 256).bfloat16().float()  # a bf16 model's states, in fp32: outputs without bf16 rounding
    cpu = module(x, idx, w)
    on_gpu = [{p: q.to("cuda") for p, q in e.items()} for e in weights]
    gpu = MoesqExperts.from_quantized(get_format(name), on_gpu, True, AMAX_IN.cuda(), AMAX_MID.cuda())
    gpu.set_factored(on_gpu)
    assert gpu._factored() and gpu.gate_up_values.is_cuda
    args = (x.cuda(), idx.cuda(), w.cuda())
    got = gpu(*args)
    assert torch.equal(gpu(*args), got)  # deterministic
    assert gpu(x.bfloat16().cuda(), *args[1:]).dtype == torch.bfloat16
    gpu.batched = False
    loop = gpu(*args)  # the per-expert fp32 loop, on the same device
    assert ((got - loop).norm() / loop.norm()).item() < 3e-4
    # against the CPU: the FP8 formats' per-token scale (amax / 448) rounds differently on CUDA, which divides by a
    # scalar through its reciprocal, and ties of bf16-valued inputs then round to other codes (~1e-2 here, the GPU
    # loop as much as this path); NVFP4's static global scales do not
    tol = 2e-2 if name.endswith("fp8") else 3e-4
    assert ((got.cpu() - cpu).norm() / cpu.norm()).item() < tol


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_installs_factored_experts_on_a_gpu_only(device):
    """Propagation on a GPU multiplies the factored weights; the CPU keeps the reference loop, and serving modules
    (make_experts) do not pay the factored copy's 2 bytes per weight."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moesq_core.compression.engine import install_block
    from moesq_core.compression.methods.base import CompressedExpert

    _, weights = _module("p48-nvfp4", True, E=3)
    installed = {}

    class Block:
        def set_experts(self, module):
            installed["module"] = module

    install_block(Block(), get_format("p48-nvfp4"), [CompressedExpert(**w) for w in weights], AMAX_IN[:3],
                  AMAX_MID[:3], True, torch.device(device))
    module = installed["module"]
    assert module._factored() == (device == "cuda")
    assert module.gate_up_proj.device.type == device
