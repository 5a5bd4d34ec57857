"""The batched one-shot solvers (all experts of a block at once) against the per-expert reference.

On the CPU the batched path computes exactly the per-expert numbers (same operations per element, same LAPACK
calls per matrix), so equality here is bitwise: codes, scales, masks, global scales, latents and the info
dicts. The recursive factorisations the GPU path uses are checked against torch's, and the whole methods with
them forced on against the reference within float tolerance.
"""
from __future__ import annotations

import logging

import pytest
import torch

from moesq_core.compression.methods import spd
from moesq_core.compression.methods.base import PROJECTIONS, CompressedExpert, ExpertData
from moesq_core.compression.methods.hessian import (
    damped_factor,
    damped_factors,
    fix_dead,
    fix_dead_batched,
    hessian,
    masked_optimum,
    masked_optimum_batched,
)
from moesq_core.compression.methods.registry import get_method
from moesq_core.compression.methods.sparsegpt_gptq import SGPTQSolver
from moesq_core.formats import get_format

FORMATS = ["p48-nvfp4", "dense-nvfp4", "s24-fp8"]
# (method, options): every Hessian-based method and variant the batched path implements
VARIANTS = [("sgptq", {}), ("sgptq", {"refit": True}), ("sgptq", {"exact_scales": False}), ("gptq", {}),
            ("obr", {}), ("obr", {"second_stage": "rtn"})]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small tensors, one intra-op thread


def variant_id(v):
    name, opts = v
    return name + "".join(f"-{k}={val}" for k, val in opts.items())


def applies(name: str, fmt_name: str) -> bool:
    return name != "gptq" or get_format(fmt_name).patterns.is_dense


