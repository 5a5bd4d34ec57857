"""The work directory: one per run. A manifest records the normalised run config, the model fingerprint
(config + the sha256 of every weight file, or the Hub revision) and a checksum for every artifact; artifacts
are written atomically (temp file + rename), so an interrupted stage resumes at its first unfinished block and
a work dir made for another model or config is refused. One process at a time: `locked()` takes an exclusive
fcntl lock on the work dir (a second process gets WorkDirLocked) and removes temp files that an interrupted
run left behind.

WorkDir creates, locks and checks the work dir and owns its manifest. The run's identity (model, format,
activation quantization, calibration) is read from the manifest once, typed and validated (RunIdentity); each
stage reads and writes its blocks through its StageLedger (open, verified block, record block, finish), which
is all the block loop, refinement's end-to-end step and export see of the work dir.

Layout (version LAYOUT, recorded in the manifest and in every stage record):
    manifest.json                 moesq version, layout, model {source, fingerprint}, config, calibration,
                                  stages {name: {config, layout, blocks {N: {file, sha256}}, block_timings, done, runs}}
    calib/calibration.safetensors token splits (train / val / init)
    stages/<stage>/block_NNN.safetensors   one artifact per MoE block: its experts packed by the format's packer,
                                  activation ranges, per-expert info (no timings: byte-deterministic)
    logs/moesq.log
    .moesq.lock                   the lock file (holds the pid of the process using the work dir)

A stage recorded in another layout (an older moesq's) is never read: reading it raises StaleStageError, and
running the stage again recomputes it from scratch.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moesq_core.paths import inside
from moesq_core.version import __version__

if TYPE_CHECKING:  # imported where used: the work dir is read before torch is needed
    from moesq_core.compression.calibration import CalibConfig
    from moesq_core.formats import Format

log = logging.getLogger("moesq")

MANIFEST = "manifest.json"
# 1: stage blocks stored unpacked (a code byte and a mask byte per weight, fp32 latents); 2: packed.
LAYOUT = 2
LOCK_FILE = ".moesq.lock"
# atomic_path's temp names: "." + final name + "." + mkstemp's 8 random characters + ".tmp"
_TMP_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
# StateStore's spilled calibration states under cache/<stage>-rank<N>/ (tempfile.mkstemp names; .pt: older moesq's)
_SPILL_NAME = re.compile(r"^tmp[a-z0-9_]{8}\.(?:states|pt)$")


class WorkDirError(RuntimeError):
    """A work dir that cannot be used as asked (other model/config, corrupt artifact). Nothing was changed."""


class WorkDirLocked(WorkDirError):
    """Another process holds the work dir's lock."""


class StaleStageError(WorkDirError):
    """A stage (or block artifact) written in another work-dir layout, by an older moesq: never read."""


class DiskWriteError(RuntimeError):
    """A write that failed for the disk's sake (full, over quota, read-only, not permitted), naming the path and
    what to free or change."""


# errno -> (what happened, what to do), for writes that fail for the disk's sake; safetensors' SafetensorError
# carries only the OS message, so each is also recognised by its strerror
_DISK_ERRORS = {
    errno.ENOSPC: ("no space left on the device", "free space there or use a --workdir / --out on another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or use a --workdir / --out on another disk"),
    errno.EROFS: ("read-only file system", "use a --workdir / --out on a writable file system"),
    errno.EACCES: ("permission denied", "make it writable or use another --workdir / --out"),
    errno.EPERM: ("operation not permitted", "make it writable or use another --workdir / --out"),
}


@contextmanager
def disk_errors(path: Path):
    """Writes under `path` inside this block that fail for the disk's sake raise DiskWriteError, naming `path`,
    the free space on its disk when it is full, and what to free or change; other errors pass unchanged."""
    try:
        yield
    except DiskWriteError:
        raise
    except Exception as e:
        code = getattr(e, "errno", None)
        code = code if code in _DISK_ERRORS else next(
            (c for c in _DISK_ERRORS if os.strerror(c) in str(e)), None)
        if code is None:
            raise
        what, todo = _DISK_ERRORS[code]
        where = Path(getattr(e, "filename", None) or path)
        if code in (errno.ENOSPC, errno.EDQUOT):
            from moesq_core.memory import size

            existing = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
            what += f" ({size(shutil.disk_usage(existing).free)} free)"
        raise DiskWriteError(f"cannot write {where}: {what}; {todo}") from e


