"""Refinement (moesq_core/compression/methods/refine): relaxation, objective, batched trainer, export, ablations."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moesq_core.compression.methods.base import PROJECTIONS, ExpertData
from moesq_core.compression.methods.refine import BlockRefiner, RefineConfig, RefineMethod, objective, relaxation
from moesq_core.compression.methods.refine.trainer import batched_act_quant, batched_weight_global
from moesq_core.compression.methods.rtn import RTN
from moesq_core.formats import P48, S24, get_format
from moesq_core.formats.quantizers import NVFP4ActQuantizer, nvfp4_global_scale

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small tensors, one intra-op thread


def make_block(E=4, H=64, inter=64, n=300, n_val=100, seed=0, with_val=True, device="cpu"):
    """Experts with correlated inputs (low-rank + noise, a few outlier channels) and random router weights."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(H, 16, generator=g)

    def tokens(m):
        x = torch.randn(m, 16, generator=g) @ L.T + 0.3 * torch.randn(m, H, generator=g)
        x[:, :3] *= 4
        return x, torch.rand(m, generator=g) * 0.5 + 0.05

    experts = []
    for e in range(E):
        x, w = tokens(n)
        xv, wv = tokens(n_val) if with_val else (None, None)
        gate = torch.randn(inter, H, generator=g) * H ** -0.5
        up = torch.randn(inter, H, generator=g) * H ** -0.5
        down = torch.randn(H, inter, generator=g) * inter ** -0.5
        def t(a):
            return None if a is None else a.to(device)
        experts.append(ExpertData(e, t(gate), t(up), t(down), t(x), t(w), t(xv), t(wv)))
    return experts


def ref_val_loss(ce, ex, fmt, p=2):
    """Held-out loss of a CompressedExpert, computed per expert with the format's own quantizers (not the
    batched trainer code): dynamic activation scales, dequantized exported weights."""
    x, w = ex.x_val, ex.w_val
    y = ex.dense_output(x)
    W = {q: ce.weights()[q].dequantize() for q in PROJECTIONS}
    xq = fmt.quant_act(x)
    h = F.silu(xq @ W["gate"].T) * (xq @ W["up"].T)
    yhat = fmt.quant_act(h) @ W["down"].T
    tw = w ** p
    return float((tw * (yhat - y).square().sum(-1)).sum() / (tw.sum() * y.shape[-1]))


def assert_same_experts(xs, ys):
    """Two runs' CompressedExperts are the same bytes (every quantized tensor) with the same info."""
    assert len(xs) == len(ys)
    for i, (a, b) in enumerate(zip(xs, ys)):
        assert a.info == b.info, i
        for p in PROJECTIONS:
            for name in ("codes", "scales", "global_scale", "mask"):
                assert torch.equal(getattr(a.weights()[p], name), getattr(b.weights()[p], name)), (i, p, name)


FAST = dict(epochs=4, steps_per_epoch=25, micro_batch_rows=256, lr_logits=5e-3, lr_values=1e-3, lr_budget_steps=None)


# --- relaxation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", [P48, S24], ids=lambda p: p.name)
def test_soft_mask_sums_to_kept_and_becomes_one_hot(ps):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 5, 4, ps.num_patterns, generator=g) * 0.01
    G = relaxation.gumbel_noise(A.shape, g, "cpu")
    for tau in (2.0, 0.5, 0.05):
        z = relaxation.soft_mask(relaxation.pattern_probs(A, tau, 100.0, G), ps)
        assert z.shape == (3, 5, 4 * ps.group)
        torch.testing.assert_close(z.reshape(3, 5, 4, ps.group).sum(-1),
                                   torch.full((3, 5, 4), float(ps.kept_per_group)))
        assert bool(((z >= 0) & (z <= 1 + 1e-6)).all())
    hot = relaxation.pattern_probs(A, 1e-4, 100.0, G)
    assert float((hot.amax(-1) - 1).abs().max()) < 1e-5
    assert torch.equal(hot.argmax(-1), (100.0 * A + G).argmax(-1))
    z = relaxation.soft_mask(hot, ps)
    assert torch.equal(z.round().bool(), ps.mask_from_index((100.0 * A + G).argmax(-1)))
    # far from zero, the relaxation is spread out
    assert float(relaxation.pattern_probs(A, 1e3, 1.0, G).amax(-1).max()) < 0.5


@pytest.mark.parametrize("ps", [P48, S24], ids=lambda p: p.name)
def test_init_logits_pick_the_init_support(ps):
    g = torch.Generator().manual_seed(2)
    mask = ps.mask_from_index(torch.randint(0, ps.num_patterns, (8, 16), generator=g))
    A = relaxation.init_logits(mask, ps, g)
    assert A.dtype == torch.float32 and A.shape == (8, 16, ps.num_patterns)
    assert torch.equal(relaxation.hard_mask(A, ps), mask)
    with pytest.raises(ValueError, match="temperature"):
        relaxation.pattern_probs(A, 0.0)


def test_gumbel_noise_is_finite_and_seeded():
    a = relaxation.gumbel_noise((1000,), torch.Generator().manual_seed(3), "cpu")
    b = relaxation.gumbel_noise((1000,), torch.Generator().manual_seed(3), "cpu")
    assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    assert abs(float(a.mean()) - 0.5772) < 0.1  # Euler–Mascheroni: the Gumbel mean


# --- objective -------------------------------------------------------------------------------------------------