def make_block(E=3, H=64, inter=32, seed=0, empty=(), dead=()) -> list[ExpertData]:
    """Experts with correlated inputs, different token counts, router weights; experts in `empty` get no
    tokens, input columns in `dead` are never excited (for expert 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in range(E):
        n = 0 if e in empty else 150 + 40 * e
        A = torch.randn(H, H, generator=g) / H**0.5 + 0.3 * torch.eye(H)
        x = torch.randn(n, H, generator=g) @ A
        if e == 0 and dead:
            x[:, list(dead)] = 0
        out.append(ExpertData(e, 0.2 * torch.randn(inter, H, generator=g), 0.2 * torch.randn(inter, H, generator=g),
                              0.2 * torch.randn(H, inter, generator=g), x, torch.rand(n, generator=g)))
    return out


def assert_same(ref: list[CompressedExpert], bat: list[CompressedExpert], what=""):
    assert len(ref) == len(bat)
    for r, b in zip(ref, bat):
        for p in PROJECTIONS:
            qr, qb = r.weights()[p], b.weights()[p]
            for k in ("codes", "scales", "global_scale", "mask"):
                a, c = getattr(qr, k), getattr(qb, k)
                assert a.dtype == c.dtype and a.shape == c.shape, (what, p, k)
                assert torch.equal(a, c), (what, p, k, float((a != c).float().mean()))
            assert torch.equal(r.latent[p], b.latent[p]), (what, p, "latent")
        assert r.info == b.info, what


def codes_agree(ref: list[CompressedExpert], bat: list[CompressedExpert]) -> float:
    same = total = 0
    for r, b in zip(ref, bat):
        for p in PROJECTIONS:
            same += int((r.weights()[p].codes == b.weights()[p].codes).sum())
            total += r.weights()[p].codes.numel()
    return same / total


# ---------------------------------------------------------------- factorisations


def spd_batch(B=4, n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, 3 * n, n, generator=g, dtype=torch.float64)
    X[..., : n // 3] *= 30  # a spread of scales, as real activations have
    return X.mT @ X / (3 * n) + 1e-3 * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("strategy", spd.STRATEGIES)
@pytest.mark.parametrize("base", [8, 32])
def test_recursive_factorisations_match_torch(base, strategy, monkeypatch):
    monkeypatch.setattr(spd, "STRATEGY", strategy)
    A = spd_batch()
    L0 = torch.linalg.cholesky(A)
    L, ok = spd.cholesky(A, True, base)
    assert bool(ok.all())
    torch.testing.assert_close(L, L0, rtol=1e-9, atol=1e-9)
    assert torch.equal(L, torch.tril(L))
    U0, ok0 = spd.inverse_cholesky_upper(A, False)
    U, ok = spd.inverse_cholesky_upper(A, True, base)
    assert bool(ok.all()) and bool(ok0.all()) and torch.equal(U, torch.triu(U))
    torch.testing.assert_close(U, U0, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(U.mT @ U, torch.linalg.inv(A), rtol=1e-6, atol=1e-8)
    b = torch.randn(A.shape[0], A.shape[-1], 3, dtype=torch.float64)
    x, ok = spd.spd_solve(A, b, True, base)
    torch.testing.assert_close(x, torch.linalg.solve(A, b), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(spd.inverse_lower(L, True, base) @ L, torch.eye(A.shape[-1], dtype=A.dtype).expand_as(A),
                               rtol=0, atol=1e-9)
    torch.testing.assert_close(spd.solve_upper(L.mT, b, True, base), torch.linalg.solve_triangular(L.mT, b, upper=True))
    Li, ok = spd.inverse_cholesky_factor(A, base)
    assert bool(ok.all()) and torch.equal(Li, torch.tril(Li))
    torch.testing.assert_close(Li, torch.linalg.inv(L0), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("strategy", spd.STRATEGIES)
@pytest.mark.parametrize("blocked", [False, True])
def test_not_positive_definite_is_flagged_per_matrix(blocked, strategy, monkeypatch):
    monkeypatch.setattr(spd, "STRATEGY", strategy)
    A = spd_batch(B=3, n=100)
    A[1] = -A[1]
    for ok in (spd.cholesky(A, blocked, 16)[1], spd.inverse_cholesky_upper(A, blocked, 16)[1],
               spd.spd_solve(A, torch.ones(3, 100, 1, dtype=A.dtype), blocked, 16)[1]):
        assert ok.tolist() == [True, False, True]


def test_damped_factors_equal_the_per_expert_factor_with_per_expert_retries(caplog):
    g = torch.Generator().manual_seed(3)
    Hs = []
    for e in range(4):
        X = torch.randn(200, 32, generator=g)
        if e == 1:
            X[:, 5] = 0  # a dead column
        Hs.append(hessian(X))
    Hs[2] = torch.diag(torch.tensor([1.0] * 31 + [-0.2]))  # needs more damping: two retries for this one alone
    H = torch.stack(Hs)
    W = torch.randn(4, 8, 32, generator=g)
    Hf, Wf = fix_dead_batched(H, W)
    with caplog.at_level(logging.WARNING, logger="moesq_core.compression.methods.hessian"):
        fac = damped_factors(Hf, 0.01, what=[f"expert {e}" for e in range(4)])
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and all(m.startswith("expert 2:") for m in msgs)
    for e in range(4):
        h1, w1 = fix_dead(Hs[e], W[e])
        assert torch.equal(h1, Hf[e]) and torch.equal(w1, Wf[e])
        ref = damped_factor(h1, 0.01)
        assert fac.percdamp[e] == ref.percdamp and fac.damp[e] == ref.damp
        assert torch.equal(fac.H[e], ref.H) and torch.equal(fac.hinv_chol[e], ref.hinv_chol)
    assert fac.percdamp[2] == pytest.approx(1.0) and fac.percdamp[0] == 0.01
    with pytest.raises(ValueError, match="expert 1: not positive definite"):
        damped_factors(torch.stack([torch.eye(4), -torch.eye(4)]), 0.01, what=["expert 0", "expert 1"])
    with pytest.raises(ValueError, match="expert 0: non-finite"):
        damped_factors(torch.full((1, 4, 4), float("nan")), what=["expert 0"])


def test_masked_optimum_batched_equals_per_expert():
    g = torch.Generator().manual_seed(4)
    fmt = get_format("p48-nvfp4")
    H = torch.stack([hessian(torch.randn(300, 64, generator=g) @ torch.randn(64, 64, generator=g)) for _ in range(3)])
    H = H + 0.01 * torch.eye(64)
    W = torch.randn(3, 10, 64, generator=g)
    mask = fmt.magnitude_mask(W)
    tiny_budget = masked_optimum_batched(W, H, mask, budget=1)  # one row per batch of systems
    for e in range(3):
        assert torch.equal(tiny_budget[e], masked_optimum(W[e], H[e], mask[e]))
    assert torch.equal(masked_optimum_batched(W, H, mask), tiny_budget)
    blocked = masked_optimum_batched(W, H, mask, blocked=True)
    torch.testing.assert_close(blocked, tiny_budget, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the sweep


def sweep_problem(E: int, R: int, C: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [E, C, C], W [E, 2R, C]): each expert's chol(H⁻¹) from correlated tokens, and two stacked projections."""
    g = torch.Generator().manual_seed(seed)
    Us, Ws = [], []
    for e in range(E):
        X = torch.randn(tokens, C, generator=g) @ (torch.randn(C, C, generator=g) / C**0.5 + 0.3 * torch.eye(C))
        Hf, Wf = fix_dead(hessian(X), 0.05 * torch.randn(2 * R, C, generator=g))
        Us.append(damped_factor(Hf).hinv_chol)
        Ws.append(Wf)
    return torch.stack(Us), torch.stack(Ws)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_batched_sweep_equals_per_expert_sweep(fmt_name, exact):
    """solve_batched on [E, 2R, C] (two stacked projections) = solve on each expert's each projection."""
    fmt = get_format(fmt_name)
    E, R = 3, 16
    U, W = sweep_problem(E, R, C=128, tokens=400, seed=5)
    solver = SGPTQSolver(fmt, blocksize=64, exact_scales=exact)
    gs = fmt.weight.global_scales(W)
    bat = solver.solve_batched(W, U, gs, row_groups=2)
    fixed = solver.solve_batched(W, U, gs, mask=bat.mask, row_groups=2)
    sparse_only = SGPTQSolver(fmt, quantize=False).solve_batched(W, U, row_groups=2)
    for e in range(E):
        for k in range(2):
            rows = slice(k * R, (k + 1) * R)
            ref = solver.solve(W[e, rows], U[e], gs[e])
            got = bat.expert(e, rows, k)
            for name in ("values", "mask", "latent", "codes", "scales"):
                assert torch.equal(getattr(ref, name), getattr(got, name)), (e, k, name)
            assert ref.pinned == got.pinned and torch.equal(ref.global_scale, got.global_scale)
            ref_fixed = solver.solve(W[e, rows], U[e], gs[e], mask=bat.mask[e, rows])
            assert torch.equal(ref_fixed.codes, fixed.codes[e, rows])
            assert torch.equal(ref_fixed.scales, fixed.scales[e, rows])
            ref_sparse = SGPTQSolver(fmt, quantize=False).solve(W[e, rows], U[e])
            assert torch.equal(ref_sparse.values, sparse_only.values[e, rows])
    if fmt.scale_block == 0:  # fixed per-row scales (OBR's second stage)
        got = solver.solve_batched(W, U, gs, mask=bat.mask, scales=bat.scales, row_groups=2)
        ref = solver.solve(W[1, :R], U[1], gs[1], mask=bat.mask[1, :R], scales=bat.scales[1, :R])
        assert torch.equal(ref.codes, got.codes[1, :R])


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_graphed_sweep_equals_launched_sweep_on_cuda(fmt_name, exact, monkeypatch, caplog):
    """On CUDA the full lazy blocks after the first are CUDA graph replays: bitwise the numbers of launching every
    op (3 full blocks and a partial one; free and fixed supports, given scales, plain SparseGPT)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    replays = []
    real_replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or real_replay(self))
    fmt = get_format(fmt_name)
    U, W = (t.cuda() for t in sweep_problem(E=3, R=16, C=224, tokens=600, seed=11))  # blocks of 64: 3 full, then 32
    gs = fmt.weight.global_scales(W)
    runs = {}
    for graphs in (False, True):
        solver = SGPTQSolver(fmt, blocksize=64, exact_scales=exact, cuda_graphs=graphs)
        free = solver.solve_batched(W, U, gs, row_groups=2)
        runs[graphs] = (free, solver.solve_batched(W, U, gs, mask=free.mask, row_groups=2),
                        solver.solve_batched(W, U, gs, mask=free.mask, scales=free.scales, row_groups=2),
                        SGPTQSolver(fmt, blocksize=64, quantize=False, cuda_graphs=graphs)
                        .solve_batched(W, U, row_groups=2))
    assert len(replays) >= 4 * 2  # 4 sweeps (FP8's pre-passes add more), each replays full blocks 2 and 3
    assert "capture failed" not in caplog.text
    for launched, graphed in zip(*runs.values()):
        for name in ("values", "mask", "latent", "codes", "scales", "global_scale", "pinned"):
            a, b = getattr(launched, name), getattr(graphed, name)
            assert (a is None and b is None) or torch.equal(a, b), name


def test_batched_sweep_refuses_bad_input():
    fmt = get_format("p48-nvfp4")
    solver = SGPTQSolver(fmt)
    U = torch.eye(64).expand(2, 64, 64)
    with pytest.raises(ValueError, match="experts, out, in"):
        solver.solve_batched(torch.zeros(8, 64), U)
    with pytest.raises(ValueError, match="do not match"):
        solver.solve_batched(torch.zeros(3, 8, 64), U)
    W = torch.zeros(2, 8, 64)
    W[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        solver.solve_batched(W, U)
    with pytest.raises(ValueError, match="multiple of 32"):
        solver.solve_batched(torch.zeros(2, 8, 48), torch.eye(48).expand(2, 48, 48))


# ---------------------------------------------------------------- the methods


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_batched_method_equals_per_expert_reference(fmt_name, variant):
    name, opts = variant
    if not applies(name, fmt_name):
        pytest.skip("gptq is dense-only")
    fmt = get_format(fmt_name)
    experts = make_block(E=4, empty=(2,), dead=(3, 40))
    ref = get_method(name, batched=False, **opts).compress_block(experts, fmt)
    calls = []
    bat = get_method(name, **opts).compress_block(experts, fmt, progress=calls.append)
    assert sum(calls) == len(experts)
    assert "fallback" in bat[2].info and "fallback" not in bat[0].info
    assert torch.all(bat[0].gate.codes[:, [3, 40]] == 0)
    assert_same(ref, bat, f"{fmt_name} {variant_id(variant)}")


@pytest.mark.parametrize("name", ["sgptq", "obr"])
def test_hessian_weighting_batched_equals_reference(name):
    fmt = get_format("p48-nvfp4")
    experts = make_block(E=2, seed=7)
    for weighting in ("w", "w2"):
        ref = get_method(name, batched=False, hessian_weighting=weighting).compress_block(experts, fmt)
        bat = get_method(name, hessian_weighting=weighting).compress_block(experts, fmt)
        assert_same(ref, bat, weighting)


def test_retries_inside_a_batch_stay_per_expert(caplog):
    """Expert 1 has 16 tokens for 64 features and percdamp=0: only its Hessian needs the retries."""
    fmt = get_format("dense-nvfp4")
    experts = make_block(E=3, seed=8)
    ex = experts[1]
    experts[1] = ExpertData(ex.index, ex.gate, ex.up, ex.down, ex.x[:16], ex.w[:16])
    with caplog.at_level("WARNING"):
        bat = get_method("sgptq", percdamp=0.0).compress_block(experts, fmt)
    ref = get_method("sgptq", percdamp=0.0, batched=False).compress_block(experts, fmt)
    assert_same(ref, bat)
    assert bat[1].info["percdamp"]["gate_up"] > 0 and bat[0].info["percdamp"]["gate_up"] == 0
    assert all(r.getMessage().startswith("expert 1 ")
               for r in caplog.records if "not positive definite" in r.getMessage())


@pytest.mark.parametrize("variant", [("sgptq", {}), ("sgptq", {"refit": True}), ("obr", {})], ids=variant_id)
def test_chunking_does_not_change_results(variant):
    name, opts = variant
    fmt = get_format("p48-nvfp4")
    experts = make_block(E=4, seed=9, empty=(1,))
    one_calls, all_calls = [], []
    one = get_method(name, chunk_gb=1e-9, **opts).compress_block(experts, fmt, progress=one_calls.append)
    whole = get_method(name, chunk_gb=64.0, **opts).compress_block(experts, fmt, progress=all_calls.append)
    assert one_calls == [1, 1, 1, 1] and sorted(all_calls) == [1, 3]
    assert_same(whole, one)
    with pytest.raises(ValueError, match="chunk_gb"):
        get_method(name, chunk_gb=0.0, **opts).compress_block(experts, fmt)


def test_block_must_share_shapes():
    fmt = get_format("p48-nvfp4")
    a = make_block(E=1, seed=10)[0]
    b = make_block(E=1, H=64, inter=64, seed=11)[0]
    with pytest.raises(ValueError, match="share their shapes"):
        get_method("sgptq").compress_block([a, b], fmt)


@pytest.mark.parametrize("strategy", spd.STRATEGIES)
@pytest.mark.parametrize("variant", [("sgptq", {}), ("obr", {}), ("sgptq", {"refit": True})], ids=variant_id)
@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "s24-fp8"])
def test_gpu_factorisations_forced_on_cpu_stay_within_float_tolerance(fmt_name, variant, strategy, monkeypatch):
    """What the GPU path computes differently (recursive factorisations) changes results only at rounding
    level: a tiny fraction of codes sit on a rounding boundary, the errors agree to float tolerance."""
    name, opts = variant
    fmt = get_format(fmt_name)
    experts = make_block(E=3, H=128, inter=64, seed=12)
    ref = get_method(name, batched=False, **opts).compress_block(experts, fmt)
    monkeypatch.setattr(spd, "BASE", 16)
    monkeypatch.setattr(spd, "STRATEGY", strategy)
    monkeypatch.setattr(spd, "_use_blocked", lambda A, blocked: True if blocked is None else blocked)
    bat = get_method(name, **opts).compress_block(experts, fmt)
    assert codes_agree(ref, bat) > 0.99
    for r, b in zip(ref, bat):
        for p in PROJECTIONS:
            assert b.info["rel_err"][p] == pytest.approx(r.info["rel_err"][p], rel=0.05)
            assert float((r.weights()[p].mask == b.weights()[p].mask).float().mean()) > 0.98


# ---------------------------------------------------------------- real experts of the shared models


def real_block(path, layer=0, n_seq=8, seq=128, max_experts=None) -> list[ExpertData]:
    """Every expert of one MoE block of a shared model with the calibration tokens its router sends it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import moe_block_inputs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    x = moe_block_inputs(model, tok, layer, n_seq, seq, chars=60_000)
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        _, weights, idx = mlp.gate(x)
    E, _, inter = mlp.experts.down_proj.shape
    counts = torch.bincount(idx.flatten(), minlength=E)
    order = counts.argsort(descending=True).tolist()[:max_experts or E]
    out = []
    for e in sorted(order):
        sel = (idx == e).any(-1)
        gu = mlp.experts.gate_up_proj[e].detach()
        out.append(ExpertData(e, gu[:inter].clone(), gu[inter:].clone(), mlp.experts.down_proj[e].detach().clone(),
                              x[sel], (weights * (idx == e)).sum(-1)[sel]))
    return out


