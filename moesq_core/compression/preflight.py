"""Before a blockwise stage starts: will the disk under the work dir hold its calibration states?

A stage embeds every calibration sequence once and keeps the states through the whole block loop
(engine.run_stage). What exceeds the cache limit (--cache-gb) spills to files under `<workdir>/cache/`, and the
resume checkpoint (state_checkpoint.StateCheckpoint) writes a full copy there, two while a new save replaces the
last. At the paper's calibration
(1,152 sequences × 4,096 tokens of a 2048-wide model in bf16: 18 GiB per copy) that is ~50 GiB at peak with the
default cache, so a stage checks it before it writes anything rather than fail an hour in with a full disk.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from moesq_core.memory import size

GiB = 1 << 30
# Kept free on top of the states' need, for the stage's other writes (block artifacts, logs), which are not counted.
DISK_MARGIN_FRACTION = 0.05
DISK_MARGIN_MIN_BYTES = 1 << 30
# A larger --cache-gb is suggested only while its states take at most this much of the memory available where
# they live: the model's weights and the methods' working memory need the rest.
MEMORY_FRACTION = 0.5
# The cache limit where the host does not say how much memory it has (auto_cache_limit_bytes).
DEFAULT_CACHE_BYTES = 4 * GiB


class StatesDiskError(ValueError):
    """The disk under the work dir cannot hold a stage's calibration states; raised before anything is written.
    A ValueError, so the CLI shows its one-line message as the error."""


@dataclass(frozen=True)
class CalibrationStates:
    """The calibration states of one blockwise stage, as engine.run_stage holds them.

    `sequences`: the calibration splits' sequence counts (train, init, val); `stage_splits`: the splits the stage
    embeds, one StateStore each, in run_stage's order, where "a+b" is splits a and b concatenated (refine's
    "train+init"). Each batch of `batch_size` sequences is one chunk of [batch, seq_len, hidden_size] elements of
    `dtype_bytes` bytes (the last batch may be shorter), and each of the `world_size` ranks holds all of them."""

    sequences: Mapping[str, int]
    stage_splits: tuple[str, ...]
    seq_len: int
    hidden_size: int
    dtype_bytes: int
    batch_size: int
    world_size: int = 1

    def split_sequences(self, split: str) -> int:
        return sum(int(self.sequences[part]) for part in split.split("+"))

    def chunk_bytes(self, split: str) -> list[int]:
        """Bytes of each chunk (batch) of a stage split's store, in order."""
        n, b = self.split_sequences(split), self.batch_size
        per_sequence = self.seq_len * self.hidden_size * self.dtype_bytes
        return [min(b, n - i) * per_sequence for i in range(0, n, b)]

    @property
    def copy_bytes(self) -> int:
        """All stage splits' states once (what one resume checkpoint file holds)."""
        return sum(sum(self.chunk_bytes(s)) for s in self.stage_splits)

    def with_sequences(self, split: str, n: int) -> "CalibrationStates":
        """The same stage with calibration split `split` (e.g. "train": --n-train) at n sequences."""
        return replace(self, sequences={**self.sequences, split: n})


@dataclass(frozen=True)
class StatesFootprint:
    """What a stage's calibration states take (bytes): `copy` is every stage split once; `spilled` the part of
    one copy past the cache limit (one rank's stores' spill files); `memory` one rank's stores' peak in memory,
    on the device the states are on (the CPU, or the GPU the model runs on); `disk` the peak the stage adds under
    the work dir's cache/, all ranks and the resume checkpoint together (see `states_footprint`)."""

    copy: int
    spilled: int
    memory: int
    disk: int


def _store_bytes(chunks: Sequence[int], limit: int) -> tuple[int, int]:
    """(in memory, spilled) of a StateStore with `limit` after appending `chunks` in order: a chunk stays in
    memory when it fits what is left under the limit, else it is appended to the spill file (StateStore.append)."""
    in_memory = spilled = 0
    for nbytes in chunks:
        if in_memory + nbytes <= limit:
            in_memory += nbytes
        else:
            spilled += nbytes
    return in_memory, spilled


