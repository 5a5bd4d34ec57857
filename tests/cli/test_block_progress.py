"""Progress inside one block (moesq_core.progress.BlockProgress): expert counts, steps, rates, ETAs, log lines and
the rich bar. Hermetic and fast: a fake clock, no sleeping, no model."""
from __future__ import annotations

import io
import logging
import re

import pytest
from rich.console import Console

from moesq_core.progress import BlockProgress, NullProgress, clock_text, progress_log, rate_text


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog):
    """The progress lines logged during the test, read on "moesq.progress" itself (an earlier CLI test's
    setup_logging may have cut "moesq" off from the root logger caplog listens on)."""
    old_level, old_propagate = progress_log.level, progress_log.propagate
    progress_log.setLevel(logging.INFO)
    progress_log.propagate = False
    progress_log.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records if r.name == "moesq.progress"]
    progress_log.removeHandler(caplog.handler)
    progress_log.setLevel(old_level)
    progress_log.propagate = old_propagate


def _block(progress=None, clock=None, **kw) -> BlockProgress:
    return BlockProgress(progress, lambda n: None, "refine", 3, clock=clock or FakeClock(), **kw)


def test_a_block_progress_is_called_like_a_progress_fn_and_advances_experts():
    finished = []
    bp = BlockProgress(None, finished.append, "refine", 3)
    bp(2)
    bp()
    assert finished == [2, 1]


def test_a_line_at_the_first_update_then_at_most_every_30_s_and_one_at_the_end(lines):
    clock = FakeClock()
    with _block(clock=clock).steps(100) as s:
        clock.now = 12.0
        s.update(1)  # the first step (with its compilation): logged at once
        assert len(lines()) == 1
        for done, t in ((2, 13.0), (20, 41.9)):  # under 30 s after the last line
            clock.now = t
            s.update(done)
        assert len(lines()) == 1
        clock.now = 42.0
        s.update(21)  # 30 s after the first line
        assert len(lines()) == 2
        clock.now = 50.0
        s.update(100)  # the last step: logged at once
        assert len(lines()) == 3
    assert len(lines()) == 3  # closing after the last step adds nothing
    assert lines()[0].startswith("refine: layer 3 steps 1/100 (1 %)")
    assert lines()[1].startswith("refine: layer 3 steps 21/100 (21 %)")
    assert lines()[2].startswith("refine: layer 3 steps 100/100 (100 %)")


def test_a_context_closed_before_the_last_step_logs_where_it_stopped(lines):
    clock = FakeClock()
    with pytest.raises(RuntimeError):
        with _block(clock=clock).steps(1280) as s:
            clock.now = 1.0
            s.update(1)
            clock.now = 2.0
            s.update(40)
            raise RuntimeError("out of memory")
    assert len(lines()) == 2 and lines()[1].startswith("refine: layer 3 steps 40/1280 (3 %)") \
        and lines()[1].endswith("(stopped early)")


def test_block_and_stage_eta_from_the_rate_since_the_first_update(lines):
    clock = FakeClock()
    bp = _block(clock=clock, blocks_after=3)  # the block starts at 0
    clock.now = 10.0
    with bp.steps(1280) as s:
        clock.now = 20.0
        s.update(1)  # 20 s for the first step: compilation, left out of the rate
        assert s.steps_per_s() is None and s.block_eta_s() is None and s.stage_eta_s() is None
        clock.now = 30.0
        s.update(11)  # 10 steps in 10 s
        assert s.steps_per_s() == pytest.approx(1.0)
        assert s.block_eta_s() == pytest.approx(1269.0)
        # each block after this one as long as this one's projection: 30 s elapsed + 1269 s left
        assert s.stage_eta_s() == pytest.approx(1269.0 + 3 * 1299.0)
        clock.now = 50.0
        s.update(31)  # the ETAs follow the measured rate, not a per-update figure
        assert s.steps_per_s() == pytest.approx(1.0) and s.block_eta_s() == pytest.approx(1249.0)
        assert s.stage_eta_s() == pytest.approx(1249.0 + 3 * (50.0 + 1249.0))
    assert "block ETA 20:49, stage ETA 1:25:46" in lines()[-1]  # 1249 s and 5146 s, at the close


def test_stage_eta_uses_the_seconds_per_block_given(lines):
    clock = FakeClock()
    with _block(clock=clock, blocks_after=3, seconds_per_block=600.0).steps(1280) as s:
        clock.now = 20.0
        s.update(1)
        clock.now = 30.0
        s.update(11)
        assert s.stage_eta_s() == pytest.approx(1269.0 + 3 * 600.0)
        assert lines()[-1] == "refine: layer 3 steps 1/1280 (0 %)"  # the first line: no rate yet
    assert lines()[-1] == "refine: layer 3 steps 11/1280 (1 %), block ETA 21:09, stage ETA 51:09 (stopped early)"


def test_the_last_block_of_a_stage_has_the_blocks_eta_as_the_stages():
    clock = FakeClock()
    with _block(clock=clock).steps(10) as s:
        clock.now = 1.0
        s.update(1)
        clock.now = 3.0
        s.update(3)
        assert s.stage_eta_s() == s.block_eta_s() == pytest.approx(7.0)
        clock.now = 10.0
        s.update(10)
        assert s.block_eta_s() == s.stage_eta_s() == 0.0


