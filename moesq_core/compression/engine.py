"""The blockwise loop of Algorithm 1: for each MoE block in order, route the current calibration
states once, gather each expert's routed tokens X, router weights w (and the dense targets through
ExpertData), compress the experts, install the compressed block, and run it to produce the next block's
inputs, so every block sees the error of the compressed prefix.

Resumable: each finished block is an artifact recorded (with its checksum) in the work dir manifest; a
re-run loads finished blocks, installs them and propagates, and compresses from the first unfinished one.
Expert-parallel: under torch.distributed, rank r compresses experts e with e % world == r; every rank holds
the same (replicated) calibration states, so each owner sees all tokens routed to its experts, and the
results are all-gathered so every rank installs the same block. The decoder-layer passes over the states
(attention up to the MoE input for routing, the whole layer for propagation) are split by batch: each rank
computes every world-th batch and broadcasts it, so every rank ends with the tensors one process computes.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moesq_core.compression import distributed
from moesq_core.compression.kernels.gather_quant_triton import gather_quant
from moesq_core.compression.methods import base as methods_base
from moesq_core.compression.methods.base import (
    PROJECTIONS,
    BlockRows,
    CompressedExpert,
    ExpertData,
    Method,
    TokenRows,
    as_tensor,
    row_amax,
    row_count,
    rows_slice,
)
from moesq_core.compression.state_checkpoint import EVERY_S, StateCheckpoint
from moesq_core.compression.workdir import (
    LAYOUT,
    StageLedger,
    StaleStageError,
    WorkDir,
    WorkDirError,
    atomic_path,
    disk_errors,
)
from moesq_core.formats import Format, QuantizedWeight, packing
from moesq_core.memory import (
    HOST_CHUNK_BYTES,
    consecutive_chunks,
    device_available_bytes,
    release_device_cache,
    release_freed_memory,
)
from moesq_core.models import MoEAdapter, MoEBlock, load_model
from moesq_core.progress import BlockProgress, NullProgress, note, skip
from moesq_core.serving.experts import MoesqExperts

log = logging.getLogger("moesq.engine")


class _Stop(Exception):
    pass


# -- calibration state storage ------------------------------------------------------------------------
@dataclass(frozen=True)
class SpilledChunk:
    """A chunk of hidden states in the store's spill file: `nbytes` raw bytes at `offset`."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class HeldChunk:
    """A chunk of hidden states kept in memory away from the device it was computed on (`device`); `copied`: the
    event after which an asynchronous copy into it has landed (None: it is there)."""

    tensor: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None = None

    def host(self) -> torch.Tensor:
        """The tensor, once its copy has landed (host code may read it)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.tensor


# GPU states held in host memory go to page-locked (pinned) memory, copied asynchronously both ways: pageable copies
# are slower and stop the host until they end. Off, or where pinning fails: pageable copies.
PIN_HELD_STATES = True


def _held(t: torch.Tensor, home: torch.device) -> HeldChunk:
    """t copied to `home` as a HeldChunk: from a GPU to pinned host memory asynchronously where it can."""
    t = t.detach()
    if PIN_HELD_STATES and t.is_cuda and home.type == "cpu":
        try:
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: a pageable copy
            pass
        else:
            dst.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return HeldChunk(dst, t.device, event)
    return HeldChunk(t.to(home), t.device)


class StateStore:
    """Per-batch hidden-state chunks; chunks beyond `limit_bytes` go to one append-only spill file that is read
    back memory-mapped (pages come in as a chunk is used and the OS may drop them again), so memory stays at
    `limit_bytes` whatever the calibration size. `home`: where the chunks kept in memory live (None: where they
    were computed); a GPU stage keeps them in host memory, which is larger and which the block's work does not
    need. A chunk always comes back on the device it was computed on."""

    def __init__(self, limit_bytes: int, spill_dir: Path | None, home: torch.device | str | None = None):
        self.limit = limit_bytes
        self.spill_dir = spill_dir
        self.home = None if home is None else torch.device(home)
        self.chunks: list[torch.Tensor | HeldChunk | SpilledChunk] = []
        self.in_memory = 0
        self.spill_path: Path | None = None
        self.spilled = 0

    def append(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.in_memory + nbytes <= self.limit or self.spill_dir is None:
            self.chunks.append(t if self.home is None or t.device == self.home else _held(t, self.home))
            self.in_memory += nbytes
            return
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        with disk_errors(self.spill_dir):
            if self.spill_path is None:
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                fd, path = tempfile.mkstemp(suffix=".states", dir=self.spill_dir)
                os.close(fd)
                self.spill_path = Path(path)
            with open(self.spill_path, "ab") as f:
                f.write(raw.tobytes())
        self.chunks.append(SpilledChunk(self.spilled, nbytes, tuple(t.shape), t.dtype, t.device))
        self.spilled += nbytes

    def __len__(self) -> int:
        return len(self.chunks)

    def _read(self, c: SpilledChunk, device: torch.device | None = None) -> torch.Tensor:
        import numpy as np

        device = c.device if device is None else device
        if c.nbytes == 0:
            return torch.empty(c.shape, dtype=c.dtype, device=device)
        # copy-on-write map: lazily paged in, never written back; back to the device the states came from
        mm = np.memmap(self.spill_path, dtype=np.uint8, mode="c", offset=c.offset, shape=(c.nbytes,))
        return torch.from_numpy(mm).view(c.dtype).reshape(c.shape).to(device)

    def stored(self, i: int) -> torch.Tensor:
        """Chunk i where the store keeps it (host memory for a spilled or held chunk), not moved to its device."""
        c = self.chunks[i]
        if isinstance(c, SpilledChunk):
            return self._read(c, torch.device("cpu"))
        return c.host() if isinstance(c, HeldChunk) else c

    def __iter__(self):
        for i in range(len(self.chunks)):
            yield self[i]

    def __getitem__(self, i: int) -> torch.Tensor:
        c = self.chunks[i]
        if isinstance(c, SpilledChunk):
            return self._read(c)
        if isinstance(c, HeldChunk):
            if c.copied is not None:  # the copy back starts after the copy in, whichever stream is current
                torch.cuda.current_stream(c.device).wait_event(c.copied)
            return c.tensor.to(c.device, non_blocking=c.copied is not None)
        return c

    def like(self, i: int) -> torch.Tensor:
        """An uninitialised tensor of chunk i's shape, dtype and device (without reading a spilled chunk)."""
        c = self.chunks[i]
        if isinstance(c, torch.Tensor):
            return torch.empty_like(c)
        t = c.tensor if isinstance(c, HeldChunk) else c
        return torch.empty(t.shape, dtype=t.dtype, device=c.device)

    def close(self) -> None:
        if self.spill_path is not None:
            self.spill_path.unlink(missing_ok=True)
            self.spill_path = None
        self.chunks, self.spilled, self.in_memory = [], 0, 0