def test_routed_loss_weights_and_padding():
    g = torch.Generator().manual_seed(4)
    y, yhat = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    w = torch.rand(2, 5, generator=g)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    for p in (0, 1, 2):
        got = objective.routed_loss(yhat, y, w, valid, p)
        for e in range(2):
            n = int(valid[e].sum())
            c = w[e, :n] ** p
            want = (c * (yhat[e, :n] - y[e, :n]).square().sum(-1)).sum() / (c.sum() * 8)
            torch.testing.assert_close(got[e], want)
    # p = 0 is the plain MSE over valid rows
    torch.testing.assert_close(objective.routed_loss(yhat, y, w, valid, 0)[0], F.mse_loss(yhat[0], y[0]))
    # an expert without rows gets 0, not NaN
    assert float(objective.routed_loss(yhat, y, w, torch.zeros_like(valid), 2).abs().sum()) == 0
    with pytest.raises(ValueError, match="loss_power"):
        objective.token_weights(w, valid, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_sq_error_gradient(dtype):
    g = torch.Generator().manual_seed(18)
    y = torch.randn(3, 7, 16, generator=g)
    tw = torch.rand(3, 7, generator=g)
    yhat = torch.randn(3, 7, 16, generator=g).to(dtype).requires_grad_()
    yref = yhat.detach().float().requires_grad_()
    scale = torch.tensor([1.0, 0.5, 2.0])
    (objective.weighted_sq_error(yhat, y, tw) * scale).sum().backward()
    ((tw * (yref - y).square().sum(-1)).sum(-1) * scale).sum().backward()
    assert yhat.grad.dtype == dtype
    torch.testing.assert_close(yhat.grad.float(), yref.grad.to(dtype).float())
    # the trainer's form: the same loss and gradient written in one forward pass, bitwise
    num, gy = objective.weighted_sq_error_and_grad(yhat, y, tw, scale)
    assert not num.requires_grad and gy.dtype == dtype
    assert torch.equal(gy, yhat.grad) and torch.equal(num, objective.weighted_sq_error(yhat.detach(), y, tw))
    torch.testing.assert_close(objective.weighted_sq_error(yhat.detach(), y, tw),
                               (tw * (yref.detach() - y).square().sum(-1)).sum(-1))


# --- batched helpers equal the format's per-tensor functions ---------------------------------------------------


@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "s24-fp8", "dense-nvfp4"])
def test_batched_quantizers_match_format(fmt_name):
    fmt = get_format(fmt_name)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 16, 64, generator=g), torch.randn(3, 16, 64, generator=g) * 3
    gs = batched_weight_global(fmt, a, b)
    for e in range(3):
        assert torch.equal(gs[e].reshape(()), fmt.global_scale(a[e], b[e]).reshape(()))
    x = torch.randn(3, 10, 64, generator=g) * torch.tensor([1.0, 1e-3, 50.0])[:, None, None]
    xq = batched_act_quant(fmt, x, ste=False)
    for e in range(3):
        assert torch.equal(xq[e], fmt.quant_act(x[e]))


# --- the trainer ---------------------------------------------------------------------------------------------


def test_ste_gradients_reach_logits_and_values():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=64, n_val=16)
    r = BlockRefiner(ex, RTN(report_errors=False).compress_block(ex, fmt), fmt,
                     RefineConfig(epochs=1, steps_per_epoch=2))
    W = r.soft_weights(1.0, 100.0)
    idx = r.val_idx
    x, y, valid, w = r._gather(idx)
    yhat = r.forward(x, W["gate"], W["up"], W["down"], torch.float32)
    objective.routed_loss(yhat, y, w, valid, 2).sum().backward()
    for p in PROJECTIONS:
        pr = r.proj[p]
        assert pr.A.grad is not None and float(pr.A.grad.abs().sum()) > 0, p
        assert pr.V.grad is not None and float(pr.V.grad.abs().sum()) > 0, p
        assert pr.A.dtype == torch.float32 and pr.V.dtype == torch.float32


def test_validation_matches_a_per_expert_reference():
    """The batched hard-mask validation is the exported model's loss on held-out rows."""
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, n=120, n_val=40, seed=6)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    r = BlockRefiner(ex, inits, fmt, RefineConfig(epochs=0, micro_batch_rows=10_000))
    v0 = r.history_val[0]
    for e, (x, ce) in enumerate(zip(ex, inits)):
        # the trainer's activation global scales: x's from the expert's calibration rows (not x_val), as
        # the engine calibrates them; h's from the validation rows themselves
        amax = x.x.abs().amax()
        xq = fmt.quant_act(x.x_val, nvfp4_global_scale(amax))
        W = {q: ce.weights()[q].dequantize() for q in PROJECTIONS}
        h = F.silu(xq @ W["gate"].T) * (xq @ W["up"].T)
        yhat = fmt.quant_act(h) @ W["down"].T
        want = objective.routed_loss(yhat[None], x.dense_output(x.x_val)[None], x.w_val[None],
                                     torch.ones(1, 40, dtype=torch.bool), 2)[0]
        torch.testing.assert_close(v0[e], want, rtol=1e-4, atol=0)
    assert isinstance(fmt.act, NVFP4ActQuantizer)


@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "s24-fp8"])
def test_refine_beats_its_init_on_held_out_rows(fmt_name):
    fmt = get_format(fmt_name)
    ex = make_block(seed=7)
    inits = RTN(report_errors=False).compress_block(ex, fmt)  # magnitude + RTN
    out = RefineMethod(RTN(report_errors=False), RefineConfig(**FAST)).compress_block(ex, fmt)
    for e in range(len(ex)):
        init_loss, ref_loss = ref_val_loss(inits[e], ex[e], fmt), ref_val_loss(out[e], ex[e], fmt)
        assert out[e].info["refine"]["best_epoch"] > 0
        assert ref_loss < 0.85 * init_loss, (e, init_loss, ref_loss)
        masks_changed = sum(int((out[e].weights()[p].mask != inits[e].weights()[p].mask).sum()) for p in PROJECTIONS)
        assert masks_changed > 0  # the support moved, not only the values


def test_refine_beats_sgptq():
    sg = pytest.importorskip("moesq_core.compression.methods.sparsegpt_gptq")
    fmt = get_format("p48-nvfp4")
    ex = make_block(seed=8)
    inits = sg.SGPTQ().compress_block(ex, fmt)
    out = RefineMethod(sg.SGPTQ(), RefineConfig(**FAST)).compress_block(ex, fmt)
    refined = [ref_val_loss(out[e], ex[e], fmt) for e in range(len(ex))]
    init = [ref_val_loss(inits[e], ex[e], fmt) for e in range(len(ex))]
    # never worse per expert (one that no epoch improved ships its init), better over the block
    assert all(r <= i for r, i in zip(refined, init)), (refined, init)
    assert sum(refined) < 0.95 * sum(init), (refined, init)


def _check_export(out, inits, fmt):
    for ce in out:
        assert torch.equal(ce.gate.global_scale, ce.up.global_scale)  # gate/up share one global scale
        for p, qw in ce.weights().items():
            assert qw.format == fmt.name
            if not fmt.patterns.is_dense:
                fmt.patterns.index_from_mask(qw.mask)  # every group is an admissible pattern
            again = fmt.quantize(qw.dequantize(), qw.mask, qw.global_scale)
            assert torch.equal(again.codes, qw.codes), p  # a fixed point of the format's quantizer
            assert torch.equal(again.scales, qw.scales), p
            assert int((qw.codes[~qw.mask.bool()]).abs().sum()) == 0


@pytest.mark.parametrize("fmt_name", ["p48-nvfp4", "s24-fp8"])
def test_export_is_what_the_format_writes(fmt_name):
    fmt = get_format(fmt_name)
    ex = make_block(E=3, n=160, n_val=40, seed=9)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    r = BlockRefiner(ex, inits, fmt, RefineConfig(**{**FAST, "epochs": 2, "steps_per_epoch": 10}))
    for epoch in (1, 2):
        r.end_epoch(epoch, r.train_epoch())
    out = r.export()
    _check_export(out, inits, fmt)
    # the batched weights validation scored are exactly what export writes (for the epoch that won)
    W, masks = r.hard_state()
    for e, ce in enumerate(out):
        if ce.info["refine"]["best_epoch"] == 2:
            for p in PROJECTIONS:
                assert torch.equal(ce.weights()[p].dequantize(), W[p][e]), (e, p)
                assert torch.equal(ce.weights()[p].mask, masks[p][e])


