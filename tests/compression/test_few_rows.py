"""Experts the calibration routes no or few tokens to: the log says how many per block and what they get, and what
they get is sound — their init (round-to-nearest on the magnitude pattern without tokens), finite scales, a static
activation range borrowed from the block — through the one-shot methods, refinement and the engine."""
from __future__ import annotations

import logging

import pytest
import torch

from moesq_core.compression.methods.base import PROJECTIONS, BlockRows, ExpertData
from moesq_core.compression.methods.refine import RefineConfig, RefineMethod
from moesq_core.compression.methods.registry import get_method
from moesq_core.formats import get_format

from conftest import CALIB

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, VAL_ROWS = (0, 1, 3, 200), (0, 1, 0, 40)


def _experts(H=64, inter=32):
    g = torch.Generator().manual_seed(0)
    out = []
    for e, (n, nv) in enumerate(zip(ROWS, VAL_ROWS)):
        w = [torch.randn(inter, H, generator=g) * 0.05, torch.randn(inter, H, generator=g) * 0.05,
             torch.randn(H, inter, generator=g) * 0.05]
        out.append(ExpertData(e, *w, torch.randn(n, H, generator=g), torch.rand(n, generator=g),
                              torch.randn(nv, H, generator=g), torch.rand(nv, generator=g),
                              block=BlockRows(0, ROWS, VAL_ROWS)))
    return out


def _finite(ce) -> bool:
    return all(bool(torch.isfinite(q.scales.float()).all() and torch.isfinite(q.global_scale.float()).all()
                    and float(q.global_scale) > 0 and torch.isfinite(q.dequantize()).all())
               for q in ce.weights().values())


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a.weights()[p], f), getattr(b.weights()[p], f))
               for p in PROJECTIONS for f in ("codes", "scales", "global_scale", "mask"))


@pytest.mark.parametrize("ship", ["best", "last"])
def test_experts_with_no_or_few_rows_get_finite_scales_and_keep_their_init_where_nothing_validates(ship):
    fmt = get_format("p48-nvfp4")
    experts = _experts()
    init = get_method("sgptq").compress_block(experts, fmt)
    refined = RefineMethod(get_method("sgptq"), RefineConfig(epochs=2, steps_per_epoch=4, ship=ship)).compress_block(
        experts, fmt)
    assert all(_finite(ce) for ce in init + refined)
    assert init[0].info["fallback"] == "rtn-magnitude (no routed tokens)"
    assert _same(refined[0], init[0])  # no rows: its init, whatever ships
    assert refined[0].info["refine"]["best_epoch"] == 0 and refined[0].info["refine"]["n_train"] == 0
    if ship == "best":  # 3 rows but no held-out one: nothing can validate an epoch, so the init ships
        assert _same(refined[2], init[2]) and refined[2].info["refine"]["best_epoch"] == 0


def test_activation_ranges_of_experts_without_tokens_are_borrowed_and_their_scales_finite():
    from moesq_core.compression.engine import expert_activation_amax, fill_missing_amax
    from moesq_core.formats.quantizers import input_global_scales

    fmt = get_format("p48-nvfp4")
    experts = _experts()
    results = get_method("rtn").compress_block(experts, fmt)
    amax = [expert_activation_amax(fmt, r, ex.inputs(), True) for r, ex in zip(results, experts)]
    amax_in, amax_mid = (torch.stack([a[i] for a in amax]) for i in (0, 1))
    assert float(amax_in[0]) == 0 and float(amax_mid[0]) == 0  # no token reached expert 0
    amax_in, amax_mid = fill_missing_amax(amax_in, amax_mid)
    assert float(amax_in[0]) == float(amax_in.max()) > 0 and float(amax_mid[0]) == float(amax_mid.max()) > 0
    # a block no token reached at all: the serving fallback scale, finite
    g, fell_back = input_global_scales(fill_missing_amax(torch.zeros(4), torch.zeros(4))[0])
    assert fell_back == 4 and bool(torch.isfinite(g).all() and (g > 0).all())


def test_few_rows_line_counts_the_experts_and_names_what_they_get():
    from moesq_core.compression.engine import FEW_ROWS, few_rows_line

    assert few_rows_line(3, (0, 0, 1, 15, FEW_ROWS, 500)) == (
        f"layer 3: 2 of 6 experts got no calibration tokens, 2 fewer than {FEW_ROWS}: those without get "
        "round-to-nearest on the magnitude pattern, the others the method on their few rows (damped)")
    assert few_rows_line(0, (FEW_ROWS, 100)) is None
    best = RefineMethod(get_method("rtn"), RefineConfig()).few_rows_fallback
    last = RefineMethod(get_method("rtn"), RefineConfig(ship="last")).few_rows_fallback
    assert "keep their init" in best and "held-out rows validate" in best
    assert "ship their last epoch" in last


def test_the_engine_logs_a_block_whose_experts_got_no_or_few_tokens_and_ships_them_sound(
        micro_path, tmp_path, monkeypatch, caplog):
    """Expert 0 of layer 0 gets no calibration token, expert 1 three (the routing cut down after the fact, as a
    router that never picks them would leave it): one log line for the block, the no-token fallback in the
    artifact, a borrowed activation range and finite scales."""
    from moesq_core.compression import engine
    from moesq_core.compression.config import MethodConfig
    from moesq_core.compression.pipeline import run_init
    from moesq_core.compression.workdir import WorkDir

    real = engine.gather_experts

    def starved(block, *a, **k):
        routed = real(block, *a, **k)
        if block.layer_index == 0:
            counts = list(routed.counts)
            for e, keep in ((0, 0), (1, 3)):
                routed.tokens[e], routed.weights[e] = routed.tokens[e][:keep], routed.weights[e][:keep]
                counts[e] = len(routed.tokens[e])
            routed.counts = tuple(counts)
        return routed

    monkeypatch.setattr(engine, "gather_experts", starved)
    run = {"calib_source": str(CALIB), "seq_len": 32, "n_train": 2, "n_val": 2, "n_init": 8}
    with caplog.at_level(logging.INFO, logger="moesq"):
        run_init(tmp_path / "wd", MethodConfig("magnitude"), micro_path, run, device="cpu", batch_size=4)
    ledger = WorkDir(tmp_path / "wd").ledger("init-magnitude")
    results, amax_in, amax_mid = engine.load_block(ledger.verified_block(0))
    tokens = tuple(ce.info["tokens"] for ce in results)
    assert tokens[:2] == (0, 3)
    layer0 = [r for r in caplog.records if r.getMessage().startswith("init-magnitude: layer 0:")]
    assert [r.getMessage() for r in layer0] == [f"init-magnitude: {engine.few_rows_line(0, tokens)}"]
    assert layer0[0].levelno == logging.WARNING and "1 of 8 experts got no calibration tokens" in layer0[0].getMessage()
    assert float(amax_in[0]) == float(amax_in.max()) and float(amax_mid[0]) == float(amax_mid.max())
    assert all(_finite(ce) for ce in results)
