"""A minimal progress interface so the core reports long loops without importing any UI library.
The CLI passes a rich-backed implementation; the default does nothing."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Protocol


class Task(Protocol):
    def advance(self, n: int = 1) -> None: ...

    # Optional: `skip(n)` marks n units done without work (e.g. blocks loaded from a resumed stage), so that
    # they do not count toward the rate an ETA is estimated from (see `skip` below).


class Progress(Protocol):
    def task(self, description: str, total: int | None) -> "contextmanager[Task]": ...


class _NullTask:
    def advance(self, n: int = 1) -> None:
        pass


class NullProgress:
    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[_NullTask]:
        yield _NullTask()


def note(progress, message: str) -> None:
    """A one-line notice for the user (e.g. a schedule before training): shown by progress objects that
    have `note`, always logged."""
    logging.getLogger("moesq").info("%s", message)
    if progress is not None and hasattr(progress, "note"):
        progress.note(message)


def skip(task, n: int = 1) -> None:
    """n units of `task` done without work (loaded, not computed): the task's `skip` when it has one (its ETA
    then ignores them), else a plain advance."""
    (task.skip if hasattr(task, "skip") else task.advance)(n)