def test_best_epoch_never_worse_than_init():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=4, seed=10)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    # lr far too large: the epochs get worse than the init, which must then ship unchanged
    cfg = RefineConfig(epochs=3, steps_per_epoch=10, micro_batch_rows=512, lr_values=0.05, lr_logits=0.05)
    out = RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)
    kept_init = 0
    for e, ce in enumerate(out):
        r = ce.info["refine"]
        vals = r["val_loss"]
        assert len(vals) == 4 and r["best_epoch"] == min(range(4), key=lambda i: vals[i])
        assert vals[r["best_epoch"]] <= vals[0]
        if r["best_epoch"] == 0:
            kept_init += 1
            for p in PROJECTIONS:
                assert ce.weights()[p] is inits[e].weights()[p] or torch.equal(ce.weights()[p].codes,
                                                                              inits[e].weights()[p].codes)
        assert ref_val_loss(ce, ex[e], fmt) <= ref_val_loss(inits[e], ex[e], fmt) * 1.02
    assert kept_init >= 1  # the bad run really was worse somewhere


def test_same_seed_same_result_and_seed_matters():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=100, n_val=0, with_val=False, seed=11)
    cfg = RefineConfig(epochs=2, steps_per_epoch=5, micro_batch_rows=64, lr_logits=5e-3, lr_values=1e-3,
                       val_fraction=0.2, lr_budget_steps=None)
    runs = [RefineMethod(RTN(report_errors=False), c).compress_block(ex, fmt)
            for c in (cfg, cfg, RefineConfig(**{**cfg.__dict__, "seed": 1}))]
    diff_seed = False
    for a, b, c in zip(*runs):
        assert a.info["refine"]["val_loss"] == b.info["refine"]["val_loss"]
        assert a.info["refine"]["n_val"] == 20  # the internal split: 20 % of 100 rows
        for p in PROJECTIONS:
            assert torch.equal(a.weights()[p].codes, b.weights()[p].codes)
            assert torch.equal(a.weights()[p].scales, b.weights()[p].scales)
            assert torch.equal(a.weights()[p].mask, b.weights()[p].mask)
            diff_seed |= not torch.equal(a.weights()[p].codes, c.weights()[p].codes)
    assert diff_seed


def test_micro_batching_does_not_change_the_step():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, n=150, n_val=20, seed=12)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    rs = [BlockRefiner(ex, inits, fmt, RefineConfig(epochs=1, steps_per_epoch=2, micro_batch_rows=m, lr_logits=5e-3,
                                                    lr_values=1e-3))
          for m in (9, 100_000)]
    losses = [r.train_step(r.epoch_order(), 0) for r in rs]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for p in PROJECTIONS:
        for attr in ("A", "V"):
            a, b = getattr(rs[0].proj[p], attr), getattr(rs[1].proj[p], attr)
            # Lion moves each entry by ±lr: summation order may flip only entries whose gradient is ~0
            assert float((a - b).abs().gt(1e-7).float().mean()) < 1e-3, (p, attr)


def test_values_only_keeps_the_init_support():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=200, n_val=60, seed=13)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    r = BlockRefiner(ex, inits, fmt,
                     RefineConfig(**{**FAST, "epochs": 1, "steps_per_epoch": 10, "train_support": False}))
    assert all(pr.A is None for pr in r.proj.values())
    V0 = {p: r.proj[p].V.detach().clone() for p in PROJECTIONS}
    r.end_epoch(1, r.train_epoch())
    W, masks = r.hard_state()
    for p in PROJECTIONS:
        assert not torch.equal(r.proj[p].V, V0[p])
        for e in range(2):
            assert torch.equal(masks[p][e], inits[e].weights()[p].mask)
    for e, ce in enumerate(r.export()):
        for p in PROJECTIONS:
            assert torch.equal(ce.weights()[p].mask, inits[e].weights()[p].mask)


def test_support_only_keeps_the_values():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=200, n_val=60, seed=14)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    r = BlockRefiner(ex, inits, fmt,
                     RefineConfig(**{**FAST, "epochs": 1, "steps_per_epoch": 20, "train_values": False}))
    V0 = {p: r.proj[p].V.detach().clone() for p in PROJECTIONS}
    A0 = {p: r.proj[p].A.detach().clone() for p in PROJECTIONS}
    r.end_epoch(1, r.train_epoch())
    _, masks = r.hard_state()
    moved = 0
    for p in PROJECTIONS:
        assert torch.equal(r.proj[p].V, V0[p])
        assert not r.proj[p].V.requires_grad
        assert not torch.equal(r.proj[p].A, A0[p])
        moved += sum(int((masks[p][e] != inits[e].weights()[p].mask).sum()) for e in range(2))
    assert moved > 0
    for e, ce in enumerate(r.export()):
        if ce.info["refine"]["best_epoch"] == 1:
            for p in PROJECTIONS:  # values re-rounded from the unchanged latent under the new masks
                assert torch.equal(ce.weights()[p].dequantize(),
                                   fmt.quantize(V0[p][e], masks[p][e], ce.weights()[p].global_scale).dequantize())


def test_dense_format_refines_values_only():
    fmt = get_format("dense-nvfp4")
    ex = make_block(E=2, n=200, n_val=60, seed=15)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    cfg = RefineConfig(epochs=3, steps_per_epoch=20, micro_batch_rows=256, lr_values=1e-4, lr_budget_steps=None)
    r = BlockRefiner(ex, inits, fmt, cfg)
    assert all(pr.A is None and pr.fixed_mask is None for pr in r.proj.values())
    out = RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)
    _check_export(out, inits, fmt)
    for e in range(2):
        assert bool(out[e].gate.mask.all())
        assert ref_val_loss(out[e], ex[e], fmt) <= ref_val_loss(inits[e], ex[e], fmt) * 1.02
    with pytest.raises(ValueError, match="nothing to refine"):
        BlockRefiner(ex, inits, fmt, RefineConfig(train_values=False))


def test_experts_with_few_or_no_rows_keep_their_init():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, n=100, with_val=False, seed=16)
    ex[1].x, ex[1].w = ex[1].x[:0], ex[1].w[:0]
    ex[2].x, ex[2].w = ex[2].x[:1], ex[2].w[:1]
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    out = RefineMethod(RTN(report_errors=False),
                       RefineConfig(epochs=1, steps_per_epoch=4, val_fraction=0.2)).compress_block(ex, fmt)
    for e in (1, 2):
        r = out[e].info["refine"]
        assert r["n_val"] == 0 and r["best_epoch"] == 0 and r["val_loss"] == [None, None]
        assert torch.equal(out[e].down.codes, inits[e].down.codes)
    assert out[0].info["refine"]["n_val"] == 20


