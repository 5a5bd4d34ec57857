"""A minimal progress interface so the core reports long loops without importing any UI library.
The CLI passes a rich-backed implementation; the default does nothing."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Protocol


class Task(Protocol):
    def advance(self, n: int = 1) -> None: ...


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