def stage_layout(record: dict) -> int:
    """The layout a stage record was written in (records without one predate layout 2)."""
    return int(record.get("layout", 1))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


@contextmanager
def atomic_path(path: Path):
    """Yield a temp path beside `path`; on success fsync and rename it over `path` (never a half file)."""
    path = Path(path)
    with disk_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            yield Path(tmp)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are ordinary files
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON atomically; a non-finite float is refused (ValueError: JSON has no NaN or Infinity)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def user_cache_dir() -> Path:
    """moesq's per-user cache ($MOESQ_CACHE_DIR, else $XDG_CACHE_HOME/moesq, else ~/.cache/moesq)."""
    if os.environ.get("MOESQ_CACHE_DIR"):
        return Path(os.environ["MOESQ_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moesq"


WEIGHT_HASH_CACHE = "weight-sha256.json"


def weight_files_sha256(paths: list[Path]) -> list[str]:
    """sha256 of each weight file, cached in the user cache by (absolute path, size, mtime): a model's weights
    are read once, later runs only stat them. A file rewritten in place gets a new mtime and is hashed again.
    Files not in the cache are hashed in parallel threads (hashlib releases the GIL): a 57 GiB checkpoint of
    49 shards takes seconds on a many-core machine instead of a minute."""
    paths = [Path(p) for p in paths]
    cache_file = user_cache_dir() / WEIGHT_HASH_CACHE
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    keys, stamps, digests = [], [], {}
    for path in paths:
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
        keys.append(key)
        stamps.append(stamp)
        hit = cache.get(key)
        if isinstance(hit, dict) and hit.get("stamp") == stamp:
            digests[key] = hit["sha256"]
    missing = [(k, p, s) for k, p, s in zip(keys, paths, stamps) if k not in digests]
    if missing:
        with ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1, 16))) as pool:
            for (key, _, stamp), digest in zip(missing, pool.map(lambda m: sha256_file(m[1]), missing)):
                digests[key] = digest
                cache[key] = {"stamp": stamp, "sha256": digest}
        try:
            write_json_atomic(cache_file, cache)
        except OSError as e:  # a read-only home only costs re-hashing next time
            log.info("could not update the weight hash cache %s: %s", cache_file, e)
    return [digests[k] for k in keys]


def hub_revision(model_dir: Path) -> str | None:
    """The commit hash of a Hugging Face Hub snapshot dir (…/snapshots/<revision>), else None."""
    model_dir = Path(model_dir)
    if model_dir.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", model_dir.name):
        return model_dir.name
    return None


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json, the tensor index (names, dtypes, shapes) and the weights' content: the sha256
    of every weight file (cached, see weight_files_sha256), or for a Hub snapshot its revision (the Hub's
    files are content-addressed by it). A copy of a model with changed weights has another fingerprint."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    h = hashlib.sha256()
    cfg = json.loads((model_dir / "config.json").read_text())
    h.update(json.dumps(cfg, sort_keys=True).encode())
    revision = hub_revision(model_dir)
    if revision:
        h.update(f"hub-revision:{revision};".encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for name in sorted(sf.keys()):
                sl = sf.get_slice(name)
                h.update(f"{name}:{sl.get_dtype()}:{list(sl.get_shape())};".encode())
    if not revision:
        files = sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("*.bin")])
        for f, digest in zip(files, weight_files_sha256(files)):
            h.update(f"{f.name}:{digest};".encode())
    return h.hexdigest()[:32]