def test_steps_per_epoch_rule():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=300, n_val=20, seed=19)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    def steps(**kw):
        return BlockRefiner(ex, inits, fmt, RefineConfig(epochs=0, **kw)).steps_per_epoch
    assert steps() == 300 // 8  # the paper's 128, capped at >= 8 rows per expert and step
    assert steps(steps_per_epoch=10) == 10
    assert steps(batch_rows=100) == 16  # 600 training rows / 100 = 6, raised to the floor of 16
    assert steps(batch_rows=100, min_steps_per_epoch=4) == 6
    assert steps(batch_rows=100_000) == 16
    with pytest.raises(ValueError, match="exclude each other"):
        RefineConfig(steps_per_epoch=4, batch_rows=100)
    plan = RefineConfig(epochs=3, steps_per_epoch=10).schedule(600, 2)
    assert (plan.total_steps, plan.rows_per_step) == (30, 60) and "30 Lion steps" in str(plan)
    r = BlockRefiner(ex, inits, fmt, RefineConfig(epochs=2, steps_per_epoch=7))
    assert r.total_steps == 14 and int(r.step_cnt.sum()) == 600
    assert tuple(r.schedule(0)) == (2.0, 100.0, 1.0, 1.0, True)
    sch = r.schedule(13)
    assert math.isclose(sch.tau, 0.05) and math.isclose(sch.gain, 500.0)
    assert math.isclose(sch.lr_logits, 0.1) and math.isclose(sch.lr_values, 0.1)


def test_bad_inputs_are_refused_clearly():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=50, n_val=10)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    with pytest.raises(ValueError, match="nothing to refine"):
        RefineConfig(train_support=False, train_values=False)
    with pytest.raises(ValueError, match="loss_power"):
        RefineConfig(loss_power=3)
    with pytest.raises(ValueError, match="init returned"):
        BlockRefiner(ex, inits[:1], fmt, RefineConfig())
    bad = make_block(E=1, H=64, inter=32, n=50, n_val=10)
    with pytest.raises(ValueError, match="shape"):
        BlockRefiner(ex[:1] + bad, inits[:1] + RTN(report_errors=False).compress_block(bad, fmt), fmt, RefineConfig())
    with pytest.raises(ValueError, match="format"):
        BlockRefiner(ex, inits, get_format("s24-fp8"), RefineConfig())
    with pytest.raises(TypeError, match="init method"):
        RefineMethod(init=object())
    assert RefineMethod(RTN()).compress_block([], fmt) == []


