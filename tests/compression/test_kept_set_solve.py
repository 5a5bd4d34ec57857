"""The kept-set least squares by preconditioned conjugate gradients (`solve="cg"`, the default of sgptq's refit and
of obr) against the exact Cholesky per row (`solve="exact"`).

Tolerance: CG stops a row once its last few steps lowered the row's objective f by at most CG_TOL·f; those
decreases estimate the A-norm error left, which is exactly the objective's excess over the optimum. So the
relative output error of CG over the exact optimum is about 1 + CG_TOL (1e-6; measured ≤ 1 + 3e-6 on the shared
models' experts and on Qwen3-30B-A3B-shaped ones, ≤ 1 + 3e-5 at a tolerance of 1e-5). The tests allow 1 + 1e-3:
margin for fp32 round-off and for the estimate being a lower bound, yet far below anything the quantization after
it could absorb (its error is ~10-100× larger)."""
from __future__ import annotations

import pytest
import torch

from moesq_core.compression.methods import hessian as hm
from moesq_core.compression.methods.base import PROJECTIONS
from moesq_core.compression.methods.hessian import (
    block_statistics,
    damped_factors,
    fix_dead_batched,
    kept_set_solve,
    masked_optimum,
    masked_optimum_batched,
    relative_error,
    row_sets_batched,
    top_eigenpairs,
)
from moesq_core.compression.methods.registry import get_method
from moesq_core.compression.methods.sparsegpt_gptq import SGPTQSolver
from moesq_core.formats import get_format

from test_batched_solvers import FORMATS, make_block, real_block

RATIO = 1 + 1e-3  # see the module docstring

pytestmark = pytest.mark.usefixtures("one_thread")


def spiked(E=3, C=128, R=24, seed=0, spikes=4):
    """Damped Hessians of correlated inputs with a few dominant directions (what real activations have), weights,
    and a paired-4:8 support."""
    g = torch.Generator().manual_seed(seed)
    Hs = []
    for _ in range(E):
        X = torch.randn(3 * C, C, generator=g) * torch.logspace(0, 1, C)[torch.randperm(C, generator=g)]
        X += 20 * torch.randn(3 * C, spikes, generator=g) @ torch.randn(spikes, C, generator=g) / C**0.5
        H = X.T @ X / (3 * C)
        Hs.append(H + 0.01 * H.diagonal().mean() * torch.eye(C))
    H = torch.stack(Hs)
    W = torch.randn(E, R, C, generator=g)
    mask = get_format("p48-nvfp4").patterns.best_mask(W.abs())
    return H, W, mask


def ratios(W, H, got, ref):
    return [relative_error(W[e], got[e], H[e]) / relative_error(W[e], ref[e], H[e]) for e in range(W.shape[0])]


@pytest.mark.parametrize("rank", [0, 32])
def test_cg_reaches_the_exact_optimum(rank, monkeypatch):
    monkeypatch.setattr(hm, "CG_RANK", rank)
    H, W, mask = spiked()
    exact = masked_optimum_batched(W, H, mask)
    stats = {}
    cg = masked_optimum_batched(W, H, mask, solve="cg", stats=stats)
    assert stats["exact_fallback_rows"] == 0 and 0 < stats["cg_iterations"] < hm.CG_MAX_ITER
    assert torch.equal(cg == 0, exact == 0)  # the support is kept
    r = ratios(W, H, cg, exact)
    assert all(1 - 1e-6 <= x <= RATIO for x in r), r
    start = ratios(W, H, W * mask, exact)
    assert min(start) > 1.5  # the problem is not trivial: plain masking is far from the optimum


def test_low_rank_preconditioner_needs_fewer_iterations(monkeypatch):
    H, W, mask = spiked(C=256, spikes=6)
    iters = {}
    for rank in (0, 32):
        monkeypatch.setattr(hm, "CG_RANK", rank)
        stats = {}
        masked_optimum_batched(W, H, mask, solve="cg", stats=stats)
        iters[rank] = stats["cg_iterations"]
    assert iters[32] * 2 <= iters[0], iters