def states_footprint(states: CalibrationStates, cache_limit_bytes: int,
                     saved_states_bytes: int = 0) -> StatesFootprint:
    """The calibration states' memory and disk over a stage, counted as engine.run_stage and StateCheckpoint
    hold them. Each stage split has a store of limit cache_limit_bytes // len(stage_splits) on every rank, whose
    chunks past the limit go to a spill file under cache/<stage>-rank<r>/. The disk peak is the largest of:

    - a layer's propagation of split s: every rank's stores' spill, plus a second spill of s (the new store fills
      while the old one is still open) and, under expert parallel (world_size > 1), the rank's own-batch store
      of s (map_batches: its batches i ≡ rank mod world, same limit); plus the checkpoint file on disk then;
    - a checkpoint save (main rank, after a propagation): every rank's stores' spill, the new checkpoint file
      written next to the previous one (removed only once the new one is complete), and the other ranks'
      own-batch stores as they route the next block meanwhile;
    - resuming from saved states (only when there are some, `saved_states_bytes` > 0): every rank's embedded
      stores and the stores loaded from the file (the embedded ones are closed after the load), and the file.

    `saved_states_bytes` (this stage's checkpoint files on disk now) are already off the free space: they are
    counted as the checkpoint copy they are until the first save replaces them, and subtracted from the peak.
    A checkpoint save and propagation are assumed to happen (any model with two or more MoE blocks, a stage
    longer than the save interval); on a model with one MoE block the count is an upper bound.

    The memory peak is one rank's stores in memory during a propagation (all stores, plus the new store and the
    own-batch store of the split being propagated), or while resuming both sets of stores. Not counted: the
    routed MoE inputs a block gathers (the methods' working memory) and the stage's block artifacts."""
    world = states.world_size
    splits = states.stage_splits
    limit = cache_limit_bytes // len(splits)  # run_stage's limit per store
    copy = states.copy_bytes
    store = {s: _store_bytes(states.chunk_bytes(s), limit) for s in splits}
    # each rank's own-batch store per split (map_batches under expert parallel; none on a single process)
    own = {s: [_store_bytes(states.chunk_bytes(s)[r::world], limit) if world > 1 else (0, 0) for r in range(world)]
           for s in splits}
    memory_all = sum(m for m, _ in store.values())
    spilled_all = sum(sp for _, sp in store.values())
    checkpoint_held = max(saved_states_bytes, copy)  # the file on disk: the one there now until a save replaces it

    propagation = max(world * spilled_all + sum(store[s][1] + own[s][r][1] for r in range(world)) + checkpoint_held
                      for s in splits)
    routing_ahead = sum(max(own[s][r][1] for s in splits) for r in range(1, world))
    checkpoint_save = world * spilled_all + copy + checkpoint_held + routing_ahead
    resume = 2 * world * spilled_all + saved_states_bytes if saved_states_bytes else 0
    disk = max(propagation, checkpoint_save, resume) - saved_states_bytes

    memory = max(memory_all + store[s][0] + own[s][r][0] for s in splits for r in range(world))
    if saved_states_bytes:
        memory = max(memory, 2 * memory_all)
    return StatesFootprint(copy=copy, spilled=spilled_all, memory=memory, disk=disk)


def disk_margin_bytes(need: int) -> int:
    return max(DISK_MARGIN_MIN_BYTES, math.ceil(DISK_MARGIN_FRACTION * need))


def fits_disk(need: int, free: int) -> bool:
    return need + disk_margin_bytes(need) <= free