@pytest.mark.gpu
def test_refine_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    fmt = get_format("p48-nvfp4")
    ex = make_block(seed=7, device="cuda")
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    out = RefineMethod(RTN(report_errors=False), RefineConfig(**FAST)).compress_block(ex, fmt)
    for e in range(len(ex)):
        assert out[e].gate.codes.device.type == "cuda"
        assert ref_val_loss(out[e], ex[e], fmt) < 0.85 * ref_val_loss(inits[e], ex[e], fmt)
    _check_export(out, inits, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("compute_dtype,rtol", [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_compiled_step_on_cuda_matches_eager(compute_dtype, rtol):
    """On CUDA the default (compile="auto") is the compiled step; eager (compile=False) stays the reference."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=5, H=128, inter=64, n=400, n_val=40, seed=23, device="cuda")
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    rs = [BlockRefiner(ex, inits, fmt, RefineConfig(epochs=1, steps_per_epoch=3, micro_batch_rows=300, compile=c,
                                                    compute_dtype=compute_dtype)) for c in (False, "auto")]
    losses = [torch.stack([r.train_step(r.epoch_order(), s) for s in range(3)]) for r in rs]
    torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=0)
    for p in PROJECTIONS:  # Lion moves by ±lr: only near-zero gradients may take the other sign
        assert float((rs[0].proj[p].V - rs[1].proj[p].V).abs().gt(1e-7).float().mean()) < 0.05
    v = [r.validate(r.hard_state()[0]) for r in rs]
    torch.testing.assert_close(v[1], v[0], rtol=rtol, atol=0)
    # another block, with more experts and rows (other micro-batch shapes), compiles nothing new
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    ex2 = make_block(E=7, H=128, inter=64, n=500, n_val=40, seed=24, device="cuda")
    r2 = BlockRefiner(ex2, RTN(report_errors=False).compress_block(ex2, fmt), fmt,
                      RefineConfig(epochs=1, steps_per_epoch=3, micro_batch_rows=300, compute_dtype=compute_dtype))
    order = r2.epoch_order()
    for s in range(3):
        r2.train_step(order, s)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_compiled_relaxation_matches_eager():
    """compile=True fuses the elementwise relaxation/quantization; it must compute the same step."""
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, H=64, inter=32, n=120, n_val=20, seed=17)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    rs = [BlockRefiner(ex, inits, fmt, RefineConfig(epochs=1, steps_per_epoch=2, micro_batch_rows=96, compile=c))
          for c in (False, True)]
    losses = [torch.stack([r.train_step(r.epoch_order(), s) for s in range(2)]) for r in rs]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for p in PROJECTIONS:
        assert float((rs[0].proj[p].V - rs[1].proj[p].V).abs().gt(1e-7).float().mean()) < 1e-3
    # a later block, with more experts and rows, reuses the compiled functions: no new graphs
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    ex2 = make_block(E=4, H=64, inter=32, n=150, n_val=20, seed=18)
    r2 = BlockRefiner(ex2, RTN(report_errors=False).compress_block(ex2, fmt), fmt,
                      RefineConfig(epochs=1, steps_per_epoch=2, micro_batch_rows=96, compile=True))
    r2.train_step(r2.epoch_order(), 0)
    assert counters["stats"]["unique_graphs"] == graphs


# --- budget rule, pattern-change check, values-first, release-faithful options ---------------------------------


def test_budget_rule_keeps_the_papers_travel():
    paper = RefineConfig(epochs=10, steps_per_epoch=128).schedule(10**6, 8)
    assert (paper.lr_scale_logits, paper.lr_scale_values) == (1.0, 1.0)  # the paper's run is unchanged
    assert (paper.lr_logits, paper.lr_values) == (2.5e-4, 5e-5)
    small = RefineConfig(epochs=2, steps_per_epoch=8).schedule(10**6, 8)
    assert small.lr_scale_values == 80.0 and math.isclose(small.lr_values, 80 * 5e-5)
    # Σ lr over the run (cosine to 0.1×) matches the paper's within the discretisation of the cosine
    def travel(s):
        return sum(s.lr_values * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / (s.total_steps - 1))))
                               for t in range(s.total_steps))
    assert travel(small) == pytest.approx(travel(paper), rel=0.05)
    # capped: 1 step per block would need ×1280
    tiny = RefineConfig(epochs=1, steps_per_epoch=1, lr_budget_cap_values=100).schedule(10**6, 8)
    assert tiny.lr_scale_values == 100.0
    # beyond the paper's budget the rates shrink; off = the rates as given
    assert RefineConfig(epochs=20, steps_per_epoch=128).schedule(10**6, 8).lr_scale_values == 0.5
    raw = RefineConfig(epochs=2, steps_per_epoch=8, lr_budget_steps=None).schedule(10**6, 8)
    assert (raw.lr_logits, raw.lr_values, raw.lr_scale_values) == (2.5e-4, 5e-5, 1.0)
    # the trainer's optimizer uses the scheduled rates
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=200, n_val=20, seed=21)
    r = BlockRefiner(ex, RTN(report_errors=False).compress_block(ex, fmt), fmt,
                     RefineConfig(epochs=2, steps_per_epoch=8))
    assert ({g["name"]: g["base_lr"] for g in r.opt.param_groups}
            == {"logits": r.plan.lr_logits, "values": r.plan.lr_values})
    assert r.plan.lr_values == pytest.approx(80 * 5e-5)


def test_values_rate_caps_the_budget_rule_by_weight_scale():
    cfg = RefineConfig(epochs=2, steps_per_epoch=8)  # the budget rule: lr(V) 5e-5 × 80 = 4e-3
    plan = cfg.schedule(10**6, 8)
    rms = torch.tensor([0.001, 0.02, 0.06, 1.0])
    m = cfg.values_rate(plan, rms)
    # each expert projection's rate: min(budget rate, ρ × RMS), never below the configured lr_values
    expect = torch.tensor([5e-5, cfg.lr_budget_values_rms * 0.02, cfg.lr_budget_values_rms * 0.06, 4e-3])
    assert torch.allclose(m * plan.lr_values, expect, rtol=1e-6)
    assert "weight RMS" in str(plan)
    # the paper's budget (and beyond it) is untouched whatever the weights' scale; the rule off: rates as planned
    paper = RefineConfig(epochs=10, steps_per_epoch=128)
    assert bool((paper.values_rate(paper.schedule(10**6, 8), rms) == 1).all())
    off = RefineConfig(epochs=2, steps_per_epoch=8, lr_budget_values_rms=None)
    assert bool((off.values_rate(off.schedule(10**6, 8), rms) == 1).all()) and "RMS" not in str(off.schedule(10**6, 8))
    with pytest.raises(ValueError, match="lr_budget_values_rms"):
        RefineConfig(lr_budget_values_rms=0.0)


def _refined_values(experts, fmt, cfg, steps=2):
    inits = RTN(report_errors=False).compress_block(experts, fmt)
    r = BlockRefiner(experts, inits, fmt, cfg)
    v0 = {p: pr.V.detach().clone() for p, pr in r.proj.items()}
    order = r.epoch_order()
    for s in range(steps):
        r.train_step(order, s)
    return r, v0, {p: pr.V.detach().clone() for p, pr in r.proj.items()}


def test_values_step_is_lion_at_each_experts_rate():
    """One step moves every value of expert e by exactly its own rate m_e·lr (after the group's decay)."""
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, n=200, n_val=20, seed=23)
    ex[1] = ExpertData(1, ex[1].gate * 4, ex[1].up * 4, ex[1].down * 4, ex[1].x, ex[1].w, ex[1].x_val, ex[1].w_val)
    cfg = RefineConfig(epochs=1, steps_per_epoch=4)
    r, v0, v1 = _refined_values(ex, fmt, cfg, steps=1)
    lr = r.plan.lr_values  # the cosine factor is 1 at the first step
    d = 1 - lr * cfg.weight_decay
    for p in PROJECTIONS:
        rms = torch.stack([getattr(e, p).pow(2).mean().sqrt() for e in ex])
        rate = torch.clamp(cfg.lr_budget_values_rms * rms, max=lr)
        assert float(rate[1]) > float(rate[0])  # the 4× wider expert takes 4× the step
        step = (v1[p] - d * v0[p]).abs()
        for e in range(3):
            assert torch.allclose(step[e], rate[e].expand_as(step[e]), rtol=1e-3, atol=1e-7), (p, e)


@pytest.mark.parametrize("rule", [RefineConfig().lr_budget_values_rms, None])
def test_short_refinement_is_invariant_to_the_weights_scale(rule):
    """down_proj is linear in its weights: scaling it by c scales the targets and outputs by c, and every
    Lion sign stays (but for rounding near zero). With the rates tied to the weights' scale the values then
    move by c× as much (the same relative updates); with absolute rates (the rule off) they do not."""
    fmt = get_format("p48-nvfp4")
    c = 4.0  # a power of two: the scaled problem is exactly the scaled one in floating point
    # weights of RMS ~0.01 (and 0.04 scaled): ρ × RMS stays below the budget rule's rate 5e-3 in both
    ex = [ExpertData(e.index, e.gate / 10, e.up / 10, e.down / 10, e.x, e.w, e.x_val, e.w_val)
          for e in make_block(E=2, n=200, n_val=20, seed=24)]
    exc = [ExpertData(e.index, e.gate, e.up, e.down * c, e.x, e.w, e.x_val, e.w_val) for e in ex]
    cfg = RefineConfig(epochs=1, steps_per_epoch=4, lr_budget_values_rms=rule)
    _, a0, a = _refined_values(ex, fmt, cfg)
    _, b0, b = _refined_values(exc, fmt, cfg)
    assert torch.allclose(b0["down"], c * a0["down"])
    mismatch = {}
    for p in PROJECTIONS:
        k = c if p == "down" else 1.0
        moved = ~torch.isclose((b[p] - b0[p]) / k, a[p] - a0[p], rtol=1e-3, atol=1e-7)
        mismatch[p] = float(moved.float().mean())
    if rule is not None:  # a few signs of ~0 gradients may round the other way
        assert max(mismatch.values()) < 0.02, mismatch
    else:
        assert mismatch["down"] > 0.5, mismatch


def test_can_change_patterns_from_the_init_gap():
    from moesq_core.compression.methods.refine.relaxation import init_gap
    from moesq_core.compression.methods.refine.trainer import remaining_gap

    assert init_gap(P48) == pytest.approx(0.01 * 4 * (2 - 0)) and init_gap(S24) == pytest.approx(0.08)
    # two logits closing 2·lr per step from a gap of 0.08: constant lr 0.01 without decay needs 4 steps
    assert remaining_gap(0.08, [0.01] * 3, 0.0) == pytest.approx(0.02)
    assert remaining_gap(0.08, [0.01] * 4, 0.0) <= 1e-12
    assert remaining_gap(0.08, [0.01], 1.0) == pytest.approx(0.08 * 0.99 - 0.02)
    # the paper's rates over 16 steps cannot move a pattern; the budget rule can
    raw = RefineConfig(epochs=2, steps_per_epoch=8, lr_budget_steps=None).schedule(10**6, 8)
    assert not raw.can_change_patterns and raw.logit_closure < 0.01
    assert "cannot change the sparsity patterns" in raw.warning and "CANNOT" in str(raw)
    assert RefineConfig(epochs=2, steps_per_epoch=8, lr_budget_cap_logits=80).schedule(10**6, 8).can_change_patterns
    assert RefineConfig(epochs=10, steps_per_epoch=128).schedule(10**6, 8).can_change_patterns
    # nothing to warn about when the support is not trained
    vo = RefineConfig(epochs=2, steps_per_epoch=8, lr_budget_steps=None, train_support=False).schedule(10**6, 8)
    assert vo.warning is None and not vo.learns_support


def test_no_pattern_moves_when_the_schedule_says_it_cannot(caplog):
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=200, n_val=40, seed=22)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    cfg = RefineConfig(epochs=2, steps_per_epoch=6, micro_batch_rows=512, lr_budget_steps=None, lr_logits=1e-3, seed=3)
    from moesq_core.compression.methods.refine import trainer

    trainer._WARNED.clear()
    with caplog.at_level("INFO"):
        r = BlockRefiner(ex, inits, fmt, cfg)
    # an expected outcome of a small budget (`moesq run`'s default): an info line, not a warning
    said = [rec for rec in caplog.records if "cannot change the sparsity patterns" in rec.getMessage()]
    assert not r.plan.can_change_patterns and [rec.levelname for rec in said] == ["INFO"]
    for epoch in (1, 2):
        r.end_epoch(epoch, r.train_epoch())
    _, masks = r.hard_state()
    for p in PROJECTIONS:
        for e in range(2):
            assert torch.equal(masks[p][e], inits[e].weights()[p].mask)
    for ce in r.export():
        assert ce.info["refine"]["groups_changed"] == 0 and ce.info["refine"]["groups"] > 0


def test_values_first_trains_values_then_both():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=200, n_val=40, seed=23)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    cfg = RefineConfig(**{**FAST, "epochs": 2, "steps_per_epoch": 5, "values_first": 0.5})
    r = BlockRefiner(ex, inits, fmt, cfg)
    assert r.values_steps == r.plan.values_first_steps == 5
    sch = [r.schedule(t) for t in range(10)]
    assert [s.joint for s in sch] == [False] * 5 + [True] * 5
    assert sch[5].tau == cfg.tau[0] and sch[9].tau == pytest.approx(cfg.tau[1])  # τ anneals over the joint phase
    assert sch[5].lr_logits == 1.0 and sch[9].lr_values == pytest.approx(0.1)
    A0 = {p: r.proj[p].A.detach().clone() for p in PROJECTIONS}
    V0 = {p: r.proj[p].V.detach().clone() for p in PROJECTIONS}
    r.end_epoch(1, r.train_epoch())
    for p in PROJECTIONS:
        assert torch.equal(r.proj[p].A, A0[p]) and not torch.equal(r.proj[p].V, V0[p])
    r.end_epoch(2, r.train_epoch())
    assert any(not torch.equal(r.proj[p].A, A0[p]) for p in PROJECTIONS)
    with pytest.raises(ValueError, match="values_first"):
        RefineConfig(values_first=1.0)


def test_release_faithful_options():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, n=200, n_val=40, seed=24)
    inits = RTN(report_errors=False).compress_block(ex, fmt)
    # lr far too large: every epoch validates worse than the init, yet "last" ships the last epoch everywhere
    bad = dict(epochs=2, steps_per_epoch=10, micro_batch_rows=512, lr_values=0.05, lr_logits=0.05, lr_budget_steps=None)
    best = RefineMethod(RTN(report_errors=False), RefineConfig(**bad)).compress_block(ex, fmt)
    last = RefineMethod(RTN(report_errors=False), RefineConfig(**bad, ship="last")).compress_block(ex, fmt)
    assert any(ce.info["refine"]["best_epoch"] == 0 for ce in best)
    assert all(ce.info["refine"]["best_epoch"] == 2 for ce in last)
    # bf16 logits: Lion's steps below half a bf16 ulp round away (the release's fault). At lr 1e-4 the logits
    # of the init's pattern and of its complement (|A| ≈ 0.08, half an ulp 2.4e-4) never move; in fp32 they do.
    for dtype, big_moved in (("bfloat16", 0), ("float32", None)):
        cfg = RefineConfig(epochs=1, steps_per_epoch=4, micro_batch_rows=512, lr_budget_steps=None, lr_logits=1e-4,
                           logits_dtype=dtype, train_values=False)
        r = BlockRefiner(ex, inits, fmt, cfg)
        assert all(pr.A.dtype == getattr(torch, dtype) for pr in r.proj.values())
        A0 = {p: r.proj[p].A.detach().clone() for p in PROJECTIONS}
        r.train_epoch()
        big = sum(int(((r.proj[p].A != A0[p]) & (A0[p].float().abs() >= 0.0625)).sum()) for p in PROJECTIONS)
        assert big == 0 if big_moved == 0 else big > 0, (dtype, big)
    # the rows reach the matmuls in the compute dtype, quantized (training and validation alike)
    for compute in ("bfloat16", "float32"):
        cfg = RefineConfig(epochs=1, steps_per_epoch=1, micro_batch_rows=512, compute_dtype=compute)
        r = BlockRefiner(ex, inits, fmt, cfg)
        xq, y, valid, _ = r._gather(r.val_idx)
        assert xq.dtype == y.dtype == getattr(torch, compute), compute
        assert torch.equal(xq, fmt.act.batched(xq.float(), r.g_in, ste=False).to(xq.dtype))  # already on the grid
    # separate gate/up global scales in training; the export still shares one (re-quantized, as served)
    sep = RefineMethod(RTN(report_errors=False),
                       RefineConfig(**FAST, shared_gate_up_global=False)).compress_block(ex, fmt)
    _check_export(sep, inits, fmt)
    for e in range(len(ex)):
        assert ref_val_loss(sep[e], ex[e], fmt) < ref_val_loss(inits[e], ex[e], fmt)
    with pytest.raises(ValueError, match="ship"):
        RefineConfig(ship="first")
    with pytest.raises(ValueError, match="logits_dtype"):
        RefineConfig(logits_dtype="float16")