def test_top_eigenpairs_match_eigh():
    H, _, _ = spiked(E=2, C=96)
    lam, V = top_eigenpairs(H, 4, iters=30)
    ev, EV = torch.linalg.eigh(H.double())
    torch.testing.assert_close(lam.double(), ev.flip(-1)[:, :4], rtol=1e-4, atol=0)
    overlap = (V.double().mT @ EV[..., -4:]).abs().amax(-1)  # each pair's vector lies along one true eigenvector
    assert bool((overlap > 0.999).all()), overlap


def test_rows_do_not_depend_on_the_rows_solved_with_them():
    """Each row has its own recurrence and stops on its own: solving a subset of rows (or one expert alone, as the
    per-expert reference does) gives bitwise the same numbers on the CPU."""
    H, W, mask = spiked()
    whole = masked_optimum_batched(W, H, mask, solve="cg")
    part = masked_optimum_batched(W[1:2, 5:9], H[1:2], mask[1:2, 5:9], solve="cg")
    assert torch.equal(part[0], whole[1, 5:9])
    assert torch.equal(masked_optimum(W[2], H[2], mask[2], "cg"), whole[2])


def test_warm_start_and_exact_fallback(monkeypatch):
    H, W, mask = spiked()
    exact = masked_optimum_batched(W, H, mask)
    stats = {}
    again = masked_optimum_batched(W, H, mask, solve="cg", start=exact, stats=stats)
    assert stats["cg_iterations"] <= 8  # started at the optimum: converged at the first check
    assert max(ratios(W, H, again, exact)) <= 1 + 1e-5
    monkeypatch.setattr(hm, "CG_MAX_ITER", 3)  # far too few: every row falls back to the exact solve
    stats = {}
    fallback = masked_optimum_batched(W, H, mask, solve="cg", stats=stats)
    assert stats["exact_fallback_rows"] == W.shape[0] * W.shape[1]
    torch.testing.assert_close(fallback, exact, rtol=1e-5, atol=1e-6)


def test_general_kept_set_solve_on_a_column_window():
    """OBR's second solve: unknowns right of a split point absorbing an error left of it (only the window of
    columns the unknowns reach enters the products)."""
    H, W, mask = spiked(C=128)
    kept, _ = row_sets_batched(mask)
    k1 = kept.shape[-1] // 2
    first, second = kept[..., :k1], kept[..., k1:]
    assert int(second.min()) >= 32  # a real window
    e1 = 0.1 * W.gather(-1, first)
    exact = kept_set_solve(H, second, first, e1, "exact")
    cg = kept_set_solve(H, second, first, e1, "cg")

    def objective(delta):  # ‖[δ on second, −e1 on first]‖²_H per expert
        v = torch.zeros_like(W).scatter_(-1, second, delta).scatter_(-1, first, -e1).double()
        return ((v @ H.double()) * v).sum((-1, -2))
    assert bool((objective(cg) <= objective(exact) * RATIO).all())
    torch.testing.assert_close(cg, exact, rtol=1e-2, atol=1e-3)


def test_solve_option_is_validated():
    for name in ("sgptq", "obr"):
        with pytest.raises(ValueError, match="solve must be one of cg, exact"):
            get_method(name, solve="lu")
    H, W, mask = spiked(E=1)
    with pytest.raises(ValueError, match="solve must be one of"):
        masked_optimum(W[0], H[0], mask[0], "cholesky")


# ---------------------------------------------------------------- real experts of the shared models


@pytest.fixture(scope="module")
def micro_block(micro_path):
    return real_block(micro_path)


@pytest.mark.parametrize("phase", ["gate_up", "down"])
@pytest.mark.parametrize("support", ["sparsegpt", "wanda"])
def test_cg_equals_exact_on_the_micro_model_hessians(micro_block, phase, support):
    """Every expert of a real block: SparseGPT's support warm-started from its values (sgptq's refit), and Wanda's
    from zero (obr)."""
    fmt = get_format("p48-nvfp4")
    inputs = (lambda ex: ex.x) if phase == "gate_up" else (lambda ex: ex.dense_intermediate())
    weight = (lambda ex: torch.cat([ex.gate, ex.up])) if phase == "gate_up" else (lambda ex: ex.down)
    st = block_statistics(micro_block, inputs, sq_norms=True)
    Hf, W = fix_dead_batched(st.H, torch.stack([weight(ex).float() for ex in micro_block]))
    fac = damped_factors(Hf)
    if support == "sparsegpt":
        sweep = SGPTQSolver(fmt, quantize=False).solve_batched(W, fac.hinv_chol)
        mask, start = sweep.mask, sweep.values
    else:
        mask, start = fmt.patterns.best_mask(W.abs() * st.sq_norms.sqrt()[:, None, :]), None
    exact = masked_optimum_batched(W, fac.H, mask)
    stats = {}
    cg = masked_optimum_batched(W, fac.H, mask, solve="cg", start=start, stats=stats)
    assert stats["exact_fallback_rows"] == 0
    r = ratios(W, fac.H, cg, exact)
    assert all(1 - 1e-6 <= x <= RATIO for x in r), r