# Where a stage keeps the calibration states it holds in memory (--cache-gb): host memory, also for a GPU stage,
# whose device memory goes to the block's work (preflight.py counts them there).
STATES_HOME = torch.device("cpu")


@dataclass
class StageSpec:
    """What one blockwise stage does. `method_for_block(layer_index)` returns the method for that block
    (refinement's init reads the init stage's artifact of the same block)."""

    name: str
    fmt: Format
    method_for_block: Callable[[int], Method]
    config: dict
    compress_split: str = "init"
    val_split: str | None = "val"
    act_quant: bool = True
    batch_size: int = 8
    cache_limit_bytes: int = 4 << 30
    # What lowers this stage's memory (option names), for the out-of-memory message.
    memory_options: tuple[str, ...] = ("--batch-size", "--cache-gb")
    # Seconds between saves of the calibration states for resuming (StateCheckpoint; 0: after every block).
    resume_every_s: float = EVERY_S
    # A step after the last block (refinement's end-to-end tuning): finalize(model, adapter, ledger, progress)
    # runs on the main process once every block is saved, before the stage is marked done; it returns a
    # summary and may rewrite the stage's blocks (StageLedger.replace_blocks).
    finalize: Callable | None = None


class StageOutOfMemoryError(RuntimeError):
    """The device ran out of memory during a stage; its finished blocks are saved (a re-run resumes)."""


# -- artifacts -----------------------------------------------------------------------------------------
def is_timing_key(key: str) -> bool:
    return key.startswith("seconds") or key.endswith("_seconds")


def split_timings(info: dict) -> tuple[dict, dict]:
    """(info without wall-clock timings, the timings): artifacts must be byte-identical between runs, so
    timings (keys named seconds* / *_seconds, at any depth) go to the manifest's block record instead."""
    clean, timings = {}, {}
    for k, v in info.items():
        if is_timing_key(str(k)):
            timings[k] = v
        elif isinstance(v, dict):
            c, t = split_timings(v)
            clean[k] = c
            if t:
                timings[k] = t
        else:
            clean[k] = v
    return clean, timings


def _stacked(fmt_name: str, qws: list[QuantizedWeight]) -> QuantizedWeight:
    """One QuantizedWeight [E, out, in] of the experts' weights of one projection (the packers' stacked form)."""
    return QuantizedWeight(fmt_name, torch.stack([q.codes for q in qws]), torch.stack([q.scales.float() for q in qws]),
                           torch.stack([q.global_scale.float().reshape(1, 1) for q in qws]),
                           torch.stack([q.mask.bool() for q in qws]))


def _expert(qw: QuantizedWeight, e: int) -> QuantizedWeight:
    """Expert e of a stacked QuantizedWeight, as a method returns it (a scalar global scale)."""
    return QuantizedWeight(qw.format, qw.codes[e], qw.scales[e], qw.global_scale[e].reshape(()), qw.mask[e])


PACK_CHUNK_BYTES = 64 << 20  # of a block's results stacked for packing at a time (see pack_block)


def pack_block(results: list[CompressedExpert], act_amax_in: torch.Tensor, act_amax_mid: torch.Tensor,
               device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], str]:
    """(tensors, metadata) of a block's artifact: per projection, the experts' weights stacked and packed by the
    format's packer (`<proj>.<packed suffix>`, [E, ...]), the activation ranges and each expert's info. Latent
    values are not stored (refinement computes its init inside the block loop). Packing (integer bit work) runs
    on `device`: the same bytes on any device, seconds less per full-width block on a GPU."""
    fmt = results[0].gate.format
    tensors: dict[str, torch.Tensor] = {"act_amax_in": act_amax_in.float().contiguous(),
                                        "act_amax_mid": act_amax_mid.float().contiguous()}
    # Packed a chunk of experts at a time into preallocated outputs (the packers work per expert along the
    # stack's first dimension, so the bytes are the whole stack's): a stacked copy of the whole block's codes
    # and masks would double the block's results in host memory.
    proj_weights = results[0].gate.codes.numel()
    chunks = consecutive_chunks(range(len(results)), [proj_weights * RESULT_BYTES_PER_WEIGHT] * len(results),
                                PACK_CHUNK_BYTES)
    for proj in PROJECTIONS:
        for chunk in chunks:
            packed = packing.pack(_stacked(fmt, [results[e].weights()[proj].to(device) for e in chunk]))
            for suffix, t in packed.items():
                name = f"{proj}.{suffix}"
                if name not in tensors:
                    tensors[name] = torch.empty((len(results), *t.shape[1:]), dtype=t.dtype)
                tensors[name][chunk[0] : chunk[-1] + 1].copy_(t)  # from `device`
            del packed
    # One metadata key: safetensors stores metadata as a hash map whose key order is not stable, and the
    # artifact's checksum must be (resume is checked by comparing checksums).
    meta = json.dumps({"layout": LAYOUT, "format": fmt, "num_experts": len(results),
                       "info": {str(e): r.info for e, r in enumerate(results)}}, sort_keys=True, default=float)
    return tensors, meta


def write_block(path: Path, tensors: dict[str, torch.Tensor], meta: str) -> None:
    """A block artifact's bytes (`pack_block`'s tensors and metadata) written to `path` as is: callers write
    through StageLedger.record_block / write_artifact or atomic_path, which make it atomic."""
    save_file(tensors, str(path), metadata={"moesq": meta})