def check_location(root: Path) -> None:
    """Refuse a work dir path that cannot be one (a file, below a file, not writable) before anything is
    written."""
    root = Path(root)
    if root.exists():
        if not root.is_dir():
            raise WorkDirError(f"work dir {root} is a file, not a directory; choose another --workdir")
        if not os.access(root, os.W_OK | os.X_OK):
            raise WorkDirError(f"work dir {root} is not writable; choose another --workdir")
        return
    parent = root.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise WorkDirError(f"work dir {root} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WorkDirError(f"work dir {root} cannot be created: {parent} is not writable")


_HELD: dict[str, list] = {}  # real path -> [lock fd, depth]: the locks this process holds (re-entrant)


class LockHeld(Exception):
    """Another process holds a lock file's lock; pid: the pid it wrote there ("unknown" if none yet)."""

    def __init__(self, pid: str):
        super().__init__(pid)
        self.pid = pid


def take_lock(path: Path) -> int:
    """An exclusive fcntl lock on `path` (created if missing), with this process's pid written into it; returns
    the fd: closing it releases the lock, and so does the process's end, even by SIGKILL. LockHeld (naming the
    holder's pid) at once if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never through a symlink
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise LockHeld(holder) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Config fields that bound memory or pick how the same numbers are computed, not what is computed (chunks of
# experts give the same bytes; micro-batches change only the float summation order; CUDA graphs replay the
# same kernels): a stage resumes or counts as done whatever they were, so the out-of-memory advice "lower it
# and re-run" works on a half-finished stage, and stages recorded before such an option existed still match.
RESOURCE_OPTIONS = frozenset({"micro_batch_rows", "chunk_gb", "cuda_graphs"})


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted((set(old) | set(new)) - RESOURCE_OPTIONS):
        a, b = old.get(k, "<unset>"), new.get(k, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} (work dir) vs {b!r} (now)")
    return out


class WorkDir:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # -- manifest -------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def path_of(self, relpath: object, entry: str) -> Path:
        """The work-dir file a manifest entry names, checked to lie inside the work dir (a crafted manifest
        must not make moesq read or delete files elsewhere)."""
        return inside(self.root, relpath, f"{self.manifest_path} {entry}")

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def load(self) -> dict:
        if not self.exists():
            raise WorkDirError(f"{self.root} is not a moesq work dir (no {MANIFEST}); run `moesq calibrate` first")
        try:
            return json.loads(self.manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise WorkDirError(f"{self.manifest_path} is corrupt ({e}); restore it or start a new work dir") from None

    def save(self, manifest: dict) -> None:
        manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json_atomic(self.manifest_path, manifest)

    # -- lock and cleanup -----------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Refuse (before writing anything) a path that is not a directory moesq may use as a work dir."""
        check_location(self.root)
        if self.root.is_dir() and not self.exists() and any(p.name != LOCK_FILE for p in self.root.iterdir()):
            raise WorkDirError(f"{self.root} exists, is not empty and is not a moesq work dir; "
                               "choose another --workdir")

    @contextmanager
    def locked(self):
        """Hold the work dir's exclusive lock (re-entrant within a process). A second process is refused at
        once with WorkDirLocked naming the holder's pid; the lock goes with the process, even on SIGKILL.
        On taking it, temp files left by an interrupted run are removed (no other process can own them)."""
        key = os.path.realpath(self.root)
        if key in _HELD:
            _HELD[key][1] += 1
            try:
                yield self
            finally:
                _HELD[key][1] -= 1
            return
        self.check_usable()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = take_lock(self.root / LOCK_FILE)
        except LockHeld as e:
            raise WorkDirLocked(f"{self.root} is in use by another moesq process (pid {e.pid}); wait for it to "
                                "finish, or use another --workdir") from None
        _HELD[key] = [fd, 1]
        try:
            self.remove_stale_temp_files()
            yield self
        finally:
            _HELD[key][1] -= 1
            if _HELD[key][1] == 0:
                del _HELD[key]
                os.close(fd)  # releases the lock; the file stays (unlinking a lock file races with waiters)

    def remove_stale_temp_files(self) -> list[Path]:
        """Remove what an interrupted run of moesq left: atomic_path's temp files and spilled calibration
        states. Only moesq's own temp names are touched; call with the lock held."""
        gone = []
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                p = Path(dirpath) / f
                spill = p.parent.parent == self.root / "cache" and _SPILL_NAME.match(f)
                if _TMP_NAME.match(f) or spill:
                    p.unlink(missing_ok=True)
                    gone.append(p)
        if gone:
            log.info("removed %d temp file(s) left by an interrupted run: %s", len(gone),
                     ", ".join(str(p.relative_to(self.root)) for p in gone[:10]))
        return gone

    def check_matches(self, model: dict, config: dict) -> dict:
        """The manifest, after checking the work dir was made for this model (fingerprint) and run config;
        raises WorkDirError naming the differences otherwise. Writes nothing."""
        m = self.load()
        ident = RunIdentity.from_manifest(m, self.manifest_path)
        if ident.model_fingerprint != model["fingerprint"]:
            raise WorkDirError(
                f"{self.root} was made for another model: {ident.model_source} (fingerprint "
                f"{ident.model_fingerprint}); {model['source']} has other weights or config (fingerprint "
                f"{model['fingerprint']}). Use another --workdir for it.")
        problems = _diff(m["config"], config)
        if problems:
            raise WorkDirError(
                f"{self.root} was made with another config:\n  " + "\n  ".join(problems)
                + "\nUse another --workdir (or delete this one)."
            )
        return m

    def init(self, model: dict, config: dict) -> dict:
        """Create, or open and check, the work dir for this model and run-level config. A work dir whose
        calibration never finished (killed or failed) and that has no stage takes the new model and config:
        nothing depends on the old ones."""
        if self.exists():
            m = self.load()
            if "calibration" not in m and not m.get("stages"):
                if m["model"] != model or m["config"] != config:
                    log.info("work dir had no calibration yet: taking the new model/config")
                    m["model"], m["config"] = model, config
                    self.save(m)
                return m
            return self.check_matches(model, config)
        self.check_usable()
        self.root.mkdir(parents=True, exist_ok=True)
        m = {"moesq_version": __version__, "layout": LAYOUT, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "model": model, "config": config, "stages": {}}
        self.save(m)
        return m

    # -- the run's identity and the stages -------------------------------------------------------------
    def identity(self) -> RunIdentity:
        """The run's identity (model, format, activation quantization, calibration), read from the manifest and
        validated: a damaged or incompatible manifest raises one WorkDirError saying so."""
        return RunIdentity.from_manifest(self.load(), self.manifest_path)

    def stage(self, stage: str) -> dict | None:
        """A stage's record in the manifest (None if never run)."""
        return self.load()["stages"].get(stage)

    def ledger(self, stage: str) -> StageLedger:
        """The ledger through which a stage reads and writes its blocks (see StageLedger)."""
        return StageLedger(self, stage)


@dataclass(frozen=True)
class RunIdentity:
    """What a work dir's run is, fixed once it is calibrated: the model (its source as given, its local path, its
    fingerprint), the format, whether activations are quantized, and the calibration (its CalibConfig and its
    source; None in manifests written before the source was recorded). Read once from the manifest
    (`WorkDir.identity`) and validated there; the stages take it typed instead of reading the manifest's dicts."""

    format_name: str
    act_quant: bool
    calib: CalibConfig
    calib_source: str | None
    model_source: str
    model_path: Path
    model_fingerprint: str

    @property
    def format(self) -> Format:
        from moesq_core.formats import get_format

        return get_format(self.format_name)

    @classmethod
    def from_manifest(cls, manifest: Any, where: str | Path = MANIFEST) -> RunIdentity:
        """The identity a manifest records; WorkDirError naming `where` and what is wrong when it cannot be read
        (a missing or mistyped field, an unknown format, an invalid calibration config). Manifests without
        `act_quant` (older moesq's) quantized activations."""
        from moesq_core.compression.calibration import CalibConfig
        from moesq_core.formats import get_format

        def bad(problem: str) -> WorkDirError:
            return WorkDirError(f"{where}: the run's identity cannot be read ({problem}); the manifest is damaged or "
                                "was written by an incompatible moesq: restore it, or start a new work dir")

        if not isinstance(manifest, dict):
            raise bad(f"expected a JSON object, got {type(manifest).__name__}")
        model, config = manifest.get("model"), manifest.get("config")
        for key, value in (("model", model), ("config", config)):
            if not isinstance(value, dict):
                raise bad(f"'{key}' is {'missing' if value is None else 'not an object'}")
        for key in ("source", "path", "fingerprint"):
            if not isinstance(model.get(key), str) or not model[key]:
                raise bad(f"model.{key} is missing or not a string")
        if not isinstance(config.get("format"), str):
            raise bad("config.format is missing or not a string")
        try:
            get_format(config["format"])
        except ValueError as e:
            raise bad(f"config.format: {e}") from None
        act_quant = config.get("act_quant", True)
        if not isinstance(act_quant, bool):
            raise bad(f"config.act_quant must be true or false, got {act_quant!r}")
        calib = config.get("calib", {})
        if not isinstance(calib, dict):
            raise bad("config.calib is not an object")
        try:
            calib = CalibConfig(**calib)
        except (TypeError, ValueError) as e:
            raise bad(f"config.calib: {e}") from None
        source = config.get("calib_source")
        if source is not None and not isinstance(source, str):
            raise bad("config.calib_source is not a string")
        return cls(config["format"], act_quant, calib, source, model["source"], Path(model["path"]),
                   model["fingerprint"])


class StageLedger:
    """One stage's part of the work dir, as a block loop uses it: `open` starts (or resumes) the stage with its
    normalised config, `blocks` / `verified_block` say which blocks are finished and read their artifacts
    (checksum-verified), `record_block` writes a block's artifact atomically and records it, `finish` marks the
    stage done with its summary. Refinement's end-to-end step rewrites a finished loop's blocks
    (`write_artifact`, `replace_blocks`); `--redo-from` forgets blocks (`drop_blocks_from`). Writes need the work
    dir's lock (WorkDir.locked), which the command holding the WorkDir takes."""

    def __init__(self, workdir: WorkDir, name: str):
        self.workdir, self.name = workdir, name

    @property
    def root(self) -> Path:
        return self.workdir.root

    @property
    def dir(self) -> Path:
        """Where the stage's block artifacts are."""
        return self.root / "stages" / self.name

    @property
    def cache_dir(self) -> Path:
        """The work dir's cache: spilled calibration states and the states saved for resuming."""
        return self.root / "cache"

    def record(self) -> dict | None:
        """The stage's record in the manifest (None if never run)."""
        return self.workdir.stage(self.name)

    def blocks(self) -> dict[int, str]:
        """The finished blocks as recorded: {layer: the artifact's sha256}."""
        return {int(k): rec["sha256"] for k, rec in ((self.record() or {}).get("blocks") or {}).items()}

    def _file(self, rec: dict, block: object) -> Path:
        return self.workdir.path_of(rec.get("file"), f"stages.{self.name}.blocks.{block}.file")

    def check_config(self, config: dict) -> dict | None:
        """The stage's record, after checking it was run with this (normalised) config; None if never run (or
        run in another layout: it is recomputed)."""
        st = self.record()
        if st is not None and stage_layout(st) != LAYOUT:
            return None
        if st is not None:
            problems = _diff(st["config"], config)
            if problems:
                raise WorkDirError(
                    f"stage {self.name!r} in {self.root} was run with another config:\n  " + "\n  ".join(problems)
                    + "\nUse another --workdir, or another stage name (refine: --stage), to keep both."
                )
        return st

    def open(self, config: dict, num_blocks: int | None = None) -> dict:
        """Register the stage with its config, or check it matches the recorded one (a started stage resumes
        at its first unfinished block). A stage recorded in another layout is started afresh: its artifacts
        (moesq's, listed in its record) are removed."""
        st = self.check_config(config)
        if st is not None and (num_blocks is None or st.get("num_blocks") == num_blocks):
            return st
        m = self.workdir.load()
        old = m["stages"].get(self.name)
        if old is not None and stage_layout(old) != LAYOUT:
            log.warning("stage %s in %s was written by an older moesq (work-dir layout %d, this moesq writes %d): "
                        "recomputing it", self.name, self.root, stage_layout(old), LAYOUT)
            # all checked before any is removed
            files = [self._file(rec, b) for b, rec in old.get("blocks", {}).items()]
            for f in files:
                f.unlink(missing_ok=True)
            del m["stages"][self.name]
        st = m["stages"].setdefault(self.name, {"config": config, "layout": LAYOUT, "blocks": {}, "done": False})
        if num_blocks is not None:
            st["num_blocks"] = num_blocks
        self.workdir.save(m)
        return st

    def finished_summary(self, config: dict) -> dict | None:
        """For a finished stage run with this config whose artifacts all check out: a summary of it (nothing
        is recomputed or rewritten); None when the stage is not finished."""
        st = self.check_config(config)
        if st is None or not st.get("done"):
            return None
        for b in st["blocks"]:
            self.verified_block(int(b))
        return {"blocks": len(st["blocks"]), "computed_now": 0}

    def verified_block(self, block: int) -> Path | None:
        """The artifact of a finished block after checking its checksum; None if the block is unfinished."""
        st = self.record()
        if st is not None and stage_layout(st) != LAYOUT:
            raise StaleStageError(
                f"stage {self.name!r} in {self.root} was written by an older moesq "
                f"(work-dir layout {stage_layout(st)}; this moesq reads layout {LAYOUT}); "
                "re-run that stage's command to recompute it, or use another --workdir")
        rec = (st or {}).get("blocks", {}).get(str(block))
        if rec is None:
            return None
        path = self._file(rec, block)
        if not path.is_file():
            raise WorkDirError(f"artifact {path} recorded as finished is missing; "
                               "remove the work dir entry or restore it")
        if sha256_file(path) != rec["sha256"]:
            raise WorkDirError(
                f"artifact {path} of stage {self.name!r} is corrupt or truncated (checksum mismatch). Nothing was "
                f"changed; re-run that stage with --redo-from {block} to recompute it from that block on."
            )
        return path

    def write_artifact(self, block: int, write: Callable[[Path], None], variant: str = "") -> Path:
        """Write a block's artifact atomically (`write(path)` writes it to a temp path, renamed into place when
        it returns): `block_NNN.safetensors`, or `block_NNN.<variant>.safetensors`. Not recorded."""
        path = self.dir / f"block_{block:03d}{'.' + variant if variant else ''}.safetensors"
        with atomic_path(path) as tmp:
            write(tmp)
        return path

    def record_block(self, block: int, write: Callable[[Path], None], extra: dict | None = None,
                     timings: dict | None = None) -> Path:
        """Write a finished block's artifact atomically (write_artifact) and record it with its checksum. Its
        timings go to the stage's `block_timings` (apart from the block record, which identifies the artifact
        and is the same in every run)."""
        path = self.write_artifact(block, write)
        m = self.workdir.load()
        st = m["stages"][self.name]
        st["blocks"][str(block)] = {"file": str(path.relative_to(self.root)), "sha256": sha256_file(path),
                                    **(extra or {})}
        if timings:
            st.setdefault("block_timings", {})[str(block)] = timings
        self.workdir.save(m)
        return path

    def finish(self, summary: dict | None = None) -> None:
        """Mark the stage done; its summary (with timings) goes into the stage's run log in the manifest."""
        m = self.workdir.load()
        st = m["stages"][self.name]
        st["done"] = True
        if summary:
            st["summary"] = summary
            st.setdefault("runs", []).append({"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **summary})
        self.workdir.save(m)

    def replace_blocks(self, paths: dict[int, Path], record: dict) -> None:
        """Make `paths` (layer -> artifact, already written) the stage's blocks in one manifest write, keeping
        the blocks they replace under "blockwise" (end-to-end tuning rewrites every block of a stage after its
        block loop; a later --redo-from needs the block-wise prefix back). `record` goes to the stage's "e2e"."""
        m = self.workdir.load()
        st = m["stages"][self.name]
        new = {str(li): {**st["blocks"][str(li)], "file": str(p.relative_to(self.root)), "sha256": sha256_file(p)}
               for li, p in paths.items()}
        st["blockwise"] = dict(st["blocks"])
        st["blocks"] = {**st["blocks"], **new}
        st["e2e"] = record
        self.workdir.save(m)

    def drop_blocks_from(self, block: int) -> None:
        """Forget blocks >= block (their files are removed) so they are recomputed. A stage whose blocks
        end-to-end tuning rewrote gets its block-wise blocks back first (the tuned files are removed)."""
        m = self.workdir.load()
        st = m["stages"].get(self.name)
        if st is None:
            return
        doomed = []  # every file to remove is checked before any is removed
        if "e2e" in st:
            kept = st.pop("blockwise", st["blocks"])
            for k, rec in st["blocks"].items():
                if rec.get("file") != kept.get(k, {}).get("file"):
                    doomed.append(self._file(rec, k))
            st["blocks"] = kept
            del st["e2e"]
        for k in [k for k in st["blocks"] if int(k) >= block]:
            doomed.append(self._file(st["blocks"].pop(k), k))
        for p in doomed:
            p.unlink(missing_ok=True)
        st["done"] = False
        self.workdir.save(m)


class WorkDirLogHandler(logging.Handler):
    """Appends to <workdir>/logs/moesq.log once the work dir exists (its manifest is written); records from
    before that are kept and written then. A command refused before it made the work dir writes nothing, so
    no logs/ appears in a directory moesq did not make."""

    def __init__(self, root: Path):
        super().__init__(logging.INFO)
        self.root = Path(root)
        self.pending: list[logging.LogRecord] = []
        self.file: logging.FileHandler | None = None
        self.unwritable = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.unwritable:
            return
        try:
            if self.file is None:
                if not (self.root / MANIFEST).is_file():
                    if len(self.pending) < 10_000:
                        self.pending.append(record)
                    return
                (self.root / "logs").mkdir(exist_ok=True)
                self.file = logging.FileHandler(self.root / "logs" / "moesq.log")
                self.file.setFormatter(self.formatter)
                self.file.handleError = self._file_error
                for r in self.pending:
                    self.file.emit(r)
                self.pending = []
            self.file.emit(record)
        except OSError:  # a read-only or full work dir: reading commands still work, without a log
            self.unwritable, self.pending = True, []
        except Exception:
            self.handleError(record)

    def _file_error(self, record: logging.LogRecord) -> None:
        """The log file's handleError: a write that failed for the disk stops the log quietly."""
        if isinstance(sys.exc_info()[1], OSError):
            self.unwritable = True
        else:
            logging.FileHandler.handleError(self.file, record)

    @property
    def path(self) -> Path | None:
        return self.root / "logs" / "moesq.log" if self.file is not None and not self.unwritable else None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()


def setup_logging(root: Path | None, quiet: bool = False) -> None:
    """Log to <workdir>/logs/moesq.log (at INFO, once the work dir exists) and, unless quiet, warnings to
    stderr. Both the "moesq" loggers and the library's module loggers ("moesq_core.*") go there."""
    loggers = [logging.getLogger("moesq"), logging.getLogger("moesq_core")]
    old = {h for lg in loggers for h in lg.handlers}
    for lg in loggers:
        for h in list(lg.handlers):
            lg.removeHandler(h)
    for h in old:
        h.close()
    handlers = []
    if root is not None:
        fh = WorkDirLogHandler(Path(root))
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(fh)
    sh = logging.StreamHandler()
    sh.setLevel(logging.ERROR if quiet else logging.WARNING)
    handlers.append(sh)
    for lg in loggers:
        lg.setLevel(logging.INFO)
        for h in handlers:
            lg.addHandler(h)
        lg.propagate = False