@pytest.fixture(scope="module")
def micro_block(micro_path):
    return real_block(micro_path)


@pytest.fixture(scope="module")
def tiny_block(tiny_path):
    return real_block(tiny_path, layer=1, max_experts=4)


@pytest.mark.parametrize("variant", [("sgptq", {}), ("sgptq", {"refit": True}), ("gptq", {}), ("obr", {})],
                         ids=variant_id)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_batched_equals_reference_on_the_micro_model(micro_block, fmt_name, variant):
    name, opts = variant
    if not applies(name, fmt_name):
        pytest.skip("gptq is dense-only")
    fmt = get_format(fmt_name)
    assert len(micro_block) == 8 and min(ex.x.shape[0] for ex in micro_block) > 0
    ref = get_method(name, batched=False, **opts).compress_block(micro_block, fmt)
    assert_same(ref, get_method(name, **opts).compress_block(micro_block, fmt), f"micro {fmt_name} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [("sgptq", {}), ("sgptq", {"refit": True}), ("gptq", {}), ("obr", {})],
                         ids=variant_id)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_batched_equals_reference_on_the_tiny_model(tiny_block, fmt_name, variant):
    name, opts = variant
    if not applies(name, fmt_name):
        pytest.skip("gptq is dense-only")
    fmt = get_format(fmt_name)
    ref = get_method(name, batched=False, **opts).compress_block(tiny_block, fmt)
    assert_same(ref, get_method(name, **opts).compress_block(tiny_block, fmt), f"tiny {fmt_name} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sgptq", "obr"])