def save_block(path: Path, results: list[CompressedExpert], act_amax_in: torch.Tensor, act_amax_mid: torch.Tensor,
               device: torch.device | str = "cpu") -> None:
    """The block's artifact (see `pack_block`), written atomically."""
    with atomic_path(path) as tmp:
        write_block(tmp, *pack_block(results, act_amax_in, act_amax_mid, device))


class BlockWriter:
    """Writes a block's artifact and records it in the manifest on one background thread, so the file write and
    its checksum (~1.3 s per full-width block) overlap the next block's install and propagation. At most one
    write is pending: `wait` before the next block's compression keeps host memory bounded by one block, and
    before anything that reads the manifest's blocks (a states save, the stage's end). A failed write raises at
    the next `wait`."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moesq-block-writer")
        self._pending = None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()
        self._pending = self._pool.submit(fn)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish the pending write (a block computed before an error or a stop is kept), then stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "BlockWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _take_expert_timings(results: list[CompressedExpert]) -> dict[str, dict]:
    """Each expert's timings ({expert: timings}, for the manifest), removed from its info (the artifact's)."""
    timings = {}
    for e, r in enumerate(results):
        r.info, t = split_timings(r.info or {})
        if t:
            timings[str(e)] = t
    return timings


def _block_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("moesq", "{}"))


def block_info(path: Path) -> dict[str, dict]:
    """Each expert's info in a block artifact (its metadata only, no tensors read)."""
    return _block_meta(path).get("info", {})


def load_block(path: Path) -> tuple[list[CompressedExpert], torch.Tensor, torch.Tensor]:
    meta = _block_meta(path)
    if meta.get("layout") != LAYOUT:  # the work dir's layout, also recorded in the artifact itself
        raise StaleStageError(
            f"{path} is a block artifact in work-dir layout {meta.get('layout', 1)} (an older moesq's); this moesq "
            f"reads layout {LAYOUT}: re-run its stage to recompute it")
    sd = load_file(str(path))
    fmt, n, info = meta["format"], int(meta["num_experts"]), meta["info"]
    stacked = {}
    for proj in PROJECTIONS:
        prefix = f"{proj}."
        stacked[proj] = packing.unpack(fmt, {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)},
                                       f"{path.name}:{proj}")
    out = [CompressedExpert(*(_expert(stacked[p], e) for p in PROJECTIONS), None, info.get(str(e), {}))
           for e in range(n)]
    return out, sd["act_amax_in"], sd["act_amax_mid"]


def install_block(block: MoEBlock, fmt: Format, results: list[CompressedExpert], amax_in, amax_mid,
                  act_quant: bool, device) -> None:
    # dequantized where the model computes (exact elementwise arithmetic: the same values as on the CPU)
    weights = [{p: w.to(device) for p, w in r.weights().items()} for r in results]
    module = MoesqExperts.from_quantized(fmt, weights, act_quant, amax_in, amax_mid)
    if torch.device(device).type == "cuda":  # propagation's bf16 matmuls (MoesqExperts' batched path)
        module.set_factored(weights)
    block.set_experts(module.to(device))


