"""rich-backed implementation of moesq_core.progress: bars with counts, rate and ETA."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

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
        minutes, seconds = divmod(int(left), 60)
        hours, minutes = divmod(minutes, 60)
        return Text(f"{hours:d}:{minutes:02d}:{seconds:02d}", style="progress.remaining")


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


class RichProgress:
    """Use as a context manager around a command's work; pass it to core functions as `progress`."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.bar = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            RateColumn(), TimeElapsedColumn(), TextColumn("eta"), EtaColumn(),
            console=err_console, disable=quiet,
        )

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
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