def free_disk_bytes(path: Path) -> int:
    """Free bytes (for this user) on the file system `path` will be on: that of its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def saved_states_bytes(cache_dir: Path, stage: str) -> int:
    """Bytes of a stage's resume checkpoint files in `cache_dir` (StateCheckpoint's <stage>-states-L*.bin)."""
    return sum(f.stat().st_size for f in Path(cache_dir).glob(f"{stage}-states-L*.bin") if f.is_file())


def _gb_option(nbytes: int) -> str:
    return f"{nbytes / GiB:g}"


def largest_fitting_sequences(states: CalibrationStates, split: str, cache_limit_bytes: int, free: int,
                              saved_bytes: int = 0) -> int | None:
    """The most sequences of calibration split `split` (1 .. its count now) whose states fit `free` at this cache
    limit, or None when not even one does (the disk need grows with the sequences: a bisection)."""
    def fits(n: int) -> bool:
        return fits_disk(states_footprint(states.with_sequences(split, n), cache_limit_bytes, saved_bytes).disk, free)

    lo, hi = 0, int(states.sequences[split])  # fits(lo) (or lo == 0); the answer is < hi when hi does not fit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo or None


def smallest_fitting_cache_gb(states: CalibrationStates, cache_limit_bytes: int, free: int,
                              saved_bytes: int = 0) -> int | None:
    """The smallest whole --cache-gb above the current limit at which the states fit `free`, or None when no
    cache limit does (the checkpoint copies alone are too big for the disk)."""
    # enough for every store to hold its split entirely: a larger cache changes nothing on disk
    every_split_in_memory = len(states.stage_splits) * max(sum(states.chunk_bytes(s)) for s in states.stage_splits)
    for gb in range(math.floor(cache_limit_bytes / GiB) + 1, math.ceil(every_split_in_memory / GiB) + 1):
        if fits_disk(states_footprint(states, gb * GiB, saved_bytes).disk, free):
            return gb
    return None


def _option(split: str) -> str:
    return f"--n-{split}"  # the calibrate option that sets a split's sequences: --n-train, --n-init, --n-val


def check_states_fit(states: CalibrationStates, cache_limit_bytes: int, cache_dir: Path, *, stage: str,
                     sized_split: str, saved_bytes: int = 0, disk_free_bytes: int | None = None,
                     memory_available_bytes: int | None = None, memory_device: str = "cpu") -> str:
    """A one-line summary of what the stage's calibration states take, if the disk under `cache_dir` (the work
    dir's cache/, where the spill and the resume checkpoint go) holds them with a margin (5 % of the need, at
    least 1 GiB); else raises StatesDiskError naming the need, the free space and what would fit: the largest
    `sized_split` count (its --n-<split> option, in a new work dir) at this --cache-gb, and the smallest
    --cache-gb whose states take at most MEMORY_FRACTION of `memory_available_bytes` (the memory of
    `memory_device`, where the in-memory states live; None: unknown, not checked).

    disk_free_bytes: the free bytes to compare with; None measures them (free_disk_bytes of cache_dir).
    saved_bytes: this stage's checkpoint files on disk now (saved_states_bytes). Writes nothing."""
    free = free_disk_bytes(cache_dir) if disk_free_bytes is None else disk_free_bytes
    need = states_footprint(states, cache_limit_bytes, saved_bytes)
    cache_gb = _gb_option(cache_limit_bytes)
    ranks = f" on each of {states.world_size} ranks" if states.world_size > 1 else ""
    memory_per_host = states.world_size if memory_device == "cpu" else 1  # ranks share the host, not GPUs
    summary = (f"calibration states: {size(need.copy)} per copy; up to {size(need.memory)} in {memory_device} "
               f"memory{ranks} (--cache-gb {cache_gb}), ~{size(need.disk)} on disk under {cache_dir} "
               f"({size(free)} free)")
    if fits_disk(need.disk, free):
        return summary

    fixes = []
    gb = smallest_fitting_cache_gb(states, cache_limit_bytes, free, saved_bytes)
    if gb is None:
        fixes.append("no --cache-gb (the resume checkpoint alone takes two copies while it is saved)")
    else:
        peak = states_footprint(states, gb * GiB, saved_bytes).memory * memory_per_host
        if memory_available_bytes is None:
            fixes.append(f"--cache-gb {gb} (~{size(peak)} of {memory_device} memory; available memory unknown)")
        elif peak <= MEMORY_FRACTION * memory_available_bytes:
            fixes.append(f"--cache-gb {gb} (~{size(peak)} of the {size(memory_available_bytes)} of {memory_device} "
                         "memory available)")
        else:
            fixes.append(f"not --cache-gb {gb}: it would take ~{size(peak)} of {memory_device} memory, more than "
                         f"{MEMORY_FRACTION:.0%} of the {size(memory_available_bytes)} available")
    option = _option(sized_split)
    n = largest_fitting_sequences(states, sized_split, cache_limit_bytes, free, saved_bytes)
    fixes.append(f"{option} {n} at --cache-gb {cache_gb} (in a new --workdir: this one's calibration is fixed)"
                 if n is not None else f"no {option} at --cache-gb {cache_gb}")
    margin = disk_margin_bytes(need.disk)
    raise StatesDiskError(
        f"stage {stage}: its calibration states ({size(need.copy)} per copy) need ~{size(need.disk)} of disk under "
        f"{cache_dir} at peak (the part past --cache-gb {cache_gb} spills, twice while a layer propagates, and the "
        f"resume checkpoint is saved next to its previous copy), but {size(free)} is free there, less a margin of "
        f"{size(margin)} ({DISK_MARGIN_FRACTION:.0%}, at least {size(DISK_MARGIN_MIN_BYTES)}); what fits: "
        f"{'; '.join(fixes)}; or {size(need.disk + margin)} free there, or a --workdir on a larger disk")