def test_no_wall_clock_times_in_the_artifacts():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, n=100, n_val=20, seed=25)
    out = RefineMethod(RTN(report_errors=False), RefineConfig(epochs=1, steps_per_epoch=2)).compress_block(ex, fmt)
    for ce in out:
        assert not any("second" in k for k in ce.info["refine"]), ce.info["refine"].keys()


def test_release_faithful_recipe_names_real_options():
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    from moesq_core.compression.methods.registry import get_method

    r = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes/release-faithful.yaml").read_text())
    get_format(r["format"])
    init = get_method(r["init"]["method"], **r["init"]["options"])
    assert init.exact_scales is False
    cfg = RefineConfig(**r["refine"])
    assert (cfg.logits_dtype, cfg.ship, cfg.shared_gate_up_global, cfg.lr_budget_steps, cfg.init_split_rows) == \
        ("bfloat16", "last", False, None, False)


@pytest.mark.parametrize("with_val", [True, False], ids=["engine-val", "own-split"])
def test_any_sharding_of_a_block_gives_bitwise_the_same_experts(with_val):
    """Expert parallel: refining any subset of a block's experts (ExpertData.block carrying the whole block's
    row counts) gives each expert exactly what refining the whole block gives it: per-expert random numbers,
    batch shapes from the block's counts, no cross-expert reductions."""
    from moesq_core.compression.methods.base import BlockRows

    fmt = get_format("p48-nvfp4")
    ex = make_block(E=5, n=120, n_val=30, seed=21, with_val=with_val)
    ex[1].x, ex[1].w = ex[1].x[:37], ex[1].w[:37]  # unequal loads, one expert without rows
    ex[3].x, ex[3].w = ex[3].x[:0], ex[3].w[:0]
    if with_val:
        ex[4].x_val, ex[4].w_val = ex[4].x_val[:7], ex[4].w_val[:7]
    rows = BlockRows(6, tuple(e.x.shape[0] for e in ex), tuple(e.x_val.shape[0] for e in ex) if with_val else None)
    for e in ex:
        e.block = rows
    cfg = RefineConfig(epochs=2, steps_per_epoch=3, micro_batch_rows=48, lr_logits=5e-3, lr_values=1e-3,
                       lr_budget_steps=None, val_fraction=0.2)
    method = RefineMethod(RTN(report_errors=False), cfg)
    whole = method.compress_block(ex, fmt)
    assert any(r.info["refine"]["best_epoch"] > 0 for r in whole)  # it did train
    for shard in ([0, 2, 4], [1, 3], [4], [3, 0]):
        part = method.compress_block([ex[i] for i in shard], fmt)
        for i, got in zip(shard, part):
            assert got.info == whole[i].info, (shard, i)
            for p in PROJECTIONS:
                for name in ("codes", "scales", "global_scale", "mask"):
                    assert torch.equal(getattr(got.weights()[p], name),
                                       getattr(whole[i].weights()[p], name)), (shard, i, p, name)
    other_layer = BlockRows(7, rows.rows, rows.val_rows)
    for e in ex:
        e.block = other_layer
    moved = method.compress_block(ex, fmt)  # the layer index seeds the random numbers too
    assert any(not torch.equal(a.gate.codes, b.gate.codes) for a, b in zip(moved, whole))


