"""rich-backed implementation of moesq_core.progress: bars with counts, rate and ETA."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

from moesq_core.progress import progress_log, rate_text

console = Console()  # results (tables, summaries) go to stdout
err_console = Console(stderr=True)  # progress bars and errors go to stderr


def work_rate(task) -> float | None:
    """Units per second of real work: units skipped (loaded, not computed) and the time spent on them do not
    count, so a resumed stage's ETA is its measured time per block × the blocks left."""
    worked, seconds = task.fields.get("worked", 0), task.fields.get("work_seconds", 0.0)
    return worked / seconds if worked and seconds > 0 else None


def time_remaining(task) -> float | None:
    """Seconds left: the units left at the work rate, less the time since the last unit finished."""
    rate = work_rate(task)
    if task.total is None or rate is None:
        return None
    since = task.get_time() - task.fields.get("mark", task.get_time())
    return max(0.0, (task.total - task.completed) / rate - since)


class RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        speed = work_rate(task)
        return Text("" if speed is None else f"{speed:.2f}/s", style="cyan")


def hms(seconds: float) -> str:
    """0:02:55: the ETA columns' form."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}"


class EtaColumn(ProgressColumn):
    """The time remaining from `time_remaining` (rich's own estimate averages only the last 30 s, which a
    stage's minutes-long blocks never fill, and counts loaded blocks as work)."""

    max_refresh = 0.5

    def render(self, task) -> Text:
        if task.total is None:
            return Text("")
        left = 0.0 if task.finished else time_remaining(task)
        if left is None:
            return Text("-:--:--", style="progress.remaining")
        return Text(hms(left), style="progress.remaining")


class BlockStepsColumn(ProgressColumn):
    """For a block's steps task (moesq_core.progress.StepTracker): routed rows per second and the stage's time
    left (the block's is EtaColumn's: its first step, which carries compilation, is skipped there). Empty for
    the other tasks, which have no such fields."""

    def render(self, task) -> Text:
        rows, stage_eta = task.fields.get("rows_per_s"), task.fields.get("stage_eta_s")
        parts = ([] if rows is None else [f"{rate_text(rows)} rows/s"]) + \
                ([] if stage_eta is None else [f"stage eta {hms(stage_eta)}"])
        return Text(", ".join(parts), style="cyan")


class _Task:
    def __init__(self, bar: Progress | None, tid=None):
        self.bar, self.tid = bar, tid

    def _fields(self) -> dict:
        return next(t for t in self.bar.tasks if t.id == self.tid).fields

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            f, now = self._fields(), self.bar.get_time()
            self.bar.update(self.tid, advance=n, worked=f["worked"] + n,
                            work_seconds=f["work_seconds"] + now - f["mark"], mark=now)

    def skip(self, n: int = 1) -> None:
        """n units done without work: they and the time since the last unit are left out of the rate."""
        if self.bar is not None:
            self.bar.update(self.tid, advance=n, mark=self.bar.get_time())

    def set_fields(self, **fields) -> None:
        """Extra figures for columns that show them (BlockStepsColumn)."""
        if self.bar is not None:
            self.bar.update(self.tid, **fields)


class _ProgressLinesToStderr(logging.Handler):
    """Prints the core's progress lines ("moesq.progress") on stderr, at most one per `every_s` seconds (the
    others still reach the log file)."""

    def __init__(self, every_s: float = 30.0):
        super().__init__(logging.INFO)
        self.every_s, self.last = every_s, None

    def emit(self, record: logging.LogRecord) -> None:
        if self.last is not None and record.created - self.last < self.every_s:
            return
        self.last = record.created
        try:
            stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
            err_console.print(f"{stamp} {record.getMessage()}", markup=False, highlight=False, soft_wrap=True)
        except Exception:
            self.handleError(record)


class RichProgress:
    """Use as a context manager around a command's work; pass it to core functions as `progress`.

    While it is entered and its bar is not visible (--quiet, or stderr not a terminal: redirected to a file,
    where rich draws the bar only once, at the end), the core's progress lines (the "moesq.progress" logger,
    e.g. a long block's steps with its rates and ETAs) are printed on stderr, at most one per 30 s, so a run
    without a terminal still shows it is working. setup_logging's own stderr handler shows only warnings; this
    rule adds these lines alone and changes nothing else that is printed. Wherever the bar is visible, it shows
    the same figures instead; the work dir's log file gets every line either way. (The lines are INFO records:
    they reach the echo where the "moesq" logger lets INFO through, as setup_logging sets it.)"""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.bar = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            RateColumn(), TimeElapsedColumn(), TextColumn("eta"), EtaColumn(), BlockStepsColumn(),
            console=err_console, disable=quiet,
        )
        self.lines_to_stderr: _ProgressLinesToStderr | None = None

    @property
    def visible(self) -> bool:
        """Whether the bar is drawn as it goes (rich's own rule for a live display)."""
        c = self.bar.console
        return not self.quiet and (c.is_jupyter or (c.is_terminal and not c.is_dumb_terminal))

    def __enter__(self):
        self.bar.__enter__()
        # one echo however many RichProgress are entered at once (a command may nest them)
        if not self.visible and not any(isinstance(h, _ProgressLinesToStderr) for h in progress_log.handlers):
            self.lines_to_stderr = _ProgressLinesToStderr()
            progress_log.addHandler(self.lines_to_stderr)
        return self

    def __exit__(self, *exc):
        if self.lines_to_stderr is not None:
            progress_log.removeHandler(self.lines_to_stderr)
            self.lines_to_stderr = None
        return self.bar.__exit__(*exc)

    def note(self, message: str) -> None:
        """A one-line notice (e.g. the refinement schedule), shown even with --quiet, on stderr."""
        err_console.print(message, highlight=False, soft_wrap=True)

    @contextmanager
    def task(self, description: str, total: int | None):
        if self.quiet:
            yield _Task(None)
            return
        tid = self.bar.add_task(description, total=total, worked=0, work_seconds=0.0, mark=self.bar.get_time())
        try:
            yield _Task(self.bar, tid)
        finally:
            task = next(t for t in self.bar.tasks if t.id == tid)
            if task.total is None:  # an indeterminate step: mark it done
                self.bar.update(tid, total=1, completed=1)
