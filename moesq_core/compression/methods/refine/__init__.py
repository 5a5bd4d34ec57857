"""moesq refinement: joint learning of the sparsity support (Gumbel-softmax over the format's patterns) and the
quantized values of every expert of a block, starting from an init method's solution (SGPTQ in the paper).

    method = RefineMethod(init=SGPTQ(), config=RefineConfig(epochs=10))   # init defaults to get_method("sgptq")
    compressed = method.compress_block(experts, get_format("p48-nvfp4"))
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from moesq_core.compression.methods.base import CompressedExpert, ExpertData, Method, ProgressFn
from moesq_core.compression.methods.refine.trainer import (
    PAPER_STEPS,
    BlockRefiner,
    RefineConfig,
    RefineSchedule,
    refine_chunks,
)
from moesq_core.formats import Format
from moesq_core.memory import release_freed_memory

log = logging.getLogger(__name__)

__all__ = ["RefineMethod", "RefineConfig", "RefineSchedule", "BlockRefiner", "PAPER_STEPS"]


class RefineMethod:
    """`init.compress_block` gives each expert's starting mask, values (its `latent` when present, else its
    dequantized weights) and the "epoch 0" every refined epoch must beat on validation; then all experts of
    the block are refined together (see trainer.py)."""

    name = "refine"

    def __init__(self, init: Method | None = None, config: RefineConfig | None = None):
        if init is None:
            from moesq_core.compression.methods.registry import (
                get_method,  # moesq's default init (SGPTQ with refit); imported lazily
            )

            init = get_method("sgptq")
        if not hasattr(init, "compress_block"):
            raise TypeError(f"RefineMethod needs an init method (an object with compress_block), "
                            f"got {type(init).__name__}")
        self.init = init
        self.config = config or RefineConfig()

    @property
    def few_rows_fallback(self) -> str:
        """What an expert the calibration routed no or few rows to ships (engine.few_rows_line): an expert without
        rows keeps its init; with ship "best" an epoch ships only where the expert's own held-out rows validated
        it better than the init (trainer.py)."""
        if self.config.ship == "last":
            return ("those without keep their init (round-to-nearest on the magnitude pattern), the others ship their "
                    "last epoch (ship: last)")
        return ("they keep their init (round-to-nearest on the magnitude pattern for those without) unless their own "
                "held-out rows validate a refined epoch better")

    def compress_block(self, experts: list[ExpertData], fmt: Format,
                       progress: ProgressFn | None = None) -> list[CompressedExpert]:
        if not experts:
            return []
        # Timings are logged, never stored in CompressedExpert.info: artifacts must be byte-identical across runs.
        t0 = time.perf_counter()
        inits = self.init.compress_block(experts, fmt, None)
        t_init = time.perf_counter() - t0
        init_of = {ex.index: ce for ex, ce in zip(experts, inits)}
        chunks = refine_chunks(experts, fmt, self.config)  # bounded memory; the same bytes as one chunk
        out = []
        with contextlib.ExitStack() as stack:
            steps = None  # the block's step tracker, where the engine gives one (BlockProgress.steps)
            for i, chunk in enumerate(chunks):
                # experts by falling row count: a micro-batch's experts are then mostly the first k of the refiner's
                # (selecting them is a view); each expert's result does not depend on its place
                ordered = sorted(chunk, key=lambda ex: (-ex.n_rows, ex.index))
                try:
                    refiner = BlockRefiner(ordered, [init_of[ex.index] for ex in ordered], fmt, self.config)
                    if steps is None and hasattr(progress, "steps"):
                        steps = stack.enter_context(progress.steps(len(chunks) * refiner.total_steps))
                    done = refiner.run(_StepReport(steps, i * refiner.total_steps, refiner.total_steps, refiner.device))
                    by_index = {ex.index: r for ex, r in zip(ordered, done)}
                    out += [by_index[ex.index] for ex in chunk]
                    plan = refiner.plan
                    del refiner, done, by_index
                    release_freed_memory()  # the chunk's trainer state: the next chunk's starts from the system
                except torch.OutOfMemoryError as exc:
                    raise torch.OutOfMemoryError(
                        f"refine: out of memory refining {len(chunk)} of the block's {len(experts)} experts together; "
                        f"lower the refine option chunk_gb or micro_batch_rows") from exc
        log.info("refine: %d experts in %d chunk(s), init %.1f s, refinement %.1f s (%s)", len(experts), len(chunks),
                 t_init, time.perf_counter() - t0 - t_init, plan)
        if progress is not None:
            progress(len(experts))
        return out


class _StepReport:
    """A refiner's on_step for the block's step tracker (or none): the steps of earlier chunks are added, and the
    tracker is told at most once a second, after a device synchronisation, so its rates and ETAs are the device's
    (the host otherwise runs ahead of a CUDA queue) at no cost to a step."""

    EVERY_S = 1.0

    def __init__(self, tracker, steps_before: int, steps: int, device: torch.device):
        self.tracker, self.before, self.steps, self.device = tracker, steps_before, steps, device
        self.rows_before = getattr(tracker, "rows", None) or 0
        self.told = None

    def __call__(self, done: int, rows: int) -> None:
        if self.tracker is None:
            return
        now = time.monotonic()
        if self.told is not None and now - self.told < self.EVERY_S and done < self.steps:  # a chunk's last: always
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.tracker.update(self.before + done, self.rows_before + rows)
        self.told = time.monotonic()