def test_routed_rows_per_second_since_the_first_update(lines):
    clock = FakeClock()
    with _block(clock=clock).steps(1280) as s:
        clock.now = 5.0
        s.update(1, rows=7_000_000)  # the first step's rows, like its time, are not in the rate
        assert s.rows_per_s() is None
        clock.now = 15.0
        s.update(3)  # an update without rows changes no row figure
        assert s.rows_per_s() is None
        clock.now = 25.0
        s.update(40, rows=7_000_000 + 284_000_000)
        assert s.rows_per_s() == pytest.approx(14.2e6)
    assert "steps 40/1280 (3 %), 14.2 M routed rows/s, block ETA " in lines()[-1]


def test_rate_and_clock_text():
    assert [rate_text(x) for x in (850, 14_200, 14.2e6, 1.4e9)] == ["850", "14.2 k", "14.2 M", "1.4 G"]
    assert [clock_text(x) for x in (0, 175, 3599.4, 9070)] == ["0:00", "2:55", "59:59", "2:31:10"]


@pytest.mark.parametrize("progress", [None, NullProgress()], ids=["None", "NullProgress"])
def test_steps_work_without_a_bar(progress, lines):
    clock = FakeClock()
    with _block(progress, clock=clock).steps(4, "epochs") as s:
        for done in range(1, 5):
            clock.now = float(done)
            s.update(done, rows=100 * done)
    assert lines()[0] == "refine: layer 3 epochs 1/4 (25 %)"
    assert lines()[-1] == "refine: layer 3 epochs 4/4 (100 %), 100 routed rows/s, block ETA 0:00, stage ETA 0:00"


def _rendered(p) -> str:
    out = Console(file=io.StringIO(), width=250, color_system=None)
    out.print(p.bar.make_tasks_table(p.bar.tasks))
    return out.file.getvalue()


def test_the_rich_bar_shows_steps_rows_per_second_and_both_etas():
    from moesq_cli.progress_display import RichProgress

    clock = FakeClock()
    p = RichProgress(quiet=False)
    p.bar.get_time = clock
    bp = BlockProgress(p, lambda n: None, "refine", 3, blocks_after=2, seconds_per_block=1000.0, clock=clock)
    with p.task("refine: layer 3 experts", 128), bp.steps(1280) as s:
        clock.now = 20.0
        s.update(1, rows=0)
        clock.now = 59.0
        s.update(40, rows=39 * 1_000_000)  # 1 step/s, 1 M rows/s from the first update
        text = _rendered(p)
    steps_row = next(line for line in text.splitlines() if "layer 3 steps" in line)
    assert "40/1280" in steps_row and "1.0 M rows/s" in steps_row
    assert "0:20:40" in steps_row  # the block's ETA: 1240 steps at 1 step/s
    assert "stage eta 0:54:00" in steps_row  # 1240 s + 2 × 1000 s
    experts_row = next(line for line in text.splitlines() if "layer 3 experts" in line)
    assert "0/128" in experts_row and "rows/s" not in experts_row and "stage eta" not in experts_row


def test_a_quiet_rich_progress_takes_the_steps_and_still_logs(lines):
    from moesq_cli.progress_display import RichProgress

    clock = FakeClock()
    with RichProgress(quiet=True) as p:
        with BlockProgress(p, lambda n: None, "refine", 3, clock=clock).steps(10) as s:
            clock.now = 1.0
            s.update(1, rows=5)
            clock.now = 2.0
            s.update(10, rows=50)
        assert not p.bar.tasks
    assert lines()[-1] == "refine: layer 3 steps 10/10 (100 %), 45 routed rows/s, block ETA 0:00, stage ETA 0:00"


@pytest.mark.parametrize("quiet", [True, False], ids=["quiet", "stderr-to-a-file"])
def test_without_a_visible_bar_the_lines_reach_stderr_at_most_every_30_s(quiet, capsys, monkeypatch, lines):
    from moesq_cli.progress_display import RichProgress, _ProgressLinesToStderr

    clock = FakeClock()
    p = RichProgress(quiet=quiet)
    monkeypatch.setattr(p.bar.console, "_force_terminal", False)  # as when stderr is redirected to a file
    with p:
        assert not p.visible
        with BlockProgress(p, lambda n: None, "refine", 3, clock=clock).steps(100) as s:
            for done in (1, 50, 100):
                clock.now += 40.0
                s.update(done)
    assert len(lines()) == 3  # all three logged (the log file's)
    # nothing but those lines: no bar either (rich would print it once, at the end, cut to the file's 80 columns)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in err), err
    assert len(err) == 1 and err[0].endswith(" refine: layer 3 steps 1/100 (1 %)")  # the others within 30 s
    assert not any(isinstance(h, _ProgressLinesToStderr) for h in progress_log.handlers)  # removed on exit
    progress_log.info("after the command")
    assert capsys.readouterr().err == ""

    echo = _ProgressLinesToStderr()
    for created in (1000.0, 1029.0, 1030.0, 1059.0, 1061.0):
        record = logging.LogRecord("moesq.progress", logging.INFO, __file__, 0, f"at {created}", None, None)
        record.created = created
        echo.handle(record)
    assert [line.split()[-1] for line in capsys.readouterr().err.splitlines()] == ["1000.0", "1030.0", "1061.0"]


def test_a_visible_bar_prints_no_progress_lines(capsys, monkeypatch, lines):
    from moesq_cli.progress_display import RichProgress, _ProgressLinesToStderr

    p = RichProgress(quiet=False)
    monkeypatch.setattr(p.bar.console, "_force_terminal", True)
    assert p.visible and not RichProgress(quiet=True).visible
    with p:
        assert not any(isinstance(h, _ProgressLinesToStderr) for h in progress_log.handlers)
        progress_log.info("refine: layer 3 steps 1/100 (1 %)")
    assert "steps 1/100" not in capsys.readouterr().err