@pytest.mark.parametrize("variant", [("sgptq", {"refit": True}), ("obr", {}), ("obr", {"second_stage": "rtn"})],
                         ids=lambda v: v[0] + "".join(f"-{k}={x}" for k, x in v[1].items()))
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_methods_with_cg_match_the_exact_solve_on_the_micro_model(micro_block, fmt_name, variant):
    """The whole method, every format, CG against the exact solve. The least squares agree to ~1e-6, but the
    rounding after them turns any tiny difference into a few flipped codes (those on a rounding boundary), and
    GPTQ's sweep pushes each flip's error onto the columns right of it: per projection the errors move by up to
    ~1.3 % either way (measured), as for any round-off-level change (cf. the GPU factorisation tests). Over the
    block they cancel: the total error agrees to 5e-4 (measured ≤ 3.1e-4), and ≥ 98 % of the codes are equal
    (measured ≥ 99.3 %)."""
    name, opts = variant
    fmt = get_format(fmt_name)
    exact = get_method(name, solve="exact", **opts).compress_block(micro_block, fmt)
    cg = get_method(name, **opts).compress_block(micro_block, fmt)
    same = total = 0
    for a, b in zip(exact, cg):
        for p in PROJECTIONS:
            qa, qb = a.weights()[p], b.weights()[p]
            assert torch.equal(qa.mask, qb.mask)
            same += int((qa.codes == qb.codes).sum())
            total += qa.codes.numel()
            assert b.info["rel_err"][p] == pytest.approx(a.info["rel_err"][p], rel=0.03)
    assert same / total > 0.98
    err = {k: sum(r.info["rel_err"][p] for r in out for p in PROJECTIONS) for k, out in (("exact", exact), ("cg", cg))}
    assert err["cg"] == pytest.approx(err["exact"], rel=5e-4), err


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [0, 32])
def test_cg_on_cuda_reaches_the_cpu_exact_optimum(rank, monkeypatch):
    monkeypatch.setattr(hm, "CG_RANK", rank)
    H, W, mask = spiked(C=256)
    exact = masked_optimum_batched(W, H, mask)
    stats = {}
    cg = masked_optimum_batched(W.cuda(), H.cuda(), mask.cuda(), solve="cg", stats=stats).cpu()
    assert stats["exact_fallback_rows"] == 0
    r = ratios(W, H, cg, exact)
    assert all(1 - 1e-6 <= x <= RATIO for x in r), r


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sgptq", "obr"])
def test_methods_with_cg_on_cuda_match_the_cpu_exact_reference(name):
    fmt = get_format("p48-nvfp4")
    experts = make_block(E=3, H=128, inter=64, seed=13)
    from moesq_core.compression.methods.base import CompressedExpert, ExpertData

    ref = get_method(name, batched=False, solve="exact").compress_block(experts, fmt)
    cuda = [ExpertData(ex.index, *(t.cuda() for t in (ex.gate, ex.up, ex.down, ex.x, ex.w))) for ex in experts]
    got = get_method(name).compress_block(cuda, fmt)
    got = [CompressedExpert(*(qw.to("cpu") for qw in (c.gate, c.up, c.down)), info=c.info) for c in got]
    for r, b in zip(ref, got):
        for p in PROJECTIONS:
            assert float((r.weights()[p].codes == b.weights()[p].codes).float().mean()) > 0.95
            assert b.info["rel_err"][p] == pytest.approx(r.info["rel_err"][p], rel=0.05)