# -- the loop --------------------------------------------------------------------------------------------
def _dist():
    return distributed.active()


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, tokens: torch.Tensor, batch_size: int, store: StateStore) -> dict:
    """Hidden states entering decoder layer 0 for each batch of `tokens`, and the keyword arguments the
    model passes to its layers (position embeddings, mask), keyed by batch size."""
    layers = model.model.layers
    kwargs_by_bs: dict[int, dict] = {}
    captured = {}

    def hook(mod, args, kwargs):
        captured["h"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    h = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        for i in range(0, len(tokens), batch_size):
            batch = tokens[i : i + batch_size].to(device)
            try:
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
            store.append(captured["h"])
            kwargs_by_bs.setdefault(len(batch), captured["kw"])
    finally:
        h.remove()
    return kwargs_by_bs


@torch.no_grad()
def map_batches(fn: Callable[[torch.Tensor], torch.Tensor], store: StateStore, what: str):
    """fn(states) for each batch of `store`, in order; fn keeps the shape and dtype (a decoder-layer pass).
    Under expert parallel each rank computes the batches i ≡ rank (mod world) and receives the others from
    their owner: every rank gets the tensors one process computes, for 1/world of the work."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        for h in store:
            yield fn(h)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    # this rank's results until their turn (spilled past the limit)
    own = StateStore(store.limit, store.spill_dir, store.home)
    for i in range(rank, len(store), world):
        h = store[i]
        out = fn(h)
        if out.shape != h.shape or out.dtype != h.dtype:
            raise RuntimeError(f"{what}: a batch pass changed the states' shape or dtype")
        own.append(out)
    try:
        for i in range(len(store)):
            t = own[i // world].contiguous() if i % world == rank else store.like(i)
            distributed.broadcast(t, i % world, f"{what}: batch {i}")
            yield t
    finally:
        own.close()


@torch.no_grad()
def _moe_inputs(layer: nn.Module, mlp: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Run a decoder layer up to its MoE block and return the block's input (post-attention-norm states)."""
    got = {}

    def hook(mod, args):
        got["x"] = args[0]
        raise _Stop

    h = mlp.register_forward_pre_hook(hook)
    try:
        layer(hidden, **kwargs)
    except _Stop:
        pass
    finally:
        h.remove()
    return got["x"]


def split_on_oom(fn: Callable[[torch.Tensor, dict], torch.Tensor], h: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """fn(h, kwargs) for a batch of sequences h [B, T, H] (a decoder-layer pass: sequences are independent); out of
    device memory, the batch is freed and run as two halves (the kwargs' tensors of batch size B sliced alike) and
    the results concatenated, down to one sequence (then the error stands)."""
    try:
        return fn(h, kwargs)
    except torch.OutOfMemoryError:
        if h.shape[0] <= 1:
            raise
    release_device_cache()
    half = h.shape[0] // 2
    log.warning("out of device memory running %d sequences through a layer; retrying them in two halves", h.shape[0])

    def part(sl: slice) -> dict:
        return {k: v[sl] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == h.shape[0] else
                tuple(t[sl] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == h.shape[0] else t for t in v)
                if isinstance(v, tuple) else v for k, v in kwargs.items()}

    return torch.cat([split_on_oom(fn, h[:half], part(slice(None, half))),
                      split_on_oom(fn, h[half:], part(slice(half, None)))])


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()  # an autograd graph kept across layers would grow with depth
def propagate(layer: nn.Module, store: StateStore, kwargs_by_bs: dict, spill: Path | None, what: str) -> StateStore:
    """The states after decoder layer `layer` for every batch of `store`, in a new store of the same limit."""
    new = StateStore(store.limit, spill, STATES_HOME)
    for out in map_batches(lambda h: split_on_oom(lambda hs, kw: _layer_out(layer(hs, **kw)), h,
                                                  kwargs_by_bs[h.shape[0]]), store, what):
        new.append(out)
    return new


@dataclass
class RoutedRows:
    """A block's routed calibration rows, each token's MoE-block input held once (not once per expert it
    reaches: top-8 routing would hold every row 8 times, 275 GB in fp32 for 4M tokens of a 2048-wide model).

    x: [T, H] every token's MoE-block input in the states' dtype; tokens[e] / weights[e]: the tokens routed to
    expert e (indices into x, token order) and the router weights the block applies to its output, for the
    experts gathered (empty for the others); counts: every expert's row count."""

    x: torch.Tensor
    tokens: list[torch.Tensor]
    weights: list[torch.Tensor]
    counts: tuple[int, ...]

    def rows(self, e: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's rows (fp32) and router weights, on `device` (default where x is)."""
        device = self.x.device if device is None else device
        return TokenRows(self.x, self.tokens[e]).materialize(device), self.weights[e].to(device)

    def row_count(self, e: int) -> int:
        return len(self.tokens[e])


ROWS_GPU_FRACTION = 0.5  # of the free device memory, for a block's per-token MoE inputs (else they wait on the host)


@torch.no_grad()
def gather_experts(block: MoEBlock, states: StateStore, kwargs_by_bs: dict,
                   experts: list[int] | None = None, stage: str = "routing") -> RoutedRows:
    """The block's MoE inputs for every calibration token and, for `experts` (default all), the tokens routed to
    each and their router weights; every expert's row count. Rows come in token order, as `(index == e).nonzero()`
    gives them, from one stable sort of the routed slots per batch (not a pass per expert). The inputs stay on
    the device the states are on while they take at most ROWS_GPU_FRACTION of its free memory, else they go to
    the host."""
    E = block.num_experts
    wanted = set(range(E) if experts is None else experts)
    parts: list[torch.Tensor] = []
    tokens: list[list[torch.Tensor]] = [[] for _ in range(E)]
    ws: list[list[torch.Tensor]] = [[] for _ in range(E)]
    total = [0] * E
    offset, on_host, kept = 0, False, 0
    moe_inputs = map_batches(lambda h: split_on_oom(lambda hs, kw: _moe_inputs(block.layer, block.mlp, hs, kw), h,
                                                    kwargs_by_bs[h.shape[0]]), states,
                             f"{stage}: routing layer {block.layer_index}")
    for x in moe_inputs:
        x = x.reshape(-1, x.shape[-1])
        idx, wts = block.route(x)
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order within each
        counts = torch.bincount(flat, minlength=E).tolist()
        start = 0
        for e, n in enumerate(counts):
            total[e] += n
            if n and e in wanted:
                sel = order[start : start + n]
                tokens[e].append(sel // k + offset)
                ws[e].append(wts.reshape(-1)[sel].float())
            start += n
        offset += x.shape[0]
        if not on_host and x.is_cuda:
            kept += x.numel() * x.element_size()
            if kept > device_available_bytes(x.device) * ROWS_GPU_FRACTION:
                parts, on_host = [p.cpu() for p in parts], True
        parts.append(x.cpu() if on_host else x)
    empty = torch.zeros(0, dtype=torch.int64)
    return RoutedRows(torch.cat(parts) if parts else torch.zeros(0, block.dense_experts.gate_up_proj.shape[-1]),
                      [torch.cat(t) if t else empty for t in tokens],
                      [torch.cat(w) if w else torch.zeros(0) for w in ws], tuple(total))


def amax_pass_bytes(H: int, inter: int, rows: int | None = None) -> int:
    """Peak transient bytes of one piece of `expert_activation_amax` over `rows` rows: the gathered fp32 rows, their
    quantized copy (4 + 4 bytes per row and hidden unit), the gate/up output, the SwiGLU output and its
    magnitudes (16 bytes per row and intermediate unit); default: a piece of methods.base.ROW_PIECE rows."""
    return (methods_base.ROW_PIECE if rows is None else rows) * (8 * H + 16 * inter)


def installed_block_bytes(experts: int, H: int, inter: int) -> int:
    """Device bytes of a compressed block installed for propagation (MoesqExperts on a GPU: dequantized fp32 gate/up
    and down weights and their bf16 factored values, 6 bytes per weight, and fp32 row factors)."""
    return experts * 3 * inter * H * 6 + experts * (2 * inter + H) * 4


def propagation_bytes(tokens: int, top_k: int, H: int, inter: int) -> int:
    """Peak transient bytes of one batch of `tokens` tokens through a decoder layer with its compressed block
    installed (MoesqExperts' batched path): the routed rows in fp32 twice (gathered and weighted, 8 bytes per routed
    row and hidden unit), its expert chunks (MoesqExperts.BATCH_BYTES of padded rows, ~6 copies: quantized input,
    gate/up output, SwiGLU output and its quantized copy, output) and the layer's hidden states (~16 bytes per token
    and hidden unit: attention's input, output and residual in fp32)."""
    return tokens * top_k * H * 8 + 6 * MoesqExperts.BATCH_BYTES * max(1, (2 * inter) // H) + tokens * H * 16


@torch.no_grad()
def expert_activation_amax(fmt: Format, result: CompressedExpert, x, act_quant: bool,
                           device: torch.device | str | None = None,
                           token_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Static activation ranges of one expert (for the calibrated activation global scales): amax of its routed
    inputs x (TokenRows of the block's token matrix, or a tensor [n, H]) and of its SwiGLU output with the
    compressed gate/up weights, computed on `device` (default where x is); zeros when no calibration token
    reached it. `token_amax` [T]: each token's amax (methods.base.row_amax of x's token matrix), which gives the
    input range without reading the rows. The rows go methods.base.ROW_PIECE at a time (every operation is
    row-wise and amax is exact, so the pieces give the numbers of one pass over all rows); a piece that runs out
    of device memory is retried in halves. Rows of a token matrix on `device` under a static input scale are
    gathered and input-quantized in one pass (gather_quant_triton where it runs; the same numbers)."""
    n = row_count(x)
    if n == 0:
        return torch.zeros(()), torch.zeros(())
    device = (x.tokens if isinstance(x, TokenRows) else x).device if device is None else torch.device(device)

    def piece(a: int, b: int) -> torch.Tensor:
        return as_tensor(rows_slice(x, a, b), device)

    if token_amax is not None and isinstance(x, TokenRows):
        amax_in = token_amax[x.idx.to(token_amax.device)].amax()
    else:
        amax_in = torch.zeros((), device=device)
        for a, b, rows in _pieces(n, lambda a, b: piece(a, b).abs().amax()):
            torch.maximum(amax_in, rows, out=amax_in)
    amax_in = amax_in.float().cpu()
    module = MoesqExperts.from_quantized(fmt, [result.weights()], act_quant, amax_in.reshape(1), None).to(device)
    g_in = module._global(module.act_global_in[0])
    gate_up = module.gate_up_proj[0].T
    gathered = act_quant and g_in is not None and isinstance(x, TokenRows) and x.tokens.device == device

    def quantized(a: int, b: int) -> torch.Tensor:
        if gathered:
            idx = x.idx[a:b].to(device)[None]
            return gather_quant(fmt.act, x.tokens, idx, torch.ones_like(idx, dtype=torch.bool), g_in.reshape(1, 1, 1),
                                torch.float32, with_x=False)[1][0]
        xs = piece(a, b)
        return fmt.quant_act(xs, g_in) if act_quant else xs

    def mid(a: int, b: int) -> torch.Tensor:
        gate, up = (quantized(a, b) @ gate_up).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).abs().amax()

    amax_mid = torch.zeros((), device=device)
    for a, b, m in _pieces(n, mid):
        torch.maximum(amax_mid, m, out=amax_mid)
    return amax_in, amax_mid.float().cpu()


def _pieces(n: int, fn: Callable[[int, int], torch.Tensor], rows: int | None = None):
    """(a, b, fn(a, b)) over rows [0, n) in pieces of `rows`; a piece that runs out of device memory is freed and
    retried in halves (down to one row, then the error stands), with a warning."""
    rows = methods_base.ROW_PIECE if rows is None else rows
    todo = [(a, min(a + rows, n)) for a in range(0, n, rows)]
    while todo:
        a, b = todo.pop(0)
        try:
            out = fn(a, b)
        except torch.OutOfMemoryError:
            if b - a <= 1:
                raise
            release_device_cache()
            half = (a + b) // 2
            log.warning("out of device memory over %d rows; retrying them in two halves", b - a)
            todo[:0] = [(a, half), (half, b)]
            continue
        yield a, b, out


FEW_ROWS = 16  # routed calibration rows below which an expert's result rests on a handful of tokens (said in the log)
# What the one-shot methods do with such experts (methods/rtn.py fallback_no_tokens; the Hessian methods' damping);
# a method that does otherwise says so in its `few_rows_fallback`.
ONE_SHOT_FEW_ROWS = ("those without get round-to-nearest on the magnitude pattern, the others the method on their "
                     "few rows (damped)")


def few_rows_line(layer: int, counts: tuple[int, ...], fallback: str = ONE_SHOT_FEW_ROWS) -> str | None:
    """The log line about a block's experts the calibration routed no or few (< FEW_ROWS) training rows to, and
    what they get instead (`fallback`); None when every expert got enough."""
    none = sum(1 for c in counts if c == 0)
    few = sum(1 for c in counts if 0 < c < FEW_ROWS)
    if not none and not few:
        return None
    return (f"layer {layer}: {none} of {len(counts)} experts got no calibration tokens, {few} fewer than {FEW_ROWS}: "
            f"{fallback}")


def fill_missing_amax(amax_in: torch.Tensor, amax_mid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert no calibration token reached still needs a static range to serve with: borrow the block's
    largest (no saturation, at worst coarser steps for that expert)."""
    for a in (amax_in, amax_mid):
        a[a == 0] = a.max()
    return amax_in, amax_mid


def run_stage(model: nn.Module, adapter: MoEAdapter, calib: dict[str, torch.Tensor], spec: StageSpec,
              ledger: StageLedger, progress=None, redo_from: int | None = None) -> dict:
    """Run (or resume) one blockwise stage through its ledger (the work dir's `ledger(spec.name)`); returns a
    summary. The model's experts end up replaced by the stage's compressed experts. Out of device memory, it
    raises StageOutOfMemoryError naming the block and the options that lower memory (the finished blocks stay
    saved)."""
    if ledger.name != spec.name:
        raise ValueError(f"stage {spec.name!r} run through the ledger of stage {ledger.name!r}")
    where: dict = {"layer": None, "moe": False}  # where the loop is, for the out-of-memory message
    try:
        return _run_stage(model, adapter, calib, spec, ledger, progress, redo_from, where)
    except torch.OutOfMemoryError as e:
        li = where["layer"]
        at = where.get("at") or ("while embedding the calibration set" if li is None
              else f"in block {li} (layer {li})" if where["moe"] else f"in layer {li}")
        cause = (str(e).splitlines() or [""])[0][:200]
        raise StageOutOfMemoryError(
            f"stage {spec.name}: out of device memory {at} ({cause}); lower {', '.join(spec.memory_options)}, "
            f"then re-run the same command: the finished blocks are saved and it resumes from there") from e


def _run_stage(model, adapter, calib, spec: StageSpec, ledger: StageLedger, progress, redo_from, where: dict) -> dict:
    """run_stage's work; keeps `where` at the layer it is on."""
    progress = progress or NullProgress()
    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    is_main = rank == 0
    blocks = {b.layer_index: b for b in adapter.blocks(model)}
    if redo_from is not None and not 0 <= redo_from <= max(blocks):
        raise ValueError(f"--redo-from {redo_from}: the model's MoE blocks are layers {min(blocks)}..{max(blocks)}")

    def open_stage():
        ledger.open(spec.config, num_blocks=len(blocks))
        if redo_from is not None and is_main:
            ledger.drop_blocks_from(redo_from)

    distributed.main_first(open_stage)  # the other ranks then only check the stage's config
    for b in blocks.values():  # every stage starts from the dense model
        b.restore_dense()
    device = next(model.parameters()).device
    layers = model.model.layers
    last_moe = max(blocks)
    splits = [spec.compress_split] + ([spec.val_split] if spec.val_split else [])
    spill = ledger.cache_dir / f"{spec.name}-rank{rank}"
    stores, kwargs_by_bs = {}, {}
    with progress.task(f"{spec.name}: embedding calibration", len(splits)) as t:
        for s in splits:
            stores[s] = StateStore(spec.cache_limit_bytes // len(splits), spill, STATES_HOME)
            kwargs_by_bs.update(capture_layer_inputs(model, calib[s], spec.batch_size, stores[s]))
            t.advance()
    saved = StateCheckpoint(ledger, calib, splits, spec.batch_size, spec.resume_every_s)
    resumed = saved.load(lambda: StateStore(spec.cache_limit_bytes // len(splits), spill, STATES_HOME), device)
    resumed_after = -1
    if resumed is not None:
        resumed_after, loaded = resumed
        for s in splits:
            stores[s].close()
        stores = loaded
        log.info("%s: resuming after layer %d from its saved calibration states (the finished blocks up to it are "
                 "installed, not run)", spec.name, resumed_after)
    computed, seconds, t_stage = 0, 0.0, time.perf_counter()
    clock = PhaseClock(device)
    finished = ledger.blocks()
    todo = [li for li in blocks if li not in finished]
    block_times: list[float] = []  # seconds of each block computed now
    with BlockWriter() as writer, saved, progress.task(f"{spec.name}: blocks", len(blocks)) as tblocks:
        for li, layer in enumerate(layers):
            if li > last_moe:
                break
            block = blocks.get(li)
            where.update(layer=li, moe=block is not None)
            before = dict(clock.seconds)
            if block is not None:
                path = ledger.verified_block(li)
                if path is not None:
                    results, amax_in, amax_mid = load_block(path)
                    log.info("%s: block %d already done, loaded %s", spec.name, li, path.name)
                    skip(tblocks)  # a loaded block: done, but no measure of the time per block
                else:
                    t0 = time.perf_counter()
                    clock.mark("other")
                    writer.wait()  # the previous block's write: one block's results in host memory at a time
                    clock.mark("write")
                    # the time per block the stage ETA uses: the later blocks' (the first carries the warm-up)
                    per_block = (sum(block_times[1:]) / (len(block_times) - 1) if len(block_times) > 1
                                 else block_times[0] if block_times else None)
                    results, amax_in, amax_mid = _compress_block(block, spec, stores, kwargs_by_bs, progress, dist,
                                                                 clock, len([b for b in todo if b > li]), per_block)
                    seconds += time.perf_counter() - t0
                    log.info("%s: layer %d, %d experts compressed in %.1f s (rank %d of %d)", spec.name, li,
                             len(results), time.perf_counter() - t0, rank, world)
                    timings = _take_expert_timings(results)
                    if is_main:
                        packed = pack_block(results, amax_in, amax_mid, device)
                        record = dict(extra={"experts": len(results)},
                                      timings={"seconds": round(time.perf_counter() - t0, 2),
                                               **({"experts": timings} if timings else {})})
                        writer.submit(lambda li=li, packed=packed, record=record: ledger.record_block(
                            li, lambda tmp: write_block(tmp, *packed), **record))
                        del packed  # the writer holds it until written
                        release_freed_memory()  # packing's stacked copies, before the install's dequantized block
                    clock.mark("write")
                    distributed.barrier(f"{spec.name}: block {li} done")
                    clock.mark("wait")
                    computed += 1
                    block_s = time.perf_counter() - t0
                    block_times.append(block_s)
                    if computed == 1 and is_main:
                        first_s = block_s
                        _note_estimate(progress, spec.name, [b for b in todo if b > li], block_s)
                    elif computed == 2 and is_main and abs(block_s - first_s) > ESTIMATE_REVISE * first_s:
                        # the first block carries the process's warm-up (compilation: 61 s against 18 s per
                        # block on a full-width refine), so its estimate can be several times too long
                        _note_estimate(progress, spec.name, [b for b in todo if b > li], block_s, revised=True)
                    tblocks.advance()
                install_block(block, spec.fmt, results, amax_in, amax_mid, spec.act_quant, device)
                del results  # the block's artifact is packed and its experts installed
                clock.mark("install")
                _log_peaks(clock, spec.name, li)  # before the propagation: a run stopped there keeps them
            if resumed_after < li < last_moe:
                saved.wait()  # a save of the states entering this layer reads them until it is done
                clock.mark("save states")
                for s in splits:
                    new = propagate(layer, stores[s], kwargs_by_bs, spill, f"{spec.name}: propagating layer {li}")
                    stores[s].close()
                    stores[s] = new
                clock.mark("propagate")
                if is_main and block is not None and saved.due():
                    writer.wait()  # the save follows the manifest's blocks up to this one
                    saved.save_in_background(li, sorted(blocks), stores)  # written while the next block computes
                    clock.mark("save states")
            if block is not None and li < last_moe:
                # propagated (or resumed past): on a lazily opened model nothing runs it again
                block.release_installed()
            release_freed_memory()  # the block's freed per-expert tensors, back to the system
            if block is not None and li > resumed_after:
                log.info("%s: layer %d phases (s): %s", spec.name, li,
                         {k: round(v - before.get(k, 0.0), 2) for k, v in clock.seconds.items()
                          if v > before.get(k, 0.0)})
                _log_peaks(clock, spec.name, li)
                if world > 1:  # what expert parallel cost this rank for the block (its routing, results, propagation)
                    log.info("%s: layer %d expert-parallel traffic (rank %d of %d): %s", spec.name, li, rank, world,
                             distributed.take_traffic().line())
    for s in stores.values():
        s.close()
    summary = {"blocks": len(blocks), "computed_now": computed, "compress_seconds": round(seconds, 2),
               "phase_seconds": clock.rounded()}
    if spec.finalize is not None:
        where["at"] = "in the step after the last block"
        if is_main:
            t0 = time.perf_counter()
            summary["finalize"] = {**spec.finalize(model, adapter, ledger, progress),
                                   "seconds": round(time.perf_counter() - t0, 2)}
        distributed.barrier(f"{spec.name}: finalized")
    summary.update(stage_seconds=round(time.perf_counter() - t_stage, 2), world_size=world)
    log.info("%s: done, %s", spec.name, summary)
    if is_main:
        ledger.finish(summary)
        saved.remove()
    distributed.barrier(f"{spec.name}: finishing")
    return summary


def _log_peaks(clock: "PhaseClock", stage: str, layer: int) -> None:
    """The peak GPU memory of the phases since the last such line (a block's work, then its propagation)."""
    peaks = clock.take_peaks()
    if peaks:
        log.info("%s: layer %d peak GPU memory per phase (GiB allocated, reserved): %s", stage, layer, peaks)


class PhaseClock:
    """Seconds per phase of the block loop, summed over blocks, and on a GPU each phase's peak device memory
    (torch's allocated and reserved bytes, the latest block's: `take_peaks`). The device is synchronised at each
    mark, so GPU work is charged to the phase that queued it (a few synchronisations per block)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.t = torch.device(device), {}, time.perf_counter()
        self.peaks: dict[str, tuple[int, int]] = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def mark(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            got = (torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device))
            old = self.peaks.get(phase, (0, 0))
            self.peaks[phase] = (max(old[0], got[0]), max(old[1], got[1]))
            torch.cuda.reset_peak_memory_stats(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.t
        self.t = now

    def take_peaks(self) -> dict[str, list[float]]:
        """{phase: [peak allocated, peak reserved] GiB} since the last call (none off a GPU)."""
        out = {k: [round(a / 2**30, 2), round(r / 2**30, 2)] for k, (a, r) in self.peaks.items()}
        self.peaks = {}
        return out

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.seconds.items()}


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


ESTIMATE_MIN_SECONDS = 10.0  # shorter remainders are over before an estimate could help anyone


ESTIMATE_REVISE = 0.25  # a second block this much faster or slower than the first revises the estimate


def _note_estimate(progress, stage: str, remaining: list[int], seconds: float, revised: bool = False) -> None:
    """Before the long part of a stage: the blocks still to compute × the first block's measured time (or the
    second's, when it differs: `revised`)."""
    if remaining and len(remaining) * seconds >= ESTIMATE_MIN_SECONDS:
        n = len(remaining)
        note(progress, f"stage {stage}: ~{n} block{'s' if n > 1 else ''} × {seconds:.1f} s/block ≈ "
                       f"{_duration(n * seconds)} remaining{' (revised after the second block)' if revised else ''}")


def _compress_block(block: MoEBlock, spec: StageSpec, stores, kwargs_by_bs, progress, dist, clock: PhaseClock,
                    blocks_after: int = 0, seconds_per_block: float | None = None):
    """One block: route the calibration states, compress this rank's experts (chunk by chunk), gather every
    rank's; (results, amax_in, amax_mid). `blocks_after` and `seconds_per_block` feed the stage ETA that a
    long method's progress shows (BlockProgress)."""
    E = block.num_experts
    H = block.dense_experts.gate_up_proj.shape[-1]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    mine = [e for e in range(E) if e % world == rank]
    if not mine:
        raise ValueError(f"{world} processes for the {E} experts of layer {block.layer_index}: "
                         f"use at most {E} (--nproc)")
    # Each rank gathers the routed rows of its own experts only.
    routed = gather_experts(block, stores[spec.compress_split], kwargs_by_bs, mine, spec.name)
    held = gather_experts(block, stores[spec.val_split], kwargs_by_bs, mine, spec.name) if spec.val_split else None
    rows = BlockRows(block.layer_index, routed.counts, held.counts if held else None)
    clock.mark("route")
    method = spec.method_for_block(block.layer_index)
    few = few_rows_line(block.layer_index, routed.counts, getattr(method, "few_rows_fallback", ONE_SHOT_FEW_ROWS))
    if few is not None and rank == 0:
        (log.warning if 0 in routed.counts else log.info)("%s: %s", spec.name, few)
    inter = block.dense_experts.down_proj.shape[-1]
    dev = next(block.mlp.gate.parameters()).device  # methods run where the model is
    results_mine, amax_mine = [], []
    # One token matrix for both splits: every expert's rows (training and held-out) are indices into it, so a
    # method can hold the whole block's calibration once (methods/base.py TokenRows).
    tokens = routed.x if held is None else torch.cat([routed.x, held.x.to(routed.x.device)])
    val_offset = routed.x.shape[0]
    train_idx, train_w = routed.tokens, routed.weights
    val_idx, val_w = (held.tokens, held.weights) if held is not None else (None, None)
    del routed, held  # only `tokens` holds the rows now
    token_amax = row_amax(tokens)  # the experts' input ranges without reading their rows
    with progress.task(f"{spec.name}: layer {block.layer_index} experts", len(mine)) as t:
        report = BlockProgress(progress, t.advance, spec.name, block.layer_index, blocks_after, seconds_per_block)
        # Experts whose dense fp32 weights fit the device together are compressed together; a larger block
        # (Kimi-K2: 68 GB of fp32 weights) goes chunk by chunk, which gives the same bytes: methods size
        # everything from the whole block's row counts (ExpertData.block), exactly as under expert parallel.
        for chunk in dense_weight_chunks(mine, inter, H, dev):
            data = []
            for e in chunk:
                w = block.expert_weights(e)
                for proj, tw in w.items():
                    spec.fmt.check_weight(tw, f"layer {block.layer_index} expert {e} {proj}")
                x = TokenRows(tokens, train_idx[e].to(tokens.device))
                wts = train_w[e].to(w["gate"].device)
                xv = wv = None
                if val_idx is not None:
                    xv = TokenRows(tokens, val_idx[e].to(tokens.device) + val_offset)
                    wv = val_w[e].to(w["gate"].device)
                data.append(ExpertData(e, w["gate"], w["up"], w["down"], x, wts, xv, wv, block=rows))
            clock.mark("weights")
            results = method.compress_block(data, spec.fmt, report)
            clock.mark("compress")
            amax_mine += [expert_activation_amax(spec.fmt, r, d.x, spec.act_quant, dev, token_amax)
                          for r, d in zip(results, data)]
            for r in results:  # to the host chunk by chunk: a Kimi-K2 block's codes and masks alone are 34 GB
                r.latent = None  # not stored, and not worth gathering across ranks (fp32 per weight)
                _results_to_cpu(r)
            results_mine += results
            clock.mark("ranges")
            del data, results
            release_freed_memory()  # the chunk's dense copies and the method's working memory
    del tokens
    by_e = {e: (r, a) for e, r, a in zip(mine, results_mine, amax_mine)}
    if dist:
        by_e = _gather_results(by_e, E, world, spec.name, block.layer_index, next(block.mlp.gate.parameters()).device)
    for r, _ in by_e.values():
        _results_to_cpu(r)  # the other ranks' arrive on this rank's device
    clock.mark("gather")
    results = [by_e[e][0] for e in range(E)]
    amax_in = torch.stack([by_e[e][1][0] for e in range(E)])
    amax_mid = torch.stack([by_e[e][1][1] for e in range(E)])
    return results, *fill_missing_amax(amax_in, amax_mid)


_QW_FIELDS = ("codes", "scales", "global_scale", "mask")


def _results_to_cpu(r) -> None:
    for qw in r.weights().values():
        for name in _QW_FIELDS:
            setattr(qw, name, getattr(qw, name).cpu())


WEIGHTS_GPU_FRACTION = 0.4  # of the free device memory, for a chunk's dense fp32 weights and results
RESULT_BYTES_PER_WEIGHT = 6  # a method's result on the device until the chunk ends: codes, mask, fp32 latent


def dense_weight_chunks(experts: list[int], inter: int, H: int, device: torch.device) -> list[list[int]]:
    """A block's experts in consecutive chunks compressed together: on a GPU as many as fit WEIGHTS_GPU_FRACTION
    of its free memory with their results (the routed rows are the block's one token matrix, already
    allocated; the method's working memory takes the rest), on the CPU as many as fit HOST_CHUNK_BYTES (the
    whole block's dense fp32 copy would be twice its checkpoint's bf16 experts); at least one expert a chunk."""
    need = [3 * inter * H * (4 + RESULT_BYTES_PER_WEIGHT)] * len(experts)
    budget = device_available_bytes(device) * WEIGHTS_GPU_FRACTION if device.type == "cuda" else HOST_CHUNK_BYTES
    return consecutive_chunks(experts, need, budget)


def _gather_results(by_e: dict, E: int, world: int, stage: str, layer: int, device: torch.device) -> dict:
    """Every rank's compressed experts and activation ranges on every rank. The weights travel as raw tensors
    (expert e sits on rank e % world; ranks holding fewer experts pad with a copy of their first), the small
    per-expert info as objects: pickling a full-width block's weights through the collective cost seconds."""
    from moesq_core.compression.methods.base import CompressedExpert

    mine = sorted(by_e)
    per = -(-E // world)
    order = mine + [mine[0]] * (per - len(mine))  # the same tensor shapes on every rank
    tensors = []
    for e in order:
        r, (a_in, a_mid) = by_e[e]
        tensors += [getattr(r.weights()[p], f) for p in PROJECTIONS for f in _QW_FIELDS]
        tensors.append(torch.stack([a_in, a_mid]))  # host tensors, like the weights now; the collective moves them
    parts = distributed.all_gather_tensors(tensors, device, f"{stage}: gathering block {layer}")
    infos = distributed.all_gather_object([(e, by_e[e][0].info, by_e[e][0].gate.format) for e in mine],
                                          f"{stage}: gathering block {layer} (info)")
    out = {}
    step = len(PROJECTIONS) * len(_QW_FIELDS) + 1
    for rank, (flat, info) in enumerate(zip(parts, infos)):
        for i, (e, inf, fmt) in enumerate(info):
            chunk = flat[i * step : (i + 1) * step]
            qws = [QuantizedWeight(fmt, *chunk[j * len(_QW_FIELDS) : (j + 1) * len(_QW_FIELDS)])
                   for j in range(len(PROJECTIONS))]
            out[e] = (CompressedExpert(*qws, None, inf), (chunk[-1][0].cpu(), chunk[-1][1].cpu()))
    return out


def load_workdir_model(workdir: str | Path, stage: str, device="cpu", dtype=torch.float32,
                       act_quant: bool | None = None):
    """(model, tokenizer): the source model with each block's experts replaced by `stage`'s compressed ones."""
    wd = WorkDir(workdir)
    identity, ledger = wd.identity(), wd.ledger(stage)
    if not (ledger.record() or {}).get("done"):
        raise WorkDirError(f"stage {stage!r} is not finished in {workdir}")
    model, tok, adapter, _ = load_model(identity.model_path, dtype=dtype, device=device)
    fmt = identity.format
    act_quant = identity.act_quant if act_quant is None else act_quant
    for block in adapter.blocks(model):
        results, amax_in, amax_mid = load_block(ledger.verified_block(block.layer_index))
        install_block(block, fmt, results, amax_in, amax_mid, act_quant, device)
    return model.eval(), tok  # the installed expert modules too
