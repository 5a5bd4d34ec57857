"""The work directory: one per run. A manifest records the command's config, the model fingerprint and a
checksum for every artifact; artifacts are written atomically (temp file + rename), so an interrupted stage
resumes at its first unfinished block and a work dir made for another model or config is refused.

Layout:
    manifest.json                 moesq version, model {source, fingerprint}, stages {name: {config, blocks, done}}
    calib/calibration.safetensors token splits (train / val / init)
    stages/<stage>/block_NNN.safetensors   one artifact per MoE block
    logs/moesq.log
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import __version__

log = logging.getLogger("moesq")

MANIFEST = "manifest.json"


class WorkDirError(RuntimeError):
    """A work dir that cannot be used as asked (other model/config, corrupt artifact). Nothing was changed."""


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
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the weight index (tensor names, dtypes, shapes): identifies the model
    without hashing gigabytes of weights."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    h = hashlib.sha256()
    cfg = json.loads((model_dir / "config.json").read_text())
    h.update(json.dumps(cfg, sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for name in sorted(sf.keys()):
                sl = sf.get_slice(name)
                h.update(f"{name}:{sl.get_dtype()}:{list(sl.get_shape())};".encode())
    return h.hexdigest()[:32]


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
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

    def init(self, model: dict, config: dict) -> dict:
        """Create, or open and check, the work dir for this model and run-level config."""
        if self.exists():
            m = self.load()
            problems = _diff({"model": m["model"]["fingerprint"], **m["config"]}, {"model": model["fingerprint"], **config})
            if problems:
                raise WorkDirError(
                    f"{self.root} was made for another model or config:\n  " + "\n  ".join(problems)
                    + "\nUse another --workdir (or delete this one)."
                )
            return m
        if self.root.exists() and any(self.root.iterdir()):
            raise WorkDirError(f"{self.root} exists, is not empty and is not a moesq work dir; choose another --workdir")
        self.root.mkdir(parents=True, exist_ok=True)
        m = {"moesq_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": model,
             "config": config, "stages": {}}
        self.save(m)
        return m

    # -- stages ----------------------------------------------------------------------------------
    def stage_dir(self, stage: str) -> Path:
        return self.root / "stages" / stage

    def open_stage(self, stage: str, config: dict) -> dict:
        """Register a stage with its config, or check it matches the recorded one."""
        m = self.load()
        st = m["stages"].get(stage)
        if st is not None:
            problems = _diff(st["config"], config)
            if problems:
                raise WorkDirError(
                    f"stage {stage!r} in {self.root} was run with another config:\n  " + "\n  ".join(problems)
                    + f"\nUse another --workdir, or remove {self.stage_dir(stage)} and its entry to redo it."
                )
            return st
        m["stages"][stage] = {"config": config, "blocks": {}, "done": False}
        self.save(m)
        return m["stages"][stage]

    def stage(self, stage: str) -> dict | None:
        return self.load()["stages"].get(stage)

    def record_block(self, stage: str, block: int, path: Path, extra: dict | None = None) -> None:
        m = self.load()
        m["stages"][stage]["blocks"][str(block)] = {
            "file": str(path.relative_to(self.root)), "sha256": sha256_file(path), **(extra or {})}
        self.save(m)

    def finish_stage(self, stage: str, summary: dict | None = None) -> None:
        m = self.load()
        m["stages"][stage]["done"] = True
        if summary:
            m["stages"][stage]["summary"] = summary
        self.save(m)

    def verified_block(self, stage: str, block: int) -> Path | None:
        """The artifact of a finished block after checking its checksum; None if the block is unfinished."""
        st = self.stage(stage)
        rec = (st or {}).get("blocks", {}).get(str(block))
        if rec is None:
            return None
        path = self.root / rec["file"]
        if not path.is_file():
            raise WorkDirError(f"artifact {path} recorded as finished is missing; remove the work dir entry or restore it")
        if sha256_file(path) != rec["sha256"]:
            raise WorkDirError(
                f"artifact {path} of stage {stage!r} is corrupt or truncated (checksum mismatch). Nothing was changed; "
                f"re-run that stage with --redo-from {block} to recompute it from that block on."
            )
        return path

    def drop_blocks_from(self, stage: str, block: int) -> None:
        """Forget blocks >= block of a stage (their files are removed) so they are recomputed."""
        m = self.load()
        st = m["stages"].get(stage)
        if st is None:
            return
        for k in [k for k in st["blocks"] if int(k) >= block]:
            p = self.root / st["blocks"].pop(k)["file"]
            p.unlink(missing_ok=True)
        st["done"] = False
        self.save(m)


def setup_logging(root: Path | None, quiet: bool = False) -> None:
    """Log to <workdir>/logs/moesq.log (always, at INFO) and, unless quiet, warnings to stderr."""
    logger = logging.getLogger("moesq")
    logger.setLevel(logging.INFO)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    if root is not None:
        (Path(root) / "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(root) / "logs" / "moesq.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(fh)
    sh = logging.StreamHandler()
    sh.setLevel(logging.ERROR if quiet else logging.WARNING)
    logger.addHandler(sh)
    logger.propagate = False