@pytest.mark.parametrize("with_block", [True, False])
def test_refining_a_block_in_memory_chunks_gives_bitwise_the_same_experts(with_block):
    """chunk_gb bounds the memory of one refinement (a Kimi-K2 block does not fit one GPU at once): the experts
    are refined chunk by chunk, each sized from the whole block, so every expert gets exactly the bytes of the
    unchunked run; without ExpertData.block the chunks are given the block the experts form."""
    from moesq_core.compression.methods.base import BlockRows
    from moesq_core.compression.methods.refine.trainer import refine_bytes_per_expert, refine_chunks

    fmt = get_format("p48-nvfp4")
    ex = make_block(E=5, n=120, n_val=30, seed=5)
    ex[2].x, ex[2].w = ex[2].x[:41], ex[2].w[:41]
    if with_block:
        rows = BlockRows(3, tuple(e.x.shape[0] for e in ex), tuple(e.x_val.shape[0] for e in ex))
        for e in ex:
            e.block = rows
    base = dict(epochs=2, steps_per_epoch=3, micro_batch_rows=48, lr_logits=5e-3, lr_values=1e-3, lr_budget_steps=None)
    per_expert = refine_bytes_per_expert(fmt, 64, 64)
    two = RefineConfig(**base, chunk_gb=2.5 * per_expert / 2**30)  # two experts per chunk
    assert [len(c) for c in refine_chunks(ex, fmt, two)] == [2, 2, 1]
    # CPU, no chunk_gb: within HOST_CHUNK_BYTES
    assert [len(c) for c in refine_chunks(ex, fmt, RefineConfig(**base))] == [5]
    whole = RefineMethod(RTN(report_errors=False), RefineConfig(**base)).compress_block(ex, fmt)
    chunked = RefineMethod(RTN(report_errors=False), two).compress_block(ex, fmt)
    assert any(r.info["refine"]["best_epoch"] > 0 for r in whole)
    assert_same_experts(whole, chunked)
    with pytest.raises(ValueError, match="chunk_gb"):
        RefineConfig(chunk_gb=0)


@pytest.mark.parametrize("with_val", [True, False])
def test_rows_of_a_shared_token_matrix_refine_to_the_bytes_of_rows_held_per_expert(with_val):
    """The engine hands refinement each expert's rows as indices into one token matrix (every token once,
    though top-k routing sends it to several experts); the trainer gathers them by index. That gives exactly
    the experts of the same rows held as tensors of their own, with or without given validation rows."""
    from moesq_core.compression.methods.base import TokenRows

    fmt = get_format("p48-nvfp4")
    ex = make_block(E=4, n=90, n_val=20, seed=11, with_val=with_val)
    ex[1].x[:30] = ex[0].x[10:40]  # tokens routed to two experts
    ex[3].x, ex[3].w = ex[3].x[:0], ex[3].w[:0]  # an expert no token reached
    g = torch.Generator().manual_seed(3)
    rows = [r for e in ex for r in ((e.x,) if e.x_val is None else (e.x, e.x_val))]
    distinct = torch.unique(torch.cat(rows), dim=0)
    tokens = torch.cat([distinct, torch.randn(17, distinct.shape[1], generator=g)])  # and tokens no expert gets
    tokens = tokens[torch.randperm(len(tokens), generator=g)]

    def index_of(x):
        return (x[:, None, :] == tokens[None]).all(-1).float().argmax(1)

    shared = [ExpertData(e.index, e.gate, e.up, e.down, TokenRows(tokens, index_of(e.x)), e.w,
                         None if e.x_val is None else TokenRows(tokens, index_of(e.x_val)), e.w_val) for e in ex]
    assert all(torch.equal(s.inputs(), e.x) for s, e in zip(shared, ex))
    cfg = RefineConfig(epochs=2, steps_per_epoch=3, micro_batch_rows=64, lr_logits=5e-3, lr_values=1e-3,
                       lr_budget_steps=None)
    own = RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)
    by_index = RefineMethod(RTN(report_errors=False), cfg).compress_block(shared, fmt)
    assert any(r.info["refine"]["best_epoch"] > 0 for r in own)
    assert_same_experts(own, by_index)


