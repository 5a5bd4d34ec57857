"""rich-backed implementation of moesq_core.progress: bars with counts, rate and ETA."""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from moesq_core.progress import clock_text, progress_log, rate_text

console = Console()  # results (tables, summaries) go to stdout
err_console = Console(stderr=True)  # progress bars and errors go to stderr
PROGRESS_EVERY_S = 30.0  # without a visible bar: a progress line on stderr at least (and at most) this often


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
    """One open task: advances the bar's task (when there is a bar) and keeps its own counts, from which
    `line()` says where it is (the stderr heartbeat's line where no bar is visible)."""

    def __init__(self, bar: Progress | None, tid=None, description: str = "", total: int | None = None,
                 clock=time.monotonic):
        self.bar, self.tid = bar, tid
        self.description, self.total, self.clock = description, total, clock
        self.completed, self.worked, self.work_seconds = 0, 0, 0.0
        self.started = self.mark = clock()
        self.fields: dict = {}

    def _fields(self) -> dict:
        return next(t for t in self.bar.tasks if t.id == self.tid).fields

    def advance(self, n: int = 1) -> None:
        now = self.clock()
        self.completed, self.worked = self.completed + n, self.worked + n
        self.work_seconds, self.mark = self.work_seconds + now - self.mark, now
        if self.bar is not None:
            f, now = self._fields(), self.bar.get_time()
            self.bar.update(self.tid, advance=n, worked=f["worked"] + n,
                            work_seconds=f["work_seconds"] + now - f["mark"], mark=now)

    def skip(self, n: int = 1) -> None:
        """n units done without work: they and the time since the last unit are left out of the rate."""
        self.completed, self.mark = self.completed + n, self.clock()
        if self.bar is not None:
            self.bar.update(self.tid, advance=n, mark=self.bar.get_time())

    def set_fields(self, **fields) -> None:
        """Extra figures for columns that show them (BlockStepsColumn)."""
        self.fields.update(fields)
        if self.bar is not None:
            self.bar.update(self.tid, **fields)

    def line(self) -> str:
        """e.g. `pack refine 12/48 (25 %), 3:02 elapsed, ETA 9:06`; an indeterminate task: its elapsed time."""
        now = self.clock()
        parts = [self.description]
        if self.total is not None:
            pct = f" ({100 * self.completed / self.total:.0f} %)" if self.total else ""
            parts[0] += f" {self.completed}/{self.total}{pct}"
        if self.fields.get("rows_per_s") is not None:
            parts.append(f"{rate_text(self.fields['rows_per_s'])} routed rows/s")
        parts.append(f"{clock_text(now - self.started)} elapsed")
        if self.total is not None and self.worked and self.work_seconds > 0:
            left = (self.total - self.completed) * self.work_seconds / self.worked - (now - self.mark)
            parts.append(f"ETA {clock_text(max(left, 0.0))}")
        if self.fields.get("stage_eta_s") is not None:
            parts.append(f"stage ETA {clock_text(self.fields['stage_eta_s'])}")
        return ", ".join(parts)


