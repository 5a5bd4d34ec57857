"""moesq refinement: joint learning of the sparsity support (Gumbel-softmax over the format's patterns) and the
quantized values of every expert of a block, starting from an init method's solution (SGPTQ in the paper).

    method = RefineMethod(init=SGPTQ(), config=RefineConfig(epochs=10))   # init defaults to get_method("sgptq")
    compressed = method.compress_block(experts, get_format("p48-nvfp4"))
"""
from __future__ import annotations

import contextlib
import dataclasses
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
    with_block_rows,
)
from moesq_core.formats import Format
from moesq_core.memory import release_device_cache, release_freed_memory

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
        out = {}
        # (experts, its config, first step and share of the block's step tracker in units of a planned chunk's
        # steps): a chunk that runs out of device memory is retried as two halves (the same bytes: see
        # refine_chunks), one expert with half the micro-batch rows (the same sums in another order)
        queue = [(chunk, self.config, float(i), 1.0) for i, chunk in enumerate(chunks)]
        plan, retries = None, 0
        with contextlib.ExitStack() as stack:
            steps = None  # the block's step tracker, where the engine gives one (BlockProgress.steps)
            while queue:
                chunk, cfg, start, share = queue.pop(0)
                # experts by falling row count: a micro-batch's experts are then mostly the first k of the refiner's
                # (selecting them is a view); each expert's result does not depend on its place
                ordered = sorted(chunk, key=lambda ex: (-ex.n_rows, ex.index))
                done = None
                try:
                    refiner = BlockRefiner(ordered, [init_of[ex.index] for ex in ordered], fmt, cfg)
                    if steps is None and hasattr(progress, "steps"):
                        steps = stack.enter_context(progress.steps(len(chunks) * refiner.total_steps))
                    T = refiner.total_steps
                    done = refiner.run(_StepReport(steps, round(start * T), T, refiner.device, share))
                    plan = refiner.plan
                except torch.OutOfMemoryError as exc:
                    if len(chunk) == 1 and cfg.micro_batch_rows <= MIN_RETRY_MICRO_BATCH_ROWS:
                        raise torch.OutOfMemoryError(
                            f"refine: out of memory refining one expert at --micro-batch-rows "
                            f"{cfg.micro_batch_rows:,}; lower the refine option chunk_gb or micro_batch_rows, or "
                            f"the calibration's tokens per block") from exc
                refiner = None
                if done is None:  # out of device memory: retry smaller, after the failed attempt's memory is back
                    release_device_cache()
                    retries += 1
                    if len(chunk) > 1:
                        chunk = with_block_rows(chunk)  # halves size their batches from the whole block's rows
                        h = len(chunk) // 2
                        queue[:0] = [(chunk[:h], cfg, start, share / 2), (chunk[h:], cfg, start + share / 2, share / 2)]
                        log.warning("refine: out of device memory refining %d experts together; retrying them as "
                                    "%d + %d", len(chunk), h, len(chunk) - h)
                    else:
                        half = dataclasses.replace(cfg, micro_batch_rows=max(1, cfg.micro_batch_rows // 2))
                        queue.insert(0, (chunk, half, start, share))
                        log.warning("refine: out of device memory refining expert %d; retrying it at "
                                    "--micro-batch-rows %d", chunk[0].index, half.micro_batch_rows)
                    continue
                out.update({ex.index: r for ex, r in zip(ordered, done)})
                del done
                release_freed_memory()  # the chunk's trainer state: the next chunk's starts from the system
        log.info("refine: %d experts in %d chunk(s)%s, init %.1f s, refinement %.1f s (%s)", len(experts), len(chunks),
                 f" and {retries} out-of-memory retries" if retries else "", t_init,
                 time.perf_counter() - t0 - t_init, plan)
        if progress is not None:
            progress(len(experts))
        return [out[ex.index] for ex in experts]


# The smallest micro-batch an out-of-memory retry goes down to (routed rows over the block).
MIN_RETRY_MICRO_BATCH_ROWS = 1024


class _StepReport:
    """A refiner's on_step for the block's step tracker (or none): the steps of earlier chunks are added, and the
    tracker is told at most once a second, after a device synchronisation, so its rates and ETAs are the device's
    (the host otherwise runs ahead of a CUDA queue) at no cost to a step."""

    EVERY_S = 1.0

    def __init__(self, tracker, steps_before: int, steps: int, device: torch.device, share: float = 1.0):
        self.tracker, self.before, self.steps, self.device = tracker, steps_before, steps, device
        self.share = share  # of a planned chunk's steps this refiner's steps count for (an out-of-memory retry's part)
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
        self.tracker.update(self.before + round(self.share * done), self.rows_before + round(self.share * rows))
        self.told = time.monotonic()
