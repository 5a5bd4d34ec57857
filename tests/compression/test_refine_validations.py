"""Refinement validates at most `validations` times per block: a long schedule (the paper's 1,280 steps as 80
epochs of 16) pays for ~10 passes over the held-out rows, not 80; up to that many epochs nothing changes."""
from __future__ import annotations

import pytest

from moesq_core.compression.methods.refine import RefineConfig, RefineMethod
from moesq_core.compression.methods.refine.trainer import validated_epochs
from moesq_core.compression.methods.rtn import RTN
from moesq_core.formats import get_format

from test_refine import FAST, assert_same_experts, make_block

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small tensors, one intra-op thread


def test_validated_epochs_are_evenly_spaced_and_end_with_the_last():
    assert validated_epochs(80, 10) == set(range(8, 81, 8))
    assert validated_epochs(10, 10) == set(range(1, 11)) == validated_epochs(10, None)
    assert validated_epochs(7, 3) == {2, 5, 7}
    with pytest.raises(ValueError, match="validations must be >= 1"):
        RefineConfig(validations=0)


def test_fewer_validations_pick_the_best_among_them():
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=3, H=64, inter=64, n=200, n_val=60)
    base = {**FAST, "epochs": 4, "steps_per_epoch": 4}
    every = RefineMethod(RTN(report_errors=False), RefineConfig(**base, validations=None)).compress_block(ex, fmt)
    # at most as many validations as epochs: the same bytes and info as validating every epoch (the default)
    assert_same_experts(every, RefineMethod(RTN(report_errors=False), RefineConfig(**base)).compress_block(ex, fmt))
    two = RefineMethod(RTN(report_errors=False), RefineConfig(**base, validations=2)).compress_block(ex, fmt)
    for a, b in zip(two, every):
        ra, rb = a.info["refine"], b.info["refine"]
        assert ra["val_epochs"] == [0, 2, 4] and "val_epochs" not in rb
        assert len(ra["val_loss"]) == 3 and len(rb["val_loss"]) == 5 and len(ra["train_loss"]) == 4
        assert ra["best_epoch"] in (0, 2, 4)
        # the same training: the losses at the epochs both validated agree
        assert ra["val_loss"] == [rb["val_loss"][i] for i in (0, 2, 4)]
        assert ra["train_loss"] == rb["train_loss"]
