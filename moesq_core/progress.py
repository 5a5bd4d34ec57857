"""A minimal progress interface so the core reports long loops without importing any UI library.
The CLI passes a rich-backed implementation; the default does nothing."""
from __future__ import annotations

import logging
import time
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


# Progress inside one block. The records go to the "moesq.progress" logger, a child of "moesq": wherever
# "moesq" logs (the work dir's logs/moesq.log under the CLI), these lines go too. The CLI's RichProgress also
# echoes them to stderr while its bar is not visible (see moesq_cli.progress_display); the core prints nothing.
progress_log = logging.getLogger("moesq.progress")


def clock_text(seconds: float) -> str:
    """2:55 under an hour, 2:31:10 from one hour on."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate_text(per_second: float) -> str:
    """850, 14.2 k, 14.2 M, 1.4 G."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_second >= scale:
            return f"{per_second / scale:.1f} {prefix}"
    return f"{per_second:.0f}"


class BlockProgress:
    """What a method reports while it compresses one block. The engine passes one as Method.compress_block's
    `progress`; calling it, progress(n), marks n experts finished (it is a ProgressFn, so methods that only count
    experts keep working). A long method reports finer steps with `steps`.

    `progress` is the run's Progress (or None); `advance_experts` is the block's experts task's advance.
    `blocks_after` is how many blocks of the stage come after this one, `seconds_per_block` the stage's measured
    time per block where known; the stage ETA uses them. Created when the block starts: the block's elapsed
    time counts from here."""

    def __init__(self, progress, advance_experts, stage: str, layer: int, blocks_after: int = 0,
                 seconds_per_block: float | None = None, log_every_s: float = 30.0, clock=time.monotonic):
        self.progress, self.advance_experts = progress, advance_experts
        self.stage, self.layer = stage, layer
        self.blocks_after, self.seconds_per_block = blocks_after, seconds_per_block
        self.log_every_s, self.clock = log_every_s, clock
        self.started = clock()

    def __call__(self, n: int = 1) -> None:
        self.advance_experts(n)

    @contextmanager
    def steps(self, total: int, what: str = "steps") -> Iterator["StepTracker"]:
        """A task of `total` steps ("{stage}: layer {layer} {what}") on the run's Progress, for the
        StepTracker it yields; on leaving (also early, also on an error) its last line is logged."""
        progress = self.progress if self.progress is not None else NullProgress()
        with progress.task(f"{self.stage}: layer {self.layer} {what}", total) as task:
            tracker = StepTracker(self, task, total, what)
            try:
                yield tracker
            finally:
                tracker.close()


class StepTracker:
    """Counts one `BlockProgress.steps` context's steps: advances its task, measures step and row rates,
    estimates the block's and the stage's time left, shows them on the task (its `set_fields`, when it has one)
    and logs a line at the first update, then at most every `log_every_s` seconds, and at the end."""

    def __init__(self, block: BlockProgress, task, total: int, what: str):
        self.block, self.task, self.total, self.what = block, task, total, what
        self.done, self.rows = 0, None
        self.first: tuple[float, int, int | None] | None = None  # (time, done, rows) at the first update
        self.last_step_time = self.last_rows_time = None
        self.logged_at: float | None = None
        self.ended = False

    def update(self, done: int, rows: int | None = None) -> None:
        """Call after a step (at least after the first and the last): `done` is the steps finished so far
        (cumulative, 0..total; numbers may be skipped), `rows` the routed rows processed so far (cumulative),
        when the method counts them."""
        now = self.block.clock()
        step = max(done - self.done, 0)
        if self.first is None:
            # The first step carries one-time work (compilation, autotuning, allocation): the rates are measured
            # from the first update on, so it counts as skipped work (see `skip`) and not toward them.
            self.first = (now, done, rows)
            skip(self.task, step)
        elif step:
            self.task.advance(step)
        if step:
            self.done, self.last_step_time = done, now
        if rows is not None:
            self.rows, self.last_rows_time = rows, now
        if hasattr(self.task, "set_fields"):
            self.task.set_fields(rows_per_s=self.rows_per_s(), block_eta_s=self.block_eta_s(),
                                 stage_eta_s=self.stage_eta_s())
        if self.ended:
            return
        if self.done >= self.total:
            self._log(now, end=True)
        elif self.logged_at is None or now - self.logged_at >= self.block.log_every_s:
            self._log(now)

    def steps_per_s(self) -> float | None:
        """Steps per second since the first update; None until a later update has finished steps."""
        if self.first is None or self.last_step_time is None or self.last_step_time <= self.first[0]:
            return None
        return (self.done - self.first[1]) / (self.last_step_time - self.first[0])

    def rows_per_s(self) -> float | None:
        """Routed rows per second since the first update, when both it and a later update gave `rows`."""
        if self.first is None or self.first[2] is None or self.last_rows_time is None \
                or self.last_rows_time <= self.first[0]:
            return None
        return (self.rows - self.first[2]) / (self.last_rows_time - self.first[0])

    def block_eta_s(self) -> float | None:
        """Seconds until the last step: the steps left at the measured step rate (0 when none is left)."""
        left = self.total - self.done
        if left <= 0:
            return 0.0
        rate = self.steps_per_s()
        return left / rate if rate else None

    def stage_eta_s(self) -> float | None:
        """Seconds until the stage's last block ends: this block's ETA plus, per block after it, the stage's
        seconds per block when given, else this block's projected duration (elapsed since it started + its ETA)."""
        block_eta = self.block_eta_s()
        if block_eta is None:
            return None
        b = self.block
        per_block = b.seconds_per_block
        if per_block is None:
            per_block = (b.clock() - b.started) + block_eta
        return block_eta + b.blocks_after * per_block

    def line(self) -> str:
        """e.g. refine: layer 3 steps 40/1280 (3 %), 14.2 M routed rows/s, block ETA 2:55, stage ETA 2:31:10"""
        b = self.block
        pct = 100 * self.done / self.total if self.total else 100
        parts = [f"{b.stage}: layer {b.layer} {self.what} {self.done}/{self.total} ({pct:.0f} %)"]
        rows, block_eta, stage_eta = self.rows_per_s(), self.block_eta_s(), self.stage_eta_s()
        if rows is not None:
            parts.append(f"{rate_text(rows)} routed rows/s")
        if block_eta is not None:
            parts.append(f"block ETA {clock_text(block_eta)}")
        if stage_eta is not None:
            parts.append(f"stage ETA {clock_text(stage_eta)}")
        return ", ".join(parts)

    def close(self) -> None:
        """The end line, unless `update` already logged it (the context closed before the last step)."""
        if not self.ended:
            self._log(self.block.clock(), end=True, early=self.done < self.total)

    def _log(self, now: float, end: bool = False, early: bool = False) -> None:
        progress_log.info("%s%s", self.line(), " (stopped early)" if early else "")
        self.logged_at, self.ended = now, end