def test_refinement_memory_estimate_counts_the_token_matrix_once():
    """The pre-flight estimate: the token matrix once (not per routed row), ROW_BYTES per routed row, one
    micro-batch; the per-expert state does not grow with the calibration."""
    from moesq_core.compression.methods.refine.trainer import (
        ROW_BYTES,
        micro_batch_bytes,
        refine_bytes_per_expert,
        refine_shared_bytes,
    )

    H, inter, T, k = 2048, 768, 1024 * 4096, 8
    shared = refine_shared_bytes(H, inter, T, 2, T * k, 262144)
    assert shared == T * H * 2 + T * k * ROW_BYTES + micro_batch_bytes(H, inter, 262144)
    # a bf16 compute dtype (CUDA's default) holds half the micro-batch activations of fp32
    assert 2 * micro_batch_bytes(H, inter, 262144, 2) == micro_batch_bytes(H, inter, 262144, 4)
    assert refine_shared_bytes(H, inter, T, 2, T * k, 262144, 2) == shared - micro_batch_bytes(H, inter, 262144, 2)
    assert 16 * 2**30 == T * H * 2 < shared < 40 * 2**30  # 1,024 sequences of 4,096 tokens: 16 GiB of bf16 tokens
    per = refine_bytes_per_expert(get_format("p48-nvfp4"), inter, H)
    assert 128 * per < 40 * 2**30 and per == refine_bytes_per_expert(get_format("p48-nvfp4"), inter, H)


def test_refinement_says_before_the_block_loop_whether_a_block_fits():
    """The pre-flight memory plan of a Qwen3-30B-A3B block at the paper's calibration (1,024 + 128 sequences of
    4,096 tokens, bf16 tokens): one chunk on an H200, chunks on a smaller GPU, and on a 24 GiB GPU a refusal
    that names the GiB needed and the options that lower it, before any work."""
    from moesq_core.compression.methods.refine.trainer import RefineMemoryError, refine_memory_plan

    fmt = get_format("p48-nvfp4")
    seqs = 1152
    tokens = seqs * 4096
    plan = dict(experts=128, H=2048, inter=768, tokens=tokens, token_bytes=2, routed_rows=tokens * 8, device="cuda:0",
                sequences=seqs)
    h200 = refine_memory_plan(fmt, RefineConfig(), available=140 * 2**30, **plan)
    assert h200.endswith("one chunk") and "GiB of calibration tokens" in h200
    h100 = refine_memory_plan(fmt, RefineConfig(), available=int(77.4 * 2**30), **plan)  # an H100 80GB's
    assert h100.endswith("one chunk"), h100
    small = refine_memory_plan(fmt, RefineConfig(), available=60 * 2**30, **plan)
    assert "chunks of experts" in small
    with pytest.raises(RefineMemoryError, match=r"needs ~\d+\.\d GiB on cuda:0.*--n-train.*\d+ of the 1152 sequences "
                                                r"would fit.*--micro-batch-rows"):
        refine_memory_plan(fmt, RefineConfig(), available=24 * 2**30, **plan)
    # fewer micro-batch rows lower it
    assert "one chunk" in refine_memory_plan(fmt, RefineConfig(micro_batch_rows=65536), available=72 * 2**30, **plan)
    assert "unknown" in refine_memory_plan(fmt, RefineConfig(), available=None, **plan)


def test_refinement_reports_its_steps_and_routed_rows_inside_the_block(caplog):
    """Given the engine's BlockProgress, refinement reports every step of the block (all chunks together) with
    the routed rows trained on: the bar's count reaches the block's steps and the log has its end line."""
    import logging

    from moesq_core.compression.methods.refine import trainer
    from moesq_core.progress import BlockProgress

    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, n=60, n_val=12, seed=2)
    done_experts, updates = [], []
    bp = BlockProgress(None, done_experts.append, "refine", 5, blocks_after=2)
    original = trainer.BlockRefiner.run

    def spy(self, on_step=None):
        return original(self, lambda d, r: (updates.append((d, r)), on_step(d, r)))

    cfg = RefineConfig(epochs=2, steps_per_epoch=3, micro_batch_rows=64,
                       chunk_gb=1.5 * trainer.refine_bytes_per_expert(fmt, 64, 64) / 2**30)
    with caplog.at_level(logging.INFO, logger="moesq.progress"):
        trainer.BlockRefiner.run = spy
        try:
            RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt, bp)
        finally:
            trainer.BlockRefiner.run = original
    assert done_experts == [3]
    # three chunks of one expert, 6 steps each; each step trains on that expert's share of its rows
    assert [d for d, _ in updates] == [1, 2, 3, 4, 5, 6] * 3
    assert [r for _, r in updates[:6]] == [20, 40, 60, 80, 100, 120]  # 60 training rows a pass, a third a step
    end = [r.getMessage() for r in caplog.records if "refine: layer 5 steps 18/18 (100 %)" in r.getMessage()]
    assert end, [r.getMessage() for r in caplog.records]


def test_a_refiners_expert_order_changes_no_expert_and_sorted_micro_batches_are_slices():
    """RefineMethod hands a refiner its experts by falling row count, so a micro-batch's experts are the first k
    (selected as a view, not copied); any order gives every expert the same bytes."""
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=5, n=80, n_val=16, seed=4)
    for e, n in zip(ex, (20, 80, 41, 60, 7)):
        e.x, e.w = e.x[:n], e.w[:n]
    cfg = RefineConfig(epochs=2, steps_per_epoch=2, micro_batch_rows=40, lr_logits=5e-3, lr_values=1e-3,
                       lr_budget_steps=None)
    inits = RTN(report_errors=False).compress_block(ex, fmt)

    def micro_batches(r):
        return [a for a, _, _ in list(r._micro_batches(r.blk_step_cnt[0], int(r.blk_step_cnt[0].max())))[1:]]

    as_given = BlockRefiner(ex, inits, fmt, cfg)
    assert any(a is not None and a.first is None for a in micro_batches(as_given))  # index_select there
    by_method = RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)
    assert_same_experts(as_given.run(), by_method)
    order = sorted(range(len(ex)), key=lambda i: -ex[i].n_rows)
    ordered = BlockRefiner([ex[i] for i in order], [inits[i] for i in order], fmt, cfg)
    acts = micro_batches(ordered)
    assert any(a is not None for a in acts) and all(a is None or a.first == len(a.idx) for a in acts)