class _ProgressLinesToStderr(logging.Handler):
    """Where no bar is visible, stderr gets a progress line at least and at most every `every_s` seconds: the
    core's progress lines ("moesq.progress"; those within `every_s` of the last printed line still reach the
    log file), and, while `start()`ed, a heartbeat thread's line for the innermost open task (`tasks`: the
    RichProgress tasks register there) whenever nothing was printed for `every_s`, so that no phase (an
    end-to-end step, pack, eval, calibration) is silent for longer."""

    def __init__(self, every_s: float | None = None):
        super().__init__(logging.INFO)
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.last: float | None = None
        self.tasks: list[_Task] = []
        self.last_done: str | None = None  # the description of the task that closed last
        self.started = time.time()
        # not `lock`: logging.Handler.handle holds self.lock around emit, which takes this one
        self.tasks_lock = threading.Lock()
        self.stop_event: threading.Event | None = None
        self.thread: threading.Thread | None = None

    def emit(self, record: logging.LogRecord) -> None:
        with self.tasks_lock:
            if self.last is not None and record.created - self.last < self.every_s:
                return
            self.last = record.created
        try:
            self._print(record.created, record.getMessage())
        except Exception:
            self.handleError(record)

    @staticmethod
    def _print(at: float, text: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(at))
        err_console.print(f"{stamp} {text}", markup=False, highlight=False, soft_wrap=True)

    def heartbeat(self, now: float | None = None) -> bool:
        """Print the innermost open task's line if nothing was printed for `every_s`; whether it printed."""
        now = time.time() if now is None else now
        with self.tasks_lock:
            # nothing printed yet: the first heartbeat comes every_s after start()
            if now - (self.started if self.last is None else self.last) < self.every_s:
                return False
            self.last = now
            task = self.tasks[-1] if self.tasks else None
            done = f", {self.last_done} done" if self.last_done else ""
        self._print(now, task.line() if task is not None
                    else f"working, {clock_text(now - self.started)} elapsed{done}")
        return True

    def start(self) -> None:
        """Start the heartbeat thread: its first line comes `every_s` after this call at the earliest."""
        self.started = time.time()  # not a printed line: the core's first line still prints at once
        self.stop_event = threading.Event()
        tick = min(max(self.every_s / 5, 0.01), 1.0)

        def beat(stop=self.stop_event):
            while not stop.wait(tick):
                self.heartbeat()

        self.thread = threading.Thread(target=beat, name="moesq-progress-heartbeat", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.stop_event.set()
            self.thread.join()
            self.thread = None


class RichProgress:
    """Use as a context manager around a command's work; pass it to core functions as `progress`.

    While it is entered and its bar is not visible (--quiet, or stderr not a terminal: a file or a pipe, where
    no bar is drawn at all), stderr gets one progress line every `every_s` seconds
    (PROGRESS_EVERY_S, 30 s), at most and, while the command runs, at least: the core's progress lines (the
    "moesq.progress" logger, e.g. a long block's steps with its rates and ETAs), else the innermost open
    task's count, elapsed time and ETA, so a run without a terminal shows it is working in every phase.
    setup_logging's own stderr handler shows only warnings; this rule adds these lines alone and changes
    nothing else that is printed. Wherever the bar is visible, it shows the same figures instead; the work
    dir's log file gets every core line either way. (The core's lines are INFO records: they reach the echo
    where the "moesq" logger lets INFO through, as setup_logging sets it.)"""

    def __init__(self, quiet: bool = False, every_s: float | None = None):
        self.quiet, self.every_s = quiet, every_s
        self.bar = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            RateColumn(), TimeElapsedColumn(), TextColumn("eta"), EtaColumn(), BlockStepsColumn(),
            console=err_console, disable=quiet,
        )
        self.lines_to_stderr: _ProgressLinesToStderr | None = None  # the echo this one started
        self.echo: _ProgressLinesToStderr | None = None  # the echo its tasks register with (also an outer one's)

    @property
    def visible(self) -> bool:
        """Whether the bar is drawn as it goes (rich's own rule for a live display)."""
        c = self.bar.console
        return not self.quiet and (c.is_jupyter or (c.is_terminal and not c.is_dumb_terminal))

    def __enter__(self):
        # a bar that is not drawn as it goes is not drawn at all: rich would print it once, at the end, cut to
        # 80 columns where stderr is a file or a pipe
        self.bar.disable = not self.visible
        self.bar.__enter__()
        # one echo however many RichProgress are entered at once (a command may nest them): the outermost's
        self.echo = next((h for h in progress_log.handlers if isinstance(h, _ProgressLinesToStderr)), None)
        if not self.visible and self.echo is None:
            self.echo = self.lines_to_stderr = _ProgressLinesToStderr(self.every_s)
            progress_log.addHandler(self.lines_to_stderr)
            self.lines_to_stderr.start()
        return self

    def __exit__(self, *exc):
        if self.lines_to_stderr is not None:
            self.lines_to_stderr.stop()
            progress_log.removeHandler(self.lines_to_stderr)
            self.lines_to_stderr = None
        self.echo = None
        return self.bar.__exit__(*exc)

    def note(self, message: str) -> None:
        """A one-line notice (e.g. the refinement schedule), shown even with --quiet, on stderr."""
        err_console.print(message, highlight=False, soft_wrap=True)

    @contextmanager
    def task(self, description: str, total: int | None):
        tid = None if self.quiet else self.bar.add_task(description, total=total, worked=0, work_seconds=0.0,
                                                        mark=self.bar.get_time())
        t = _Task(None if self.quiet else self.bar, tid, description, total)
        echo = self.echo
        if echo is not None:
            with echo.tasks_lock:
                echo.tasks.append(t)
        try:
            yield t
        finally:
            if echo is not None:
                with echo.tasks_lock:
                    echo.tasks.remove(t)
                    echo.last_done = description
            if tid is not None:
                task = next(x for x in self.bar.tasks if x.id == tid)
                if task.total is None:  # an indeterminate step: mark it done
                    self.bar.update(tid, total=1, completed=1)
