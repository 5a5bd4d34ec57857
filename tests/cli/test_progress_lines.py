"""Without a terminal (a log file, CI), every phase of a command prints a progress line on stderr at least every
`every_s` seconds (moesq_cli.progress_display: 30 s; a tiny interval here): the innermost open task's count, elapsed
time and ETA."""
from __future__ import annotations

import re
import subprocess
import sys
import time

from moesq_runner import ENV, SMALL

STAMPED = re.compile(r"^\d\d:\d\d:\d\d (.*)$")


def _stamped(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := STAMPED.match(line))]


def test_every_open_task_prints_its_line_at_the_interval(capsys, monkeypatch):
    from moesq_cli.progress_display import RichProgress

    p = RichProgress(quiet=False, every_s=0.05)
    monkeypatch.setattr(p.bar.console, "_force_terminal", False)  # as when stderr is redirected to a file
    with p:
        assert not p.visible
        with p.task("pack refine", 4) as t:
            t.advance()
            time.sleep(0.5)
            with p.task("loading packed", None):  # the innermost open task is the one shown
                time.sleep(0.5)
            t.advance()
            time.sleep(0.5)
    err = capsys.readouterr().err
    lines = _stamped(err)
    assert any(re.fullmatch(r"pack refine 1/4 \(25 %\), 0:0\d elapsed, ETA 0:0\d", line) for line in lines), err
    assert any(re.fullmatch(r"loading packed, 0:0\d elapsed", line) for line in lines), err
    assert any(line.startswith("pack refine 2/4 (50 %)") for line in lines), err
    assert lines.index(next(x for x in lines if x.startswith("loading"))) < \
        lines.index(next(x for x in lines if x.startswith("pack refine 2/4")))
    time.sleep(0.2)
    assert capsys.readouterr().err == ""  # the heartbeat stops with the command


def test_a_visible_bar_prints_no_heartbeat(capsys, monkeypatch):
    from moesq_cli.progress_display import RichProgress

    p = RichProgress(quiet=False, every_s=0.05)
    monkeypatch.setattr(p.bar.console, "_force_terminal", True)
    with p, p.task("pack refine", 4):
        time.sleep(0.3)
    assert not _stamped(capsys.readouterr().err)


def test_a_command_with_stderr_to_a_pipe_prints_progress_lines(micro_path, tmp_path):
    """`moesq calibrate` with stderr to a pipe and a 0.05 s interval: its phases print their lines (loading the
    model and tokenizer outside any task: that it is working)."""
    run = ("import sys, moesq_cli.progress_display as p; p.PROGRESS_EVERY_S = 0.05; from moesq_cli.app import main; "
           "sys.argv[0] = 'moesq'; main()")
    r = subprocess.run([sys.executable, "-c", run, "calibrate", "--model", str(micro_path), "-w", str(tmp_path / "wd"),
                        *SMALL], capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = _stamped(r.stderr)
    assert any(re.fullmatch(r"calibrate: reading and tokenizing, 0:\d\d elapsed", x) for x in lines), r.stderr
    assert all(re.fullmatch(r"(calibrate: reading and tokenizing|working), 0:\d\d elapsed(, .* done)?", x)
               for x in lines), r.stderr


def test_core_progress_lines_reach_stderr_through_logging(capsys):
    """The core's "moesq.progress" records go through logging's Handler.handle (which takes the handler's own
    lock) to the stderr echo: printed, never blocking the command."""
    import logging
    import threading

    from moesq_cli.progress_display import _ProgressLinesToStderr

    echo = _ProgressLinesToStderr(every_s=0.0)
    log = logging.getLogger("moesq.progress.test-echo")
    log.setLevel(logging.INFO)
    log.addHandler(echo)
    done = threading.Event()

    def work():
        log.info("block 1/2: step 4/8")
        log.info("block 2/2: step 8/8")
        done.set()

    try:
        threading.Thread(target=work, daemon=True).start()
        assert done.wait(30), "a progress log line blocked the command"
    finally:
        log.removeHandler(echo)
    assert _stamped(capsys.readouterr().err) == ["block 1/2: step 4/8", "block 2/2: step 8/8"]
