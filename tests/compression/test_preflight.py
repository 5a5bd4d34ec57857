"""The disk check before a blockwise stage (moesq_core/compression/preflight.py): the calibration states' memory and
disk counted by hand on small cases, the refusal and what it suggests at the paper's calibration size, and through
the stage functions a refusal that leaves the work dir as it was; the summary line through the CLI."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from moesq_core.compression.preflight import (
    CalibrationStates,
    GiB,
    StatesDiskError,
    check_states_fit,
    fits_disk,
    free_disk_bytes,
    size,
    states_footprint,
)

from moesq_runner import FAST, TINY_CALIB, moesq_here

# 5 training and 3 validation sequences of 4 tokens, 2 wide, fp32, batches of 2: 32 bytes a sequence, so the
# training store's chunks are 64, 64, 32 bytes and the validation store's 64, 32 (256 bytes per copy)
SMALL = CalibrationStates({"train": 5, "val": 3}, ("train", "val"), seq_len=4, hidden_size=2, dtype_bytes=4,
                          batch_size=2)
# the paper's calibration in refine: 896 training + 128 one-shot sequences in one split, 128 validation ones, of
# 4,096 tokens, 2048 wide, bf16, batches of 8: 16 MiB a sequence, 128 MiB a chunk, 18 GiB per copy
PAPER = CalibrationStates({"train": 896, "init": 128, "val": 128}, ("train+init", "val"), seq_len=4096,
                          hidden_size=2048, dtype_bytes=2, batch_size=8)


def test_footprint_by_hand_one_process():
    # cache 160 bytes: 80 per store. train: 64 stays, 64 spills (128 > 80), 32 spills (96 > 80): 64 in memory,
    # 96 spilled. val: 64 stays, 32 spills: 64 in memory, 32 spilled. Spill of one copy 128, the copy 256.
    f = states_footprint(SMALL, 160)
    assert (f.copy, f.spilled) == (256, 128)
    # memory: both stores (128) and, while train propagates, its new store's 64
    assert f.memory == 192
    # disk: propagating train = spill 128 + train's second spill 96 + the checkpoint file 256 = 480;
    # propagating val = 128 + 32 + 256 = 416; a checkpoint save = 128 + the previous file 256 + the new 256 = 640
    assert f.disk == 640


def test_footprint_by_hand_two_ranks_no_cache():
    # the one-shot stage, 5 sequences (chunks 64, 64, 32: 160 bytes per copy), cache 0: every chunk spills
    states = CalibrationStates({"init": 5}, ("init",), seq_len=4, hidden_size=2, dtype_bytes=4, batch_size=2,
                               world_size=2)
    f = states_footprint(states, 0)
    assert (f.copy, f.spilled, f.memory) == (160, 160, 0)
    # propagating: each rank's store 160 and new store 160, and its own-batch store (rank 0 chunks 0 and 2: 96,
    # rank 1 chunk 1: 64), 2 × 320 + 96 + 64 = 800, plus the checkpoint 160 = 960. A save: 2 × 160 + 2 × 160 +
    # rank 1 routing ahead 64 = 704.
    assert f.disk == 960


def test_footprint_by_hand_with_saved_states():
    # SMALL at cache 160 with a 256-byte checkpoint on disk (already off the free space): resuming holds the
    # embedded and the loaded stores' spill, 2 × 128, next to the file 256 = 512; a save still 640. The need is
    # the peak less the file there now: 640 - 256.
    f = states_footprint(SMALL, 160, saved_states_bytes=256)
    assert f.disk == 384
    assert f.memory == 256  # resuming: the embedded stores and the loaded ones, 2 × 128


def test_paper_calibration_summary():
    line = check_states_fit(PAPER, 4 * GiB, Path("/data/wd/cache"), stage="refine", sized_split="train",
                            disk_free_bytes=1 << 40)
    # 1152 × 16 MiB per copy; the stores hold 2 GiB each in memory, 2 GiB more while train+init propagates;
    # spill 14 GiB + two checkpoint copies 36 GiB while one is saved
    assert line == ("calibration states: 18.0 GiB per copy; up to 6.0 GiB in cpu memory (--cache-gb 4), "
                    "~50.0 GiB on disk under /data/wd/cache (1024.0 GiB free)")


def test_refusal_names_the_need_the_free_space_and_what_fits():
    with pytest.raises(StatesDiskError) as e:
        check_states_fit(PAPER, 4 * GiB, Path("/data/wd/cache"), stage="refine", sized_split="train",
                         disk_free_bytes=40 * GiB, memory_available_bytes=120 * GiB)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert msg.startswith("stage refine: its calibration states (18.0 GiB per copy) need ~50.0 GiB of disk under "
                          "/data/wd/cache at peak")
    assert "40.0 GiB is free there, less a margin of 2.5 GiB (5%, at least 1.0 GiB)" in msg
    # n training sequences: spill (n + 128) / 64 - 2 GiB past the two 2 GiB stores, checkpoint 2 × (n + 256) / 64
    # GiB; with the 5 % margin that is at most 40 GiB up to n = 642 (39.998 GiB), not at 643 (40.05)
    assert "--n-train 642 at --cache-gb 4 (in a new --workdir" in msg
    # --cache-gb 28: 14 GiB per store, train+init's 16 GiB spill 2 GiB, + 36 GiB of checkpoint = 38 GiB (39.9 with
    # the margin); 27 spills 2.5 GiB (40.4). Memory: 14 + 2 + 14 while train+init propagates = 30 GiB, within half
    # of the 120 available.
    assert "--cache-gb 28 (~30.0 GiB of the 120.0 GiB of cpu memory available)" in msg
    assert msg.endswith("or 52.5 GiB free there, or a --workdir on a larger disk")
    # the suggestions are the boundaries the footprint itself gives
    assert fits_disk(states_footprint(PAPER.with_sequences("train", 642), 4 * GiB).disk, 40 * GiB)
    assert not fits_disk(states_footprint(PAPER.with_sequences("train", 643), 4 * GiB).disk, 40 * GiB)
    assert fits_disk(states_footprint(PAPER, 28 * GiB).disk, 40 * GiB)
    assert not fits_disk(states_footprint(PAPER, 27 * GiB).disk, 40 * GiB)


def test_refusal_when_memory_or_the_checkpoint_rule_out_a_larger_cache():
    def refusal(free_gib: float, memory_gib: float | None) -> str:
        with pytest.raises(StatesDiskError) as e:
            check_states_fit(PAPER, 4 * GiB, Path("/wd/cache"), stage="refine", sized_split="train",
                             disk_free_bytes=int(free_gib * GiB),
                             memory_available_bytes=None if memory_gib is None else int(memory_gib * GiB))
        return str(e.value)

    # --cache-gb 28 would take 30 GiB, more than half of 50
    assert ("not --cache-gb 28: it would take ~30.0 GiB of cpu memory, more than 50% of the 50.0 GiB available"
            in refusal(40, 50))
    assert "--cache-gb 28 (~30.0 GiB of cpu memory; available memory unknown)" in refusal(40, None)
    # 30 GiB free: with nothing spilled the checkpoint still takes 2 × 18 GiB while it is saved
    assert "no --cache-gb (the resume checkpoint alone takes two copies" in refusal(30, 120)
    # the one-shot stage's option
    init = CalibrationStates({"init": 1024}, ("init",), seq_len=4096, hidden_size=2048, dtype_bytes=2, batch_size=8)
    with pytest.raises(StatesDiskError, match=r"--n-init \d+ at --cache-gb 4"):
        check_states_fit(init, 4 * GiB, Path("/wd/cache"), stage="init-sgptq", sized_split="init",
                         disk_free_bytes=20 * GiB)
    # less than the margin: no count fits
    with pytest.raises(StatesDiskError, match="no --n-init at --cache-gb 4"):
        check_states_fit(init, 4 * GiB, Path("/wd/cache"), stage="init-sgptq", sized_split="init",
                         disk_free_bytes=GiB // 2)


def test_free_disk_of_the_nearest_existing_parent(tmp_path):
    missing = tmp_path / "wd" / "cache"
    assert abs(free_disk_bytes(missing) - shutil.disk_usage(tmp_path).free) < 256 << 20
    assert not (tmp_path / "wd").exists()


# -- through the stage functions and the CLI ---------------------------------------------------------------------
def _snapshot(wd: Path) -> dict[str, bytes]:
    """Every file of the work dir and its bytes; the lock file's content is its holder's pid."""
    return {str(p.relative_to(wd)): b"" if p.name == ".moesq.lock" else p.read_bytes()
            for p in sorted(wd.rglob("*")) if p.is_file()} | {
            str(p.relative_to(wd)) + "/": b"" for p in wd.rglob("*") if p.is_dir()}


@pytest.fixture
def calibrated(micro_path, tmp_path, monkeypatch) -> Path:
    wd = tmp_path / "wd"
    moesq_here("calibrate", "--model", micro_path, "-w", wd, *TINY_CALIB, "--quiet")
    monkeypatch.setenv("MOESQ_CACHE_DIR", str(tmp_path / "user-cache"))  # the weight-hash cache, not the home's
    return wd


@pytest.mark.parametrize("stage, option", [("refine", "--n-train"), ("init-rtn", "--n-init")])
def test_stage_refused_before_anything_is_written(calibrated, stage, option):
    from moesq_core.compression import pipeline
    from moesq_core.compression.workdir import WorkDir

    before = _snapshot(calibrated)
    manifest = (calibrated / "manifest.json").read_bytes()
    with pytest.raises(StatesDiskError) as e:
        if stage == "refine":
            pipeline.refine(WorkDir(calibrated), {"epochs": 1, "steps_per_epoch": 2}, device="cpu",
                            disk_free_bytes=0)
        else:
            pipeline.init_stage(WorkDir(calibrated), "rtn", device="cpu", disk_free_bytes=0)
    msg = str(e.value)
    assert msg.startswith(f"stage {stage}: its calibration states") and str(calibrated / "cache") in msg
    assert "but 0 B is free there" in msg and re.search(f"no {option} at --cache-gb \\d+\\b", msg)
    assert (calibrated / "manifest.json").read_bytes() == manifest
    assert _snapshot(calibrated) == before
    assert not (calibrated / "cache").exists() and not (calibrated / "stages").exists()


def test_cli_prints_the_summary_line(micro_path, tmp_path):
    wd = tmp_path / "wd"
    r = moesq_here("init-sgptq", "--method", "rtn", "--model", micro_path, "-w", wd, *TINY_CALIB, *FAST)
    line = next(x for x in r.stderr.splitlines() if x.startswith("calibration states:"))
    # the one-shot split: 4 sequences of 32 tokens, the model's width, fp32 on the CPU
    hidden = json.loads((micro_path / "config.json").read_text())["hidden_size"]
    states = CalibrationStates({"init": 4}, ("init",), seq_len=32, hidden_size=hidden, dtype_bytes=4, batch_size=8)
    # the default cache (auto): the host holds these few states whole
    limit = GiB  # a whole GiB holding all of them
    f = states_footprint(states, limit)
    assert line.startswith(f"calibration states: {size(f.copy)} per copy; up to {size(f.memory)} in cpu memory "
                           f"(--cache-gb auto: {limit / GiB:g}), ~{size(f.disk)} on disk under {wd / 'cache'} (")
