"""Calibration states saved between blocks, so a resumed stage starts where it stopped.

Without them a resumed stage re-runs every finished block's decoder layer over all calibration states to
rebuild the next block's inputs: on a 48-layer, full-width model that is ~6 s per finished block on an H200, and
a stage resumed after 40 blocks spends minutes before it computes anything. The engine saves the states after a
block's propagation at most every `every_s` seconds; a resumed run loads the latest one whose finished blocks are
still the manifest's (same checksums), installs those blocks without running them, and goes on from there.

One raw file of the chunks (streamed, so host memory holds one chunk at a time) and a JSON record written after
it (atomic), which is what makes the file count: chunk table, checksum of the raw file, the blocks it follows
and what else fixes the states (batch size, the calibration tokens). Files are moesq's own, in the work dir's
cache, and removed when the stage finishes. The engine saves on a thread of its own while the next block
computes (`save_in_background`; a full-width model's 18 GiB took ~27 s, every other block).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time

import numpy as np
import torch

from moesq_core.compression.workdir import StageLedger, atomic_path, write_json_atomic
from moesq_core.paths import inside

log = logging.getLogger("moesq.engine")

EVERY_S = 60.0  # at most one save a minute: a save is ~0.5 s per GB of states, a resume loses < a minute
SAVE_COST_RATIO = 20  # and at most one per 20 × the last save's duration (StateCheckpoint.due)


def _tokens_digest(calib: dict[str, torch.Tensor], splits: list[str]) -> str:
    h = hashlib.sha256()
    for s in splits:
        t = calib[s].detach().cpu().contiguous()
        h.update(f"{s}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StateCheckpoint:
    """The saved states of one stage (rank-independent: every rank holds the same states)."""

    def __init__(self, ledger: StageLedger, calib: dict[str, torch.Tensor], splits: list[str], batch_size: int,
                 every_s: float = EVERY_S):
        self.ledger, self.stage, self.splits, self.every_s = ledger, ledger.name, list(splits), every_s
        self.dir = ledger.cache_dir
        self.record_path = self.dir / f"{self.stage}-states.json"
        self.key = {"batch_size": batch_size, "splits": self.splits, "tokens": _tokens_digest(calib, splits)}
        self.last_save = time.monotonic()
        self.last_seconds = 0.0  # how long the last save took
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()

    # -- a save on its own thread ------------------------------------------------------------------------------
    def save_in_background(self, layer: int, moe_layers: list[int], stores: dict) -> None:
        """`save` on a thread of its own, so that the next block computes while the states are written. The
        stores must stay as they are until `wait()` returns (the engine waits before the next propagation
        replaces them); use the checkpoint as a context manager so that the stage's end waits for the save and
        an error or interrupt cancels it (its half-written file is removed)."""
        self.wait()

        def run():
            try:
                self.save(layer, moe_layers, stores)
            except _Cancelled:
                log.info("%s: saving the calibration states after layer %d cancelled", self.stage, layer)
            except BaseException as e:  # re-raised by wait(), in the stage's thread
                self._error = e

        self._thread = threading.Thread(target=run, name=f"moesq-{self.stage}-save-states", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for a save started by save_in_background; its error, if any, is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def cancel(self) -> None:
        """Stop a save in progress at its next chunk (its file is not kept) and wait for it."""
        if self._thread is not None:
            self._cancel.set()
            self._thread.join()
            self._thread = None
            self._cancel.clear()
        self._error = None

    def __enter__(self) -> "StateCheckpoint":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
        else:
            self.cancel()

    def _blocks(self, upto: int) -> dict[str, str]:
        return {str(k): sha256 for k, sha256 in self.ledger.blocks().items() if k <= upto}

    # -- save ------------------------------------------------------------------------------------------------
    def due(self) -> bool:
        """Whether a save is due: `every_s` since the last one (0: after every block), and at least
        SAVE_COST_RATIO × the last save's own duration, so saving takes at most ~1/SAVE_COST_RATIO of the stage (a
        full-width model's 18 GiB of states at the paper's calibration take ~40 s to write: after every 6-minute
        block that was a tenth of the run)."""
        elapsed = time.monotonic() - self.last_save
        return elapsed >= self.every_s and (self.every_s == 0 or elapsed >= SAVE_COST_RATIO * self.last_seconds)

    def save(self, layer: int, moe_layers: list[int], stores: dict) -> None:
        """The states entering layer `layer` + 1, after the finished MoE blocks up to `layer`."""
        blocks = self._blocks(layer)
        if sorted(int(k) for k in blocks) != [li for li in moe_layers if li <= layer]:
            return  # a block up to here is not recorded (yet): nothing consistent to save
        t0 = time.perf_counter()
        raw = self.dir / f"{self.stage}-states-L{layer:03d}.bin"
        chunks, h, offset = [], hashlib.sha256(), 0
        with atomic_path(raw) as tmp, open(tmp, "wb") as f:
            for s in self.splits:
                for i in range(len(stores[s])):
                    if self._cancel.is_set():
                        raise _Cancelled
                    t = stores[s].stored(i)  # as kept (host memory or the spill file), not via its device
                    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    f.write(memoryview(b))
                    h.update(memoryview(b))
                    chunks.append({"split": s, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                   "offset": offset, "nbytes": int(b.nbytes)})
                    offset += int(b.nbytes)
        write_json_atomic(self.record_path, {**self.key, "layer": layer, "blocks": blocks, "file": raw.name,
                                             "sha256": h.hexdigest(), "bytes": offset, "chunks": chunks})
        self._remove_files(keep=raw.name)  # the previous save (and any a kill left unrecorded)
        self.last_save = time.monotonic()
        self.last_seconds = time.perf_counter() - t0
        log.info("%s: calibration states after layer %d saved for resuming (%.2f GB in %.1f s)", self.stage, layer,
                 offset / 1e9, time.perf_counter() - t0)

    # -- load ------------------------------------------------------------------------------------------------
    def _record(self) -> dict | None:
        try:
            return json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None

    def load(self, make_store, device: torch.device) -> tuple[int, dict] | None:
        """(layer, {split: store}) of the saved states if they still follow the manifest's blocks, else None."""
        rec = self._record()
        if rec is None:
            return None
        why = None
        if any(rec.get(k) != v for k, v in self.key.items()):
            why = "other calibration sequences or batch size"
        elif rec.get("blocks") != self._blocks(int(rec["layer"])):
            why = "the blocks it follows were recomputed or removed"
        raw = inside(self.dir, rec.get("file"), f"{self.record_path} file")
        if why is None and (not raw.is_file() or raw.stat().st_size != rec["bytes"]):
            why = "its file is missing or truncated"
        if why is None:
            h = hashlib.sha256()
            with open(raw, "rb") as f:
                while b := f.read(1 << 24):
                    h.update(b)
            if h.hexdigest() != rec["sha256"]:
                why = "checksum mismatch"
        if why is not None:
            log.info("%s: saved calibration states not used (%s); recomputing them", self.stage, why)
            return None
        stores = {s: make_store() for s in self.splits}
        for c in rec["chunks"]:
            dtype = getattr(torch, c["dtype"])
            if c["nbytes"] == 0:
                t = torch.empty(c["shape"], dtype=dtype)
            else:
                mm = np.memmap(raw, dtype=np.uint8, mode="c", offset=c["offset"], shape=(c["nbytes"],))
                t = torch.from_numpy(mm).view(dtype).reshape(c["shape"]).clone()
            stores[c["split"]].append(t.to(device))
        return int(rec["layer"]), stores

    def _remove_files(self, keep: str | None = None) -> None:
        for f in self.dir.glob(f"{self.stage}-states-L*.bin"):  # our names only
            if f.name != keep:
                f.unlink(missing_ok=True)

    def remove(self) -> None:
        self.record_path.unlink(missing_ok=True)
        self._remove_files()


class _Cancelled(Exception):
    """A background save stopped by StateCheckpoint.cancel."""
