"""The engine's block loop as a user meets it: an estimate of the remaining time after the first computed
block (resumed blocks do not count toward it, in the note or in the progress bar's ETA), and a device that
runs out of memory mid-block giving one line that names the stage, the block and what lowers memory, with the
finished blocks kept for a resume."""
from __future__ import annotations

import re
import time
from contextlib import contextmanager

import pytest
import torch

from moesq_core.compression.engine import StageOutOfMemoryError, StageSpec, run_stage
from moesq_core.compression.methods.rtn import RTN
from moesq_core.compression.workdir import WorkDir, model_fingerprint
from moesq_core.formats import get_format

pytestmark = pytest.mark.usefixtures("one_thread")


def _new_wd(root, path) -> WorkDir:
    wd = WorkDir(root)
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)}, {"format": "p48-nvfp4"})
    return wd


class OutOfMemoryRTN(RTN):
    """RTN on a device too small for it: the method raises torch's out-of-memory error."""

    def compress_block(self, experts, fmt, progress=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB\nOf the allocated memory ...")


def _spec(method_for_block, **kw) -> StageSpec:
    return StageSpec("init-rtn", get_format("p48-nvfp4"), method_for_block, {"method": "rtn"}, batch_size=4, **kw)


class Recorder:
    """A progress object that records notes and, per task, its advances and skips."""

    def __init__(self):
        self.notes: list[str] = []
        self.tasks: dict[str, list[str]] = {}

    def note(self, message: str) -> None:
        self.notes.append(message)

    @contextmanager
    def task(self, description, total):
        events = self.tasks.setdefault(description, [])

        class T:
            def advance(self, n=1):
                events.append("advance")

            def skip(self, n=1):
                events.append("skip")

        yield T()


def test_out_of_memory_names_stage_block_and_options_then_resumes(micro_calibrated, tmp_path):
    model, adapter, path, calib = micro_calibrated
    wd = _new_wd(tmp_path / "wd", path)
    spec = _spec(lambda li: OutOfMemoryRTN() if li == 2 else RTN(),
                 memory_options=("the method option chunk_gb", "--batch-size", "--cache-gb"))
    with pytest.raises(StageOutOfMemoryError) as info:
        run_stage(model, adapter, calib, spec, wd.ledger("init-rtn"))
    msg = str(info.value)
    assert "\n" not in msg and isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert msg.startswith("stage init-rtn: out of device memory in block 2 (layer 2)"), msg
    assert "Tried to allocate 20.00 GiB" in msg and "chunk_gb" in msg and "--batch-size" in msg and "--cache-gb" in msg
    assert "re-run the same command: the finished blocks are saved" in msg
    assert sorted(wd.stage("init-rtn")["blocks"]) == ["0", "1"] and not wd.stage("init-rtn")["done"]
    assert run_stage(model, adapter, calib, _spec(lambda li: RTN()), wd.ledger("init-rtn"))["computed_now"] == 2


def test_cli_prints_out_of_memory_as_one_line(tmp_path):
    """The command line shows the domain error as it is: one line, no exception type, no traceback."""
    import typer

    from moesq_cli.app import _guard
    from moesq_cli.progress_display import err_console

    def command(workdir=None):
        raise StageOutOfMemoryError("stage refine: out of device memory in block 5 (layer 5) (CUDA out of memory.); "
                                    "lower --micro-batch-rows, --batch-size, --cache-gb, then re-run the same "
                                    "command: the finished blocks are saved and it resumes from there")

    with err_console.capture() as cap, pytest.raises(typer.Exit) as ex:
        _guard(command)(workdir=None)
    out = " ".join(cap.get().split())
    assert ex.value.exit_code == 1
    assert out.startswith("error: stage refine: out of device memory in block 5") and "Traceback" not in out
    assert "StageOutOfMemoryError" not in out


def test_estimate_after_the_first_computed_block(micro_calibrated, tmp_path, monkeypatch):
    from moesq_core.compression import engine

    model, adapter, path, calib = micro_calibrated
    wd = _new_wd(tmp_path / "wd", path)
    rec = Recorder()
    run_stage(model, adapter, calib, _spec(lambda li: RTN()), wd.ledger("init-rtn"), rec)
    assert not [n for n in rec.notes if "remaining" in n], rec.notes  # a stage over in seconds needs no estimate
    wd.ledger("init-rtn").drop_blocks_from(0)
    monkeypatch.setattr(engine, "ESTIMATE_MIN_SECONDS", 0.0)  # as if every block took minutes
    # blocks of milliseconds differ by more than the revision threshold from noise alone: the revision is
    # tested below, with a first block made slow on purpose
    revise = engine.ESTIMATE_REVISE
    monkeypatch.setattr(engine, "ESTIMATE_REVISE", float("inf"))
    rec = Recorder()
    run_stage(model, adapter, calib, _spec(lambda li: RTN()), wd.ledger("init-rtn"), rec)
    est = [n for n in rec.notes if "remaining" in n]
    assert len(est) == 1, rec.notes
    assert re.fullmatch(r"stage init-rtn: ~3 blocks × \d+\.\d s/block ≈ \d+ s remaining", est[0]), rec.notes
    assert rec.tasks["init-rtn: blocks"] == ["advance"] * 4

    # resumed after 2 blocks: the loaded ones are skipped (no rate from them) and the estimate counts only
    # the blocks still to compute
    wd.ledger("init-rtn").drop_blocks_from(2)
    rec = Recorder()
    run_stage(model, adapter, calib, _spec(lambda li: RTN()), wd.ledger("init-rtn"), rec)
    assert rec.tasks["init-rtn: blocks"] == ["skip", "skip", "advance", "advance"]
    assert [n for n in rec.notes if "remaining" in n][0].startswith("stage init-rtn: ~1 block × ")

    # a first block slowed by warm-up (here: a pause) gives an estimate the second block revises
    monkeypatch.setattr(engine, "ESTIMATE_REVISE", revise)

    def slow_first(li):
        if li == 0:
            time.sleep(1.0)
        return RTN()

    wd.ledger("init-rtn").drop_blocks_from(0)
    rec = Recorder()
    run_stage(model, adapter, calib, _spec(slow_first), wd.ledger("init-rtn"), rec)
    est = [n for n in rec.notes if "remaining" in n]
    assert len(est) == 2 and est[0].startswith("stage init-rtn: ~3 blocks × "), est
    assert re.fullmatch(r"stage init-rtn: ~2 blocks × \d+\.\d s/block ≈ \d+ s remaining "
                        r"\(revised after the second block\)", est[1]), est
    first, second = (float(re.search(r"× ([\d.]+) s/block", n).group(1)) for n in est)
    assert first >= 1.0 > second


def test_progress_bar_eta_ignores_skipped_units():
    from moesq_cli.progress_display import RichProgress, time_remaining, work_rate

    clock = [0.0]
    p = RichProgress()
    p.bar.get_time = lambda: clock[0]
    with p.task("stage: blocks", 6) as t:
        task = p.bar.tasks[-1]
        clock[0] = 5.0
        t.skip(2)  # two blocks loaded from a resumed stage, in 5 s
        assert work_rate(task) is None and time_remaining(task) is None
        clock[0] = 65.0
        t.advance()  # one computed block: 60 s
        assert work_rate(task) == pytest.approx(1 / 60)
        assert time_remaining(task) == pytest.approx(3 * 60)
        clock[0] = 95.0
        assert time_remaining(task) == pytest.approx(3 * 60 - 30)
        clock[0] = 155.0
        t.advance()  # a slower one: 90 s; the rate is the mean over computed blocks
        assert time_remaining(task) == pytest.approx(2 * 75)