def test_batched_on_cuda_matches_the_cpu_reference(name):
    fmt = get_format("p48-nvfp4")
    experts = make_block(E=3, H=128, inter=64, seed=13)
    ref = get_method(name, batched=False).compress_block(experts, fmt)
    cuda = [ExpertData(ex.index, *(t.cuda() for t in (ex.gate, ex.up, ex.down, ex.x, ex.w))) for ex in experts]
    got = get_method(name).compress_block(cuda, fmt)
    assert got[0].gate.codes.is_cuda
    got = [CompressedExpert(*(qw.to("cpu") for qw in (c.gate, c.up, c.down)), info=c.info) for c in got]
    assert codes_agree(ref, got) > 0.95
    for r, b in zip(ref, got):
        for p in PROJECTIONS:
            assert b.info["rel_err"][p] == pytest.approx(r.info["rel_err"][p], rel=0.1)


def test_solver_chunks_are_sized_from_the_memory_free_before_each(monkeypatch):
    """Without chunk_gb the budget is read again before every chunk (the finished chunks' results hold memory the
    next one cannot use); the chunks change size with it and the results stay those of one pass."""
    from moesq_core.compression.methods import batching

    experts = make_block(E=5, seed=3)
    fmt = get_format("p48-nvfp4")
    one_pass = get_method("sgptq").compress_block(experts, fmt)
    per_expert = batching.solver_bytes_per_expert(32, 64)
    budgets = iter([3 * per_expert, per_expert, 2 * per_expert, 5 * per_expert])
    monkeypatch.setattr(batching, "memory_budget", lambda device, chunk_gb: next(budgets))
    sizes = []
    real = get_method("sgptq")._compress_chunk
    method = get_method("sgptq")
    monkeypatch.setattr(method, "_compress_chunk",
                        lambda chunk, f, budget: sizes.append(len(chunk)) or real(chunk, f, budget))
    assert_same(one_pass, method.compress_block(experts, fmt), "chunks sized per chunk")
    assert sizes == [3, 1, 1]


def test_out_of_memory_names_the_option_that_lowers_it():
    from moesq_core.compression.methods.batching import compress_batched

    def boom(chunk, budget):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError, match="chunk_gb"):
        compress_batched(make_block(E=2), get_format("p48-nvfp4"), "sgptq", boom, chunk_gb=2.0)
