"""rich-backed implementation of moesq_core.progress: bars with counts, rate and ETA."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

console = Console()  # results (tables, summaries) go to stdout
err_console = Console(stderr=True)  # progress bars and errors go to stderr


class RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:.2f}/s", style="cyan")


class _Task:
    def __init__(self, bar: Progress | None, tid=None):
        self.bar, self.tid = bar, tid

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.advance(self.tid, n)


class RichProgress:
    """Use as a context manager around a command's work; pass it to core functions as `progress`."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.bar = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            RateColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
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
        tid = self.bar.add_task(description, total=total)
        try:
            yield _Task(self.bar, tid)
        finally:
            task = next(t for t in self.bar.tasks if t.id == tid)
            if task.total is None:  # an indeterminate step: mark it done
                self.bar.update(tid, total=1, completed=1)