def auto_cache_limit_bytes(states: CalibrationStates, memory_available_bytes: int | None,
                           saved_bytes: int = 0) -> int:
    """The default cache limit (--cache-gb), a whole number of GiB: every stage split in memory when their peak
    (`states_footprint`'s memory, a propagation's old and new stores) takes at most MEMORY_FRACTION of the host
    memory available, else the largest that does (0: everything spills); DEFAULT_CACHE_BYTES when the system does
    not say how much memory it has."""
    if memory_available_bytes is None:
        return DEFAULT_CACHE_BYTES
    room = MEMORY_FRACTION * memory_available_bytes / states.world_size  # the ranks share the host
    everything = len(states.stage_splits) * max(sum(states.chunk_bytes(s)) for s in states.stage_splits)
    if states_footprint(states, everything, saved_bytes).memory <= room:
        return math.ceil(everything / GiB) * GiB  # a whole --cache-gb; more than the states changes nothing
    lo, hi = 0, math.ceil(everything / GiB)  # whole GiB; the footprint grows with the limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if states_footprint(states, mid * GiB, saved_bytes).memory <= room else (lo, mid)
    return lo * GiB


class StatesPlan(NamedTuple):
    """What `check_stage_states` decided: its summary line and the cache limit the stage runs with."""

    line: str
    cache_limit_bytes: int


def check_stage_states(ledger, splits: Sequence[str], calib: Mapping, model, *, batch_size: int,
                       cache_limit_bytes: int | None, sized_split: str,
                       disk_free_bytes: int | None = None) -> StatesPlan:
    """check_states_fit for a stage about to run engine.run_stage(model, ..., calib, spec, ledger) (the stage's
    StageLedger) with its compress and validation splits `splits` and spec.batch_size: the states' width and dtype
    are the model's input embeddings' (what enters layer 0), the world size torch.distributed's; their memory is
    the host's (engine.STATES_HOME), whatever device the model runs on. `cache_limit_bytes` None: sized from the
    host's available memory (`auto_cache_limit_bytes`). Returns the summary line and the limit; writes nothing."""
    from moesq_core.compression import distributed
    from moesq_core.memory import available_memory_bytes

    embedding = model.get_input_embeddings().weight
    dist = distributed.active()
    states = CalibrationStates(
        sequences={k: len(v) for k, v in calib.items()}, stage_splits=tuple(splits),
        seq_len=int(calib[splits[0]].shape[1]), hidden_size=int(embedding.shape[-1]),
        dtype_bytes=embedding.element_size(), batch_size=batch_size,
        world_size=dist.get_world_size() if dist else 1)
    # run_stage's spill dirs (cache/<stage>-rank<r>), StateCheckpoint's
    cache_dir, stage = ledger.cache_dir, ledger.name
    saved = saved_states_bytes(cache_dir, stage)
    available = available_memory_bytes()
    auto = cache_limit_bytes is None
    if auto:
        cache_limit_bytes = auto_cache_limit_bytes(states, available, saved)
    line = check_states_fit(states, cache_limit_bytes, cache_dir, stage=stage, sized_split=sized_split,
                            saved_bytes=saved, disk_free_bytes=disk_free_bytes,
                            memory_available_bytes=available, memory_device="cpu")
    if auto:
        line = line.replace(f"(--cache-gb {_gb_option(cache_limit_bytes)})",
                            f"(--cache-gb auto: {_gb_option(cache_limit_bytes)})", 1)
    return StatesPlan(line, cache_limit_bytes)
